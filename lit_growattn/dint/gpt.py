"""The project's GPT with mha attention converted to DINT or low-rank DINT, for `python -m lit_growattn convert
--ckpt … --to dint|lowrank_dint`: Q1/K1/temperature/V/O keep their mha names and values and λ = 0 exactly, so the
converted model's outputs are the mha model's. λ then receives gradient at once, ⟨∂L/∂y, (A3 − A2)·V⟩, and the
fresh second map starts learning once λ ≠ 0."""

from __future__ import annotations

import torch

from lit_growattn.module import GrowAttentionLM


def to_dint(src_path, hparams: dict, state: dict, to: str, seed: int, variant_args: dict) -> GrowAttentionLM:
    """The GrowAttentionLM of attention `to` (dint or lowrank_dint) that holds the mha weights `state` of the
    checkpoint at `src_path` (hyperparameters `hparams`), λ = 0 and the second map drawn from `seed`: its outputs
    are the mha model's."""
    hparams.update(attention=to, attention_args={**variant_args, "lambda_init": 0.0})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = GrowAttentionLM(**hparams)
    missing, unexpected = module.load_state_dict(state, strict=False)
    unfilled = [k for k in missing if ".attn.qk2." not in k and not k.endswith(".attn.lam")]
    leftover = [k for k in unexpected if k.startswith("model.")]  # others are evaluation-metric states
    if unfilled or leftover:
        raise ValueError(f"{src_path} does not fit {to}: missing {unfilled}, unexpected {leftover}")
    return module
