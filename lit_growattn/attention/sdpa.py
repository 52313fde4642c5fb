"""Causal attention through `F.scaled_dot_product_attention`, padded to head sizes the fused kernels accept.

PyTorch picks a kernel per call and silently falls back to the math kernel (an explicit s×s map, bf16 upcast
to fp32) when none of the fused ones accepts the shapes. Growth produces every query/key width d_head and
value width d_v (each side grows on its own; a statistics step widens the values by e′), and:
- flash attention (CUDA and CPU) needs q, k and v of the same width; on CUDA at most 256;
- memory-efficient and cuDNN attention (CUDA) need widths that are multiples of 8.
Zero columns add exactly 0 to q·kᵀ (the scale is explicit, so it does not see the padded width), and zero
value columns only add output columns that are sliced off: padding q, k and v to one common width is exact.
Flash rounds head sizes up to 32/64 internally anyway, so the padding costs little.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

SdpaPad = Literal["auto", "on", "off"]  # whether to pad the head sizes (`pads`)
SDPA_PADS: tuple[str, ...] = get_args(SdpaPad)
FLASH_MAX_WIDTH = 256  # CUDA flash attention's largest head size
FUSED_MULTIPLE = 8  # memory-efficient and cuDNN attention: head sizes in multiples of 8


def padded_widths(d_qk: int, d_v: int) -> tuple[int, int]:
    """(q/k width, v width) the fused kernels accept: one common multiple of 8 up to flash's limit, above it
    each width rounded up to a multiple of 8 (flash is then out of reach; memory-efficient attention is not)."""
    common = -(-max(d_qk, d_v) // FUSED_MULTIPLE) * FUSED_MULTIPLE
    if common <= FLASH_MAX_WIDTH:
        return common, common
    return tuple(-(-d // FUSED_MULTIPLE) * FUSED_MULTIPLE for d in (d_qk, d_v))


def pads(mode: SdpaPad, device: torch.device) -> bool:
    """Whether `mode` pads on this device. `auto`: on CUDA only. On CPU padding unlocks the CPU flash kernel,
    which pays only for long sequences in fp32 (docs/gpu.md), so `auto` leaves CPU as it is."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def causal_attention(q: Tensor, k: Tensor, v: Tensor, pad: SdpaPad = "auto") -> Tensor:
    """softmax(q·kᵀ + causal mask)·v with scale 1; q, k (b, h, s, d), v (b, h, s, d_v) → (b, h, s, d_v)."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"queries and keys must have the same width, got {q.shape[-1]} and {k.shape[-1]}")
    d_qk, d_v = q.shape[-1], v.shape[-1]
    if not pads(pad, q.device):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)
    w_qk, w_v = padded_widths(d_qk, d_v)
    q, k, v = _widen(q, w_qk), _widen(k, w_qk), _widen(v, w_v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0)[..., :d_v]


def _widen(t: Tensor, width: int) -> Tensor:
    t = t if t.shape[-1] == width else F.pad(t, (0, width - t.shape[-1]))
    # Fused kernels also need a unit stride along the head dim; F.pad keeps the input's odd strides (at d = 1).
    return t if t.stride(-1) == 1 else t.contiguous()
