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


def test_the_tokenizer_loads_without_the_models_config_class(tmp_path, monkeypatch):
    """A folder whose tokenizer_config.json names its tokenizer class loads without AutoConfig (the
    model's config module imports torch's compiler stack: seconds at every server start), and gives
    the tokenizer AutoConfig's path gives; one that names none still loads, through AutoConfig."""
    import json

    from transformers import AutoConfig, AutoTokenizer

    from hetserve.runtime.model.make import make_model
    from hetserve.serve.text import HFCodec

    text = "héllo wörld, 12 tokens <eos> and more"
    named = make_model(tmp_path / "named", "opt", layers=1, hidden=32, heads=2, seed=0)
    unnamed = make_model(tmp_path / "unnamed", "llama", layers=1, hidden=32, heads=2, kv_heads=1, seed=0)
    cfg_file = unnamed / "tokenizer_config.json"
    cfg_file.write_text(json.dumps({k: v for k, v in json.loads(cfg_file.read_text()).items() if k != "tokenizer_class"}))
    expected = {d: AutoTokenizer.from_pretrained(str(d)) for d in (named, unnamed)}

    calls = []
    real = AutoConfig.from_pretrained

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", counted)
    for folder in (named, unnamed):
        codec = HFCodec.from_dir(folder)
        want = expected[folder]
        assert type(codec.tok) is type(want) and codec.eos_token_id == want.eos_token_id
        assert codec.encode(text) == want.encode(text, add_special_tokens=False)
    assert calls == [str(unnamed)]
