"""A GPT-style decoder (nanoGPT's layout: token + position embeddings, pre-LN blocks, tied head)
whose attention comes from the registry by name."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lit_growattn.attention import QKForm, attention_class
from lit_growattn.attention.value import ValueMap
from lit_growattn.model.compiled import CompiledBlocks
from lit_growattn.model.config import GPTConfig


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = attention_class(cfg.attention)(cfg, layer_idx, **cfg.attention_args)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x)))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        # Checked here rather than in GPTConfig, which the attention variants read: unknown names fail before any
        # layer is built, listing the registered ones.
        attention_class(cfg.attention)
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        nn.init.normal_(self.wte.weight, std=0.02)
        nn.init.normal_(self.wpe.weight, std=0.02)
        self.compiled: CompiledBlocks | None = None

    def forward(self, idx: Tensor) -> Tensor:
        """idx (b, s) token ids → logits (b, s, vocab)."""
        s = idx.shape[1]
        if s > self.cfg.block_size:
            raise ValueError(f"sequence length {s} exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(s, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        if self._runs_compiled():
            x = self.compiled(x)
        else:
            for block in self.blocks:
                x = block(x)
        return self.lm_head(self.ln_f(x))

    def compile_blocks(self) -> None:
        """Training steps run compiled blocks from now on (see `lit_growattn.model.compiled`)."""
        self.compiled = CompiledBlocks(self.blocks)

    def _runs_compiled(self) -> bool:
        # Training steps only. Evaluation (and the growth line search) and statistics steps, whose capture hooks
        # and side effects would break the graph, stay eager: they are a small share of the steps.
        if self.compiled is None or not (self.training and torch.is_grad_enabled()):
            return False
        return not any(form.capture for forms in self.qk_forms() for form in forms) and not any(
            block.attn.value.capture for block in self.blocks)

    def qk_forms(self) -> list[list[QKForm]]:
        """The growable query/key forms, one list per layer."""
        return [block.attn.qk_forms() for block in self.blocks]

    def named_value_maps(self) -> list[tuple[int, str, ValueMap]]:
        """(layer, module name under this GPT, value map) of every layer whose value side can grow."""
        return [(i, f"blocks.{i}.attn.value", block.attn.value) for i, block in enumerate(self.blocks)
                if block.attn.value_growable]

    def named_qk_forms(self) -> list[tuple[int, str, QKForm]]:
        """(layer, module name under this GPT, form) of every growable form, layer by layer in module order."""
        return [(i, f"blocks.{i}.{name}", m) for i, block in enumerate(self.blocks)
                for name, m in block.named_modules() if isinstance(m, QKForm)]

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward = 3 × forward, 2 FLOPs per multiply-add): the weight
        matmuls, plus the score and value products of a causal map, (s+1)/2 keys per query on average."""
        weights = sum(p.numel() for name, p in self.named_parameters() if name != "wpe.weight")
        per_query = sum(
            m.n_head * m.d_head + block.attn.value.n_head * block.attn.value.d_v
            for block in self.blocks for m in getattr(block.attn, "score_maps", block.attn.qk_forms)()
        )
        return 6.0 * weights + 3.0 * (seq_len + 1) * per_query

    def head_sizes(self) -> list[int]:
        """Per-layer query/key head size (all forms of a layer share it)."""
        return [forms[0].d_head if forms else self.cfg.head_size(i) for i, forms in enumerate(self.qk_forms())]

    def value_sizes(self) -> list[int]:
        """Per-layer value head size, as the config states it (DIFF's value map is twice as wide and never grows)."""
        return [block.attn.value.d_v if block.attn.value_growable else self.cfg.value_head_size(i)
                for i, block in enumerate(self.blocks)]
