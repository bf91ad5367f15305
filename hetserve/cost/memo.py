"""The cost model with its pure sub-results memoised: the same formulas and the same numbers, looked up.

``MemoCost(base)`` is ``base``'s cost model (same cluster, model, efficiencies and kernel pricing;
it shares ``base``'s state) with the model's derived shapes (``params_per_layer``, ``q_dim`` …,
properties recomputed on every access) read once into plain attributes, and its sub-results kept:

* the collectives (``allreduce_time``, ``p2p_time``, ``pp_handoff_time``) by their arguments,
  which repeat for every iteration at a given batch size;
* the per-stage prices (``stage_prefill_time``, ``stage_kv_capacity``, ``stage_prompt``: a stage's
  prompt terms read once, and ``stage_decode``: a decode iteration's terms at a batch, each context
  then a few multiplications, ``cost.decode``) by what the formulas read of a stage;
* a replica's decode round at a batch (``decode_round``) by what it reads of the layout
  (``layout_signature``).

What the formulas read of a stage: the layer count, the position (first / last), the batch, and of
its devices only their GPU type (and CPU cores, for a worker slot), FLOP/s, memory bandwidth and
usable memory (slowest / smallest device paces) and the links among them (TP all-reduce). A stage
inside one machine is keyed by those (its ``signature``), so the same GPUs on another machine hit:
the layout search prices thousands of stage sequences whose stages mostly repeat, and a simulated
fleet runs many copies of one replica. A stage across machines (its all-reduce shares NICs) is
keyed by its devices.

The replica-level methods (TTFT, decode step, KV capacity …) are the cost model's own and call
these, so every figure is the cost model's, bit for bit; nothing here prices anything itself.
"""

from __future__ import annotations

from hetserve.cost.analytic import CostModel, PrefillBatch
from hetserve.cost.decode import DecodeRound, StageDecode
from hetserve.cost.layout import ReplicaLayout, StageLayout
from hetserve.cost.prefill_costs import StagePrompt

# entries a memo keeps before it starts afresh: a long simulation prices ever new prefill
# batches, a search ever new layouts
_MEMO_MAX = 200_000

_SHAPES = ("name", "num_layers", "hidden", "num_heads", "num_kv_heads", "vocab", "dtype_bytes", "q_dim",
           "kv_dim", "params_per_layer", "embedding_params", "head_params", "bytes_per_layer", "weight_bytes",
           "kv_bytes_per_token_per_layer", "kv_bytes_per_token", "num_params", "dim_head", "ffn_hidden",
           "max_context")


class _Shapes:
    """The model's shapes read once into plain attributes; anything else from the spec itself."""

    def __init__(self, model):
        self.__dict__.update({k: getattr(model, k) for k in _SHAPES})
        self._spec = model

    def __getattr__(self, name):  # only reached for names not copied above
        return getattr(self.__dict__["_spec"], name)


class MemoCost(CostModel):
    """``base`` with its shapes read once and its sub-results memoised (module docstring)."""

    def __init__(self, base: CostModel):
        self.__dict__.update(base.__dict__)  # not CostModel.__init__: the same state, shared
        self.model = _Shapes(base.model)
        self._signatures: dict[tuple[int, ...], int] = {}  # devices -> signature number
        self._signature_ids: dict[tuple, int] = {}  # what the formulas read -> its number
        self._ar: dict = {}
        self._p2p: dict = {}
        self._handoff: dict[tuple, float] = {}
        self._prefill: dict[tuple, float] = {}
        self._prompts: dict[tuple, StagePrompt] = {}
        self._decode: dict[tuple, StageDecode] = {}
        self._kv: dict[tuple, float] = {}
        self._rounds: dict[tuple, DecodeRound] = {}
        self._layout_sigs: dict[int, tuple[ReplicaLayout, int]] = {}  # id(layout) -> (layout, its number)
        self._layout_ids: dict[tuple, int] = {}
        self._hops: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple] = {}  # (a, b) devices -> their links

    def signature(self, devices: tuple[int, ...]) -> int:
        """What the stage formulas read of a TP group's devices, as a small integer: equal signatures
        get the same number. The memo keys below are looked up millions of times on large pools, and
        a tuple's hash is not cached (a TP-4 signature hashes ~40 floats per lookup)."""
        sig = self._signatures.get(devices)
        if sig is None:
            c = self.cluster
            if len({c.devices[d].machine for d in devices}) > 1:
                full = ("devices", devices)
            else:
                full = (tuple((c.devices[d].gpu.name, c.devices[d].cpu_cores, self._flops[d], self._membw[d],
                               self._memory[d]) for d in devices),
                        tuple((float(self._alpha[d, e]), float(self._beta[d, e])) for d in devices for e in devices
                              if d != e))
            sig = self._signatures[devices] = self._signature_ids.setdefault(full, len(self._signature_ids))
        return sig

    def allreduce_time(self, devices, nbytes):
        key = (self.signature(tuple(devices)), nbytes)
        v = self._ar.get(key)
        if v is None:
            v = _remember(self._ar, key, super().allreduce_time(devices, nbytes))
        return v

    def p2p_time(self, src, dst, nbytes):
        key = (src, dst, nbytes)
        v = self._p2p.get(key)
        if v is None:
            v = _remember(self._p2p, key, super().p2p_time(src, dst, nbytes))
        return v

    def pp_handoff_time(self, a: StageLayout, b: StageLayout, tokens: float) -> float:
        key = (a.devices, b.devices, tokens)
        t = self._handoff.get(key)
        if t is None:
            t = _remember(self._handoff, key, super().pp_handoff_time(a, b, tokens))
        return t

    def stage_prefill_time(self, stage: StageLayout, batch: PrefillBatch, is_last: bool = False) -> float:
        # the batch by its fields: equal batches are equal field by field, and a tuple of them
        # hashes in C (the frozen dataclass's hash is a Python call)
        key = (self.signature(stage.devices), stage.layers[1] - stage.layers[0], batch.num_seqs, batch.tokens,
               batch.sum_sq, batch.scored, is_last)
        t = self._prefill.get(key)
        if t is None:
            t = _remember(self._prefill, key, super().stage_prefill_time(stage, batch, is_last))
        return t

    def stage_prompt(self, stage: StageLayout) -> StagePrompt:
        key = (self.signature(stage.devices), stage.layers[1] - stage.layers[0])
        v = self._prompts.get(key)
        if v is None:
            v = _remember(self._prompts, key, StagePrompt(self, stage))
        return v

    def stage_decode(self, stage: StageLayout, batch: float, is_last: bool = False) -> StageDecode:
        key = (self.signature(stage.devices), stage.layers[1] - stage.layers[0], batch, is_last)
        v = self._decode.get(key)
        if v is None:
            v = _remember(self._decode, key, super().stage_decode(stage, batch, is_last))
        return v

    def stage_kv_capacity(self, stage: StageLayout, is_first: bool = False, is_last: bool = False) -> float:
        key = (self.signature(stage.devices), stage.layers[1] - stage.layers[0], is_first, is_last)
        v = self._kv.get(key)
        if v is None:
            v = _remember(self._kv, key, super().stage_kv_capacity(stage, is_first, is_last))
        return v

    def layout_signature(self, layout: ReplicaLayout) -> int:
        """What a replica's decode round reads of its layout, as a small integer: each stage's
        signature and layer count, the links of each pipeline hand-off (α, β of every device pair
        it may take), and whether its devices share a host's cores. Found by the layout's identity
        (its hash is a Python call per stage), the layout kept beside it so the identity stays its own."""
        kept = self._layout_sigs.get(id(layout))
        if kept is None or kept[0] is not layout:
            stages = layout.stages
            hops = tuple(self._hop(a.devices, b.devices) for a, b in zip(stages, stages[1:]))
            full = (tuple((self.signature(s.devices), s.layers[1] - s.layers[0]) for s in stages), hops,
                    self._on_shared_cores(layout))
            kept = _remember(self._layout_sigs, id(layout),
                             (layout, self._layout_ids.setdefault(full, len(self._layout_ids))))
        return kept[1]

    def _hop(self, a: tuple[int, ...], b: tuple[int, ...]) -> tuple:
        """(α, β) of every device pair a pipeline hand-off from ``a`` to ``b`` may take: a layout
        search prices many layer splits of one stage sequence, each a new layout with the same hops."""
        key = (a, b)
        hop = self._hops.get(key)
        if hop is None:
            hop = _remember(self._hops, key, tuple((float(self._alpha[d, e]), float(self._beta[d, e])) if d != e
                                                   else None for d in a for e in b))
        return hop

    def decode_round(self, layout: ReplicaLayout, batch: float, micro_batches: int | None = None) -> DecodeRound:
        # by what the round reads of the layout: a fleet's copies of one replica share their rounds
        key = (self.layout_signature(layout), batch, micro_batches)
        r = self._rounds.get(key)
        if r is None:
            r = _remember(self._rounds, key, super().decode_round(layout, batch, micro_batches))
        return r


def _remember(memo: dict, key, value):
    """Keep ``value`` in ``memo`` (started afresh past ``_MEMO_MAX`` entries) and return it."""
    if len(memo) >= _MEMO_MAX:
        memo.clear()
    memo[key] = value
    return value


def memoised(cost: CostModel) -> CostModel:
    """A ``MemoCost`` over a plain ``CostModel`` (a memoised one or another subclass is returned as is)."""
    return MemoCost(cost) if type(cost) is CostModel else cost
