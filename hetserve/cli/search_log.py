"""What `hetserve plan --history` and `--plot` write: the searches' logs and their convergence curves."""

from __future__ import annotations

from pathlib import Path


def write_history(plans, path: str | Path) -> None:
    """The search logs of ``plans`` as one JSON file: ``{"runs": [log, ...]}``."""
    import json

    runs = [p.search_log or {"algorithm": p.algorithm} for p in plans]
    Path(path).write_text(json.dumps({"model": plans[0].model, "cluster": plans[0].cluster, "runs": runs},
                                     indent=1) + "\n")


def plot_convergence(plans, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for p in plans:
        hist = (p.search_log or {}).get("history", [])
        if not hist:
            continue
        xs, ys = [h[0] for h in hist], [h[1] for h in hist]
        # the plan is chosen after the search (colocated / mixed alternatives, the bound): its value
        # and the run's whole time (the table's "search s") end the curve, as a dot
        end_t, end_v = p.estimate.get("search", {}).get("wall_s"), p.estimate.get("throughput_tokens_per_s")
        if end_t is not None and end_v is not None:
            xs, ys = xs + [max(end_t, xs[-1])], ys + [ys[-1]]
        line, = ax.step(xs, ys, where="post", label=p.algorithm)
        if end_t is not None and end_v is not None:
            ax.plot([xs[-1]], [end_v], "o", color=line.get_color())
    ax.set_xlabel("search time (s)")
    ax.set_ylabel("best estimated throughput (output tokens/s)")
    ax.set_title(f"{plans[0].model} on {plans[0].cluster}\n(dot: the plan chosen at the end, alternatives and bound "
                 "included;\nestimates under the cost model)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
