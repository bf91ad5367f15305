import json

import pytest

from hetserve.errors import SpecError
from hetserve.specs.model import MODEL_PRESETS, ModelSpec, load_model


def test_llama2_70b_counts_match_the_issue():
    m = load_model("llama-2-70b")
    assert abs(m.num_params / 1e9 - 68.98) < 0.01
    assert m.kv_bytes_per_token == 327_680  # 2 (K,V) · 80 layers · 8 heads · 128 · 2 bytes


def test_opt30b_kv_bytes():
    assert load_model("opt-30b").kv_bytes_per_token == 1_376_256  # 2 · 48 · 7168 · 2


def test_llama2_7b_params_by_hand():
    m = MODEL_PRESETS["llama-2-7b"]
    h, f, v = 4096, 11008, 32000
    per_layer = 4 * h * h + 3 * h * f + 2 * h
    assert m.params_per_layer == per_layer
    assert m.num_params == 32 * per_layer + 2 * v * h + h  # embed + head + final norm
    assert abs(m.num_params / 1e9 - 6.74) < 0.01


def test_gqa_shrinks_k_and_v():
    full = ModelSpec("a", "llama", 2, 512, 8, 8, 1024, 100, 128)
    gqa = ModelSpec("b", "llama", 2, 512, 8, 2, 1024, 100, 128)
    assert full.params_per_layer - gqa.params_per_layer == 2 * 512 * (512 - 128)
    assert gqa.kv_bytes_per_token * 4 == full.kv_bytes_per_token


def _write(tmp_path, cfg):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    return p


def test_from_hf_config_llama_and_folder(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_attention_heads": 64,
           "num_key_value_heads": 8, "num_hidden_layers": 80, "vocab_size": 32000,
           "max_position_embeddings": 4096, "torch_dtype": "float16"}
    _write(tmp_path, cfg)
    m = ModelSpec.from_hf_config(tmp_path)
    assert m.num_params == MODEL_PRESETS["llama-2-70b"].num_params


def test_from_hf_config_opt_qwen_mistral(tmp_path):
    opt = {"model_type": "opt", "hidden_size": 7168, "ffn_dim": 28672, "num_attention_heads": 56,
           "num_hidden_layers": 48, "vocab_size": 50272, "max_position_embeddings": 2048,
           "word_embed_proj_dim": 7168, "torch_dtype": "float16"}  # as facebook/opt-30b's config.json
    assert ModelSpec.from_hf_config(_write(tmp_path, opt)).kv_bytes_per_token == 1_376_256
    qwen = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
            "num_key_value_heads": 4, "num_hidden_layers": 28, "vocab_size": 152064,
            "max_position_embeddings": 32768}
    q = ModelSpec.from_hf_config(_write(tmp_path, qwen))
    assert abs(q.num_params / 1e9 - 7.62) < 0.01  # Qwen2-7B: 7.62 B
    mistral = dict(qwen, model_type="mistral", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                   num_key_value_heads=8, num_hidden_layers=32, vocab_size=32000)
    assert abs(ModelSpec.from_hf_config(_write(tmp_path, mistral)).num_params / 1e9 - 7.24) < 0.01


@pytest.mark.parametrize("cfg,field", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"model_type": "llama", "hidden_size": -1, "intermediate_size": 128, "num_attention_heads": 4,
      "num_hidden_layers": 2, "vocab_size": 10, "max_position_embeddings": 8}, "hidden_size"),
    ({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
      "num_hidden_layers": "two"}, "num_hidden_layers"),
])
def test_bad_config_names_field(tmp_path, cfg, field):
    with pytest.raises(SpecError) as e:
        ModelSpec.from_hf_config(_write(tmp_path, cfg))
    assert f"field '{field}'" in str(e.value) and "\n" not in str(e.value)


def test_unknown_model_lists_presets():
    with pytest.raises(SpecError, match="llama-2-70b"):
        load_model("no-such-model")


def test_malformed_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(SpecError, match="valid JSON"):
        ModelSpec.from_hf_config(p)


def test_a_config_file_is_named_by_its_own_name_a_checkpoint_by_its_folder(tmp_path, monkeypatch):
    """Two model files of one folder are two models (a plan made for one must not accept the other),
    and a config file in the working folder still has a name."""
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 512}
    (tmp_path / "ok.json").write_text(json.dumps(cfg))
    (tmp_path / "mistral.json").write_text(json.dumps({**cfg, "num_key_value_heads": 2}))
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    assert load_model(tmp_path / "ok.json").name == "ok" and load_model(tmp_path / "mistral.json").name == "mistral"
    assert load_model(tmp_path / "ckpt").name == load_model(tmp_path / "ckpt" / "config.json").name == "ckpt"
    monkeypatch.chdir(tmp_path)
    assert load_model("ok.json").name == "ok"
    monkeypatch.chdir(tmp_path / "ckpt")
    assert load_model("config.json").name == "ckpt"


_TINY = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
         "intermediate_size": 128, "vocab_size": 320, "max_position_embeddings": 128}


@pytest.mark.parametrize("fields, dtype_bytes", [({"dtype": "float32"}, 4), ({"torch_dtype": "float32"}, 4),
                                                 ({"dtype": "float32", "torch_dtype": "float32"}, 4),
                                                 ({"dtype": "bfloat16"}, 2), ({"torch_dtype": "float16"}, 2)])
def test_dtype_is_read_first_as_transformers_does(tmp_path, fields, dtype_bytes):
    m = ModelSpec.from_hf_config(_write(tmp_path, {**_TINY, **fields}))
    assert m.dtype_bytes == dtype_bytes
    assert m.dtype_from == "config.json " + ("dtype" if "dtype" in fields else "torch_dtype")


def test_a_config_naming_no_dtype_is_sized_in_float32_and_says_it_was_assumed(tmp_path):
    """No ``dtype`` / ``torch_dtype``: float32 (UNNAMED_DTYPE), the dtype the runtime loads it in
    (tests/runtime/test_checkpoint_dtype.py holds the two readers to one answer)."""
    m = ModelSpec.from_hf_config(_write(tmp_path, _TINY))
    named = ModelSpec.from_hf_config(_write(tmp_path, {**_TINY, "torch_dtype": "float32"}))
    assert (m.dtype, m.dtype_bytes, m.weight_bytes, m.kv_bytes_per_token) == \
        ("float32", 4, named.weight_bytes, named.kv_bytes_per_token)
    assert "no dtype in config.json: float32 assumed" in m.dtype_from


def test_a_float64_checkpoint_says_it_is_served_as_float32(tmp_path):
    m = ModelSpec.from_hf_config(_write(tmp_path, {**_TINY, "torch_dtype": "float64"}))
    assert (m.dtype, m.dtype_bytes, m.dtype_from) == ("float32", 4, "config.json torch_dtype float64, served as float32")


def test_dtype_and_torch_dtype_that_disagree_are_refused(tmp_path):
    with pytest.raises(SpecError) as exc:
        ModelSpec.from_hf_config(_write(tmp_path, {**_TINY, "dtype": "float32", "torch_dtype": "bfloat16"}))
    msg = str(exc.value)
    assert "config.json" in msg and "'dtype'" in msg and "bfloat16" in msg and "float32" in msg


@pytest.mark.parametrize("field", ["intermediate_size", "model_type", "num_hidden_layers"])
def test_a_missing_config_field_is_said_to_be_missing(tmp_path, field):
    cfg = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128}
    with pytest.raises(SpecError) as e:
        ModelSpec.from_hf_config(_write(tmp_path, {k: v for k, v in cfg.items() if k != field}))
    assert str(e.value).endswith(f"field '{field}': expected " + (
        "one of llama, mistral, qwen2, opt" if field == "model_type" else "a positive integer of at most 2147483647")
        + " (the field is missing)")
    with pytest.raises(SpecError) as e:  # present but wrong: the value is shown, and nothing said missing
        ModelSpec.from_hf_config(_write(tmp_path, {**cfg, field: 0}))
    assert "(the field is missing)" not in str(e.value) and str(e.value).endswith("got 0")
