"""Served vs simulated engine steps for the same requests: where a latency gap comes from.

``hetserve compare`` gives TTFT / TPOT / E2E per request; when the two sides differ, these step
figures say whether the cost model's *step* is off or the time goes *between* steps (queueing, the
front end, the transport). Per replica and kind of step (``decode``: running sequences only;
``prompt``: a step carrying prompt tokens), each side gives:

* ``steps``, the mean decoding sequences per step and the mean prompt tokens per step;
* ``step_ms``: the mean span of a step — served: from the coordinator sending it to handling its
  result (``runtime.step_timing``); simulated: the step's time on the simulator's clock, contention
  and the front end's dispatch wait included;
* ``token_ms`` (decode steps): the mean interval between a sequence's consecutive tokens at the
  engine — for a pipeline the interval between one micro-batch's results, so it compares with the
  simulator's iteration; the served TPOT adds the HTTP/SSE stream to it;
* ``model_ms`` (served side): the calibrated cost model's time for the *served* batches, alone on
  the machine (no contention, no dispatch wait): served ``step_ms`` / ``model_ms`` is how much longer
  the live step took than the cost model says that very batch takes;
* ``worker_ms`` / ``worker_cpu_ms`` (served side): the stage leaders' own wall time on the step and
  their step threads' CPU time in it (``runtime.worker``): ``step_ms`` less ``worker_ms`` went to the
  transport and the front end, ``worker_ms`` less ``worker_cpu_ms`` to the worker waiting for a core.

Decode steps are also split by whether another replica ran a prompt step beside them
(``beside_prompts``). And the cores each served process kept busy during the replay
(``cpu_utilisation``: the front end — server, coordinator, client — and every worker), which the
simulator's host model estimates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np


@dataclass(frozen=True)
class StepRow:
    replica: str
    started: float
    finished: float
    decode_ids: tuple[int, ...]
    decode_context: float
    prompt_tokens: tuple[int, ...]
    worker_s: float = float("nan")  # served: the stage leaders' own time on the step (runtime.step_timing)
    worker_cpu_s: float = float("nan")  # ... and their step threads' CPU time

    @property
    def kind(self) -> str:
        return "prompt" if self.prompt_tokens else "decode"


def served_rows(timings: Iterable[Any]) -> list[StepRow]:
    """``runtime.step_timing.StepTiming`` records as rows."""
    return [StepRow(t.replica, t.started, t.finished, tuple(t.decode_ids), float(t.decode_context),
                    tuple(t.prompt_tokens), t.worker_s, t.worker_cpu_s) for t in timings]


ROW_FIELDS = ("replica", "started", "finished", "decode_ids", "decode_context", "prompt_tokens", "worker_s",
              "worker_cpu_s")


def rows_to_json(rows: list[StepRow]) -> dict[str, list]:
    """Rows as columns (a benchmark's JSON keeps a run's served steps, so a replay can split them
    again); an untimed worker (NaN) as null."""
    def plain(x):
        return list(x) if isinstance(x, tuple) else (None if isinstance(x, float) and x != x else x)
    return {f: [plain(getattr(r, f)) for r in rows] for f in ROW_FIELDS}


def rows_from_json(cols: dict[str, list]) -> list[StepRow]:
    """``rows_to_json``'s inverse."""
    nan = float("nan")
    return [StepRow(rep, start, end, tuple(dec), float(ctx), tuple(pr), nan if w is None else w,
                    nan if wc is None else wc)
            for rep, start, end, dec, ctx, pr, w, wc in zip(*(cols[f] for f in ROW_FIELDS))]


def simulated_rows(replicas, prompt_len) -> list[StepRow]:
    """The steps the simulator's replicas traced (``trace``: (start, end, decode ids, prompt ids)),
    ``prompt_len(rid)`` the prompt tokens of a request."""
    rows = []
    for rep in replicas:
        for start, end, decodes, prompts in rep.trace or ():
            rows.append(StepRow(rep.id, start, end, tuple(decodes), 0.0, tuple(prompt_len(r) for r in prompts)))
    return rows


def _token_intervals(rows: list[StepRow]) -> list[float]:
    """Per step and decoding member, the time since that member's previous token (step finishes;
    a sequence's first decode step counts from the step that finished its prompt)."""
    last: dict[int, float] = {}
    out = []
    for r in sorted(rows, key=lambda r: r.finished):
        for rid in r.decode_ids:
            if rid in last:
                out.append(r.finished - last[rid])
            last[rid] = r.finished
    return out


def beside_prompts(rows: list[StepRow]) -> dict[int, float]:
    """Per decode-only step (by its index in ``rows``) of a replica beside which other replicas in
    ``rows`` ran prompt steps, the share of its span they covered (at most 1). On worker slots that
    share a host's cores a prefill beside a decode step slows it: the split in ``summarise`` shows
    by how much, served and simulated."""
    prompts = [r for r in rows if r.kind == "prompt"]
    if not prompts:
        return {}
    who = np.array([r.replica for r in prompts])
    start = np.array([r.started for r in prompts])
    end = np.array([r.finished for r in prompts])
    out = {}
    for i, r in enumerate(rows):
        if r.kind != "decode" or r.finished <= r.started:
            continue
        others = who != r.replica
        if not others.any():
            continue
        covered = np.clip(np.minimum(end[others], r.finished) - np.maximum(start[others], r.started), 0.0, None)
        out[i] = min(1.0, float(covered.sum()) / (r.finished - r.started))
    return out


def summarise(rows: list[StepRow], model_time=None) -> dict[str, dict[str, float]]:
    """Per "replica kind": steps, mean decodes, mean prompt tokens, mean step ms, mean token ms and,
    with ``model_time(row)`` (seconds), the cost model's mean for the same steps. Where other
    replicas ran prompt steps, a replica's decode steps are also split into "decode alone" (none
    beside them) and "decode beside prompt" (beside them for at least half of the step;
    ``beside_prompts``)."""
    groups: dict[tuple[str, str], list[StepRow]] = {}
    share = beside_prompts(rows)
    for i, r in enumerate(rows):
        groups.setdefault((r.replica, r.kind), []).append(r)
        if i in share and (share[i] == 0.0 or share[i] >= 0.5):
            groups.setdefault((r.replica, "decode alone" if share[i] == 0.0 else "decode beside prompt"), []).append(r)
    out: dict[str, dict[str, float]] = {}
    for key, sel in sorted(groups.items()):
        d = {"steps": float(len(sel)),
             "decodes": float(np.mean([len(r.decode_ids) for r in sel])),
             "prompt_tokens": float(np.mean([sum(r.prompt_tokens) for r in sel])),
             "step_ms": 1e3 * float(np.mean([r.finished - r.started for r in sel]))}
        if key[1] == "decode":
            gaps = _token_intervals([r for r in rows if r.replica == key[0]])
            d["token_ms"] = 1e3 * float(np.mean(gaps)) if gaps else float("nan")
        if model_time is not None:
            d["model_ms"] = 1e3 * float(np.mean([model_time(r) for r in sel]))
        worker = [(r.worker_s, r.worker_cpu_s) for r in sel if r.worker_s == r.worker_s]  # not NaN: timed
        if worker:
            d["worker_ms"], d["worker_cpu_ms"] = (1e3 * float(x) for x in np.mean(worker, axis=0))
        out[f"{key[0]} {key[1]}"] = d
    return out


def step_model(cost, layouts: dict, micro_batches: int | None = None):
    """``model_time(row)``: the cost model's time for a served step's batch on its replica's layout
    (alone: no contention, no dispatch wait). A pipeline's step is one micro-batch through every stage."""
    from hetserve.cost.analytic import PrefillBatch

    def model_time(r: StepRow) -> float:
        layout = layouts[r.replica]
        if r.prompt_tokens:
            prompts = PrefillBatch.of(list(r.prompt_tokens))
            if not r.decode_ids:
                return cost.prefill_time(layout, prompts)
            return cost.mixed_step_time(layout, len(r.decode_ids), r.decode_context, prompts, 1)
        return cost.decode_step_time(layout, len(r.decode_ids), r.decode_context, 1)

    return model_time


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) process ``pid`` has used so far: /proc on Linux, else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def machine_busy_cpu_s() -> float | None:
    """CPU seconds all of this machine's cores have spent busy since boot (/proc/stat: everything but
    idle and I/O wait), or None off Linux. Less the served processes' own CPU over the same window, it
    is what *other* processes took from the cores during a replay: a served figure measured beside a
    busy neighbour describes the neighbour as much as the plan, and the bench must be able to say so."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        if fields[0] != "cpu":
            return None
        ticks = [int(x) for x in fields[1:]]
        busy = sum(ticks[:8]) - ticks[3] - ticks[4]  # user nice system idle iowait irq softirq steal
        return busy / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def cpu_utilisation(before: dict[str, float | None], after: dict[str, float | None], wall_s: float) -> dict:
    """Per process, the cores it kept busy on average between two ``process_cpu_s`` readings."""
    return {k: (after[k] - v) / wall_s for k, v in before.items()
            if v is not None and after.get(k) is not None and wall_s > 0}


def other_cores_busy(own: dict[str, float], machine_before: float | None, machine_after: float | None,
                     wall_s: float) -> float | None:
    """Cores kept busy by processes other than the served ones (``own``: ``cpu_utilisation``'s
    result) between two ``machine_busy_cpu_s`` readings; None where either reading is missing."""
    if machine_before is None or machine_after is None or wall_s <= 0:
        return None
    return max(0.0, (machine_after - machine_before) / wall_s - sum(own.values()))


def print_steps(served: dict, simulated: dict, console=None) -> None:
    """The served and simulated engine steps per replica and step kind, as two tables (counts, then
    times) narrow enough for a piped, 80-column console; "–": not measured for that row or side."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    keys = sorted(set(served) | set(simulated))

    def g(d: dict, k: str, digits: int) -> str:
        x = d.get(k, float("nan"))
        return "–" if x != x else f"{x:.{digits}f}"

    def table(title: str, headers: tuple[str, ...]) -> Table:
        # figures are never cut: the row's name folds first, then the headers (two words each)
        t = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, title_justify="left")
        t.add_column("replica · step", overflow="fold", ratio=1)
        for h in headers:
            t.add_column(h, justify="right", no_wrap=True, min_width=max(len(w) for w in h.split()))
        return t

    counts = table("engine steps: served (coordinator clock) vs simulated",
                   ("steps\nserved", "steps\nsim", "decodes\nserved", "decodes\nsim", "prompt\nserved", "prompt\nsim"))
    times = table("engine step times, ms: served vs simulated",
                  ("step\nserved", "step\nsim", "worker", "worker\nCPU", "cost\nmodel", "token\nserved", "token\nsim"))
    for key in keys:
        a, b = served.get(key, {}), simulated.get(key, {})
        counts.add_row(key, g(a, "steps", 0), g(b, "steps", 0), g(a, "decodes", 1), g(b, "decodes", 1),
                       g(a, "prompt_tokens", 0), g(b, "prompt_tokens", 0))
        times.add_row(key, g(a, "step_ms", 2), g(b, "step_ms", 2), g(a, "worker_ms", 2), g(a, "worker_cpu_ms", 2),
                      g(a, "model_ms", 2), g(a, "token_ms", 2), g(b, "token_ms", 2))
    console.print(counts)
    console.print()
    console.print(times)
    console.print("worker: the workers' own time for a step, and their CPU time in it; cost model: the simulator's "
                  "time for the served batches; prompt: prompt tokens")
