"""Learned performance models (Aladdin §3): three small linear laws fitted by least squares.

* prefill batch time      ``t_pre = k1 · Σ l_in + c1``                       (Aladdin Eq. 2)
* decode iteration time   ``t_d = (k2 · l_ave + c2) · b + c3 = k2 · Σ ctx + c2 · b + c3``  (Eq. 3)
* KV-cache use            ``kv = h · tokens + j``  (bytes, per request)          (Eq. 1)

Coefficients are fitted with non-negative least squares (``scipy.optimize.nnls``): every one of
them is a physical cost, and a negative slope would turn Aladdin's Eq. 4 upside down. Each fit
reports its error on the data it was fitted to (R², MAPE, max relative error).

Two sources of data:

(a) measurements from the simulator or the runtime, as arrays or as a CSV with the columns
    ``phase,batch_size,num_tokens,value``: ``phase`` is ``prefill`` (num_tokens = Σ input tokens,
    value = seconds), ``decode`` (num_tokens = Σ context tokens of the batch, value = seconds per
    iteration) or ``kv`` (num_tokens = tokens of one request, value = bytes);
(b) samples drawn from the analytic cost model for one replica layout
    (``fit_from_cost_model``), so a replica nobody has measured yet still has coefficients.

No imports from the planner, simulator or runtime (docs/design.md layering).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from scipy.optimize import nnls

from hetserve.errors import SpecError


@dataclass(frozen=True)
class FitReport:
    """How well a linear law matches the data it was fitted to."""

    n: int
    r2: float
    mape: float  # mean |pred - y| / y
    max_rel_error: float

    @staticmethod
    def of(y: np.ndarray, pred: np.ndarray) -> "FitReport":
        y, pred = np.asarray(y, float), np.asarray(pred, float)
        ss_res = float(np.sum((y - pred) ** 2))
        ss_tot = float(np.sum((y - y.mean()) ** 2))
        r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
        rel = np.abs(pred - y) / np.maximum(np.abs(y), 1e-12)
        return FitReport(len(y), r2, float(rel.mean()), float(rel.max()))


@dataclass(frozen=True)
class PrefillModel:
    """``t = k1 · tokens + c1`` seconds for a prefill batch of ``tokens`` prompt tokens in all."""

    k1: float
    c1: float

    def time(self, tokens: float) -> float:
        return self.k1 * tokens + self.c1

    def max_tokens(self, budget_s: float) -> float:
        """Largest Σ input whose prefill finishes within ``budget_s`` (Aladdin constraint (c))."""
        if budget_s < self.c1:
            return 0.0
        return float("inf") if self.k1 <= 0 else (budget_s - self.c1) / self.k1


@dataclass(frozen=True)
class DecodeModel:
    """``t = k2 · Σ ctx + c2 · b + c3`` seconds per decode iteration of ``b`` sequences."""

    k2: float
    c2: float
    c3: float

    def time(self, batch: float, context_tokens: float) -> float:
        if batch <= 0:
            return 0.0
        return self.k2 * context_tokens + self.c2 * batch + self.c3

    def context_limit(self, batch: float, atgt_s: float) -> float:
        """Aladdin Eq. 4: the largest Σ context at which ``batch`` sequences still iterate within
        ``atgt_s`` (negative: this batch size alone breaks the target)."""
        room = atgt_s - self.c3 - self.c2 * batch
        if self.k2 <= 0:
            return float("inf") if room >= 0 else -1.0
        return room / self.k2


@dataclass(frozen=True)
class KVModel:
    """``bytes = h · tokens + j`` for one request holding ``tokens`` tokens of context."""

    h: float
    j: float = 0.0

    def bytes(self, tokens: float) -> float:
        return self.h * tokens + self.j

    def tokens_equivalent(self, tokens: float) -> float:
        """The request's footprint in KV-pool tokens (its per-request overhead ``j`` included)."""
        return tokens + (self.j / self.h if self.h > 0 else 0.0)


@dataclass(frozen=True)
class PerformanceModel:
    """One worker's learned models plus its KV pool, as Aladdin's placement reads them."""

    prefill: PrefillModel
    decode: DecodeModel
    kv: KVModel
    kv_capacity_tokens: float
    reports: dict[str, FitReport] | None = None

    def to_dict(self) -> dict:
        out = {"prefill": vars(self.prefill), "decode": vars(self.decode), "kv": vars(self.kv),
               "kv_capacity_tokens": self.kv_capacity_tokens}
        if self.reports:
            out["fit"] = {k: vars(v) for k, v in self.reports.items()}
        return out


# ----------------------------------------------------------------------------- fitting


def _nnls(features: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, FitReport]:
    """Non-negative least squares, columns rescaled so nnls is well conditioned."""
    features, y = np.asarray(features, float), np.asarray(y, float)
    if len(y) < features.shape[1]:
        raise ValueError(f"need at least {features.shape[1]} samples, got {len(y)}")
    scale = np.maximum(np.abs(features).max(axis=0), 1e-300)
    coef, _ = nnls(features / scale, y)
    coef = coef / scale
    return coef, FitReport.of(y, features @ coef)


def fit_prefill(tokens: Sequence[float], times_s: Sequence[float]) -> tuple[PrefillModel, FitReport]:
    """Fit Eq. 2 to prefill batches (Σ input tokens, seconds)."""
    x = np.asarray(tokens, float)
    (k1, c1), rep = _nnls(np.column_stack([x, np.ones_like(x)]), times_s)
    return PrefillModel(float(k1), float(c1)), rep


def fit_decode(batch: Sequence[float], context_tokens: Sequence[float],
               times_s: Sequence[float]) -> tuple[DecodeModel, FitReport]:
    """Fit Eq. 3 to decode iterations (batch size, Σ context tokens, seconds)."""
    b, c = np.asarray(batch, float), np.asarray(context_tokens, float)
    (k2, c2, c3), rep = _nnls(np.column_stack([c, b, np.ones_like(b)]), times_s)
    return DecodeModel(float(k2), float(c2), float(c3)), rep


def fit_kv(tokens: Sequence[float], nbytes: Sequence[float]) -> tuple[KVModel, FitReport]:
    """Fit Eq. 1 to KV use (tokens of one request, bytes)."""
    x = np.asarray(tokens, float)
    (h, j), rep = _nnls(np.column_stack([x, np.ones_like(x)]), nbytes)
    return KVModel(float(h), float(j)), rep


@dataclass
class Measurements:
    """Raw samples of the three laws (what the simulator or runtime records)."""

    prefill_tokens: list[float]
    prefill_s: list[float]
    decode_batch: list[float]
    decode_context: list[float]
    decode_s: list[float]
    kv_tokens: list[float]
    kv_bytes: list[float]

    @staticmethod
    def empty() -> "Measurements":
        return Measurements([], [], [], [], [], [], [])

    def fit(self, kv_capacity_tokens: float, kv_bytes_per_token: float | None = None) -> PerformanceModel:
        """Fit every law that has data; KV falls back to ``kv_bytes_per_token`` when unmeasured."""
        pre, rp = fit_prefill(self.prefill_tokens, self.prefill_s)
        dec, rd = fit_decode(self.decode_batch, self.decode_context, self.decode_s)
        reports = {"prefill": rp, "decode": rd}
        if self.kv_tokens:
            kv, reports["kv"] = fit_kv(self.kv_tokens, self.kv_bytes)
        elif kv_bytes_per_token is not None:
            kv = KVModel(float(kv_bytes_per_token))
        else:
            raise ValueError("no KV samples and no kv_bytes_per_token to fall back on")
        return PerformanceModel(pre, dec, kv, float(kv_capacity_tokens), reports)


def read_measurements(path: str | Path) -> Measurements:
    """Read a ``phase,batch_size,num_tokens,value`` CSV (see the module docstring)."""
    path = Path(path)
    try:
        fh = path.open(newline="")
    except OSError as exc:
        raise SpecError(str(path), "(file)", "a readable CSV file", exc.strerror) from exc
    m = Measurements.empty()
    with fh:
        reader = csv.DictReader(fh)
        need = {"phase", "batch_size", "num_tokens", "value"}
        if not need <= set(reader.fieldnames or []):
            raise SpecError(str(path), "(header)", "columns " + ",".join(sorted(need)),
                            ",".join(reader.fieldnames or []))
        for line, row in enumerate(reader, start=2):
            try:
                b, n, v = float(row["batch_size"]), float(row["num_tokens"]), float(row["value"])
            except (TypeError, ValueError) as exc:
                raise SpecError(f"{path}:{line}", "batch_size/num_tokens/value", "numbers",
                                ",".join(str(x) for x in row.values())) from exc
            phase = row["phase"].strip()
            if phase == "prefill":
                m.prefill_tokens.append(n), m.prefill_s.append(v)
            elif phase == "decode":
                m.decode_batch.append(b), m.decode_context.append(n), m.decode_s.append(v)
            elif phase == "kv":
                m.kv_tokens.append(n), m.kv_bytes.append(v)
            else:
                raise SpecError(f"{path}:{line}", "phase", "prefill, decode or kv", phase)
    return m


def write_measurements(path: str | Path, m: Measurements) -> None:
    """Write samples in the CSV layout ``read_measurements`` takes."""
    with Path(path).open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["phase", "batch_size", "num_tokens", "value"])
        for t, s in zip(m.prefill_tokens, m.prefill_s):
            w.writerow(["prefill", 1, t, s])
        for b, c, s in zip(m.decode_batch, m.decode_context, m.decode_s):
            w.writerow(["decode", b, c, s])
        for t, v in zip(m.kv_tokens, m.kv_bytes):
            w.writerow(["kv", 1, t, v])


# ----------------------------------------------------------------------------- from the analytic model


def sample_cost_model(cost, layout, *, max_prefill_tokens: int = 4096, max_batch: int | None = None,
                      max_context: int | None = None, max_decode_s: float | None = None, samples: int = 200,
                      seed: int = 0) -> Measurements:
    """Draw samples of the three laws from the analytic ``CostModel`` for one ``ReplicaLayout``.

    Prefill batches: 1–8 prompts with random lengths summing to at most ``max_prefill_tokens``.
    Decode iterations: batches up to what the KV pool holds at the sampled average context; with
    ``max_decode_s`` only iterations up to that time are kept (fit the region a scheduler works
    in, e.g. up to 1.5× the ATGT target: the roofline bends, a line fitted over every batch size
    is off where it matters). Running time: O(``samples``) cost-model calls.
    """
    from hetserve.cost.analytic import PrefillBatch  # local: keeps this module light to import

    rng = np.random.default_rng(seed)
    model = cost.model
    cap = max(1.0, cost.kv_capacity_tokens(layout))
    max_context = max_context or model.max_context
    m = Measurements.empty()
    for _ in range(samples):
        total = int(rng.integers(16, max_prefill_tokens + 1))
        k = int(rng.integers(1, 9))
        cuts = np.sort(rng.integers(1, total, size=k - 1)) if k > 1 and total > k else np.array([], int)
        lengths = np.diff(np.concatenate([[0], cuts, [total]])).astype(int)
        lengths = [int(x) for x in lengths if x > 0]
        m.prefill_tokens.append(float(sum(lengths)))
        m.prefill_s.append(cost.prefill_time(layout, PrefillBatch.of(lengths)))
    tries = 0
    while len(m.decode_s) < samples and tries < 20 * samples:
        tries += 1
        avg = float(rng.integers(16, max_context + 1))
        bmax = max(1, int(cap // avg))
        if max_batch is not None:
            bmax = min(bmax, max_batch)
        b = int(rng.integers(1, bmax + 1))
        t = cost.decode_step_time(layout, b, b * avg)
        if max_decode_s is not None and t > max_decode_s and len(m.decode_s) + (20 * samples - tries) > samples:
            continue
        m.decode_batch.append(float(b)), m.decode_context.append(b * avg), m.decode_s.append(t)
    per_token = model.kv_bytes_per_token
    for _ in range(samples // 4 or 1):
        t = float(rng.integers(1, max_context + 1))
        m.kv_tokens.append(t), m.kv_bytes.append(per_token * t)
    return m


def fit_from_cost_model(cost, layout, **kwargs) -> PerformanceModel:
    """Aladdin's three laws for one replica, fitted to samples of the analytic cost model."""
    meas = sample_cost_model(cost, layout, **kwargs)
    return meas.fit(cost.kv_capacity_tokens(layout))
