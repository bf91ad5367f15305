"""Output-length predictors (Aladdin §2.3, §4.3).

``BucketMeanPredictor`` is Aladdin's "most naive" predictor: the historical mean output length of
requests whose input length falls in the same bucket, learned online from finished requests.
When a running request outlives its prediction it is re-predicted as the conditional mean
E[out | out > generated] over the same bucket (§4.3: "we predict the output length again using
conditional average output length when l_real > l_pred with the same input length").

``OraclePredictor`` knows every request's true output (for upper-bound runs).

One protocol for every predictor (the simulator's too): ``predict(request_id, input_tokens,
generated_tokens=0)`` — with ``generated_tokens > 0`` it is a re-prediction for a request that has
already produced that many tokens — and ``observe(request_id, input_tokens, output_tokens)``.

Both are pure Python + numpy; nothing here touches the simulator or the runtime.
"""

from __future__ import annotations

import bisect
import inspect
from typing import Mapping, Protocol, Sequence

import numpy as np

# Powers of two up to 32k: prompt lengths spread over three decades, so equal-width buckets
# would leave the long tail with one sample each.
DEFAULT_EDGES: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class OutputPredictor(Protocol):
    def predict(self, request_id: int, input_tokens: int, generated_tokens: int = 0) -> float:
        """Predicted total output tokens; with ``generated_tokens`` > 0, a re-prediction given that
        the request has already produced that many (the result exceeds ``generated_tokens``)."""
        ...

    def observe(self, request_id: int, input_tokens: int, output_tokens: int) -> None: ...


def check_predictor(predictor: object) -> None:
    """TypeError unless ``predictor`` follows ``OutputPredictor``: ``predict`` and ``observe`` each
    take (request id, input tokens, generated / output tokens). A caller with another argument
    order would feed a predictor the wrong numbers without any error, so it is refused up front."""
    for method in ("predict", "observe"):
        fn = getattr(predictor, method, None)
        if not callable(fn):
            raise TypeError(f"{type(predictor).__name__} has no {method}(request_id, input_tokens, ...) method")
        try:
            inspect.signature(fn).bind(0, 0, 0)
        except TypeError as exc:
            raise TypeError(f"{type(predictor).__name__}.{method} must take (request_id, input_tokens, "
                            f"{'generated_tokens' if method == 'predict' else 'output_tokens'}): {exc}") from exc
        except ValueError:  # no signature to read (a builtin): trust it
            pass


class BucketMeanPredictor:
    """Mean output per input-length bucket, learned online.

    ``edges`` are the upper bounds of the buckets (a last open bucket catches the rest).
    ``prior``: the prediction for a bucket with no history yet (the global mean once any request
    has finished). Memory: every observed output is kept per bucket (``history`` most recent),
    sorted lazily, so a re-prediction is one binary search plus a prefix sum.
    """

    name = "bucket-mean"

    def __init__(self, edges: Sequence[int] = DEFAULT_EDGES, prior: float = 128.0, history: int = 100_000):
        if list(edges) != sorted(set(edges)) or not edges or edges[0] <= 0:
            raise ValueError("bucket edges must be positive and strictly increasing")
        if prior <= 0 or history <= 0:
            raise ValueError("prior and history must be positive")
        self.edges = tuple(int(e) for e in edges)
        self.prior = float(prior)
        self.history = int(history)
        n = len(self.edges) + 1
        self._values: list[list[int]] = [[] for _ in range(n)]
        self._sorted: list[np.ndarray | None] = [None] * n
        self._prefix: list[np.ndarray | None] = [None] * n
        self._sum = [0.0] * n
        self._total, self._count = 0.0, 0

    def bucket(self, input_tokens: int) -> int:
        return bisect.bisect_left(self.edges, input_tokens)

    # ---------------------------------------------------------------- learning
    def observe(self, request_id: int, input_tokens: int, output_tokens: int) -> None:
        b = self.bucket(input_tokens)
        vals = self._values[b]
        vals.append(int(output_tokens))
        self._sum[b] += output_tokens
        if len(vals) > self.history:
            self._sum[b] -= vals.pop(0)
        self._sorted[b] = None
        self._total += output_tokens
        self._count += 1

    def fit(self, inputs: Sequence[int], outputs: Sequence[int]) -> "BucketMeanPredictor":
        """Learn from a history of finished requests at once (e.g. yesterday's trace)."""
        for i, o in zip(inputs, outputs):
            self.observe(-1, int(i), int(o))
        return self

    # ---------------------------------------------------------------- predicting
    def _fallback(self) -> float:
        return self._total / self._count if self._count else self.prior

    def predict(self, request_id: int, input_tokens: int, generated_tokens: int = 0) -> float:
        """The bucket mean; once ``generated_tokens`` reach it, E[out | out > generated] instead."""
        b = self.bucket(input_tokens)
        n = len(self._values[b])
        mean = self._sum[b] / n if n else self._fallback()
        if generated_tokens <= 0 or generated_tokens < mean:
            return mean
        return self.repredict(input_tokens, generated_tokens)

    def repredict(self, input_tokens: int, generated_tokens: int) -> float:
        """E[out | out > generated] in the request's bucket; twice ``generated`` (at least one more
        token) when no finished request of the bucket ever ran that long."""
        b = self.bucket(input_tokens)
        if self._values[b]:
            if self._sorted[b] is None:
                arr = np.sort(np.asarray(self._values[b], float))
                self._sorted[b], self._prefix[b] = arr, np.concatenate([[0.0], np.cumsum(arr)])
            arr, pre = self._sorted[b], self._prefix[b]
            k = int(np.searchsorted(arr, generated_tokens, side="right"))
            if k < len(arr):
                return float((pre[-1] - pre[k]) / (len(arr) - k))
        return float(max(2 * generated_tokens, generated_tokens + 1))

    def bucket_means(self) -> dict[str, float]:
        """Readable summary: bucket label -> mean output (buckets with history only)."""
        out = {}
        lo = 0
        for b, hi in enumerate(self.edges + (None,)):
            if self._values[b]:
                label = f"({lo}, {hi}]" if hi is not None else f"> {lo}"
                out[label] = self._sum[b] / len(self._values[b])
            lo = hi if hi is not None else lo
        return out


class OraclePredictor:
    """Knows the true output length of every request id (an upper bound on prediction)."""

    name = "oracle"

    def __init__(self, outputs: Mapping[int, int] | Sequence[int]):
        self._outputs = outputs

    def predict(self, request_id: int, input_tokens: int, generated_tokens: int = 0) -> float:
        out = float(self._outputs[request_id])
        return out if generated_tokens < out else float(generated_tokens) + 1.0

    def observe(self, request_id: int, input_tokens: int, output_tokens: int) -> None:
        pass


class NoisyOraclePredictor:
    """The true output length times a log-normal error exp(N(0, σ²)) drawn once per request: a
    predictor of known, tunable quality between the oracle (σ = 0) and the bucket mean.

    A request that outlives its prediction is re-predicted as twice what it has generated (the
    true length is not consulted again)."""

    name = "noisy"

    def __init__(self, outputs: Sequence[int], sigma: float = 0.5, seed: int = 0):
        if sigma < 0:
            raise ValueError("sigma must be non-negative")
        self._outputs = np.asarray(outputs, float)
        rng = np.random.default_rng(seed)
        self._noise = np.exp(rng.normal(0.0, sigma, len(self._outputs)))
        self.sigma = float(sigma)

    def predict(self, request_id: int, input_tokens: int, generated_tokens: int = 0) -> float:
        p = max(1.0, float(self._outputs[request_id] * self._noise[request_id]))
        if generated_tokens < p:
            return p
        return float(max(2 * generated_tokens, generated_tokens + 1))

    def observe(self, request_id: int, input_tokens: int, output_tokens: int) -> None:
        pass
