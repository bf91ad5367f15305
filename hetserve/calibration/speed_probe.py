"""How fast this machine runs the checkpoint *now*, relative to when it was calibrated.

A calibration is a few minutes of measurements; on a shared VM the machine's own speed then drifts
by tens of percent within minutes, with no other process of the VM busy (a one-token decode of
6.3 ms in one run, 9.1 ms in the next). A served run then meets
another machine than the one the cost model was fitted on. The probe is a short, fixed piece of the
same work — the checkpoint's one-token decode steps and a prompt, through ``transformers`` in this
process on one thread, as each worker computes — read in ``hetserve calibrate``'s rounds and again
just before and after ``hetserve compare`` serves. The ratio of the two (``slowdown``), to the power
``SPEED_WEIGHT`` (``weighted``: the part of it that carries to the workers), scales every calibrated
time (``Efficiency.at_speed``), so the simulator prices the machine the served run met.

It is a *machine* index, not a cost: it prices no plan shape, and the plan being compared plays no
part in it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Sequence

PROMPT_TOKENS = 128  # the probe's prompt (shorter where the checkpoint's context is)
CONTEXT_TOKENS = 16  # the decode steps' context
# How much of the probe's ratio carries to the served workers, as a power (``weighted``). The probe
# runs in this process, on one thread, between the serving phases; the workers' speed while serving
# follows it only in part. Regressed in logs over bench_predict's cells, each cell's served /
# simulated-as-calibrated factor on the ratio has a slope of about 0.75, and that power leaves the
# least residual spread (docs/cost-model.md).
SPEED_WEIGHT = 0.75


@dataclass(frozen=True)
class SpeedReading:
    decode_s: float  # median one-token decode step, batch 1, this process, one thread
    prefill_s: float  # median prompt of PROMPT_TOKENS
    samples: int  # decode steps timed (prompts: one per 8 of them)

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "SpeedReading":
        return SpeedReading(float(d["decode_s"]), float(d["prefill_s"]), int(d.get("samples", 0)))


def combine(readings: Sequence[SpeedReading]) -> SpeedReading:
    """The median of several readings (a calibration's rounds, a compare's before and after)."""
    if not readings:
        raise ValueError("no speed readings")
    return SpeedReading(statistics.median(r.decode_s for r in readings),
                        statistics.median(r.prefill_s for r in readings), sum(r.samples for r in readings))


def slowdown(now: SpeedReading, then: SpeedReading) -> float:
    """How many times slower the machine runs now than then: the geometric mean of the decode and
    the prompt ratios (the two stress the cores differently: weights streamed vs GEMMs)."""
    return ((now.decode_s / then.decode_s) * (now.prefill_s / then.prefill_s)) ** 0.5


def weighted(slow: float, weight: float = SPEED_WEIGHT) -> float:
    """The factor the calibrated times are scaled by for a probe ratio ``slow``: ``slow ** weight``
    (``SPEED_WEIGHT``; 1: all of the ratio, 0: none, as calibrated)."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"the speed probe's weight must be in [0, 1], not {weight}")
    return slow ** weight


def round_median(samples: Sequence[tuple[int, float]], readings: Sequence[SpeedReading]) -> float:
    """Median of a calibration probe's ``(round, seconds)`` samples, each first scaled to the speed of
    the rounds' median reading (``combine``) by its own round's reading: on this VM the machine's
    speed moves within one calibration too (round readings 0.94-1.27x their median), and a probe's
    samples from a slow round otherwise pull its median up. That median reading is the calibration's
    reference, the one ``hetserve compare`` scales the calibrated times from, so a calibration then
    describes the machine at one speed, and calibrations a minute apart agree about twice as
    closely on their decode probes as with the raw samples. Without readings, the plain
    median (``measure`` reads one before every round, or none at all)."""
    if not samples:
        raise ValueError("no samples")
    if not readings:
        return statistics.median(s for _, s in samples)
    ref = combine(readings)
    return statistics.median(s / slowdown(readings[r], ref) for r, s in samples)


def paired_round_median(a: Sequence[tuple[int, float]], b: Sequence[tuple[int, float]],
                        readings: Sequence[SpeedReading]) -> float:
    """``round_median`` of ``a − b`` taken round by round: two probes of one round run seconds apart,
    so the machine's drift between rounds cancels in their difference, where a difference of their
    two medians keeps it (each median may come from another round). The stream overhead (HTTP −
    engine TPOT) is paired per round with this, as the request overhead is paired per request."""
    by_round = dict(b)
    pairs = [(r, s - by_round[r]) for r, s in a if r in by_round]
    return round_median(pairs, readings)


class SpeedProbe:
    """The checkpoint loaded once in this process; ``read`` times it."""

    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        self._torch = torch
        hf_logging.disable_progress_bar()
        # the checkpoint's own dtype, as the workers load it (runtime/model/config.py)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto").eval()
        limit = int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)
        self.prompt_tokens = max(1, min(PROMPT_TOKENS, limit - 2))
        self.read(0.0)  # warm-up: the first calls allocate and pick kernels

    def readings(self, n: int, seconds: float) -> list[SpeedReading]:
        """``n`` readings of ``seconds`` each, back to back (``combine`` takes their median)."""
        return [self.read(seconds) for _ in range(n)]

    def read(self, seconds: float = 1.5) -> SpeedReading:
        """Alternate 8 decode steps and one prompt for about ``seconds`` (at least one round)."""
        torch = self._torch
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as each worker (runtime/workers/worker.py)
        decode, prefill = [], []
        end = time.perf_counter() + seconds
        try:
            with torch.inference_mode():
                while True:
                    out = self.model(torch.full((1, CONTEXT_TOKENS), 65), use_cache=True)
                    past, token = out.past_key_values, torch.full((1, 1), 66)
                    for _ in range(8):
                        t0 = time.perf_counter()
                        past = self.model(token, past_key_values=past, use_cache=True).past_key_values
                        decode.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    self.model(torch.full((1, self.prompt_tokens), 65))
                    prefill.append(time.perf_counter() - t0)
                    if time.perf_counter() >= end:
                        break
        finally:
            torch.set_num_threads(threads)
        return SpeedReading(statistics.median(decode), statistics.median(prefill), len(decode))
