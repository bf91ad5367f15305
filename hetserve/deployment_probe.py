"""The deployment probe: how fast the served plan's own workers run *now*, as the calibration prices them.

``runtime.speed_probe`` reads the machine's speed in the process that serves (the front end), and
``compare`` scales the calibrated times by its ratio to the calibration's reading. On the 2-core CPU
VM that index follows the workers only in part: over 45 light-load cells of 15 served runs, the
workers' own decode step against the cost model's price for it still spread 7.3 % (one standard
deviation of the log) after the probe's correction, 8.6 % before (docs/benchmarks.md, sixteenth
session). The workers are other processes than the probe, started minutes after the calibration.

This probe asks the deployment itself. Just before the trace is replayed (and again after it), a
few requests go through the server one at a time, each alone on the plan: ``PROBE_PROMPT`` prompt
tokens, ``PROBE_OUTPUT`` output tokens. The same requests, each alone, are simulated with the
calibration at a slow-down ``s``; ``solve_slowdown`` finds the ``s`` at which the simulated mean TTFT
and TPOT meet the measured ones (the geometric mean of the two ratios, as the speed probe combines
its decode and its prompt). No figure of the replayed trace enters it: it is a calibration of the
deployment at one sequence, taken seconds before it serves, and it carries what the calibration's
one-device probes do not say about this plan at one sequence (its stages' hand-ons, a TP group's
collectives) along with the machine's speed.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

PROBE_PROMPT = 128  # tokens: the calibration's second prompt length, the trace's longest here
PROBE_OUTPUT = 24  # tokens: as the calibration's decode probes (calibration_probes.measure)
PROBE_REQUESTS = 3  # a side (before and after the trace)
# the simulated probe requests are spaced this far apart (simulated seconds), so each runs alone
PROBE_GAP_S = 60.0
# the slow-downs searched (beyond them the deployment is not the calibrated machine: clamped)
SLOWDOWN_RANGE = (0.25, 4.0)


@dataclass(frozen=True)
class ProbeResult:
    ttft_s: float
    tpot_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def probe_requests(max_context: int, n: int = PROBE_REQUESTS, gap_s: float = 0.0, seed: int = 0):
    """``n`` probe requests (``serve.loadgen.LoadRequest``) of random printable token ids, ``gap_s``
    apart: ``PROBE_PROMPT`` prompt tokens, fewer where the checkpoint's context (``max_context``)
    would not hold them and ``PROBE_OUTPUT`` more."""
    from hetserve.serve.loadgen import LoadRequest

    output_tokens = PROBE_OUTPUT
    prompt_tokens = max(1, min(PROBE_PROMPT, max_context - output_tokens - 1))
    rng = np.random.default_rng(seed)
    return [LoadRequest(i * gap_s, rng.integers(32, 127, prompt_tokens).tolist(), output_tokens) for i in range(n)]


def measure(url: str, model: str, requests: Sequence) -> list[ProbeResult]:
    """Each request alone through the server (one replay per request, in turn), timed at the client."""
    from hetserve.serve.loadgen import LoadRequest, replay

    out = []
    for r in requests:
        (res,) = replay(url, model, [LoadRequest(0.0, r.prompt, r.max_tokens)], ignore_eos=True)
        if res.error is not None or res.tpot_s is None:
            raise RuntimeError(f"deployment probe request failed: {res.error or 'no second token'}")
        out.append(ProbeResult(res.ttft_s, res.tpot_s))
    return out


def solve_slowdown(simulate: Callable[[float], tuple[float, float]], measured: Sequence[ProbeResult]) -> float:
    """The slow-down ``s`` at which ``simulate(s)`` (the probe requests' mean TTFT and mean TPOT,
    simulated alone with the calibration at ``s``) meets ``measured``: the root of the mean of the
    log ratios of TTFT and TPOT, which grows with ``s``. Clamped to ``SLOWDOWN_RANGE``."""
    from scipy.optimize import brentq

    if not measured:
        raise ValueError("no probe results")
    ttft = float(np.mean([m.ttft_s for m in measured]))
    tpot = float(np.mean([m.tpot_s for m in measured]))

    def gap(s: float) -> float:
        t1, t2 = simulate(s)
        return 0.5 * (math.log(t1 / ttft) + math.log(t2 / tpot))

    lo, hi = SLOWDOWN_RANGE
    g_lo, g_hi = gap(lo), gap(hi)
    if g_lo >= 0:
        return lo
    if g_hi <= 0:
        return hi
    return float(brentq(gap, lo, hi, xtol=1e-4))
