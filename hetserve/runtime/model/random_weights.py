"""Random weights made on the worker's device: real shapes served without a weights file.

A checkpoint folder written by ``hetserve make-model --random-weights`` holds ``config.json``, the
tokenizer and ``random_weights.json`` (the seed and the spread), and no safetensors: a 7B-shaped
model is a few kilobytes on disk, and each worker draws its stage where it runs
(``loader.load_stage`` reads the marker). ``random_stage`` is also what benchmarks call directly.

Each parameter is drawn from N(0, ``init_std``) with a generator seeded by the seed and the
parameter's name in the whole model (layer ``i`` of a stage starting at layer ``a`` is layer
``a + i``), so a layer has the same weights in every stage and replica that holds it: a pipeline or
a prefill -> decode plan gives the tokens one stage gives. Norm weights are ones, biases zeros. A TP
rank draws its own shard: the shards of several ranks are not slices of one model.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from hetserve.errors import SpecError

MARKER = "random_weights.json"
_LAYER = re.compile(r"^layers\.(\d+)\.")


def write_marker(out_dir: str | Path, seed: int, init_std: float) -> None:
    (Path(out_dir) / MARKER).write_text(json.dumps({"seed": seed, "init_std": init_std}, indent=2) + "\n")


def read_marker(model_dir: str | Path) -> dict | None:
    """The folder's random-weight recipe (``seed``, ``init_std``), or None for a checkpoint with weights."""
    path = Path(model_dir) / MARKER
    if not path.is_file():
        return None
    try:
        recipe = json.loads(path.read_text())
        return {"seed": int(recipe["seed"]), "init_std": float(recipe["init_std"])}
    except (ValueError, KeyError, TypeError) as exc:
        raise SpecError(str(path), "seed/init_std", "a JSON object with an integer seed and a number init_std",
                        str(exc)) from exc


def _param_seed(seed: int, tp_rank: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{tp_rank}:{name}".encode()).digest()[:8], "little") >> 1


def random_stage(cfg, layers, device="cpu", dtype=None, seed: int = 0, *, has_embed: bool = False,
                 has_head: bool = False, tp_rank: int = 0, tp_world: int = 1, tp_group=None,
                 init_std: float = 0.02):
    """A stage of ``cfg`` (an ``ArchConfig``) with random weights, made directly on ``device``.

    ``layers`` is a count or ``(first, last)``; ``dtype`` defaults to ``cfg.dtype``. Each weight is
    allocated once, on ``device`` in ``dtype`` (the module docstring says how it is drawn). torch is
    imported here: ``make-model`` reads this module before it may load torch."""
    import torch
    from torch import nn

    from hetserve.runtime.model.llama import RMSNorm
    from hetserve.runtime.model.stage import finish_stage, meta_stage

    first, last = (0, layers) if isinstance(layers, int) else layers
    device = torch.device(device)
    dtype = dtype or getattr(torch, cfg.dtype)
    model = meta_stage(cfg, last - first, has_embed=has_embed, has_head=has_head, tp_rank=tp_rank,
                       tp_world=tp_world, tp_group=tp_group)
    gen = torch.Generator(device=device)
    state = {}
    for name, param in model.named_parameters():
        tensor = torch.empty(param.shape, device=device, dtype=dtype)
        module_name, pname = name.rsplit(".", 1)
        if pname == "bias":
            tensor.zero_()
        elif isinstance(model.get_submodule(module_name), (nn.LayerNorm, RMSNorm)):
            tensor.fill_(1.0)
        else:
            whole = _LAYER.sub(lambda m: f"layers.{first + int(m.group(1))}.", name)
            tensor.normal_(0.0, init_std, generator=gen.manual_seed(_param_seed(seed, tp_rank, whole)))
        state[name] = tensor
    model.load_state_dict(state, assign=True, strict=True)
    return finish_stage(model, device)
