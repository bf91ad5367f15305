"""The analytic cost model with its pure sub-results memoised, for the simulator's hot loop.

Same formulas, same numbers: ``MemoCostModel`` is ``CostModel`` with (a) the model's derived
shapes (``params_per_layer``, ``q_dim`` …, properties recomputed on every access) read once into
plain attributes, and (b) ``allreduce_time`` and ``p2p_time`` cached on their arguments, which
repeat for every iteration at a given batch size. Nothing here prices anything itself.
"""

from __future__ import annotations

from hetserve.cost.analytic import CostModel

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


class MemoCostModel(CostModel):
    def __init__(self, cluster, model, efficiency=None):
        super().__init__(cluster, model, efficiency)
        self.model_spec = model
        self.model = _Shapes(model)  # frozen shapes, read once
        self._ar: dict = {}
        self._p2p: dict = {}

    def allreduce_time(self, devices, nbytes):
        key = (tuple(devices), nbytes)
        v = self._ar.get(key)
        if v is None:
            v = self._ar[key] = super().allreduce_time(devices, nbytes)
        return v

    def p2p_time(self, src, dst, nbytes):
        key = (src, dst, nbytes)
        v = self._p2p.get(key)
        if v is None:
            v = self._p2p[key] = super().p2p_time(src, dst, nbytes)
        return v


def fast(cost: CostModel) -> CostModel:
    """A memoised twin of a plain ``CostModel`` (a subclass or other model is returned as is)."""
    if type(cost) is CostModel:
        return MemoCostModel(cost.cluster, cost.model, cost.eff)
    return cost
