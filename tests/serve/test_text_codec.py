"""The served model's tokenizer (``serve.text.HFCodec``) as the front end uses it."""

from __future__ import annotations

import logging


def test_an_over_long_prompt_encodes_without_transformers_warning(tmp_path, capfd, caplog):
    """The engine refuses an over-long prompt with its own 400; transformers must not also warn."""
    from hetserve.runtime.model.make import make_model
    from hetserve.serve.text import HFCodec

    codec = HFCodec.from_dir(make_model(tmp_path / "m", "llama", layers=1, hidden=32, heads=2, kv_heads=1, seed=0))
    limit = codec.tok.model_max_length
    assert limit < 10_000
    with caplog.at_level(logging.WARNING):
        ids = codec.encode("x" * (limit + 50))
    assert len(ids) > limit
    said = capfd.readouterr().err + caplog.text
    assert "sequence length is longer" not in said, said
