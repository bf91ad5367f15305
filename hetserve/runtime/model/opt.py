"""Layers [a, b) of an OPT model (learned positions with offset 2, LayerNorm, ReLU FFN), no parallelism.

Follows transformers' ``modeling_opt``: queries scaled before attention, pre- or post-LN per
``do_layer_norm_before``, optional ``project_in`` / ``project_out`` when the word-embedding width
differs from the hidden size (opt-350m).
"""

from __future__ import annotations

import torch
from torch import nn

from hetserve.runtime.model.attention import AttnMeta, paged_attention
from hetserve.runtime.model.config import ArchConfig
from hetserve.runtime.model.llama import ACT

POSITION_OFFSET = 2


class Attention(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        H, b = cfg.hidden_size, cfg.enable_bias
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(H, H, bias=b)
        self.k_proj = nn.Linear(H, H, bias=b)
        self.v_proj = nn.Linear(H, H, bias=b)
        self.out_proj = nn.Linear(H, H, bias=b)

    def forward(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], meta: AttnMeta) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        q = (self.q_proj(x) * D ** -0.5).view(T, -1, D)  # (T, Hq, D), scaled first as in OPT
        k = self.k_proj(x).view(T, -1, D)  # (T, Hkv, D)
        v = self.v_proj(x).view(T, -1, D)
        return self.out_proj(paged_attention(q, k, v, kv[0], kv[1], meta, scale=1.0))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig):
        super().__init__()
        affine = cfg.layer_norm_affine
        self.pre_ln = cfg.do_layer_norm_before
        self.self_attn = Attention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=cfg.enable_bias)
        self.fc2 = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=cfg.enable_bias)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        self.act = ACT[cfg.hidden_act]

    def forward(self, h, kv, meta):
        x = self.self_attn_layer_norm(h) if self.pre_ln else h
        h = h + self.self_attn(x, kv, meta)
        if not self.pre_ln:
            h = self.self_attn_layer_norm(h)
        x = self.final_layer_norm(h) if self.pre_ln else h
        h = h + self.fc2(self.act(self.fc1(x)))
        return h if self.pre_ln else self.final_layer_norm(h)


class OPTStage(nn.Module):
    """Layers ``[first, first + num_layers)``; embeddings if ``has_embed``, final norm + LM head if ``has_head``."""

    TP_PLAN = {"q_proj": "column", "k_proj": "column", "v_proj": "column", "out_proj": "row",
               "fc1": "column", "fc2": "row"}

    def __init__(self, cfg: ArchConfig, num_layers: int, has_embed: bool, has_head: bool):
        super().__init__()
        H, P = cfg.hidden_size, cfg.word_embed_proj_dim
        self.cfg = cfg
        self.embed_tokens = self.embed_positions = self.project_in = None
        self.final_layer_norm = self.project_out = self.lm_head = None
        if has_embed:
            self.embed_tokens = nn.Embedding(cfg.vocab_size, P)
            self.embed_positions = nn.Embedding(cfg.max_positions + POSITION_OFFSET, H)
            self.project_in = nn.Linear(P, H, bias=False) if P != H else None
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(num_layers))
        if has_head:
            if cfg.final_layer_norm:
                self.final_layer_norm = nn.LayerNorm(H, elementwise_affine=cfg.layer_norm_affine)
            self.project_out = nn.Linear(H, P, bias=False) if P != H else None
            self.lm_head = nn.Linear(P, cfg.vocab_size, bias=False)

    def init_buffers(self, device: torch.device) -> None:
        pass

    @staticmethod
    def checkpoint_keys(local: str, first_layer: int, cfg: ArchConfig) -> tuple[str, ...]:
        if local.startswith("layers."):
            _, i, rest = local.split(".", 2)
            return (f"model.decoder.layers.{first_layer + int(i)}.{rest}",)
        if local == "lm_head.weight":
            return ("lm_head.weight", "model.decoder.embed_tokens.weight")
        return (f"model.decoder.{local}",)

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # (T, P)
        if self.project_in is not None:
            x = self.project_in(x)  # (T, H)
        return x + self.embed_positions(positions + POSITION_OFFSET)

    def forward(self, h: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttnMeta) -> torch.Tensor:
        for layer, kv in zip(self.layers, kv_caches):
            h = layer(h, kv, meta)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.final_layer_norm is not None:
            h = self.final_layer_norm(h)
        if self.project_out is not None:
            h = self.project_out(h)
        return self.lm_head(h)  # (N, V)
