"""Where a cell's step times part: the served engine steps against the cost model and the simulator.

    .venv/bin/python -m bench.predict.steps RUN.json [RUN.json ...] [--plans pipeline-2] [--loads 0.8]

Each file is a ``bench_predict --json`` run; every cell asked for is replayed (refitted) by the code
of now (``--replay --refit``, the slow-down its speed probe read) and its engine steps split two ways:

* **decode steps by the sequences in them** (on a pipeline, one micro-batch): served — the span the
  coordinator saw, the stage leaders' wall and CPU time on it (``runtime.step_timing``) — against
  the cost model's time for the same batch alone (no contention, no dispatch: ``step_compare.step_model``)
  and each sequence's mean context. How a step grows with its batch, served and priced.
* **prompt steps by what ran beside them**: *alone*, *beside* another step in flight (a pipeline's
  free micro-batch slot), *with decodes* riding in the same step; served span and model time, and
  the simulated steps of the same kind (the simulator traces a pipeline's decoding micro-batches
  as one round, so its decode steps are not split here).
* **token periods by the sequences decoding**: a sequence's time from one of its decode steps to its
  next, by how many sequences of its replica decoded in that time, served against simulated. A
  period is what TPOT averages, and it is comparable on both sides however the steps are traced.

About 10 s a saved run; the latest figures are in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

BATCH_CAP = 6  # decode steps of this many sequences or more share a row
PERIOD_CAP = 4  # token periods with this many sequences decoding or more share a row


def decode_by_batch(served, model_s) -> list[dict]:
    """Served decode-only steps grouped by their sequences (``BATCH_CAP`` and more in one row)."""
    groups: dict[int, list] = {}
    for row, model in zip(served, model_s):
        if row.decode_ids and not row.prompt_tokens:
            per_seq = row.decode_context / len(row.decode_ids)
            groups.setdefault(min(len(row.decode_ids), BATCH_CAP), []).append(
                (row.finished - row.started, row.worker_s, row.worker_cpu_s, model, per_seq))
    return [{"batch": b, "steps": len(v), **dict(zip(("span_s", "worker_s", "cpu_s", "model_s", "context"),
                                                    np.nanmean(np.array(v), axis=0)))}
            for b, v in sorted(groups.items())]


def prompt_kinds(rows, model_s=None) -> dict[str, dict]:
    """Prompt steps by what ran beside them: {"alone" | "beside" | "with decodes": steps, mean span,
    mean model time (served rows only), mean prompt tokens}. *Beside*: another step of the same
    replica overlapped it (another replica's steps, e.g. a prefill/decode plan's decode side, do not count)."""
    starts = np.array([r.started for r in rows])
    ends = np.array([r.finished for r in rows])
    replicas = np.array([r.replica for r in rows])
    kinds: dict[str, list] = {}
    for i, r in enumerate(rows):
        if not r.prompt_tokens:
            continue
        overlapped = ((starts < r.finished) & (ends > r.started) & (replicas == r.replica)).sum() > 1
        kind = "with decodes" if r.decode_ids else "beside" if overlapped else "alone"
        model = model_s[i] if model_s else 0.0
        kinds.setdefault(kind, []).append((r.finished - r.started, sum(r.prompt_tokens), model))
    return {kind: {"steps": len(v), "span_s": float(np.mean([x[0] for x in v])),
                   "tokens": float(np.mean([x[1] for x in v])),
                   "model_s": float(np.mean([x[2] for x in v])) if model_s else float("nan")}
            for kind, v in kinds.items()}


def token_periods(rows) -> dict[int, list[float]]:
    """Each sequence's token periods (seconds from the start of one of its decode steps to the start
    of its next), keyed by the sequences of its replica that decoded in that time (``PERIOD_CAP`` and
    more under one key). Decode-only steps: a step carrying a prompt ends its sequences' periods
    there (its time is the prompt's TTFT as much as their TPOT)."""
    by_replica: dict[str, list] = {}
    for r in rows:
        by_replica.setdefault(r.replica, []).append(r)
    periods: dict[int, list[float]] = {}
    for steps in by_replica.values():
        steps.sort(key=lambda r: r.started)
        last: dict[int, int] = {}  # sequence -> index of its last decode-only step
        for i, r in enumerate(steps):
            for seq in r.decode_ids:
                j = last.pop(seq, None)
                if r.prompt_tokens:
                    continue
                if j is not None:
                    beside = {s for q in steps[j:i + 1] if not q.prompt_tokens for s in q.decode_ids}
                    periods.setdefault(min(len(beside), PERIOD_CAP), []).append(r.started - steps[j].started)
                last[seq] = i
    return periods


def print_cell(cell: dict, console) -> None:
    from rich.table import Table

    rows = cell["step_rows"]
    speed = (cell.get("speed") or {}).get("slowdown", 1.0)
    console.rule(f"{cell['plan']} at {cell['rate']:.2f} req/s ({cell['fraction']:.0%} of capacity), "
                 f"slow-down {speed:.3f}")
    t = Table("sequences", "steps", "served span ms", "worker ms", "worker CPU ms", "model ms", "context / sequence",
              title="served decode steps by batch (a pipeline's micro-batch) against the cost model's time for it")
    for g in decode_by_batch(rows["served"], rows["model_s"]):
        t.add_row(f"{g['batch']}{'+' if g['batch'] == BATCH_CAP else ''}", str(g["steps"]),
                  *(f"{g[k] * 1e3:.1f}" for k in ("span_s", "worker_s", "cpu_s", "model_s")), f"{g['context']:.0f}")
    console.print(t)
    served, simulated = prompt_kinds(rows["served"], rows["model_s"]), prompt_kinds(rows["simulated"])
    t = Table("prompt step", "served steps", "served span ms", "model ms", "simulated steps", "simulated ms",
              "sim / served", title="prompt steps by what ran beside them")
    for kind in ("alone", "beside", "with decodes"):
        a, b = served.get(kind), simulated.get(kind)
        if not a and not b:
            continue
        t.add_row(kind, str(a["steps"]) if a else "0", f"{a['span_s'] * 1e3:.1f}" if a else "-",
                  f"{a['model_s'] * 1e3:.1f}" if a else "-", str(b["steps"]) if b else "0",
                  f"{b['span_s'] * 1e3:.1f}" if b else "-", f"{b['span_s'] / a['span_s']:.2f}" if a and b else "-")
    console.print(t)
    served, simulated = token_periods(rows["served"]), token_periods(rows["simulated"])
    t = Table("sequences decoding", "served periods", "served median ms", "simulated periods", "simulated median ms",
              "sim / served", title="a sequence's token periods by the sequences decoding in them")
    for n in sorted(set(served) | set(simulated)):
        a, b = served.get(n), simulated.get(n)
        t.add_row(f"{n}{'+' if n == PERIOD_CAP else ''}", str(len(a or [])),
                  f"{np.median(a) * 1e3:.1f}" if a else "-", str(len(b or [])),
                  f"{np.median(b) * 1e3:.1f}" if b else "-", f"{np.median(b) / np.median(a):.2f}" if a and b else "-")
    console.print(t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="bench_predict --json files")
    ap.add_argument("--plans", help="comma-separated plan names (default: every plan)")
    ap.add_argument("--loads", help="comma-separated load fractions, e.g. 0.8 (default: every load)")
    args = ap.parse_args()

    from bench.lib.console import wide_console

    from bench.predict.run import read_run, replay_quietly

    console = wide_console()
    plans = set(args.plans.split(",")) if args.plans else None
    loads = [float(x) for x in args.loads.split(",")] if args.loads else None
    for run in args.runs:
        data = read_run(run)
        data["cells"] = [c for c in data["cells"] if (plans is None or c["plan"] in plans)
                         and (loads is None or any(abs(c["fraction"] - f) < 1e-6 for f in loads))]
        missing = [c["plan"] for c in data["cells"] if not c.get("served_steps")]
        if missing:
            raise SystemExit(f"{run}: cells without served steps ({', '.join(missing)}): saved before they "
                             "were kept")
        console.print(f"[bold]{run}[/bold]")
        for cell in replay_quietly(data, run, refit=True, keep_rows=True):
            print_cell(cell, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
