"""Layers [a, b) of a Llama-family model (GQA, RoPE, RMSNorm, SwiGLU), with no notion of parallelism.

Numerics follow transformers' ``modeling_llama`` op for op (norm in float32, RoPE cos/sin from
``positions * inv_freq``; ``kernels.rms_norm`` / ``kernels.rotary`` round where it rounds), so
greedy tokens match ``generate``. Tensor parallelism is applied from
outside by ``hetserve.runtime.model.tp`` using ``TP_PLAN``; heads are inferred from tensor shapes, so a
sharded attention needs no flags.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetserve.runtime import kernels
from hetserve.runtime.model.attention import AttnMeta, paged_attention
from hetserve.runtime.model.config import ArchConfig

ACT = {"silu": F.silu, "relu": F.relu, "gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


def rope_inv_freq(cfg: ArchConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq (D/2,), attention scaling) for this config's RoPE type."""
    rope_type = cfg.rope.get("rope_type", "default")
    if rope_type == "default":
        base, dim = cfg.rope.get("rope_theta", 10000.0), cfg.head_dim
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    # scaled variants (llama3, yarn, ...): use transformers' own formulas (imported only here)
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](LlamaConfig(**cfg.raw), "cpu")
    return inv_freq.float(), float(scaling)


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        D = cfg.head_dim
        self.head_dim = D
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * D, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * D, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * D, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * D, cfg.hidden_size, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor], meta: AttnMeta) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q = self.q_proj(x).view(T, -1, D)  # (T, Hq, D)
        k = self.k_proj(x).view(T, -1, D)  # (T, Hkv, D)
        v = self.v_proj(x).view(T, -1, D)  # (T, Hkv, D)
        q, k = kernels.rotary(q, k, cos, sin)
        return self.o_proj(paged_attention(q, k, v, kv[0], kv[1], meta, scale=D ** -0.5))


class MLP(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = ACT[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos, sin, kv, meta):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaStage(nn.Module):
    """Layers ``[first, first + num_layers)``; the embedding if ``has_embed``, norm + LM head if ``has_head``."""

    TP_PLAN = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "o_proj": "row",
               "gate_proj": "column", "up_proj": "column", "down_proj": "row"}

    def __init__(self, cfg: ArchConfig, num_layers: int, has_embed: bool, has_head: bool):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if has_embed else None
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if has_head else None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if has_head else None
        self.inv_freq: torch.Tensor | None = None
        self.rope_scaling = 1.0

    def init_buffers(self, device: torch.device) -> None:
        inv_freq, self.rope_scaling = rope_inv_freq(self.cfg)
        self.inv_freq = inv_freq.to(device)

    @staticmethod
    def checkpoint_keys(local: str, first_layer: int, cfg: ArchConfig) -> tuple[str, ...]:
        """Checkpoint names for a local parameter name, most likely first."""
        if local.startswith("layers."):
            _, i, rest = local.split(".", 2)
            return (f"model.layers.{first_layer + int(i)}.{rest}",)
        if local == "lm_head.weight":
            return ("lm_head.weight", "model.embed_tokens.weight")
        return (f"model.{local}",)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)  # (T, H)

    def forward(self, h: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttnMeta) -> torch.Tensor:
        freqs = meta.positions[:, None].float() * self.inv_freq[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        cos = (emb.cos() * self.rope_scaling).to(h.dtype)
        sin = (emb.sin() * self.rope_scaling).to(h.dtype)
        for layer, kv in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, kv, meta)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(h))  # (N, V)
