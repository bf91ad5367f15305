"""Build one stage of a checkpoint: the plain model on the meta device, sharded, then filled from safetensors.

The stage is built on the meta device (no memory for weights that the checkpoint overwrites) and
shrunk to this TP rank's shard there. Each worker then memory-maps the checkpoint and reads only its
slice of each tensor (``safe_open(..., device=...).get_slice(name)[slices]``), so a TP-``n`` worker
reads about ``1/n`` of its layers' bytes, and each tensor goes to the worker's device and dtype
as it is read: the stage never exists whole in another dtype or on another device.
Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``) layouts are read.
``load_stage`` also returns a ``LoadReport`` (seconds, bytes read) for the worker to report; a
folder of random weights (``random_weights``) is drawn instead of read. The empty stage (meta
device, TP shard) comes from ``stage.py``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hetserve.errors import SpecError
from hetserve.runtime.model.config import ArchConfig
from hetserve.runtime.model.random_weights import random_stage, read_marker
from hetserve.runtime.model.stage import STAGE_CLASSES, finish_stage, meta_stage
from hetserve.runtime.model.tp import shard_of, tp_kind

__all__ = ["LoadReport", "CheckpointReader", "STAGE_CLASSES", "meta_stage", "finish_stage", "load_stage",
           "check_weights", "build_stage"]


@dataclass(frozen=True)
class LoadReport:
    """What making one worker's stage took: build + load seconds, checkpoint bytes read, from where."""

    seconds: float
    bytes_read: int  # bytes of the checkpoint's tensors this rank read (its shards only)
    tensors: int
    source: str  # the checkpoint directory, or "random"

    def as_dict(self) -> dict:
        return asdict(self)


class CheckpointReader:
    """Name -> file index over a safetensors checkpoint; tensors are read lazily by slice.

    Every file's header is read here, so a truncated or foreign file, a broken index or one naming
    a missing file fails at once as a ``SpecError`` naming it, not later inside a worker."""

    def __init__(self, model_dir: str | Path, device: str | torch.device = "cpu"):
        self.dir = Path(model_dir)
        self.device = str(device)
        self._open: dict[Path, object] = {}
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            self.files = _weight_map(index)
        else:
            single = self.dir / "model.safetensors"
            if not single.exists():
                raise SpecError(str(self.dir), "model.safetensors", "a safetensors checkpoint in the model directory")
            self.files = {k: single for k in self._header(single).keys()}  # noqa: SIM118 (not iterable)
        for path in set(self.files.values()):
            self._header(path)

    def _header(self, path: Path):
        """The open file (its header read; tensors are memory-mapped on demand)."""
        f = self._open.get(path)
        if f is None:
            try:
                f = self._open[path] = safe_open(str(path), framework="pt", device=self.device)
            except (SafetensorError, OSError) as e:
                raise SpecError(str(self.dir), path.name, "a readable safetensors file", str(e)) from e
        return f

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _file(self, name: str):
        return self._header(self.files[name])

    def read(self, name: str, slices: tuple[slice, ...] | None = None) -> torch.Tensor:
        """The tensor (or its ``slices``) on the reader's device, in the checkpoint's dtype."""
        part = self._file(name).get_slice(name)
        return part[slices] if slices is not None else part[:]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def close(self) -> None:
        self._open.clear()


def load_stage(cfg: ArchConfig, model_dir: str | Path, layers: tuple[int, int], *, has_embed: bool,
               has_head: bool, tp_rank: int = 0, tp_world: int = 1, tp_group=None,
               device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[nn.Module, LoadReport]:
    """Layers ``[a, b)`` of the checkpoint in ``model_dir`` as this TP rank's shard, and what loading
    took; a folder of random weights (``random_weights``) draws them on ``device`` instead."""
    start = time.perf_counter()
    device = torch.device(device)
    first, last = layers
    recipe = read_marker(model_dir)
    if recipe is not None:
        model = random_stage(cfg, layers, device, dtype, recipe["seed"], has_embed=has_embed, has_head=has_head,
                             tp_rank=tp_rank, tp_world=tp_world, tp_group=tp_group, init_std=recipe["init_std"])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return model, LoadReport(time.perf_counter() - start, 0, sum(1 for _ in model.parameters()),
                                 f"random weights (seed {recipe['seed']}), {model_dir}")
    model = meta_stage(cfg, last - first, has_embed=has_embed, has_head=has_head, tp_rank=tp_rank,
                       tp_world=tp_world, tp_group=tp_group)
    reader = CheckpointReader(model_dir, device)
    state: dict[str, torch.Tensor] = {}
    bytes_read = 0
    try:
        for name, param in model.named_parameters():
            tensor, nbytes = _read_param(model, reader, name, tuple(param.shape), first, cfg, tp_rank, tp_world)
            # one tensor at a time in the checkpoint's dtype, then cast where it lies: the stage
            # is never whole in another dtype
            state[name] = tensor.to(device=device, dtype=dtype).contiguous()
            bytes_read += nbytes
    finally:
        reader.close()
    model.load_state_dict(state, assign=True, strict=True)
    finish_stage(model, device)
    if device.type == "cuda":  # the casts are queued: the stage is ready when they are done
        torch.cuda.synchronize(device)
    report = LoadReport(time.perf_counter() - start, bytes_read, len(state), str(model_dir))
    return model, report


def _weight_map(index: Path) -> dict[str, Path]:
    """Tensor name -> file of a sharded checkpoint's ``model.safetensors.index.json``."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not (isinstance(weight_map, dict) and all(isinstance(f, str) for f in weight_map.values())):
            raise TypeError(type(weight_map).__name__)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise SpecError(str(index), "weight_map", "an object mapping each tensor to its file", str(e)) from e
    files = {k: index.parent / f for k, f in weight_map.items()}
    missing = sorted({p.name for p in files.values() if not p.is_file()})
    if missing:
        raise SpecError(str(index), "weight_map", "files in the model directory", ", ".join(missing))
    return files


def check_weights(model_dir: str | Path) -> None:
    """The folder's weights can be had (a safetensors checkpoint or a random-weight recipe): one
    clear error before any worker starts, not one from each."""
    if read_marker(model_dir) is None:
        CheckpointReader(model_dir).close()


def build_stage(cfg: ArchConfig, model_dir: str | Path, layers: tuple[int, int], *, has_embed: bool,
                has_head: bool, tp_rank: int = 0, tp_world: int = 1, tp_group=None,
                device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """``load_stage`` without the report."""
    return load_stage(cfg, model_dir, layers, has_embed=has_embed, has_head=has_head, tp_rank=tp_rank,
                      tp_world=tp_world, tp_group=tp_group, device=device, dtype=dtype)[0]


def _read_param(model: nn.Module, reader: CheckpointReader, name: str, shape: tuple[int, ...], first: int,
                cfg: ArchConfig, tp_rank: int, tp_world: int) -> tuple[torch.Tensor, int]:
    """(this rank's shard of parameter ``name`` on the reader's device, bytes read for it)."""
    keys = STAGE_CLASSES[cfg.arch].checkpoint_keys(name, first, cfg)
    key = next((k for k in keys if k in reader), None)
    if key is None:
        raise SpecError(str(reader.dir), keys[0], "a tensor in the checkpoint")
    module_name, pname = name.rsplit(".", 1)
    full = reader.shape(key)
    shard = shard_of(tp_kind(model, module_name), pname, full, tp_rank, tp_world)
    if shard.shape(full) != shape:
        raise SpecError(str(reader.dir), key, f"shape {shape} for this shard", shard.shape(full))
    if shard.zero:  # nothing to read: this rank adds no row-parallel bias
        return torch.zeros(shape, device=reader.device), 0
    tensor = reader.read(key, shard.slices)
    return tensor, tensor.numel() * tensor.element_size()
