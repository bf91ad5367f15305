"""Build one stage of a checkpoint: the plain model on the meta device, sharded, then filled from safetensors.

Each worker memory-maps the checkpoint and reads only its slice of each tensor
(``safe_open(...).get_slice(name)[slices]``), so a TP-``n`` worker reads about ``1/n`` of its layers' bytes.
Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) layouts are read.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from hetserve.errors import SpecError
from hetserve.runtime.model.config import ArchConfig
from hetserve.runtime.model.llama import LlamaStage
from hetserve.runtime.model.opt import OPTStage
from hetserve.runtime.model.tp import apply_tp, shard_of, tp_kind

STAGE_CLASSES: dict[str, type[nn.Module]] = {"llama": LlamaStage, "opt": OPTStage}


class CheckpointReader:
    """Name -> file index over a safetensors checkpoint; tensors are read lazily by slice."""

    def __init__(self, model_dir: str | Path):
        self.dir = Path(model_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            self.files = {k: self.dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            single = self.dir / "model.safetensors"
            if not single.exists():
                raise SpecError(str(self.dir), "model.safetensors", "a safetensors checkpoint in the model directory")
            with safe_open(str(single), framework="pt") as f:
                self.files = {k: single for k in f.keys()}
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def read(self, name: str, slices: tuple[slice, ...] | None = None) -> torch.Tensor:
        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        part = self._open[path].get_slice(name)
        return part[slices] if slices is not None else part[:]

    def shape(self, name: str) -> tuple[int, ...]:
        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return tuple(self._open[path].get_slice(name).get_shape())

    def close(self) -> None:
        self._open.clear()


@contextlib.contextmanager
def _skip_init():
    """No random initialisation while building (every weight is loaded afterwards).

    Initialising meta tensors is free but its first call imports torch's reference decompositions,
    which costs seconds of start-up in every worker process.
    """
    names = ("normal_", "uniform_", "kaiming_uniform_", "ones_", "zeros_", "trunc_normal_", "xavier_uniform_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def build_stage(cfg: ArchConfig, model_dir: str | Path, layers: tuple[int, int], *, has_embed: bool,
                has_head: bool, tp_rank: int = 0, tp_world: int = 1, tp_group=None,
                device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """Layers ``[a, b)`` of the checkpoint in ``model_dir`` as this TP rank's shard, ready for inference."""
    cls = STAGE_CLASSES[cfg.arch]
    first, last = layers
    with torch.device("meta"), _skip_init():
        model = cls(cfg, last - first, has_embed, has_head)
    apply_tp(model, tp_rank, tp_world, tp_group)
    reader = CheckpointReader(model_dir)
    state: dict[str, torch.Tensor] = {}
    try:
        for name, param in model.named_parameters():
            module_name, pname = name.rsplit(".", 1)
            key = next((k for k in cls.checkpoint_keys(name, first, cfg) if k in reader), None)
            if key is None:
                raise SpecError(str(model_dir), cls.checkpoint_keys(name, first, cfg)[0],
                                "a tensor in the checkpoint")
            shard = shard_of(tp_kind(model, module_name), pname, reader.shape(key), tp_rank, tp_world)
            tensor = reader.read(key, shard.slices)
            if shard.zero:
                tensor = torch.zeros_like(tensor)
            if tuple(tensor.shape) != tuple(param.shape):
                raise SpecError(str(model_dir), key, f"shape {tuple(param.shape)} for this shard",
                                tuple(tensor.shape))
            state[name] = tensor.to(device=device, dtype=dtype)
    finally:
        reader.close()
    model.load_state_dict(state, assign=True, strict=True)
    model.init_buffers(torch.device(device))
    model.eval().requires_grad_(False)
    return model
