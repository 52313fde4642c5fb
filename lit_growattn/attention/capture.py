"""Query/key statistics capture through the attention call, written once for the project's `qk.QKForm` and the
Hugging Face `hf.growable.GrowableAttention`: the full statistics (e′ extra columns, docs/design.md §4) or, when the
unit holds test matrices, the sketch's (k + l columns, `attention.sketch`, §12)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from lit_growattn.attention.sketch import explicit_products, extend_queries_keys
from lit_growattn.growth.sketch import TestMatrices


def extended_queries_keys(sketch: TestMatrices | None, xa: Tensor, q: Tensor, k: Tensor,
                          record: Callable[..., None]) -> tuple[Tensor, Tensor]:
    """q (b, H, s, d) and k (b, KV, s, d) widened so that the attention call's backward records the statistics of the
    detached X′ = xa (b, s, e′), whatever the mask: Q̃ = [q | E], K̃ = [k | X′] with E (b, H, s, e′) a zero leaf, so
    that `record(E.grad)` receives G X′ (b, H, s, e′); with a sketch, `extend_queries_keys`'s columns and products."""
    if sketch is not None:
        return extend_queries_keys(sketch, xa, q, k, record)
    b, h, s, e_in = *q.shape[:3], xa.shape[-1]
    ext = q.new_zeros(b, h, s, e_in, requires_grad=True)
    ext.register_hook(record)
    keys = xa.to(k.dtype).unsqueeze(1).expand(b, k.shape[1], s, e_in)
    return torch.cat([q, ext], dim=-1), torch.cat([k, keys], dim=-1)


def score_gradient_products(sketch: TestMatrices | None, xa: Tensor, grad: Tensor, n_kv_head: int) -> tuple[Tensor, ...]:
    """What an explicit score map's gradient G (b, H, s, s) records with the detached X′ (b, s, e′): G X′
    (b, H, s, e′), or with a sketch `explicit_products`' two thin products."""
    if sketch is not None:
        return explicit_products(sketch, xa, grad, n_kv_head)
    return (grad.to(xa.dtype) @ xa.unsqueeze(1),)
