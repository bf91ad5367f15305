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


def test_a_generic_tokenizer_loads_as_autotokenizer_loads_it_without_its_import(tmp_path):
    """A folder naming transformers' generic tokenizer class (make-model's) gets the very tokenizer
    AutoTokenizer gives, loaded without AutoTokenizer's module (it imports the model-loading stack)."""
    import json
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from hetserve.runtime.model.make import make_model
    from hetserve.serve.text import HFCodec, generic_tokenizer

    folder = make_model(tmp_path / "m", "llama", layers=1, hidden=32, heads=2, kv_heads=1, seed=0)
    assert generic_tokenizer(folder)
    ours, auto = HFCodec.from_dir(folder).tok, AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    text = "Grüße, 世界! <eos> tabs\tand  spaces"
    assert ours.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False)
    assert ours.encode(text) == auto.encode(text)  # special tokens added alike
    ids = auto.encode(text)
    assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert (ours.eos_token_id, ours.bos_token_id, ours.all_special_ids) == (auto.eos_token_id, auto.bos_token_id,
                                                                           auto.all_special_ids)
    code = ("import sys; from hetserve.serve.text import HFCodec; HFCodec.from_dir(sys.argv[1]); "
            "print('transformers.models.auto.tokenization_auto' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr

    # another class named, or a model type AutoTokenizer overrides the named class for: AutoTokenizer's way
    named = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**named, "tokenizer_class": "LlamaTokenizer"}))
    assert not generic_tokenizer(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps(named))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    assert not generic_tokenizer(folder)
