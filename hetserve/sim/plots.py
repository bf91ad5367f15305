"""PNG plots of simulation results (matplotlib, Agg backend; no display needed).

The plots read a run's per-request arrays and summary dict and import nothing of the simulator:
``metrics.SimResult.save`` draws its latency CDFs here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def has_slo(summary: dict) -> bool:
    """Whether a summary's run set any SLO target: without one every completed request "meets" it,
    so attainment and goodput say nothing (a plot or table shows something else instead)."""
    return any(v is not None for v in (summary.get("slo") or {}).values())


def simulated_title(what: str, pricing: Mapping[str, str] | None, source: str | None = None) -> str:
    """A simulated figure's title: what it shows, and where its times come from (``source``, e.g. a
    calibration, else how the cost model priced each GPU type)."""
    from hetserve.cost.kernel_pricing import describe_pricing

    if source:
        return f"simulated {what} (discrete-event simulator; times from the {source})"
    return f"simulated {what} (discrete-event simulator; cost model" + (
        f": {describe_pricing(pricing)})" if pricing else ")")


# points a CDF line draws at most: a panel is some 450 pixels wide and 300 high, so a million-request
# run's line of a million points looks the same as one of a few thousand and took seconds more to lay
# out and save (and memory in proportion)
CDF_POINTS = 2000


def cdf_points(values: np.ndarray, max_points: int = CDF_POINTS) -> tuple[np.ndarray, np.ndarray]:
    """The empirical CDF of ``values`` as (x, fraction at or below x), at most ``max_points`` of its
    points, evenly spaced in rank, the lowest and the highest value always among them."""
    x = np.sort(values)
    n = len(x)
    ranks = np.arange(1, n + 1) if n <= max_points else np.unique(np.linspace(1, n, max_points).round().astype(int))
    return x[ranks - 1], ranks / max(n, 1)


def plot_latency_cdfs(results: Mapping[str, Any], path: str | Path, title: str | None = None) -> Path:
    """CDFs of TTFT, TPOT and E2E, one line per labelled result (a ``metrics.SimResult``: its
    ``ttft``, ``tpot``, ``e2e``, ``output_tokens`` and ``info``), on log axes (ticks between
    decades are labelled when a panel spans less than one); one-token outputs have no TPOT. The
    title says where the figures come from (by default how the cost model priced each GPU type)."""
    import textwrap

    if title is None:
        title = simulated_title("latency", next(iter(results.values())).info.get("pricing") if results else None)
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    fig.suptitle(textwrap.fill(title, 150), fontsize=9)
    for label, res in results.items():
        tpot = res.tpot[res.output_tokens > 1]
        for ax, (name, x) in zip(axes, (("TTFT", res.ttft), ("TPOT", tpot), ("E2E", res.e2e))):
            x, y = cdf_points(x[np.isfinite(x) & (x > 0)])
            ax.plot(x, y, label=label)
            ax.set_xlabel(f"{name} (s)")
            if len(x):
                ax.set_xscale("log")
            ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_rate_sweep(rows: Sequence[dict], path: str | Path, label_key: str = "label", title: str | None = None) -> Path:
    """Throughput and SLO attainment against arrival rate (rows from ``rate_sweep``); with no SLO
    set, the share of requests completed (not rejected) instead, which is all attainment would
    count. The title says where the figures come from (default: the runs' cost-model pricing)."""
    import textwrap

    if title is None:
        title = simulated_title("rate sweep", rows[0]["summary"].get("run", {}).get("pricing") if rows else None)
    slo = any(has_slo(r["summary"]) for r in rows)
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    fig.suptitle(textwrap.fill(title, 120), fontsize=9)
    labels = sorted({r.get(label_key, "") for r in rows})
    for lab in labels:
        rs = sorted((r for r in rows if r.get(label_key, "") == lab), key=lambda r: r["rate"])
        x = [r["rate"] for r in rs]
        a.plot(x, [r["summary"]["throughput_tokens_per_s"] for r in rs], marker="o", label=lab or None)
        b.plot(x, [r["summary"]["slo_attainment"] if slo else r["summary"]["completed"] / max(r["summary"]["requests"], 1)
                   for r in rs], marker="o", label=lab or None)
    a.set_xlabel("arrival rate (req/s)")
    a.set_ylabel("output tokens/s")
    b.set_xlabel("arrival rate (req/s)")
    b.set_ylabel("SLO attainment" if slo else "requests completed (no SLO set)")
    b.set_ylim(0, 1.05)
    for ax in (a, b):
        ax.grid(alpha=0.3)
    if any(labels):
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
