"""A stage of a model as a module: built on the meta device (no memory for weights that are
loaded or drawn afterwards), shrunk to one TP rank's shard there, then finished on its device.
``loader`` fills it from a checkpoint, ``random_weights`` draws it."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from hetserve.runtime.model.config import ArchConfig
from hetserve.runtime.model.cpu_weights import arrange_cpu_weights
from hetserve.runtime.model.llama import LlamaStage
from hetserve.runtime.model.opt import OPTStage
from hetserve.runtime.model.tp import apply_tp

STAGE_CLASSES: dict[str, type[nn.Module]] = {"llama": LlamaStage, "opt": OPTStage}


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


def meta_stage(cfg: ArchConfig, num_layers: int, *, has_embed: bool, has_head: bool, tp_rank: int = 0,
               tp_world: int = 1, tp_group=None) -> nn.Module:
    """This TP rank's shard of a stage of ``num_layers`` layers, every parameter on the meta device."""
    with torch.device("meta"), _skip_init():
        model = STAGE_CLASSES[cfg.arch](cfg, num_layers, has_embed, has_head)
    return apply_tp(model, tp_rank, tp_world, tp_group)


def finish_stage(model: nn.Module, device: torch.device) -> nn.Module:
    """Non-parameter state (RoPE frequencies) on ``device``; inference mode, no gradients; linear
    weights on a CPU in their dtype's layout (``cpu_weights``)."""
    model.init_buffers(device)
    model.eval().requires_grad_(False)
    if torch.device(device).type == "cpu":
        arrange_cpu_weights(model)
    return model
