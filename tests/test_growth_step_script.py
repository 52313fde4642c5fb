"""studies/growth_step/growth_step.py: its training runs (held-out loss around events, Q/K Adam reset) and their table."""

import json
import os
import subprocess
import sys

import lightning as L

from conftest import REPO
from callback_helpers import recall_data, tiny_module, trainer

from lit_growattn import AtEpochs, GrowAttentionCallback, GrowthSettings, StatisticsSettings, StepSearch

sys.path.insert(0, str(REPO / "studies" / "growth_step"))
import growth_step  # noqa: E402


def test_reset_drops_the_qk_adam_state_at_the_growth_and_keeps_the_rest(tmp_path):
    L.seed_everything(0)
    data = recall_data()
    module = tiny_module(data)
    grow = GrowAttentionCallback(AtEpochs([1]), growth=GrowthSettings(columns=1),
                                 statistics=StatisticsSettings(batches=2), step_search=StepSearch(alphas=[0.0]))
    fit = trainer(tmp_path, [grow, growth_step.ResetQKMoments()], max_epochs=2)
    fit.fit(module, data)
    (optimizer,) = fit.optimizers
    per_epoch = fit.num_training_batches
    steps = {name: int(optimizer.state[p]["step"]) for name, p in module.named_parameters()}
    qk = [n for n in steps if n.endswith((".w_q", ".w_k"))]
    assert len(qk) == 4 and len(steps) > len(qk)  # w_q and w_k of 2 layers, and the rest
    assert all(steps[n] == per_epoch for n in qk)  # restarted at epoch 1
    assert all(s == 2 * per_epoch for n, s in steps.items() if n not in qk)


def test_train_runs_record_event_losses_and_render_the_table(tmp_path):
    out = tmp_path / "runs.jsonl"
    tiny = ["--trainer.max_epochs=3", "--trainer.limit_train_batches=6", "--trainer.limit_val_batches=2",
            "--trainer.callbacks.init_args.statistics.batches=2", "--data.init_args.batch_size=8"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "studies" / "growth_step" / "growth_step.py"), "train", "--text", str(REPO / "README.md"),
         "--runs", "grow natural/append α=0 + Q/K reset", "--seeds", "0", "--out", str(out),
         *[f"--override={o}" for o in tiny]],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    (run,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert [e["alpha"] for e in run["events"]] == [0.0, 0.0] and len(run["val"]) == 3
    before, after = run["event_loss"]["before"], run["event_loss"]["after"]
    assert len(before) == len(after) == 2  # one loss each side of each event
    assert all(abs(a - b) < 1e-4 for a, b in zip(after, before))  # α = 0 and a reset keep the function
    assert "| grow natural/append α=0 + Q/K reset | 1 |" in growth_step.runs_table([run])
