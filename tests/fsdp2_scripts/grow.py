"""One growth run on 2 CPU processes (gloo; 1 for some runs), under FSDP2 (ModelParallelStrategy) or DDP, for tests/test_fsdp2.py.
Lightning's launcher starts this script again for rank 1, so it is a script, not a function of the test.

    python tests/fsdp2_scripts/grow.py {fsdp2|ddp} RUN OUT_DIR [CHECKPOINT]

RUN is one of RUNS below. The run hf_llama grows an HFCausalLM loaded from OUT_DIR/llama, a tiny Llama the test
writes with save_pretrained; the run mixed is at_epochs under FSDP2's mixed precision (fsdp_param_dtype: bfloat16). With CHECKPOINT (e.g.
`step=3.ckpt`) the run resumes from that checkpoint of the same run (or of the run it names as `resumes`) written
before.

Each rank writes OUT_DIR/<strategy>_<run>[_from_<checkpoint>]_<rank>.pt: the event history; the full optimizer state by
parameter name just before and just after the run's first growth; how that state and the parameters are held one
step after it (DTensor, placements, dtypes, FSDP roots) and that step's gradients (type, dtype); the dtypes FSDP2's
collectives sent during the fit; the validation loss after the run and the widths and weight dtypes forward uses
then; the final full parameters. A checkpoint after every step goes to OUT_DIR/<strategy>_<run>_checkpoints (named
`step=N.ckpt`; under FSDP2 a distributed checkpoint, a folder, but for the run hf_llama, which writes single
files). The hparams as training started are recorded too.
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from callback_helpers import recall_data, tiny_module  # noqa: E402
from lit_growattn import (AtEpochs, AutoSchedule, GrowAttentionCallback, GrowthSettings, StatisticsSettings,  # noqa: E402
                          StepSearch)
from lit_growattn.attention.qk import QKForm  # noqa: E402
from lit_growattn.attention.value import ValueMap  # noqa: E402
from lit_growattn.hf.growable import GrowableAttention  # noqa: E402
from lit_growattn.training.fsdp2 import reshard_all  # noqa: E402


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def optimizer_state(trainer, pl_module) -> dict[str, dict[str, torch.Tensor]]:
    (optimizer,) = trainer.optimizers
    reshard_all(pl_module)  # after the validation's forward passes the root holds its parameters unsharded
    return {name: {key: full(value) for key, value in optimizer.state[p].items()}
            for name, p in pl_module.named_parameters() if p in optimizer.state}


def layout(trainer, pl_module) -> dict:
    """How parameters and their Adam moments are held: per parameter name, (is a DTensor, placements, local numel,
    global numel, dtype) of the parameter, whether every moment is a DTensor placed like it, and the moments'
    dtypes; and the FSDP roots."""
    (optimizer,) = trainer.optimizers
    params = {}
    for name, p in pl_module.named_parameters():
        moments = [v for v in optimizer.state[p].values() if torch.is_tensor(v) and v.ndim > 0]
        placed_alike = all(isinstance(v, DTensor) and v.placements == p.placements and v.device_mesh == p.device_mesh
                           for v in moments) if isinstance(p, DTensor) else None
        params[name] = {"dtensor": isinstance(p, DTensor), "placements": str(getattr(p, "placements", None)),
                        "local": p.to_local().numel() if isinstance(p, DTensor) else p.numel(), "numel": p.numel(),
                        "moments_placed_alike": placed_alike, "moments": len(moments), "dtype": p.dtype,
                        "moment_dtypes": {v.dtype for v in moments}}
    roots = [name for name, m in pl_module.named_modules()
             if isinstance(m, FSDPModule) and m._get_fsdp_state()._is_root]
    return {"params": params, "roots": roots}


class Recorder(GrowAttentionCallback):
    """The growth callback, recording the hparams as training starts (after any checkpoint loaded), the optimizer
    state around its first event, and the layout and gradients of the next step."""

    def on_train_start(self, trainer, pl_module):
        super().on_train_start(trainer, pl_module)
        self.started_with = dict(pl_module.hparams)

    def _grow(self, trainer, pl_module, point, batch_idx):
        first = not self.history
        before = optimizer_state(trainer, pl_module) if first else None
        super()._grow(trainer, pl_module, point, batch_idx)
        if first:
            self.before, self.after = before, optimizer_state(trainer, pl_module)
            self.grown_at = trainer.global_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        if getattr(self, "grown_at", None) == trainer.global_step:  # the first step after the growth
            self.gradients = {(type(p.grad).__name__, p.grad.dtype)
                              for p in pl_module.parameters() if p.grad is not None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if getattr(self, "grown_at", None) == trainer.global_step - 1 and not hasattr(self, "layout"):
            self.layout = layout(trainer, pl_module)  # one optimizer step after the growth


def forward_seen(pl_module, inputs) -> dict[str, list]:
    """What a forward pass actually computes with, layer by layer: the query/key and value head sizes (d_head, d_v)
    of the tensors it makes, and the dtypes of the W_Q and W_V it multiplies (w_q, w_v)."""
    seen = {"d_head": [], "d_v": [], "w_q": [], "w_v": []}
    queries_keys, hf_queries_keys, values = QKForm.queries_keys, GrowableAttention.queries_keys, ValueMap.values

    def spy(method):
        def spy_qk(form, *args):
            q, k = method(form, *args)
            seen["d_head"].append(q.shape[-1])
            seen["w_q"].append(form.w_q.dtype)
            return q, k
        return spy_qk

    def spy_v(value_map, x):
        v = values(value_map, x)
        seen["d_v"].append(v.shape[-1])
        seen["w_v"].append(value_map.w_v.dtype)
        return v

    QKForm.queries_keys, GrowableAttention.queries_keys = spy(queries_keys), spy(hf_queries_keys)
    ValueMap.values = spy_v
    try:
        with torch.no_grad():
            pl_module(inputs)
    finally:
        QKForm.queries_keys, GrowableAttention.queries_keys, ValueMap.values = queries_keys, hf_queries_keys, values
    return seen


def spy_collectives() -> dict[str, set[torch.dtype]]:
    """The dtypes of the tensors FSDP2's all-gathers (the parameters) and reduce-scatters (the gradients) send from
    now on, by collective; FSDP2 sends them through torch.distributed's all_gather_single and
    reduce_scatter_single."""
    sent = {"all_gather_single": set(), "reduce_scatter_single": set()}

    def spy(name):
        collective = getattr(dist, name)

        def send(output, input, *args, **kwargs):
            sent[name].add(input.dtype)
            return collective(output, input, *args, **kwargs)
        setattr(dist, name, send)

    for name in sent:
        spy(name)
    return sent


def hf_llama(data, out: str):
    from lit_growattn.hf import HFCausalLM

    return HFCausalLM(pretrained=os.path.join(out, "llama"), vocab_size=data.vocab_size, block_size=data.max_seq_len,
                      warmup_steps=0, lr_schedule="cosine")


# Events at epochs 1 and 2 (steps 2 and 4), each growing one layer (layer 0, then 1; the other stays sharded while
# the event rates its candidates) on both sides by 2 columns, then 2 more steps.
AT_EPOCHS = dict(batch_size=4, examples=16, max_epochs=3, callback=lambda: dict(
    schedule=AtEpochs([1, 2]), growth=GrowthSettings(grow="both", columns=2, value_columns=2),
    statistics=StatisticsSettings(batches=2, layers_per_event=1)))

KEPT_ONE = dict(batch_size=8, examples=48, max_epochs=2, module=lambda data, out: tiny_module(data, dropout=0.0),
                callback=lambda: dict(schedule=AtEpochs([1]), growth=GrowthSettings(columns=2),
                                      statistics=StatisticsSettings(batches=3),
                                      step_search=StepSearch(batches=1, alphas=[0.0, 1.0])))

# The runs, by name: the data (2 ranks, so a rank's epoch holds examples / batch_size / 2 batches), the module (of
# the data and OUT_DIR), the epochs, the micro-batches per optimizer step and the growth callback's arguments.
RUNS = {
    # The growths of AT_EPOCHS from sketched statistics, gathered over 2 micro-batches per optimizer step (twice the
    # examples: still 2 steps an epoch).
    "at_epochs": dict(AT_EPOCHS, examples=32, accumulate=2, module=lambda data, out: tiny_module(data, dropout=0.0),
                      callback=lambda: dict(AT_EPOCHS["callback"](), statistics=StatisticsSettings(
                          batches=4, layers_per_event=1, sketch="on", sketch_size=4))),
    # The growths of AT_EPOCHS of a Hugging Face Llama with GQA (4 query heads, 2 key/value heads) and RoPE.
    # Its checkpoints are single files (`save_distributed_checkpoint=False`), which load another way: parameter by
    # parameter, never through the load_state_dict of an HFCausalLM, which holds no parameter of its own.
    "hf_llama": dict(AT_EPOCHS, module=hf_llama, single_file_checkpoints=True),
    # The growths of AT_EPOCHS computing in bfloat16 (the weights all-gathered in it), gradients reduced in float32.
    "mixed": dict(AT_EPOCHS, module=lambda data, out: tiny_module(data, dropout=0.0, fsdp_param_dtype="bfloat16")),
    # One rank closes its window before epoch 1's growth keeping one batch to rate on (6 batches an epoch, a
    # checkpoint after each step); kept_one_on_two resumes its step=6.ckpt on 2 ranks, of which one keeps none.
    "kept_one": dict(KEPT_ONE, devices=1),
    "kept_one_on_two": dict(KEPT_ONE, resumes="kept_one"),
    # A check every 4 of 16 steps, both sides growing from 2 within a cache budget of mean head size 4 (as
    # tests/test_callback_ddp.py's run under DDP).
    "auto": dict(batch_size=32, examples=512, module=lambda data, out: tiny_module(data, dropout=0.0, d_v=2),
                 max_epochs=2, callback=lambda: dict(
        schedule=AutoSchedule(budget=4, check_every=4, spend_until=1.0), growth=GrowthSettings(grow="both"),
        statistics=StatisticsSettings(batches=4))),
}


def main(kind: str, run: str, out: str, checkpoint: str | None = None) -> None:
    name = f"{kind}_{run}"
    settings = RUNS[run]
    L.seed_everything(0)
    data = recall_data(batch_size=settings["batch_size"], examples=settings["examples"])
    module = settings["module"](data, out)
    grow = Recorder(**settings["callback"]())
    devices = settings.get("devices", 2)
    strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1, save_distributed_checkpoint=not
                                     settings.get("single_file_checkpoints", False)) if kind == "fsdp2" else "ddp"
    checkpoints = os.path.join(out, f"{name}_checkpoints")
    resumed = None if checkpoint is None else os.path.join(out, f"{kind}_{settings.get('resumes', run)}_checkpoints",
                                                           checkpoint)
    if resumed is not None:
        name, checkpoints = f"{name}_from_{checkpoint}", os.path.join(out, f"{name}_from_{checkpoint}_checkpoints")
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision="32-true",
                        max_epochs=settings["max_epochs"], accumulate_grad_batches=settings.get("accumulate", 1),
                        logger=False,
                        callbacks=[grow, ModelCheckpoint(checkpoints, filename="{step}", save_top_k=-1,
                                                         every_n_train_steps=1)],
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        limit_val_batches=1, deterministic=True)
    collectives = spy_collectives()
    trainer.fit(module, data, ckpt_path=resumed)
    # Lightning calls configure_model again: the module is already sharded.
    (validated,) = trainer.validate(module, datamodule=data, verbose=False)
    inputs, _ = next(iter(data.train_dataloader()))
    seen = forward_seen(module, inputs)
    result = {
        "history": [{k: v for k, v in e.items() if k not in ("seconds", "timings")} for e in grow.history],
        "before": getattr(grow, "before", None), "after": getattr(grow, "after", None),
        "layout": getattr(grow, "layout", None), "val_loss": validated["val/loss"],
        "started_with": grow.started_with,
        "sizes": {"d_head": module.head_sizes(), "d_v": module.value_sizes()},
        "forward_widths": {side: seen[side] for side in ("d_head", "d_v")},
        "forward_dtypes": {weight: seen[weight] for weight in ("w_q", "w_v")},
        "gradients": getattr(grow, "gradients", None), "collectives": collectives,
        "params": {name: full(p) for name, p in module.named_parameters()},
    }
    torch.save(result, os.path.join(out, f"{name}_{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:])
