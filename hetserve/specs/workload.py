"""Workloads: requests (arrival time, input tokens, output tokens), traces, classes and SLOs.

A ``Workload`` keeps its requests as three numpy arrays so the simulator and planner can take
statistics and slices of 19k-request traces without Python loops.

Readers:
- the Azure LLM inference trace layout ``TIMESTAMP,ContextTokens,GeneratedTokens`` (timestamps
  as in the file or plain seconds), arrivals taken from the file: its times must not decrease from
  row to row (request ids are row order), and they are shifted so the first arrives at 0;
- length-only files ``num_prefill_tokens,num_decode_tokens`` (ShareGPT), which get Poisson
  arrivals at a chosen rate (``DEFAULT_SYNTHETIC_RATE``, 1 req/s, when none is given).

Either layout may add two optional columns (absent: every request is a plain completion):
``n`` — choices per request (OpenAI's ``n``; each choice generates the row's output tokens), and
``prompt_logprobs`` — 1 where the request scores its prompt (``echo`` with ``logprobs``: the LM head
runs over every prompt position). A scoring request with ``max_tokens: 0`` is a row of one output
token: the engine samples one that nobody sees.

Classes follow HexGen-2 §5.1: heavy prefill = more than 512 input tokens, heavy decode = more
than 128 output tokens (HPLD, HPHD, LPHD, LPLD).
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import math
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Iterator

import numpy as np

from hetserve.errors import SpecError
from hetserve.specs._validation import existing_path, shown_name

HEAVY_PREFILL_TOKENS = 512
HEAVY_DECODE_TOKENS = 128
CLASSES = ("HPLD", "HPHD", "LPHD", "LPLD")

# Bundled traces; see data/workloads/ATTRIBUTION.md.
WORKLOAD_PRESETS = {
    "azure-conv": "azure_llm_2023_conv.csv",
    "sharegpt": "sharegpt.csv",
}
DEFAULT_SYNTHETIC_RATE = 1.0  # req/s for length-only traces when no rate is given
# req/s: far past any pool. Beyond it the gaps between arrivals shrink toward float's smallest
# values (a rate of 1e308 leaves them denormal and the mean rate reads inf).
MAX_RATE = 1e9


@dataclass(frozen=True)
class Request:
    id: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    choices: int = 1  # sequences decoded from the one prompt (OpenAI ``n``)
    prompt_logprobs: bool = False  # the prefill scores every prompt position


@dataclass(frozen=True)
class SLO:
    """Latency targets in seconds; ``None`` means no target on that metric."""

    ttft_s: float | None = None
    tpot_s: float | None = None  # also Aladdin's ATGT target
    e2e_s: float | None = None

    def __post_init__(self) -> None:
        for k in ("ttft_s", "tpot_s", "e2e_s"):
            v = getattr(self, k)
            if v is not None and v <= 0:
                raise ValueError(f"SLO {k} must be positive, got {v}")


@dataclass(frozen=True, eq=False)
class Workload:
    name: str
    arrival_s: np.ndarray  # float64, sorted, first at 0
    input_tokens: np.ndarray  # int64
    output_tokens: np.ndarray  # int64, per choice
    choices: np.ndarray | None = None  # int64 ≥ 1 per request (None: all 1)
    prompt_logprobs: np.ndarray | None = None  # bool per request (None: all False)
    # req/s of the Poisson arrivals drawn for a trace without times (None: arrivals read or reshaped)
    poisson_rate: float | None = None

    def __post_init__(self) -> None:
        n = len(self.arrival_s)
        if len(self.input_tokens) != n or len(self.output_tokens) != n:
            raise ValueError("workload arrays must have equal length")
        if n and np.any(np.diff(self.arrival_s) < 0):
            raise ValueError("arrivals must be sorted")
        # the optional columns are always arrays once built, so every reader indexes them alike
        ch = np.ones(n, np.int64) if self.choices is None else np.asarray(self.choices, np.int64)
        lp = np.zeros(n, bool) if self.prompt_logprobs is None else np.asarray(self.prompt_logprobs, bool)
        if len(ch) != n or len(lp) != n:
            raise ValueError("workload arrays must have equal length")
        if n and ch.min() < 1:
            raise ValueError("choices must be at least 1")
        object.__setattr__(self, "choices", ch)
        object.__setattr__(self, "prompt_logprobs", lp)

    def __len__(self) -> int:
        return len(self.arrival_s)

    def __iter__(self) -> Iterator[Request]:
        for i in range(len(self)):
            yield self[i]

    def __getitem__(self, i: int) -> Request:
        return Request(i, float(self.arrival_s[i]), int(self.input_tokens[i]), int(self.output_tokens[i]),
                       int(self.choices[i]), bool(self.prompt_logprobs[i]))

    # ---------------------------------------------------------------- statistics
    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1] - self.arrival_s[0]) if len(self) > 1 else 0.0

    @property
    def rate(self) -> float:
        """Mean arrival rate, requests/s: (n - 1) / span."""
        return (len(self) - 1) / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def mean_input(self) -> float:
        return float(self.input_tokens.mean()) if len(self) else 0.0

    @property
    def mean_output(self) -> float:
        """Mean output tokens of one choice."""
        return float(self.output_tokens.mean()) if len(self) else 0.0

    @property
    def mean_choices(self) -> float:
        return float(self.choices.mean()) if len(self) else 1.0

    @property
    def scoring_share(self) -> float:
        """Share of the requests that score their prompt (``prompt_logprobs``)."""
        return float(self.prompt_logprobs.mean()) if len(self) else 0.0

    def _with(self, name: str, arrival_s: np.ndarray, idx=slice(None), times: int = 1) -> "Workload":
        """A workload of these requests (``idx``, each ``times`` over) at new arrival times."""
        def cols(a: np.ndarray) -> np.ndarray:
            return np.tile(a[idx], times) if times > 1 else a[idx]
        return Workload(name, arrival_s, cols(self.input_tokens), cols(self.output_tokens), cols(self.choices),
                        cols(self.prompt_logprobs))

    def classes(self) -> np.ndarray:
        """HexGen-2 class label per request (array of strings)."""
        hp = self.input_tokens > HEAVY_PREFILL_TOKENS
        hd = self.output_tokens > HEAVY_DECODE_TOKENS
        return np.where(hp, np.where(hd, "HPHD", "HPLD"), np.where(hd, "LPHD", "LPLD"))

    # ---------------------------------------------------------------- transformations
    def _take(self, mask_or_idx: np.ndarray, name: str) -> "Workload":
        arr = self.arrival_s[mask_or_idx]
        start = arr[0] if len(arr) else 0.0
        return self._with(name, arr - start, mask_or_idx)

    def of_class(self, cls: str) -> "Workload":
        """Only the requests of one HexGen-2 class (arrival times kept from the trace)."""
        if cls not in CLASSES:
            raise SpecError(self.name, "class", "one of " + ", ".join(CLASSES), cls)
        return self._take(self.classes() == cls, f"{self.name}:{cls}")

    def filter_lengths(self, max_input: int | None = None, max_output: int | None = None) -> "Workload":
        """Drop requests longer than the limits (MoLink drops input > 2048 or output > 1024)."""
        keep = np.ones(len(self), bool)
        if max_input is not None:
            keep &= self.input_tokens <= max_input
        if max_output is not None:
            keep &= self.output_tokens <= max_output
        return self._take(keep, self.name)

    def within_context(self, max_tokens: int) -> "Workload":
        """Drop requests whose prompt + output exceed a model's context window."""
        return self._take(self.input_tokens + self.output_tokens <= max_tokens, self.name)

    def head(self, n: int) -> "Workload":
        return self._take(np.arange(min(n, len(self))), self.name)

    def window(self, start_s: float, end_s: float) -> "Workload":
        return self._take((self.arrival_s >= start_s) & (self.arrival_s < end_s), self.name)

    def unspaced(self) -> str | None:
        """Why the arrivals cannot be rescaled to a rate (None: they can): one request, or all of
        them at one instant, have no spacing to stretch."""
        if len(self) < 2:
            return f"{len(self)} request" + ("" if len(self) == 1 else "s")
        if self.duration_s <= 0:
            return f"all {len(self)} requests arriving at one instant ({float(self.arrival_s[0]):g} s)"
        return None

    def _refuse_rescale(self, source: str | None, option: str, value: float) -> None:
        why = self.unspaced()
        if why is not None:  # a rate that would be ignored is refused, never silently dropped
            raise SpecError(source or self.name, "arrivals",
                            f"arrivals spread over time for {option} {value:g} to rescale (drop {option} to replay "
                            f"the trace as it is; a trace without arrival times, no TIMESTAMP column, gets Poisson "
                            f"arrivals at --rate)", why)

    def scale_rate(self, factor: float, *, source: str | None = None, option: str = "--rate-scale") -> "Workload":
        """Compress time by ``factor`` (2 = twice the arrival rate); the burst shape is kept.
        ``SpecError`` naming ``source`` (the trace as the user named it) and ``option`` when the
        arrivals have no spacing to compress."""
        if factor <= 0:
            raise SpecError(self.name, "rate_scale", "a positive number", factor)
        self._refuse_rescale(source, option, factor)
        return self._with(self.name, self.arrival_s / factor)

    def _check_rate(self, rate: float, source: str | None, option: str) -> None:
        if not 0 < rate <= MAX_RATE:  # also refuses nan
            raise SpecError(source or self.name, option, f"a positive number of requests/s, at most {MAX_RATE:.0e}",
                            rate)

    def with_rate(self, rate: float, *, source: str | None = None, option: str = "--rate") -> "Workload":
        """Rescale arrivals so the mean rate is ``rate`` requests/s (refused as ``scale_rate``)."""
        self._check_rate(rate, source, option)
        self._refuse_rescale(source, option, rate)
        return self._with(self.name, self.arrival_s / (rate / self.rate))

    def with_poisson_arrivals(self, rate: float, seed: int = 0, *, source: str | None = None,
                              option: str = "rate") -> "Workload":
        """Replace arrival times with a Poisson process at ``rate`` req/s."""
        self._check_rate(rate, source, option)
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(self))
        arr = np.concatenate([[0.0], np.cumsum(gaps[1:])]) if len(self) else gaps
        return dataclasses.replace(self._with(self.name, arr), poisson_rate=float(rate))

    def repeat(self, times: int) -> "Workload":
        """The trace played ``times`` times back to back (for scaling benchmarks)."""
        span = self.duration_s + (1.0 / self.rate if self.rate > 0 else 1.0)
        arr = np.concatenate([self.arrival_s + k * span for k in range(times)])
        return self._with(f"{self.name}x{times}", arr, times=times)

    @staticmethod
    def from_lists(name: str, arrivals, inputs, outputs, choices=None, prompt_logprobs=None) -> "Workload":
        arr = np.asarray(arrivals, float)
        order = np.argsort(arr, kind="stable")
        ch = None if choices is None else np.asarray(choices, np.int64)[order]
        lp = None if prompt_logprobs is None else np.asarray(prompt_logprobs, bool)[order]
        return Workload(name, arr[order] - (arr[order][0] if len(arr) else 0.0),
                        np.asarray(inputs, np.int64)[order], np.asarray(outputs, np.int64)[order], ch, lp)


# ----------------------------------------------------------------------------- readers


MAX_SPAN_S = 10 * 365.25 * 86400
MAX_TIME_S = 1e10
MAX_TOKENS = 10 ** 15  # tokens of one request's prompt or output, far past any model's context


def _parse_time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    # Azure timestamps carry 7 fractional digits; datetime takes at most 6.
    head, _, frac = text.strip().partition(".")
    return _seconds_of(head) + (float("0." + frac) if frac else 0.0)


@functools.lru_cache(maxsize=1 << 16)
def _seconds_of(head: str) -> float:
    """``YYYY-MM-DD HH:MM:SS`` as a Unix time; a trace's neighbouring rows share their second."""
    return datetime.strptime(head, "%Y-%m-%d %H:%M:%S").timestamp()


def _csv_rows(fh, src: str) -> Iterator[list[str]]:
    """The file's rows one at a time, closed once read: a list of them all would hold a
    million-request trace as three million strings (hundreds of MB) to build three arrays."""
    with fh:
        try:
            yield from csv.reader(fh)
        except (UnicodeDecodeError, csv.Error) as exc:
            raise SpecError(src, "(file)", "a UTF-8 text CSV file", str(exc).splitlines()[0]) from exc


def _read_csv(path: Path, rate: float | None, seed: int, name: str) -> Workload:
    src = str(path)
    try:
        fh = path.open(newline="", encoding="utf-8-sig")  # -sig: a spreadsheet's byte-order mark is no header
    except OSError as exc:
        raise SpecError(src, "(file)", "a readable CSV file", exc.strerror) from exc
    rows = _csv_rows(fh, src)
    # column names in any case ("Timestamp", "contexttokens"): a time column that went unread
    # would be replaced by made-up arrivals without a word
    named = [h.strip() for h in next(rows, [])]
    header = [h.lower() for h in named]
    twice = sorted({named[i] for i, h in enumerate(header) if header.count(h) > 1})
    if twice:  # which of the two columns would be read is a guess: say so instead
        raise SpecError(src, "(header)", "each column once", f"{twice[0]} twice")
    if {"contexttokens", "generatedtokens"} <= set(header):
        cols, time_col = ("contexttokens", "generatedtokens"), header.index("timestamp") if "timestamp" in header else None
    elif {"num_prefill_tokens", "num_decode_tokens"} <= set(header):
        cols = ("num_prefill_tokens", "num_decode_tokens")
        time_col = header.index("arrived_at") if "arrived_at" in header else None
    else:
        raise SpecError(src, "(header)", "columns TIMESTAMP,ContextTokens,GeneratedTokens or "
                        "num_prefill_tokens,num_decode_tokens", ",".join(named))
    ci, co = header.index(cols[0]), header.index(cols[1])
    cols = (named[ci], named[co])  # as the file spells them, for the messages below
    extra = _OptionalColumns(header, named)
    arrivals, ins, outs = [], [], []
    last = (0, "")  # the previous request's line and time, as the file writes it
    for line, row in enumerate(rows, start=2):
        if not row:
            continue
        if len(row) > len(header):  # a field more than the header names: a shifted or merged row
            raise SpecError(f"{src}:{line}", "row", f"{len(header)} fields, as the header ({','.join(named)})",
                            f"{len(row)}: {','.join(row)}")
        try:
            i, o = int(row[ci]), int(row[co])
        except (ValueError, IndexError) as exc:
            raise SpecError(f"{src}:{line}", cols[0] if "timestamp" not in header else "row",
                            "integer token counts and a timestamp", ",".join(row)) from exc
        try:
            t = _parse_time(row[time_col]) if time_col is not None else 0.0
        except (ValueError, IndexError) as exc:
            raise SpecError(f"{src}:{line}", named[time_col], "a time in seconds or 'YYYY-MM-DD HH:MM:SS'",
                            row[time_col] if time_col < len(row) else "nothing") from exc
        if not math.isfinite(t):
            raise SpecError(f"{src}:{line}", "timestamp", "a finite time", row[time_col])
        # a trace spans at most ten years, and its times are seconds or Unix times before 2286:
        # past that a float cannot tell one second from the next and the arrivals collapse
        if abs(t) > MAX_TIME_S or (arrivals and abs(t - arrivals[0]) > MAX_SPAN_S):
            raise SpecError(f"{src}:{line}", named[time_col], f"a time within {MAX_SPAN_S:.0f} s (ten years) of "
                            f"the first row's and at most {MAX_TIME_S:.0e} s", row[time_col])
        # request ids follow the file's rows: a time before the row above would have them reordered
        # by arrival (``Workload.from_lists`` sorts) without a word
        if arrivals and t < arrivals[-1]:
            raise SpecError(f"{src}:{line}", named[time_col], f"times in non-decreasing order (at or after "
                            f"line {last[0]}'s {last[1]})", row[time_col])
        last = (line, row[time_col].strip() if time_col is not None else "")
        if i <= 0 or o <= 0:
            raise SpecError(f"{src}:{line}", f"{cols[0]}/{cols[1]}", "positive token counts", f"{i},{o}")
        if max(i, o) > MAX_TOKENS:  # past it the counts overflow the 64-bit sums taken of them
            raise SpecError(f"{src}:{line}", f"{cols[0]}/{cols[1]}", f"token counts of at most {MAX_TOKENS:.0e}",
                            f"{i},{o}")
        extra.read(row, f"{src}:{line}")
        arrivals.append(t), ins.append(i), outs.append(o)
    if not ins:
        raise SpecError(src, "(rows)", "at least one request")
    wl = Workload.from_lists(name, arrivals, ins, outs, extra.choices, extra.prompt_logprobs)
    if time_col is None:
        wl = wl.with_poisson_arrivals(DEFAULT_SYNTHETIC_RATE if rate is None else rate, seed, source=src,
                                      option="--rate")
    elif rate is not None:
        wl = wl.with_rate(rate, source=str(src))
    return wl


class _OptionalColumns:
    """The trace's optional ``n`` and ``prompt_logprobs`` columns, row by row (None: column absent)."""

    def __init__(self, header: list[str], named: list[str]):
        self._n = header.index("n") if "n" in header else None
        self._lp = header.index("prompt_logprobs") if "prompt_logprobs" in header else None
        self._names = named
        self.choices: list[int] | None = [] if self._n is not None else None
        self.prompt_logprobs: list[bool] | None = [] if self._lp is not None else None

    def read(self, row: list[str], where: str) -> None:
        if self._n is not None:
            cell = row[self._n].strip() if self._n < len(row) else ""
            if not cell.isdigit() or int(cell) < 1:
                raise SpecError(where, self._names[self._n], "a whole number of choices, at least 1", cell)
            self.choices.append(int(cell))
        if self._lp is not None:
            cell = row[self._lp].strip().lower() if self._lp < len(row) else ""
            if cell not in _FLAGS:
                raise SpecError(where, self._names[self._lp], "0 or 1 (true / false)", cell)
            self.prompt_logprobs.append(_FLAGS[cell])


_FLAGS = {"0": False, "1": True, "false": False, "true": True}


def workload_presets() -> list[str]:
    return sorted(WORKLOAD_PRESETS)


def load_workload(name_or_path: str | Path, rate: float | None = None, seed: int = 0) -> Workload:
    """A bundled trace (``azure-conv``, ``sharegpt``) or a CSV file.

    ``rate`` (req/s): for timed traces, rescales arrivals to that mean rate; for length-only
    traces, the Poisson rate (default 1 req/s).
    """
    key = str(name_or_path)
    path = existing_path(key)
    if path is None:
        if key not in WORKLOAD_PRESETS:
            raise SpecError(shown_name(key), "(workload)", "an existing CSV file or a preset: " + ", ".join(workload_presets()))
        path = Path(str(resources.files("hetserve") / "data" / "workloads" / WORKLOAD_PRESETS[key]))
        return _read_csv(path, rate, seed, key)
    return _read_csv(path, rate, seed, path.stem)
