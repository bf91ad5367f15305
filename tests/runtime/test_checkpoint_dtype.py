"""One checkpoint, one dtype: the planner's reader of a config.json (``ModelSpec.from_hf_config``)
and the runtime's (``ArchConfig``) must size it alike, or the planner places weights and KV the
runtime then does not fit. A config naming no dtype is the case to watch: both read it as
``UNNAMED_DTYPE``."""

import json

import pytest

from hetserve.runtime.deployment import model_spec
from hetserve.runtime.model.config import ArchConfig
from hetserve.specs.model import DTYPE_BYTES, UNNAMED_DTYPE, ModelSpec

LLAMA = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128}
OPT = {"model_type": "opt", "vocab_size": 320, "hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
       "num_attention_heads": 4, "max_position_embeddings": 128}


def _both(folder):
    """(the planner's ModelSpec, the runtime's dtype, the cost model's view at the runtime's dtype)."""
    arch = ArchConfig.from_dir(folder)
    return ModelSpec.from_hf_config(folder), arch.dtype, model_spec(arch, DTYPE_BYTES[arch.dtype])


@pytest.mark.parametrize("base", [LLAMA, OPT], ids=["llama", "opt"])
@pytest.mark.parametrize("fields", [{}, {"dtype": "bfloat16"}, {"torch_dtype": "float16"}, {"torch_dtype": "float64"},
                                    {"dtype": "float32", "torch_dtype": "float32"}])
def test_the_planner_and_the_runtime_read_a_configs_dtype_alike(tmp_path, base, fields):
    (tmp_path / "config.json").write_text(json.dumps({**base, **fields}))
    planned, served, runtime = _both(tmp_path)
    assert planned.dtype == served and planned.dtype_bytes == DTYPE_BYTES[served]
    assert (planned.weight_bytes, planned.kv_bytes_per_token) == (runtime.weight_bytes, runtime.kv_bytes_per_token)
    if not fields:
        assert served == UNNAMED_DTYPE == "float32"


def test_a_random_weights_folder_names_no_dtype_and_both_readers_agree(tmp_path):
    """``make-model --random-weights`` writes a config.json without a dtype (no weights are saved for
    transformers to record one): both readers take the unnamed dtype."""
    from hetserve.runtime.model.make import make_model

    folder = make_model(tmp_path / "m", "llama", layers=2, hidden=64, heads=4, kv_heads=2, random_weights=True)
    raw = json.loads((folder / "config.json").read_text())
    assert raw.get("dtype") is None and raw.get("torch_dtype") is None
    planned, served, runtime = _both(folder)
    assert planned.dtype == served == UNNAMED_DTYPE
    assert (planned.weight_bytes, planned.kv_bytes_per_token) == (runtime.weight_bytes, runtime.kv_bytes_per_token)


@pytest.mark.parametrize("sharded", [False, True], ids=["one-file", "sharded"])
def test_a_config_naming_no_dtype_takes_its_weights_as_transformers_5_does(tmp_path, sharded):
    """transformers 5 loads a checkpoint whose config.json names no dtype at its weights' dtype
    (``dtype="auto"``); both readers read that from the safetensors header, and say so."""
    import torch
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    tensors = {"model.embed_tokens.weight": torch.zeros(4, 4, dtype=torch.bfloat16),
               "model.layers.0.attn.step": torch.zeros(1, dtype=torch.int64)}
    if sharded:
        save_file(tensors, tmp_path / "model-00001-of-00002.safetensors")
        save_file({"lm_head.weight": torch.zeros(4, 4, dtype=torch.float16)}, tmp_path / "model-00002-of-00002.safetensors")
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors"}}))
    else:
        save_file(tensors, tmp_path / "model.safetensors")
    planned, served, runtime = _both(tmp_path)
    assert planned.dtype == served == "bfloat16" and planned.dtype_bytes == 2
    assert (planned.weight_bytes, planned.kv_bytes_per_token) == (runtime.weight_bytes, runtime.kv_bytes_per_token)
    assert "its weights'" in planned.dtype_from
    # a dtype the config names wins over the weights', as in transformers
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "torch_dtype": "float32"}))
    planned, served, _ = _both(tmp_path)
    assert planned.dtype == served == "float32"
    # an unreadable header is no dtype: the unnamed rule, and the loader says what is wrong with the file
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    for f in tmp_path.glob("*.safetensors"):
        f.write_bytes(b"\xff" * 16)
    planned, served, _ = _both(tmp_path)
    assert planned.dtype == served == UNNAMED_DTYPE
