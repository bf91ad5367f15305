"""Results of a run: per-request timings (numpy arrays), per-replica statistics, the summary.

Per request (seconds): ``ttft`` = first token − arrival; ``e2e`` = finish − arrival;
``tpot`` = (e2e − ttft) / (output − 1) (0 for one-token outputs: they meet any TPOT target, and
the summary's TPOT and ATGT figures leave them out, and requests.csv writes them nan); ``atgt`` (Aladdin §2.2) = decode time /
(output − 1), where decode time runs from joining the decode batch to the last token, so it leaves
out KV transfer and admission waits that TPOT includes. A summary figure no request has is null.

A request attains the SLO when every target that is set holds (TTFT, TPOT, E2E); goodput is
attaining requests per second of the run. ``duration_s`` runs from the first arrival to the last
finish. GPU-hours charge every device of the plan for the whole duration.

A request rejected at arrival (``policies.request_checks``: what a served deployment refuses) has no
timings: it counts in ``requests`` and ``rejected``, never attains the SLO, and is left out of the
latency figures, the throughput and the token counts, which are those of the completed requests.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hetserve.sim.plots import plot_latency_cdfs, simulated_title
from hetserve.specs.workload import SLO

if TYPE_CHECKING:  # pragma: no cover
    from hetserve.planner.plan import Plan
    from hetserve.sim.replicas.base import Replica
    from hetserve.sim.requests import RequestTable
    from hetserve.specs.cluster import Cluster


def latency_stats(x) -> dict[str, float | None]:
    """Mean and percentiles of one latency over the requests that have it; None for each (JSON
    null) when none has it (nothing completed, no KV hand-off, only one-token outputs), so no
    figure reads as a measured zero. Simulated and served summaries both use it."""
    x = np.asarray(x, float)
    if len(x) == 0:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"mean": float(x.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


@dataclass
class ReplicaStats:
    id: str
    role: str
    devices: int
    requests: int
    utilisation: float  # busy fraction of the run
    kv_capacity_tokens: float
    kv_mean_tokens: float
    kv_peak_tokens: float

    def to_dict(self) -> dict[str, Any]:
        cap = self.kv_capacity_tokens or 1.0
        return {"role": self.role, "devices": self.devices, "requests": self.requests,
                "utilisation": self.utilisation, "kv_capacity_tokens": self.kv_capacity_tokens,
                "kv_mean_use": self.kv_mean_tokens / cap, "kv_peak_use": self.kv_peak_tokens / cap}


def result_of(r: "RequestTable", replicas: "list[Replica]", slo: SLO, plan: "Plan", cluster: "Cluster",
              info: dict[str, Any]) -> "SimResult":
    """The result of a finished run: the request table's timings and each replica's statistics."""
    ids = [x.id for x in replicas]
    finished = [t for t in r.t_finish if t == t]  # rejected requests never finish (NaN)
    end = max(finished) if finished else (r.arrival[0] if r.n else 0.0)
    span = end - (r.arrival[0] if r.n else 0.0)
    stats = [ReplicaStats(x.id, x.role, len(x.layout.devices), x.served,
                          x.busy_s / span if span > 0 else 0.0, x.kv_capacity, x.kv_mean(end), x.kv_peak)
             for x in replicas]
    dev = [cluster.device(d).index for d in plan.devices]
    return SimResult(
        np.asarray(r.arrival), np.asarray(r.inp, np.int64), np.asarray(r.out, np.int64),
        np.asarray(r.t_start), np.asarray(r.t_first), np.asarray(r.t_kv_start), np.asarray(r.t_kv_done),
        np.asarray(r.t_join), np.asarray(r.t_finish),
        [ids[i] if i >= 0 else "" for i in r.prefill_rep], [ids[i] if i >= 0 else "" for i in r.decode_rep],
        slo, stats, len(dev), cluster.usd_per_hour(dev), info=info, rejected=list(r.rejected),
        choices=np.asarray(r.choices, np.int64))


@dataclass
class SimResult:
    arrival: np.ndarray
    input_tokens: np.ndarray
    output_tokens: np.ndarray
    t_start: np.ndarray
    t_first: np.ndarray
    t_kv_start: np.ndarray
    t_kv_done: np.ndarray
    t_join: np.ndarray
    t_finish: np.ndarray
    prefill_replica: list[str]
    decode_replica: list[str]
    slo: SLO
    replicas: list[ReplicaStats]
    num_devices: int
    usd_per_hour: float | None
    info: dict[str, Any] = field(default_factory=dict)  # plan, workload, options, speed
    # per request, why it was rejected at arrival ("" = admitted; ``policies.request_checks.REASONS``)
    rejected: list[str] = field(default_factory=list)
    # per request, the choices it decoded (OpenAI ``n``; None: one each): ``output_tokens`` is one
    # choice's, so TPOT is a choice's token interval, and the summary's token counts are all choices'
    choices: np.ndarray | None = None

    # ------------------------------------------------------------------ per request
    def __len__(self) -> int:
        return len(self.arrival)

    @property
    def ttft(self) -> np.ndarray:
        return self.t_first - self.arrival

    @property
    def queue(self) -> np.ndarray:
        """Waiting for a replica: from reaching the replicas (the arrival plus the served front end's
        request overhead, HTTP and tokenisation, which is not queueing) to the prompt's start."""
        return np.maximum(0.0, self.t_start - self.arrival - self.info.get("request_overhead_s", 0.0))

    @property
    def e2e(self) -> np.ndarray:
        return self.t_finish - self.arrival

    @property
    def tpot(self) -> np.ndarray:
        steps = self.output_tokens - 1
        return np.where(steps > 0, (self.t_finish - self.t_first) / np.maximum(steps, 1), 0.0)

    @property
    def atgt(self) -> np.ndarray:
        steps = self.output_tokens - 1
        dec = np.where(np.isnan(self.t_join), self.t_finish - self.t_first, self.t_finish - self.t_join)
        return np.where(steps > 0, dec / np.maximum(steps, 1), 0.0)

    @property
    def slo_met(self) -> np.ndarray:
        ok = np.isfinite(self.t_finish)
        s = self.slo
        if s.ttft_s is not None:
            ok &= self.ttft <= s.ttft_s
        if s.tpot_s is not None:
            ok &= self.tpot <= s.tpot_s
        if s.e2e_s is not None:
            ok &= self.e2e <= s.e2e_s
        return ok

    @property
    def completed(self) -> np.ndarray:
        """Mask of the requests that finished (not rejected)."""
        return np.isfinite(self.t_finish)

    @property
    def rejected_by(self) -> dict[str, int]:
        """Rejected requests per reason."""
        counts: dict[str, int] = {}
        for why in self.rejected:
            if why:
                counts[why] = counts.get(why, 0) + 1
        return counts

    @property
    def duration_s(self) -> float:
        done = self.completed
        return float(self.t_finish[done].max() - self.arrival[0]) if done.any() else 0.0

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict[str, Any]:
        """The docs/design.md summary JSON (its keys first), extended."""
        n = len(self)
        ok = self.completed
        done = int(ok.sum())
        dur = self.duration_s
        generated = self.output_tokens if self.choices is None else self.output_tokens * self.choices
        out_tokens = int(generated[ok].sum())
        met = self.slo_met
        gpu_hours = self.num_devices * dur / 3600.0
        usd = self.usd_per_hour * dur / 3600.0 if self.usd_per_hour is not None else None
        tput = out_tokens / dur if dur > 0 else 0.0
        intervals = self.output_tokens > 1
        return {
            "requests": n, "completed": done, "rejected": n - done, "rejected_by": self.rejected_by,
            "duration_s": dur,
            "throughput_tokens_per_s": tput,
            "goodput_requests_per_s": float(met.sum()) / dur if dur > 0 else 0.0,
            "slo_attainment": float(met.mean()) if n else 1.0,
            # a one-token output has no token interval: TPOT and ATGT leave it out, as served runs do
            "ttft_s": latency_stats(self.ttft[ok]), "tpot_s": latency_stats(self.tpot[ok & intervals]),
            "e2e_s": latency_stats(self.e2e[ok]),
            # extensions
            "atgt_s": latency_stats(self.atgt[ok & intervals]),
            "queue_s": latency_stats(self.queue[ok]),
            "kv_transfer_s": latency_stats((self.t_kv_done - self.t_kv_start)[np.isfinite(self.t_kv_done)]),
            "slo": {"ttft_s": self.slo.ttft_s, "tpot_s": self.slo.tpot_s, "e2e_s": self.slo.e2e_s},
            "input_tokens": int(self.input_tokens[ok].sum()), "output_tokens": out_tokens,
            "requests_per_s": done / dur if dur > 0 else 0.0,
            "output_tokens_per_s": tput,
            "gpu_hours": gpu_hours,
            "usd": usd,
            "usd_per_million_output_tokens": usd / out_tokens * 1e6 if usd is not None and out_tokens else None,
            "replicas": {s.id: s.to_dict() for s in self.replicas},
            "run": self.info,
        }

    # ------------------------------------------------------------------ files
    def to_csv(self, path: str | Path) -> None:
        """One row per request: inputs, replicas, timestamps and latencies (seconds). A one-token
        output's TPOT and ATGT are written nan, as a colocated request's KV transfer is: it has no
        token interval, and the summary leaves it out of those figures, so a 0 here would pull down
        any mean taken from this file (its ``slo_met`` still counts it as meeting the TPOT target)."""
        no_interval = self.output_tokens <= 1
        cols = {"id": np.arange(len(self)), "arrival_s": self.arrival, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "ttft_s": self.ttft,
                "tpot_s": np.where(no_interval, np.nan, self.tpot), "atgt_s": np.where(no_interval, np.nan, self.atgt),
                "e2e_s": self.e2e, "queue_s": self.queue,
                "kv_transfer_s": self.t_kv_done - self.t_kv_start, "first_token_s": self.t_first,
                "finish_s": self.t_finish, "slo_met": self.slo_met.astype(int)}
        with Path(path).open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(list(cols) + ["prefill_replica", "decode_replica", "rejected"])
            rejected = self.rejected or [""] * len(self)
            rows = zip(*[c.tolist() for c in cols.values()], self.prefill_replica, self.decode_replica, rejected)
            for row in rows:
                w.writerow([f"{v:.6g}" if isinstance(v, float) else v for v in row])

    def save(self, outdir: str | Path, plots: bool = True, summary: dict | None = None) -> list[Path]:
        """Write summary.json (``summary``: the caller's, e.g. with its timings' source; default
        ``self.summary()``), requests.csv and (optionally) latency_cdf.png under ``outdir``."""
        out = Path(outdir)
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "summary.json", out / "requests.csv"]
        written[0].write_text(json.dumps(self.summary() if summary is None else summary, indent=2) + "\n")
        self.to_csv(written[1])
        if plots:
            source = (summary or {}).get("timings", {}).get("source")  # the caller's, with its calibration
            written.append(plot_latency_cdfs({"simulated": self}, out / "latency_cdf.png",
                                             simulated_title("latency", None, source) if source else None))
        return written
