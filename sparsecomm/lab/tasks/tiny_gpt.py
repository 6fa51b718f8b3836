"""A small GPT (decoder-only transformer) for byte-level language modelling.

Pre-norm blocks, learned positions, weight-tied output head; nanoGPT's shape at toy size.
"""
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256  # bytes
    context: int = 64
    num_layers: int = 2
    num_heads: int = 4
    width: int = 128


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.width)
        self.attn = nn.MultiheadAttention(cfg.width, cfg.num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width))
        self.register_buffer("causal_mask", torch.ones(cfg.context, cfg.context, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x):  # x: (B, T, C)
        t = x.shape[1]
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=self.causal_mask[:t, :t], need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.token = nn.Embedding(cfg.vocab_size, cfg.width)
        self.position = nn.Embedding(cfg.context, cfg.width)
        self.blocks = nn.Sequential(*[Block(cfg) for _ in range(cfg.num_layers)])
        self.norm = nn.LayerNorm(cfg.width)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        # nanoGPT's init: with PyTorch's N(0, 1) embeddings the tied head starts with
        # logits of std ~sqrt(width) and a loss near 60 instead of ln(256) = 5.5.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):  # idx: (B, T) int64 -> logits (B, T, vocab)
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.token(idx) + self.position(positions))
        return self.norm(x) @ self.token.weight.T  # tied head
