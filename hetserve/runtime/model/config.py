"""``ArchConfig``: what the runtime needs from a checkpoint's ``config.json``, read without transformers.

Worker processes import only torch and safetensors (transformers costs seconds per process at
start-up), so the architecture is read here from the JSON directly. Supported families: Llama
(``model_type`` llama, incl. GQA and RoPE scaling) and OPT.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetserve.errors import SpecError
from hetserve.specs.model import DTYPE_BYTES, UNNAMED_DTYPE, served_dtype, weights_dtype

ARCHS = ("llama", "opt")


@dataclass(frozen=True)
class ArchConfig:
    arch: str  # "llama" | "opt"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    max_positions: int
    norm_eps: float
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str = UNNAMED_DTYPE  # the checkpoint's, where its config.json names one (``_dtype``)
    tie_word_embeddings: bool = False
    # llama
    rope: dict[str, Any] = field(default_factory=dict)  # rope_theta, rope_type, scaling fields
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # opt
    do_layer_norm_before: bool = True
    enable_bias: bool = True
    word_embed_proj_dim: int = 0
    final_layer_norm: bool = True
    layer_norm_affine: bool = True
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"unsupported architecture {self.arch!r}; supported: {ARCHS}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer, all KV heads, at the checkpoint dtype."""
        return 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[served_dtype(self.dtype)]

    @staticmethod
    def from_dir(model_dir: str | Path) -> ArchConfig:
        path = Path(model_dir) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise SpecError(str(path), "(file)", "a Hugging Face config.json in the model directory") from None
        except json.JSONDecodeError as exc:
            raise SpecError(str(path), "(file)", "valid JSON", str(exc)) from exc
        if isinstance(raw, dict) and not (raw.get("dtype") or raw.get("torch_dtype")):
            found = weights_dtype(model_dir)  # the planner's rule (``ModelSpec.from_hf_config``)
            if found:
                raw = {**raw, "dtype": found[0]}
        return ArchConfig.from_dict(raw, str(path))

    @staticmethod
    def from_dict(raw: dict[str, Any], source: str = "<config>") -> ArchConfig:
        model_type = raw.get("model_type")
        try:
            if model_type in ("llama", "mistral") and not raw.get("sliding_window"):
                return _llama(raw)
            if model_type == "opt":
                return _opt(raw, source)
        except KeyError as exc:
            raise SpecError(source, str(exc.args[0]), "a field of a Hugging Face config") from None
        raise SpecError(source, "model_type", f"one of {ARCHS}", model_type)


def _eos(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _dtype(raw: dict[str, Any]) -> str:
    """The checkpoint's dtype as the runtime holds it: ``dtype``, else the older ``torch_dtype`` (else
    its weights', which ``from_dir`` put there), else ``UNNAMED_DTYPE``, by the planner's rule
    (``ModelSpec.from_hf_config``), so both size it alike."""
    return served_dtype(raw.get("dtype") or raw.get("torch_dtype") or UNNAMED_DTYPE)


def _llama(raw: dict[str, Any]) -> ArchConfig:
    heads = raw["num_attention_heads"]
    rope = dict(raw.get("rope_parameters") or {})
    if not rope:  # transformers 4.x layout
        rope = dict(raw.get("rope_scaling") or {})
        rope["rope_theta"] = raw.get("rope_theta", 10000.0)
        rope.setdefault("rope_type", rope.pop("type", "default"))
    return ArchConfig(
        arch="llama", vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
        num_layers=raw["num_hidden_layers"], num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        ffn_size=raw["intermediate_size"], max_positions=raw.get("max_position_embeddings", 2048),
        norm_eps=raw.get("rms_norm_eps", 1e-6), eos_token_ids=_eos(raw), bos_token_id=raw.get("bos_token_id"),
        dtype=_dtype(raw), tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), rope=rope,
        attention_bias=bool(raw.get("attention_bias", False)), mlp_bias=bool(raw.get("mlp_bias", False)),
        hidden_act=raw.get("hidden_act", "silu"), raw=raw)


def _opt(raw: dict[str, Any], source: str = "<config>") -> ArchConfig:
    heads = raw["num_attention_heads"]
    hidden = raw["hidden_size"]
    if not (isinstance(heads, int) and isinstance(hidden, int) and heads > 0 and hidden % heads == 0):
        # hidden // heads would silently truncate the head size
        raise SpecError(source, "num_attention_heads", f"a positive divisor of hidden_size ({hidden})", heads)
    return ArchConfig(
        arch="opt", vocab_size=raw["vocab_size"], hidden_size=hidden, num_layers=raw["num_hidden_layers"],
        num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads, ffn_size=raw["ffn_dim"],
        max_positions=raw.get("max_position_embeddings", 2048), norm_eps=1e-5, eos_token_ids=_eos(raw),
        bos_token_id=raw.get("bos_token_id"), dtype=_dtype(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        hidden_act=raw.get("activation_function", "relu"),
        do_layer_norm_before=bool(raw.get("do_layer_norm_before", True)),
        enable_bias=bool(raw.get("enable_bias", True)),
        word_embed_proj_dim=raw.get("word_embed_proj_dim") or hidden,
        final_layer_norm=bool(raw.get("do_layer_norm_before", True)) and not raw.get("_remove_final_layer_norm", False),
        layer_norm_affine=bool(raw.get("layer_norm_elementwise_affine", True)), raw=raw)


# Llama-2-7B's shape, as ``llama_arch`` keywords (the published config.json's sizes)
LLAMA2_7B = {"hidden": 4096, "heads": 32, "kv_heads": 32, "ffn": 11008, "layers": 32, "vocab": 32000,
             "max_positions": 4096}


def llama_arch(*, hidden: int, heads: int, ffn: int, layers: int, vocab: int, kv_heads: int | None = None,
               max_positions: int = 4096, dtype: str = "bfloat16", norm_eps: float = 1e-5) -> ArchConfig:
    """A Llama ``ArchConfig`` made in memory (no checkpoint directory): ``llama_arch(**LLAMA2_7B)``."""
    return ArchConfig.from_dict({
        "model_type": "llama", "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads or heads, "intermediate_size": ffn, "num_hidden_layers": layers,
        "vocab_size": vocab, "max_position_embeddings": max_positions, "rms_norm_eps": norm_eps,
        "hidden_act": "silu", "torch_dtype": dtype}, "<llama_arch>")
