"""The step runner's padded decode path equals a plain eager step (CPU runs it eagerly through the
same static buffers and buckets that CUDA graphs replay). Token equality through real workers for
every plan shape is ``test_engine_equivalence.py``."""

from __future__ import annotations

import pytest
import torch

from hetserve.runtime.model.runner import StepRunner, buckets


def test_buckets_cover_every_batch_up_to_the_largest():
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(1) == [1]


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_padded_decode_steps_equal_unpadded_eager_ones_and_padding_writes_no_kv(arch, model_dirs):
    from hetserve.runtime.model.attention import build_attn_meta
    from hetserve.runtime.model.config import ArchConfig
    from hetserve.runtime.model.loader import build_stage
    from hetserve.runtime.workers.kv_pool import KVPool

    cfg = ArchConfig.from_dir(model_dirs[arch])
    stage = build_stage(cfg, model_dirs[arch], (0, cfg.num_layers), has_embed=True, has_head=True)
    torch.manual_seed(0)
    padded = KVPool(cfg.num_layers, 3072, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    padded.k.normal_(), padded.v.normal_()
    plain = KVPool(cfg.num_layers, 3072, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    plain.k.copy_(padded.k), plain.v.copy_(padded.v)
    runner = StepRunner(stage, padded.layers(), 16, cfg.hidden_size, torch.float32, torch.device("cpu"),
                        max_batch=32, max_blocks=8)
    assert not runner.graphs  # CPU: eager through the buffers
    with torch.inference_mode():
        for batch, bucket in ((3, 4), (17, 32)):
            starts = [(7 * b) % 100 + 1 for b in range(batch)]
            tables = [[b * 8 + i for i in range(8)] for b in range(batch)]
            h = torch.randn(batch, cfg.hidden_size)
            step = runner.prepare(starts, [1] * batch, tables)
            assert step.bucket == bucket and step.meta.slot_mapping.shape == (bucket,)
            assert step.meta.slot_mapping[batch:].tolist() == [-1] * (bucket - batch)
            got = runner.run(step, h)
            want = stage(h, plain.layers(), build_attn_meta(starts, [1] * batch, tables, 16))
            torch.testing.assert_close(got, want)
            # padding rows wrote nothing: outside the real rows' slots both pools hold the same
            # bytes; in them, the same values (a 4-row GEMM may round apart from a 3-row one)
            written = torch.zeros(padded.k.shape[1], dtype=torch.bool)
            written[step.meta.slot_mapping[:batch]] = True
            for a, b in ((padded.k, plain.k), (padded.v, plain.v)):
                assert torch.equal(a[:, ~written], b[:, ~written])
                torch.testing.assert_close(a[:, written], b[:, written])
        # beyond the buffers (a table wider than max_blocks): an eager step of its own shape
        step = runner.prepare([200], [1], [list(range(16))])
        assert step.bucket is None
