"""Mixed precision end to end from the command line: training under autocast grows, statistics stay in fp32."""

import math

import pytest
import torch

from lit_growattn import growth
from lit_growattn.attention import QKForm
from lit_growattn.commands.cli import main

from conftest import REPO


# On CPU `--trainer.precision=16-mixed` quietly becomes bf16-mixed (Lightning has no fp16 autocast there): fp16
# with its GradScaler takes the plugin.
FP16_CPU = ('--trainer.plugins={"class_path": "lightning.pytorch.plugins.MixedPrecision", '
            '"init_args": {"precision": "16-mixed", "device": "cpu"}}')


@pytest.mark.parametrize("capture", ["extend", "explicit"])
@pytest.mark.parametrize("precision, half", [("--trainer.precision=bf16-mixed", torch.bfloat16), (FP16_CPU, torch.float16)])
def test_mixed_precision_growth_run_keeps_statistics_in_fp32(tmp_path, tiny_cli_args, monkeypatch, precision, half,
                                                             capture):
    attention, sums = [], []
    queries_keys, update = QKForm.queries_keys, growth.FormStats.update

    def spy_queries_keys(self, xa):
        q, k = queries_keys(self, xa)
        attention.append((q.dtype, k.dtype, self.capture if torch.is_grad_enabled() else None))
        return q, k

    monkeypatch.setattr(QKForm, "queries_keys", spy_queries_keys)
    monkeypatch.setattr(growth.FormStats, "update",
                        lambda self, *args: sums.append(self.n_sum.dtype) or update(self, *args))
    cli = main(["--config", str(REPO / "configs/mqar_grow.yaml"), *tiny_cli_args, "--trainer.max_epochs=2",
                precision, "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
                "--trainer.callbacks.init_args.statistics.batches=2", f"--trainer.callbacks.init_args.statistics.capture={capture}",
                "--data.init_args.num_train_examples=256", "--data.init_args.num_val_examples=64"], run=False)
    cli.trainer.fit(cli.model, cli.datamodule)
    assert cli.model.model.head_sizes() == [4, 4]
    # Attention runs in half precision under autocast, statistics steps included; the sums are kept in fp32.
    assert {(half, half)} == {(q, k) for q, k, _ in attention}
    assert capture in {mode for _, _, mode in attention}
    assert sums and set(sums) == {torch.float32}, sums
    assert (cli.trainer.precision_plugin.scaler is not None) == (half == torch.float16)
    # The model's own weights stay fp32 under a mixed precision (only the compute is in half).
    assert all(p.dtype == torch.float32 for p in cli.model.parameters())
    assert math.isfinite(cli.trainer.callback_metrics["val/loss"])


def test_fp16_weights_are_refused_before_training(tmp_path, tiny_cli_args):
    with pytest.raises(ValueError, match="precision='16-true' is not supported.*use '16-mixed'"):
        main(["fit", "--config", str(REPO / "configs/mqar.yaml"), *tiny_cli_args, "--trainer.precision=16-true"])
    assert not list(tmp_path.rglob("*.ckpt"))
