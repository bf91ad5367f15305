"""Tensor parallelism as a transformation of a plain stage model (as gpt-fast's ``tp.py``).

The model code knows nothing of parallelism. A stage class names its parallel linears in
``TP_PLAN`` (module name suffix -> ``"column"`` or ``"row"``); ``apply_tp`` shrinks those modules
to one rank's shard (on the meta device, before any weight is read) and adds an all-reduce after
every row-parallel linear. ``shard_of`` says which slice of a full checkpoint tensor a rank loads,
so each worker reads only its own bytes from safetensors.

Column-parallel: weight rows (output features) split in ``world`` contiguous blocks; because
q/k/v rows are head-major, that is a split by attention heads, and gate/up/fc1 by FFN columns.
Row-parallel: weight columns (input features) split the same way; each rank's partial output is
summed by all-reduce. A row-parallel bias is added once: rank 0 holds it, the others hold zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Shard:
    slices: tuple[slice, ...]  # applied to the full checkpoint tensor
    zero: bool = False  # this rank holds zeros of the sliced shape (row-parallel bias off rank 0)

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of this shard of a tensor of shape ``full``."""
        return tuple(len(range(*s.indices(n))) for s, n in zip(self.slices, full))


def shard_of(kind: str | None, param: str, shape: tuple[int, ...], rank: int, world: int) -> Shard:
    """Slice of a full tensor of ``shape`` that ``rank`` of ``world`` loads for a ``kind`` linear."""
    full = tuple(slice(None) for _ in shape)
    if kind is None or world == 1:
        return Shard(full)
    if kind == "column":  # weight (out, in), bias (out,): split dim 0
        n = shape[0] // world
        return Shard((slice(rank * n, (rank + 1) * n),) + full[1:])
    if kind == "row":
        if param == "bias":
            return Shard(full, zero=rank != 0)
        n = shape[1] // world
        return Shard((slice(None), slice(rank * n, (rank + 1) * n)))
    raise ValueError(f"unknown tensor-parallel kind {kind!r}")


def tp_kind(model: nn.Module, module_name: str) -> str | None:
    """``"column"``, ``"row"`` or None for the module at ``module_name`` of a stage model."""
    return getattr(model, "TP_PLAN", {}).get(module_name.rsplit(".", 1)[-1])


def check_divisible(model: nn.Module, world: int) -> None:
    """Raise ValueError naming the first parallel linear whose sharded dimension ``world`` does not divide."""
    for name, mod in model.named_modules():
        kind = tp_kind(model, name)
        if kind and isinstance(mod, nn.Linear):
            dim = mod.out_features if kind == "column" else mod.in_features
            if dim % world:
                raise ValueError(f"{name}: {dim} features cannot be split over a TP degree of {world}")


def apply_tp(model: nn.Module, rank: int, world: int, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Shrink ``model``'s parallel linears to ``rank``'s shard and all-reduce row-parallel outputs.

    Call on a model built on the meta device; weights are loaded afterwards with ``shard_of``.
    """
    if world == 1:
        return model
    check_divisible(model, world)
    for name, mod in model.named_modules():
        kind = tp_kind(model, name)
        if not kind or not isinstance(mod, nn.Linear):
            continue
        dev, dtype = mod.weight.device, mod.weight.dtype
        if kind == "column":
            mod.out_features //= world
            mod.weight = nn.Parameter(torch.empty(mod.out_features, mod.in_features, device=dev, dtype=dtype))
            if mod.bias is not None:
                mod.bias = nn.Parameter(torch.empty(mod.out_features, device=dev, dtype=dtype))
        else:
            mod.in_features //= world
            mod.weight = nn.Parameter(torch.empty(mod.out_features, mod.in_features, device=dev, dtype=dtype))
            mod.register_forward_hook(_all_reduce_hook(group))
    return model


def _all_reduce_hook(group):
    def hook(_module, _inputs, output: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(output, group=group)
        return output
    return hook
