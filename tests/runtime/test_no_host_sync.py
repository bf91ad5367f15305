"""A step's forward never reads device data back to the host, and what it dispatches per layer.

The decode step (padded to its bucket, through the step runner's static buffers) and a prompt step
of a real stage run under a ``TorchDispatchMode`` that records every aten op. Outside the attention
kernels nothing may be data-dependent (``aten._local_scalar_dense`` is ``.item()`` / ``int(t)`` /
``bool(t)``; ``nonzero`` and boolean-mask indexing wait for the device too): on a GPU each would
stall the host until the device catches up, and none can be captured in a CUDA graph. The kernels
(``runtime.kernels``) are opaque here: on CUDA they are Triton launches, checked by their own tests;
the plain-torch ones that run on CPU are recorded apart.

Run with ``-s`` to see the operators each layer dispatches (what a GPU launches; views launch
nothing). The same count at the commit before the step runner, with the whole-context gather and
a grid per group in the model's own code: Llama 55 per layer for a decode step, 58 for a prompt
step, 73 for a mixed one; OPT 26, 29, 44.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hetserve.runtime import kernels

SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique2", "equal",
            "is_nonzero"}
VIEW_OPS = {"view", "_unsafe_view", "reshape", "transpose", "t", "unsqueeze", "squeeze", "expand", "slice",
            "select", "chunk", "split", "narrow", "permute", "as_strided", "alias", "detach", "split_with_sizes"}
KERNELS = ("store_kv", "paged_decode_attention", "paged_prefill_attention")


class OpRecorder(TorchDispatchMode):
    """Records (op name, kernel it ran inside or None) for every aten op dispatched."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, str | None]] = []
        self.inside: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func.overloadpacket.__name__, self.inside))
        return func(*args, **(kwargs or {}))


def _wrap_kernels(monkeypatch, rec: OpRecorder) -> None:
    for name in KERNELS:
        inner = getattr(kernels, name)

        def call(*args, _inner=inner, _name=name, **kw):
            rec.ops.append((f"kernel:{_name}", None))
            rec.inside = _name
            try:
                return _inner(*args, **kw)
            finally:
                rec.inside = None
        monkeypatch.setattr(kernels, name, call)


def _stage(model_dir):
    from hetserve.runtime.model.config import ArchConfig
    from hetserve.runtime.model.loader import build_stage
    from hetserve.runtime.model.runner import StepRunner
    from hetserve.runtime.workers.kv_pool import KVPool

    cfg = ArchConfig.from_dir(model_dir)
    stage = build_stage(cfg, model_dir, (0, cfg.num_layers), has_embed=True, has_head=True)
    pool = KVPool(cfg.num_layers, 1024, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    runner = StepRunner(stage, pool.layers(), 16, cfg.hidden_size, torch.float32, torch.device("cpu"),
                        max_batch=32, max_blocks=64)
    return stage, runner


def _record_step(stage, runner, rec, starts, q_lens):
    """Prepare (outside the recorder: host work), then embed, layers and LM head under it; the
    ops of layer 0 and of the whole forward."""
    tables = [list(range(4 * b, 4 * b + 4)) for b in range(len(starts))]
    step = runner.prepare(starts, q_lens, tables)
    ids = torch.randint(0, 250, (sum(q_lens),))
    marks: list[int] = []
    hooks = [stage.layers[0].register_forward_pre_hook(lambda *_: marks.append(len(rec.ops))),
             stage.layers[0].register_forward_hook(lambda *_: marks.append(len(rec.ops)))]
    try:
        with torch.inference_mode(), rec:
            h = stage.embed(ids, step.meta.positions[:step.num_tokens])
            h = runner.run(step, h)
            stage.logits(h[step.meta.last_token[:len(q_lens)]]).argmax(-1)
    finally:
        for hook in hooks:
            hook.remove()
    return rec.ops[marks[0]:marks[1]], rec.ops


STEPS = {"decode": ([10, 20, 5], [1, 1, 1]), "prompt": ([0, 0], [12, 5]), "mixed": ([10, 0], [1, 9])}


@pytest.mark.parametrize("cpu_kernels", ["native", "torch"])
@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_a_step_reads_nothing_back_and_what_each_layer_dispatches(arch, cpu_kernels, model_dirs, monkeypatch):
    """With the C++ decode kernel, and with the plain-torch kernels and the kept contexts a float32
    CPU worker runs where the C++ kernels do not build."""
    with pytest.MonkeyPatch.context() as kernel_choice:
        if cpu_kernels == "torch":
            kernel_choice.setattr(kernels.native, "available", lambda: False)
        stage, runner = _stage(model_dirs[arch])
        assert (runner.grids is not None) == (cpu_kernels == "torch")
        for kind, (starts, q_lens) in STEPS.items():
            rec = OpRecorder()
            _wrap_kernels(monkeypatch, rec)
            layer, forward = _record_step(stage, runner, rec, starts, q_lens)
            outside = [op for op, inside in forward if inside is None]
            assert not SYNC_OPS & set(outside), (kind, Counter(op for op in outside if op in SYNC_OPS))
            mine = [op for op, inside in layer if inside is None]
            launched = [op for op in mine if op not in VIEW_OPS]
            in_kernels = Counter(op for op, inside in layer if inside is not None and op in SYNC_OPS)
            print(f"\n{arch} {kind} ({cpu_kernels} kernels): layer 0 dispatches {len(mine)} ops ({len(launched)} "
                  f"not views), kernels as one each: {dict(Counter(launched))}; host reads inside the "
                  f"plain-torch kernels: {dict(in_kernels)}")
            assert any(op.startswith("kernel:") for op in mine)  # attention went through the kernels
            monkeypatch.undo()


def test_the_recorder_sees_a_host_read():
    """The check above can fail: a ``.item()`` in a forward is recorded as ``_local_scalar_dense``."""
    rec = OpRecorder()
    with rec:
        x = torch.arange(4)
        int(x.max())
        x[x > 1]
    ops = {op for op, _ in rec.ops}
    assert "_local_scalar_dense" in ops and ops & {"nonzero", "index"}
