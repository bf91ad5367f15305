"""Model architecture: the shapes the cost model and the runtime need, with exact parameter counts.

Parameters are counted from the real weight shapes: a gated FFN (Llama, Qwen2, Mistral) has
three H×F matrices, OPT's has two; grouped-query attention shrinks K and V to
``num_kv_heads * head_dim`` columns. ``kv_bytes_per_token`` covers K and V of every layer.

Presets are a named table checked at import (nanoGPT style); ``ModelSpec.from_hf_config`` reads
a Hugging Face ``config.json`` of the Llama, Mistral, Qwen2 or OPT families.
"""

from __future__ import annotations

import dataclasses

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from hetserve.errors import SpecError
from hetserve.specs._validation import _json_object as unique_keys, existing_path, shown_name

ARCHS = ("llama", "mistral", "qwen2", "opt")

# weight bytes per parameter of the dtypes the runtime loads weights in
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
WIDER_DTYPES = ("float64",)  # checkpoints the runtime loads in float32
# The dtype of a config.json that names none (neither ``dtype`` nor ``torch_dtype``): float32,
# torch's default dtype. The planner's reader (``ModelSpec.from_hf_config``) and the runtime's
# (``runtime/model/config.py``) both take it from here, so the planner sizes weights, KV and
# activations at the bytes the runtime then holds. transformers 4's ``from_pretrained`` loads such a
# checkpoint in float32 too; transformers 5's ``dtype="auto"`` takes its weights' dtype: where the
# folder holds safetensors weights both readers take theirs (``weights_dtype``) and fall back to
# float32 only where there are none (a ``make-model --random-weights`` folder, a config file alone).
UNNAMED_DTYPE = "float32"
# safetensors' dtype codes of the floating-point weights a checkpoint may hold
_SAFETENSORS_FLOATS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
_MAX_HEADER = 100 << 20  # safetensors' own bound on a file's JSON header
# a config.json's sizes (layers, widths, heads, vocabulary, context) stay within torch's int32 indices
MAX_DIM = 2 ** 31 - 1


def weights_dtype(folder: str | Path) -> tuple[str, str] | None:
    """(dtype, file) of the first floating-point tensor of the folder's safetensors weights (the
    first shard of ``model.safetensors.index.json``, or ``model.safetensors``), read from the
    file's header alone: the dtype transformers 5 loads a checkpoint in when its config.json names
    none. None where there are no such weights or the header cannot be read (the loader says why)."""
    folder = Path(folder)
    try:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
            file = folder / shards[0] if shards else None
        else:
            file = folder / "model.safetensors"
        if file is None or not file.is_file():
            return None
        with file.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n)) if 0 < n <= _MAX_HEADER else {}
    except (OSError, ValueError, AttributeError):
        return None
    for name, entry in header.items() if isinstance(header, dict) else ():
        dtype = _SAFETENSORS_FLOATS.get(entry.get("dtype")) if isinstance(entry, dict) and name != "__metadata__" else None
        if dtype:
            return dtype, file.name
    return None


def served_dtype(name) -> str:
    """The dtype the runtime holds a checkpoint's weights in: its own where the runtime has it,
    else float32 (a float64 checkpoint is served, and sized, as float32)."""
    return str(name) if str(name) in DTYPE_BYTES else "float32"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    arch: str  # one of ARCHS
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden: int
    vocab: int
    max_context: int
    dtype_bytes: int = 2  # fp16 / bf16
    tie_embeddings: bool = False
    head_dim: int | None = None  # defaults to hidden // num_heads
    # the dtype the sizes are in and where it came from (``describe model`` says both); "" for a
    # preset, sized at ``dtype_bytes`` (float16 / bfloat16). Not part of the model's identity.
    dtype: str = field(default="", compare=False)
    dtype_from: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"model {self.name}: arch must be one of {ARCHS}, got {self.arch!r}")
        for f in ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn_hidden", "vocab", "max_context"):
            if getattr(self, f) <= 0:
                raise ValueError(f"model {self.name}: {f} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model {self.name}: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim is None and self.hidden % self.num_heads:
            raise ValueError(f"model {self.name}: hidden must divide evenly into heads")

    # ------------------------------------------------------------------ shapes
    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden // self.num_heads

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.dim_head

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.dim_head

    @property
    def gated_ffn(self) -> bool:
        return self.arch != "opt"

    @property
    def has_bias(self) -> bool:
        return self.arch == "opt"

    def tp_problem(self, tp: int) -> str | None:
        """Why a TP group of ``tp`` devices cannot shard this model, or None if it can.

        Heads, KV heads and the FFN width are split evenly across the group (no KV-head
        replication): the planner searches, the validator checks and the runtime shards by
        this one rule.
        """
        for what, n in (("attention heads", self.num_heads), ("KV heads", self.num_kv_heads),
                        ("FFN width", self.ffn_hidden)):
            if n % tp:
                return f"TP degree {tp} does not divide {self.name}'s {n} {what}"
        return None

    # ------------------------------------------------------------------ parameter counts
    @cached_property  # the cost model reads it ~10⁵ times per planner run
    def params_per_layer(self) -> int:
        h, q, kv, f = self.hidden, self.q_dim, self.kv_dim, self.ffn_hidden
        attn = h * q + 2 * h * kv + q * h
        ffn = (3 if self.gated_ffn else 2) * h * f
        if self.arch == "opt":  # biases on every projection, LayerNorm has weight + bias
            attn += q + 2 * kv + h
            ffn += f + h
            norms = 4 * h
        else:
            norms = 2 * h  # RMSNorm weights
            if self.arch == "qwen2":
                attn += q + 2 * kv  # Qwen2 has biases on Q, K, V
        return attn + ffn + norms

    @property
    def embedding_params(self) -> int:
        """Token (and for OPT, learned position) embeddings: held by the first stage."""
        pos = (self.max_context + 2) * self.hidden if self.arch == "opt" else 0
        return self.vocab * self.hidden + pos

    @property
    def head_params(self) -> int:
        """Final norm + LM head: held by the last stage (the head shares the embedding if tied)."""
        norm = (2 if self.arch == "opt" else 1) * self.hidden
        return norm + (0 if self.tie_embeddings else self.vocab * self.hidden)

    @property
    def num_params(self) -> int:
        return self.num_layers * self.params_per_layer + self.embedding_params + self.head_params

    @property
    def bytes_per_layer(self) -> int:
        return self.params_per_layer * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        return 2 * self.kv_dim * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_bytes_per_token_per_layer

    def flops_per_token_per_layer(self) -> int:
        """Dense (matmul) FLOPs for one token through one layer: 2 per weight."""
        return 2 * self.params_per_layer

    # ------------------------------------------------------------------ readers
    @staticmethod
    def from_hf_config(path: str | Path, name: str | None = None) -> "ModelSpec":
        """Read a Hugging Face ``config.json`` (or a checkpoint folder holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        src = str(path)
        try:
            cfg = json.loads(path.read_text(), object_pairs_hook=unique_keys)
        except OSError as exc:
            raise SpecError(src, "(file)", "a readable config.json", exc.strerror) from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SpecError(src, "(file)", "valid JSON (UTF-8 text)", str(exc)) from exc
        if not isinstance(cfg, dict):
            raise SpecError(src, "(top level)", "a JSON object")
        def missing(key: str) -> str:  # a field left out is said to be, not shown as a wrong value
            return " (the field is missing)" if key not in cfg else ""

        model_type = cfg.get("model_type")
        if model_type not in ARCHS:
            raise SpecError(src, "model_type", "one of " + ", ".join(ARCHS) + missing("model_type"), model_type)

        def need(key: str) -> int:
            value = cfg.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_DIM:
                raise SpecError(src, key, f"a positive integer of at most {MAX_DIM}{missing(key)}", value)
            return value

        # transformers 5 reads ``dtype`` and falls back to the older ``torch_dtype``: so do we, and two
        # that disagree are refused (which one a loader takes differs between versions)
        named, legacy = cfg.get("dtype"), cfg.get("torch_dtype")
        if named and legacy and str(named) != str(legacy):
            raise SpecError(src, "dtype", f"the dtype torch_dtype also gives ({legacy}), or one of the two only "
                            "(transformers reads dtype first)", named)
        found = weights_dtype(path.parent) if not (named or legacy) and path.name == "config.json" else None
        dtype = named or legacy or (found[0] if found else UNNAMED_DTYPE)
        if str(dtype) not in (*DTYPE_BYTES, *WIDER_DTYPES):  # sized as float32 unseen otherwise
            raise SpecError(src, "dtype" if named else "torch_dtype",
                            "one of " + ", ".join((*DTYPE_BYTES, *WIDER_DTYPES)), dtype)
        served = served_dtype(dtype)
        dtype_bytes = DTYPE_BYTES[served]
        if found:
            dtype_from = f"no dtype in config.json: its weights' ({found[1]}), as transformers 5 loads it"
        elif not (named or legacy):
            dtype_from = f"no dtype in config.json: {UNNAMED_DTYPE} assumed, torch's default, as the runtime loads it"
        else:
            dtype_from = f"config.json {'dtype' if named else 'torch_dtype'}" + (
                f" {dtype}, served as {served}" if served != str(dtype) else "")
        read_dtype = {"dtype": served, "dtype_from": dtype_from}
        # a checkpoint's config.json is named by its folder, any other config file by its own name
        # (two model files of one folder are two models, and "." names nothing)
        label = name or cfg.get("_name_or_path") or (path.resolve().parent.name if path.name == "config.json"
                                                     else path.stem)
        if model_type == "opt":
            if cfg.get("word_embed_proj_dim", cfg.get("hidden_size")) != cfg.get("hidden_size"):
                raise SpecError(src, "word_embed_proj_dim", "equal to hidden_size (projected OPT variants "
                                "are not supported)", cfg.get("word_embed_proj_dim"))
            heads, hidden = need("num_attention_heads"), need("hidden_size")
            if hidden % heads:  # OPT has no head_dim field: hidden_size / num_attention_heads must be whole
                raise SpecError(src, "num_attention_heads", f"a divisor of hidden_size ({hidden})", heads)
            return ModelSpec(str(label), "opt", need("num_hidden_layers"), hidden, heads, heads,
                             need("ffn_dim"), need("vocab_size"), need("max_position_embeddings"),
                             dtype_bytes, bool(cfg.get("tie_word_embeddings", True)), **read_dtype)
        heads = need("num_attention_heads")
        if cfg.get("head_dim") is None and need("hidden_size") % heads:  # no head_dim: hidden / heads is it
            raise SpecError(src, "num_attention_heads", f"a divisor of hidden_size ({cfg['hidden_size']})", heads)
        kv = need("num_key_value_heads") if cfg.get("num_key_value_heads") is not None else heads
        head_dim = need("head_dim") if cfg.get("head_dim") is not None else None
        shape = (need("num_hidden_layers"), need("hidden_size"), heads, kv, need("intermediate_size"),
                 need("vocab_size"), need("max_position_embeddings"))  # a missing field named as itself
        try:
            return ModelSpec(str(label), model_type, *shape, dtype_bytes, bool(cfg.get("tie_word_embeddings", False)),
                             head_dim, **read_dtype)
        except ValueError as exc:  # shapes that do not fit together (heads vs hidden, GQA groups)
            raise SpecError(src, "(shape)", "a consistent model shape", str(exc)) from exc


# Presets: shapes from each model's published config.json.
MODEL_PRESETS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("llama-2-7b", "llama", 32, 4096, 32, 32, 11008, 32000, 4096),
    ModelSpec("llama-2-13b", "llama", 40, 5120, 40, 40, 13824, 32000, 4096),
    ModelSpec("llama-2-70b", "llama", 80, 8192, 64, 8, 28672, 32000, 4096),
    # LLaMA-1 "30B" (33B parameters): hidden 6656, 52 heads, FFN 17920.
    ModelSpec("llama-30b", "llama", 60, 6656, 52, 52, 17920, 32000, 2048),
    ModelSpec("opt-30b", "opt", 48, 7168, 56, 56, 28672, 50272, 2048, tie_embeddings=True),
    # Qwen-7B shapes (hidden 4096, 32 layers, FFN 11008 per matrix, 151,936 vocab); counted as
    # the Qwen2 family (biases on Q, K, V), as transformers loads it.
    ModelSpec("qwen-7b", "qwen2", 32, 4096, 32, 32, 11008, 151936, 8192),
    # Qwen2-7B (the model MoLink evaluates), from Qwen/Qwen2-7B config.json: 28 layers, hidden
    # 3584, 28 heads with 4 KV heads (GQA), intermediate 18944, vocab 152064, untied embeddings.
    ModelSpec("qwen2-7b", "qwen2", 28, 3584, 28, 4, 18944, 152064, 131072),
)}


def model_presets() -> list[str]:
    return sorted(MODEL_PRESETS)


def load_model(name_or_path: str | Path) -> ModelSpec:
    """A preset name, a ``config.json`` path, or a checkpoint folder holding one."""
    key = str(name_or_path)
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    path = existing_path(key)
    if path is not None:
        return ModelSpec.from_hf_config(path)
    raise SpecError(shown_name(key), "(model)", "a config.json, a checkpoint folder or a preset: " + ", ".join(model_presets()))


def load_model_as(name_or_path: str | Path, name: str) -> ModelSpec:
    """``load_model``, named as a plan names its model: a checkpoint folder's label need not be the
    name the plan was made with (what must match, the layers and shapes, the deployment checks)."""
    return dataclasses.replace(load_model(name_or_path), name=name)
