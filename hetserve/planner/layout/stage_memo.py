"""The cost model with its per-stage prices memoised, for the layout search.

A layout search prices thousands of stage sequences (``layer_split``): every layer split and
polish step re-prices whole pipelines whose stages mostly repeat — the same TP group holding the
same number of layers, on the same or an identical class of GPUs. ``StageMemoCost`` is a
``CostModel`` whose per-stage terms (``stage_prefill_time``, ``stage_decode_time``,
``stage_kv_capacity``, ``pp_handoff_time``) are looked up by what the formulas read of a stage;
the replica-level methods (TTFT, decode step, KV capacity, colocated capacity …) are the cost
model's own and call these, so every figure is the cost model's, bit for bit, and the formulas
stay in one place (``cost.analytic``).

What a stage's price reads: the layer count, the position (first / last), the batch, and of its
devices only their FLOP/s, memory bandwidth and usable memory (slowest / smallest device paces)
and the links among them (TP all-reduce). A stage inside one machine is keyed by those (the
``signature``), so the same GPUs on another machine hit; a stage across machines (its
all-reduce shares NICs) by its devices.
"""

from __future__ import annotations

from hetserve.cost.analytic import CostModel, PrefillBatch
from hetserve.cost.layout import StageLayout


class StageMemoCost(CostModel):
    """``base``'s cost model (same cluster, model, efficiencies) with memoised stage prices."""

    def __init__(self, base: CostModel):  # noqa: super().__init__ not called: shares base's state
        self.__dict__.update(base.__dict__)
        self._signatures: dict[tuple[int, ...], int] = {}  # devices -> signature number
        self._signature_ids: dict[tuple, int] = {}  # what the formulas read -> its number
        self._prefill: dict[tuple, float] = {}
        self._decode: dict[tuple, float] = {}
        self._kv: dict[tuple, float] = {}
        self._handoff: dict[tuple, float] = {}

    def signature(self, devices: tuple[int, ...]) -> int:
        """What the stage formulas read of a TP group's devices (module docstring), as a small
        integer: equal signatures get the same number. The memo keys below are looked up
        millions of times on large pools, and a tuple's hash is not cached (a TP-4 signature
        hashes ~40 floats per lookup)."""
        sig = self._signatures.get(devices)
        if sig is None:
            c = self.cluster
            if len({c.devices[d].machine for d in devices}) > 1:
                full = ("devices", devices)
            else:
                full = (tuple((self._flops[d], self._membw[d], self._memory[d]) for d in devices),
                        tuple((float(self._alpha[d, e]), float(self._beta[d, e])) for d in devices for e in devices
                              if d != e))
            sig = self._signatures[devices] = self._signature_ids.setdefault(full, len(self._signature_ids))
        return sig

    def stage_prefill_time(self, stage: StageLayout, batch: PrefillBatch, is_last: bool = False) -> float:
        # the batch by its fields: equal batches are equal field by field, and a tuple of them
        # hashes in C (the frozen dataclass's hash is a Python call)
        key = (self.signature(stage.devices), stage.layers[1] - stage.layers[0], batch.num_seqs, batch.tokens,
               batch.sum_sq, is_last)
        t = self._prefill.get(key)
        if t is None:
            t = self._prefill[key] = super().stage_prefill_time(stage, batch, is_last)
        return t

    def stage_decode_time(self, stage: StageLayout, batch: float, context_tokens: float,
                          is_last: bool = False) -> float:
        key = (self.signature(stage.devices), stage.layers[1] - stage.layers[0], batch, context_tokens, is_last)
        t = self._decode.get(key)
        if t is None:
            t = self._decode[key] = super().stage_decode_time(stage, batch, context_tokens, is_last)
        return t

    def stage_kv_capacity(self, stage: StageLayout, is_first: bool = False, is_last: bool = False) -> float:
        key = (self.signature(stage.devices), stage.layers[1] - stage.layers[0], is_first, is_last)
        v = self._kv.get(key)
        if v is None:
            v = self._kv[key] = super().stage_kv_capacity(stage, is_first, is_last)
        return v

    def pp_handoff_time(self, a: StageLayout, b: StageLayout, tokens: float) -> float:
        key = (a.devices, b.devices, tokens)
        t = self._handoff.get(key)
        if t is None:
            t = self._handoff[key] = super().pp_handoff_time(a, b, tokens)
        return t
