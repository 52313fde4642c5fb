"""scripts/bench.py's presets and the pieces its measurements share (model, data, capture, trainer)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Callable

import lightning as L
import torch
from torch.utils.data import TensorDataset

import bench_common

from lit_growattn import growth  # bench_common has put the repository on the path
from lit_growattn.callback.window import NamedForms, capture_mode, fold_captured
from lit_growattn.module import GrowAttentionLM


CPU = torch.device("cpu")  # on a GPU, scripts/bench_gpu.py

VARIANTS = ("normal", "extend", "explicit", "extend_pinv", "explicit_pinv", "round_robin", "value", "both",
            "sketch_qk", "sketch_value", "sketch_both")
# The round_robin variant: capture="auto" on a third of the layers, as GrowAttentionCallback(layers_per_step=n/3).
# value: the value maps' capture alone (growth.grow: value); both: it with the query/key capture="auto" (grow: both).
# sketch_*: the same sides under statistics.sketch: on (capture "auto"), through the callback's own StatsWindow.
ROUND_ROBIN_SHARE = 3
SKETCH = growth.SketchSize.of(24)  # statistics.sketch_size's default: k 24, l 36, k_c 24
SKETCH_SIDES = {"qk": "qk", "value": "value", "both": "both_sides"}  # variant suffix → key infix


# -- configuration ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int
    d_head: int
    seq_len: int
    batch: int
    vocab: int = 256

    @property
    def name(self) -> str:
        return f"s{self.seq_len}_b{self.batch}"

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch


@dataclass(frozen=True)
class Preset:
    shapes: tuple[Shape, ...]  # the first is the default shape of the top-level keys
    repeats: int  # interleaved repeats of the step-cost measurements
    fit_repeats: int  # Lightning fits (and plain runs) for the throughput ratio
    fit_warmup: int  # steps excluded at the start of each fit / plain run
    fit_steps: int  # timed steps per fit / plain run
    growth_shape: Shape  # model and micro-batch of the growth event
    growth_micro_batches: int  # statistics from growth_micro_batches × growth_shape.batch instances
    grow_by: int
    growth_repeats: int
    sweep_seqs: tuple[int, ...]
    sweep_tokens: int
    epoch_steps: int = 1000  # epoch assumed for the growth event's share
    crossover_widths: tuple[int, ...] = (64, 128, 256, 512, 1024)  # n_embd of the sketch_crossover's one-layer GPTs
    crossover_tokens: tuple[int, int] = (256, 4)  # their sequence length and batch


DEFAULT = Shape(n_layer=6, n_embd=256, n_head=8, d_head=8, seq_len=256, batch=8)  # the shape of docs/design.md §4
TINY = Shape(n_layer=2, n_embd=64, n_head=4, d_head=4, seq_len=64, batch=8)
PRESETS = {
    "full": Preset(
        shapes=(DEFAULT, replace(DEFAULT, seq_len=1024, batch=2)), repeats=5, fit_repeats=3, fit_warmup=2,
        fit_steps=3, growth_shape=DEFAULT, growth_micro_batches=4, grow_by=8, growth_repeats=3,
        sweep_seqs=(128, 256, 512, 1024, 2048), sweep_tokens=2048,
    ),
    "quick": Preset(
        shapes=(TINY, replace(TINY, seq_len=256, batch=2)), repeats=5, fit_repeats=3, fit_warmup=3, fit_steps=8,
        growth_shape=TINY, growth_micro_batches=2, grow_by=4, growth_repeats=3, sweep_seqs=(32, 64, 128, 256, 512),
        sweep_tokens=512, crossover_widths=(32, 64), crossover_tokens=(64, 2),
    ),
}


@dataclass
class Env:
    logger: str
    log: Callable[[str], None] = field(default=lambda msg: None)


# -- shared pieces ---------------------------------------------------------------------------------
def make_lm(shape: Shape, seed: int = 0, cls: type[GrowAttentionLM] = GrowAttentionLM) -> GrowAttentionLM:
    return bench_common.make_lm(seed, cls, vocab_size=shape.vocab, block_size=shape.seq_len, n_layer=shape.n_layer,
                                n_head=shape.n_head, n_embd=shape.n_embd, d_head=shape.d_head)


def token_data(shape: Shape, n_batches: int, seed: int = 0) -> TensorDataset:
    return bench_common.token_data(shape.vocab, shape.seq_len, shape.batch, n_batches, seed)


def named_forms(lm: GrowAttentionLM) -> NamedForms:
    """(layer, parameter-name prefix, form), as the callback names them."""
    return [(layer, f"model.{name}", form) for layer, name, form in lm.model.named_qk_forms()]


def named_values(lm: GrowAttentionLM) -> NamedForms:
    """(layer, parameter-name prefix, value map), as the callback names them."""
    return list(lm.growable_values())


def fold(forms: NamedForms, stats: list[growth.Sums], weight: float = 1.0) -> None:
    """What the callback does with the captured pairs after a backward (no GradScaler here)."""
    fold_captured(forms, stats, weight, grad_scale=None)


def set_capture(forms: NamedForms, mode: str | None) -> None:
    for _, _, form in forms:
        form.capture = mode


def auto_capture(inputs: torch.Tensor) -> str:
    """The callback's own capture='auto' choice for these inputs (not a copy of the rule)."""
    return capture_mode("auto", inputs.device)


def median(xs) -> float:
    return float(statistics.median(xs))


def make_trainer(env: Env, callbacks, tmp: str, **kwargs) -> L.Trainer:
    logger = False
    if env.logger == "tensorboard":
        from lightning.pytorch.loggers import TensorBoardLogger

        logger = TensorBoardLogger(tmp, name="bench")
    args = dict(
        accelerator="cpu", devices=1, precision="32-true", logger=logger, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
    )
    return L.Trainer(**{**args, **kwargs})
