"""Growth under FSDP2 (Lightning's ModelParallelStrategy) on 2 CPU processes with gloo, against the same run under DDP;
and the strategies, modules and callbacks refused at setup.

The runs are scripts (tests/fsdp2_scripts/grow.py), since Lightning's launcher starts the script again for rank 1;
one FSDP2 run and one DDP run serve most tests below (about 15 s each), an AutoSchedule run under FSDP2 one, and
the FSDP2 run under the mixed-precision policy (bfloat16 compute, float32 reduce) the tests of that policy. Gloo
all-gathers and reduce-scatters bfloat16 tensors on CPU, so the policy runs on 2 processes as it would on GPUs."""

import math
import sys
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import EMAWeightAveraging
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from lit_growattn import AtEpochs, GrowAttentionCallback, GrowAttentionLM
from lit_growattn.analysis import AttentionAnalysisCallback
from lit_growattn.callback.checks import check_model_parallel, check_strategy
from lit_growattn.growth import loss_rounding
from lit_growattn.training.checkpoint import read_checkpoint
from lit_growattn.training.fsdp2 import (GatheredBlocks, check_sharded_by_blocks, is_sharded, mixed_precision_policy,
                                         plain_copy, shard_model)
from lit_growattn.training.optimization import default_optimizer

from callback_helpers import recall_data, tiny_module
from hf_helpers import saved_tiny_model, tiny_config
from conftest import REPO, launch, needs_transformers, run_command

SCRIPT = REPO / "tests" / "fsdp2_scripts" / "grow.py"
EPS = torch.finfo(torch.float32).eps  # the runs train in 32-true: ModelParallelStrategy refuses 64-true
STEPS = 6  # optimizer steps of a run: 3 epochs of 2 (grow.py)
GROWTH_AMPLIFICATION = 8  # how much a growth may widen a round-off difference between two runs (see below)
TOKENS = 16 * 8  # the kept batches the step size is rated on: the window's 16 sequences of 8 tokens
# What the first event grows (layer 0, both sides): name → the dim it grows along.
GROWN = {"model.blocks.0.attn.qk.w_q": -1, "model.blocks.0.attn.qk.w_k": -1, "model.blocks.0.attn.value.w_v": -1,
         "model.blocks.0.attn.value.w_o": 1}


class FakeMesh:
    """What the checks read of ModelParallelStrategy's device mesh: its size and its named dimensions' sizes."""

    def __init__(self, data_parallel: int, tensor_parallel: int):
        self.sizes = {"data_parallel": data_parallel, "tensor_parallel": tensor_parallel}

    def size(self) -> int:
        return math.prod(self.sizes.values())

    def __getitem__(self, name: str) -> SimpleNamespace:
        return SimpleNamespace(size=lambda: self.sizes[name])


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp2")


def run(out, kind: str, name: str, checkpoint: str | None = None, ranks: int = 2) -> list[dict]:
    """What grow.py records on each of `ranks` ranks for the run `name` under `kind` (fsdp2 or ddp), resumed from
    `checkpoint` (e.g. "step=3.ckpt") if given."""
    resumed = [] if checkpoint is None else [checkpoint]
    done = launch([sys.executable, SCRIPT, kind, name, out, *resumed], cwd=out)
    assert done.returncode == 0, done.stderr[-4000:]
    name = name if checkpoint is None else f"{name}_from_{checkpoint}"
    return [torch.load(out / f"{kind}_{name}_{rank}.pt", weights_only=False) for rank in range(ranks)]


@pytest.fixture(scope="module")
def runs(out):
    """{"fsdp2": [rank 0, rank 1], "ddp": [...]}: the same two growths, of one layer each, under each."""
    return {kind: run(out, kind, "at_epochs") for kind in ("fsdp2", "ddp")}


@pytest.fixture(scope="module")
def hf_runs(out):
    """As `runs`, for an HFCausalLM loaded from a tiny random Llama written with save_pretrained."""
    needs_transformers()
    saved_tiny_model("llama", out / "llama")
    return {kind: run(out, kind, "hf_llama") for kind in ("fsdp2", "ddp")}


def events(record: dict) -> list[dict]:
    return [{key: event[key] for key in ("event", "skipped", "d_head", "d_v", "alpha", "loss_before", "loss_after",
                                         "predicted_decrease", "discarded_energy")} for event in record["history"]]


def test_fsdp2_grows_the_same_columns_as_ddp(runs):
    """Two events, each rebuilding one block while the other stays sharded, from sketched statistics gathered over 2
    micro-batches per optimizer step (the Hugging Face run below: full statistics, one micro-batch). Fails if the
    candidates' rating does not see them (every α rates as the current loss, so α = 0 is taken at the first event),
    if the growth is set on sharded blocks (silently ignored: the next steps train the old widths and the weights
    part), if Adam's state is not carried as DDP carries it, or if the sums are reduced otherwise than under DDP."""
    assert [e["sketch"] for e in runs["fsdp2"][0]["history"]] == [{"k": 4, "l": 6, "k_c": 4}] * 2
    assert_grows_as_ddp(runs, [([4, 2], [10, 8]), ([4, 4], [10, 10])])


def test_a_hugging_face_llama_grows_under_fsdp2_as_under_ddp(hf_runs):
    """HFCausalLM's decoder layers are the blocks (`blocks`), rebuilt with the growable attention's surgery
    (`build_block`): a Llama with GQA (two query heads per key/value head, so a rank holds one key head) and RoPE
    grows the same NoPE columns as under DDP, and forward computes with them."""
    assert_grows_as_ddp(hf_runs, [([10, 8], [10, 8]), ([10, 10], [10, 10])])
    for record in hf_runs["fsdp2"]:
        assert record["forward_widths"] == {"d_head": [10, 10], "d_v": [10, 10]} == record["sizes"]


def assert_grows_as_ddp(runs: dict[str, list[dict]], sizes: list[tuple[list[int], list[int]]]) -> None:
    """The FSDP2 run grew alike on every rank, to `sizes` ((d_head, d_v) per event), with DDP's decisions and
    losses, and ended with DDP's weights."""
    fsdp2, ddp = (events(runs[kind][0]) for kind in ("fsdp2", "ddp"))
    assert events(runs["fsdp2"][1]) == fsdp2  # every rank grew alike
    assert [(e["d_head"], e["d_v"]) for e in fsdp2] == sizes
    assert fsdp2[0]["alpha"] > 0
    for got, want in zip(fsdp2, ddp, strict=True):
        assert {k: got[k] for k in ("event", "skipped", "d_head", "d_v", "alpha")} == {
            k: want[k] for k in ("event", "skipped", "d_head", "d_v", "alpha")}
        rounding = loss_rounding(want["loss_before"], torch.float32, TOKENS)
        for key in ("loss_before", "loss_after"):
            assert got[key] == pytest.approx(want[key], abs=rounding)
        # The growth's float64 maths on float32 weights and sums that agree to an ulp or so.
        assert got["predicted_decrease"] == pytest.approx(want["predicted_decrease"], rel=16 * EPS)
        assert got["discarded_energy"] == pytest.approx(want["discarded_energy"], rel=16 * EPS, abs=16 * EPS)
    rounding = loss_rounding(fsdp2[0]["loss_before"], torch.float32, TOKENS)
    assert fsdp2[0]["loss_after"] < fsdp2[0]["loss_before"] - rounding  # the rated candidate changed the loss
    # Both runs take the same micro-batches on the same ranks, yet their weights may part by round-off: where it comes
    # from is not pinned down (not Adam's foreach kernel: it shows with foreach=False too). Each step may then move a
    # weight by an ulp or so of its magnitude; a growth amplifies what differs (it solves for the new columns from
    # the statistics), without changing its decisions: in a 12-step variant of this run the weights differed by
    # 1.2e-7 before the first growth and 4.2e-6 after the second. Hence |w|·ε per step and a factor of 8 per growth
    # (about 4 measured). This stays far below one Adam step (lr), by which a growth the forward did not see, or
    # state carried wrongly, would move them. (Without biases: a key bias's gradient is zero but for round-off, which
    # Adam's normalisation turns into steps of size lr whatever the strategy; measured 1e-5 after two steps.)
    lr = default_optimizer([torch.zeros(1, requires_grad=True)]).defaults["lr"]
    growths = len(fsdp2)
    for rank in (0, 1):
        got, want = runs["fsdp2"][rank]["params"], runs["ddp"][rank]["params"]
        assert got.keys() == want.keys()
        for name in want:
            tolerance = want[name].abs().max().item() * EPS * STEPS * GROWTH_AMPLIFICATION**growths
            assert tolerance < lr / 10
            torch.testing.assert_close(got[name], want[name], atol=tolerance, rtol=0, msg=lambda m: f"{name}: {m}")
    assert runs["fsdp2"][0]["val_loss"] == pytest.approx(runs["ddp"][0]["val_loss"], rel=16 * EPS)


def test_forward_computes_with_the_grown_widths(runs):
    """The widths read off the query and value tensors inside a forward pass after the run (validation already ran
    again through configure_model), not the parameters' shapes: a growth set on a sharded block leaves its shapes
    grown until the next unshard, while forward runs the old widths."""
    for record in runs["fsdp2"]:
        assert record["forward_widths"] == {"d_head": [4, 4], "d_v": [10, 10]} == record["sizes"]


def test_adam_state_is_carried_as_dtensors_placed_like_the_parameters(runs):
    """After the first growth every moment is a DTensor with its parameter's mesh and placements, each rank holding its
    shard; the old slice of a grown tensor's moments is the state before the growth, the new slice empty (first
    moments) or the old slice's mean (second moments, new_second_moment: mean), as under DDP."""
    for record in runs["fsdp2"]:
        for name, held in record["layout"]["params"].items():
            assert held["dtensor"] and held["moments_placed_alike"] and held["moments"] == 2, name
            assert held["local"] <= math.ceil(held["numel"] / 2), name
        before, after = record["before"], record["after"]
        assert after.keys() == before.keys()
        for name, dim in GROWN.items():
            for key in ("exp_avg", "exp_avg_sq"):
                old, new = before[name][key], after[name][key]
                kept = new.narrow(dim, 0, old.shape[dim])
                added = new.narrow(dim, old.shape[dim], new.shape[dim] - old.shape[dim])
                assert torch.equal(kept, old), (name, key)
                fill = old.mean() if key == "exp_avg_sq" else torch.zeros(())
                assert torch.equal(added, fill.expand_as(added)), (name, key)
        for name in after:
            for key, value in after[name].items():
                want = runs["ddp"][0]["after"][name][key]
                # Two steps of moments before the growth, from runs that may part by round-off (see the test above).
                torch.testing.assert_close(value, want, atol=16 * EPS * want.abs().max().item(), rtol=0,
                                           msg=lambda m: f"{name} {key}: {m}")


def test_one_fsdp_root_after_growth(runs):
    """The rebuilt blocks joined the root's lazy initialisation again (`fsdp2.relazy`, private API of torch): without
    it each would be a root of its own, which keeps its parameters unsharded after forward."""
    for record in runs["fsdp2"]:
        assert record["layout"]["roots"] == [""]


def test_a_distributed_checkpoint_after_growth_holds_the_grown_shapes(runs, out):
    """Writing one runs the divergence guard on the sharded weights (each rank checks its shards, the ranks agree)."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = out / "fsdp2_at_epochs_checkpoints" / "step=6.ckpt"  # the last step's
    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    final = runs["fsdp2"][0]["params"]  # both layers grown by the run's end
    assert final["model.blocks.1.attn.qk.w_q"].shape[-1] == 4
    for name, param in final.items():
        assert tuple(saved[f"state_dict.{name}"].size) == tuple(param.shape), name


def assert_resumed_bit_equal(resumed: list[dict], uninterrupted: list[dict]) -> None:
    for got, want in zip(resumed, uninterrupted, strict=True):
        assert got["history"] == want["history"]
        assert got["sizes"] == want["sizes"] == got["forward_widths"]
        assert got["params"].keys() == want["params"].keys()
        for name, value in want["params"].items():
            assert torch.equal(got["params"][name], value), name
        assert got["val_loss"] == want["val_loss"]


def test_a_distributed_checkpoint_resumes_bit_equal_after_a_growth_inside_a_window(runs, out):
    """Step 3: layer 0 grew at step 2, and each rank holds its own partial sums of the window of the growth at step 4.
    The module is built and sharded at the sizes of its hparams, then its blocks take the checkpoint's before Lightning
    loads it (torch's "Size mismatch" otherwise); the window resumes per rank, and the run ends as the uninterrupted
    one did, bit for bit. The hparams describe the checkpoint's sizes from the start."""
    resumed = run(out, "fsdp2", "at_epochs", "step=3.ckpt")
    assert_resumed_bit_equal(resumed, runs["fsdp2"])
    for record in resumed:
        assert {key: record["started_with"][key] for key in ("d_head", "d_v")} == {"d_head": [4, 2], "d_v": [10, 8]}


def test_a_hugging_face_llama_resumes_bit_equal_from_a_single_file_under_fsdp2(hf_runs, out):
    """`save_distributed_checkpoint=False`: one file, which Lightning loads parameter by parameter (its shapes read
    from the file mapped into memory), never through the load_state_dict of an HFCausalLM, which holds no parameter
    of its own: the hparams must still describe the checkpoint's sizes, not those the model was built with. The
    decoder layers take those sizes as the project's GPT blocks do (rebuilt by `build_block` with the surgery and
    the rotary columns they keep)."""
    assert (out / "fsdp2_hf_llama_checkpoints" / "step=3.ckpt").is_file()
    resumed = run(out, "fsdp2", "hf_llama", "step=3.ckpt")
    assert_resumed_bit_equal(resumed, hf_runs["fsdp2"])
    for record in resumed:
        assert {key: record["started_with"][key] for key in ("head_sizes", "v_head_sizes")} == {
            "head_sizes": [10, 8], "v_head_sizes": [10, 8]}


def test_mixed_precision_resumes_bit_equal(mixed, out):
    """The blocks rebuilt at the checkpoint's sizes are sharded with the policy, as a growth's are."""
    assert_resumed_bit_equal(run(out, "fsdp2", "mixed", "step=3.ckpt"), mixed)


def test_a_window_resumed_on_more_ranks_than_kept_batches_rates_in_lockstep_under_fsdp2(out):
    """One rank closed the window keeping one batch; resumed on 2 ranks, rank 1 has none to rate on, but every
    forward under FSDP2 is a collective: it runs as many (uncounted) as rank 0 instead of leaving rank 0 waiting for
    ever, and both rate the candidates as the uninterrupted run did."""
    (uninterrupted,) = run(out, "fsdp2", "kept_one", ranks=1)
    resumed = run(out, "fsdp2", "kept_one_on_two", "step=6.ckpt")
    want = uninterrupted["history"][0]
    for record in resumed:
        (got,) = record["history"]
        assert got["event"] == want["event"] == "epoch 1" and got["alpha"] == want["alpha"]
        assert got["loss_before"] == pytest.approx(want["loss_before"], abs=loss_rounding(want["loss_before"],
                                                                                           torch.float32, 8 * 8))
        assert got["d_head"] == want["d_head"] == [4, 4]


@pytest.fixture(scope="module")
def auto_runs(out):
    return run(out, "fsdp2", "auto")


def test_auto_schedule_decides_the_same_on_every_rank_under_fsdp2(auto_runs):
    """Its decisions are rank 0's, broadcast; the blocks it grows are rebuilt alike on every rank."""
    first, second = auto_runs
    assert first["history"] == second["history"] and [e["step"] for e in first["history"]] == [4, 8, 12]
    assert {d["side"] for e in first["history"] for d in e["decisions"]} == {"d_head", "d_v"}
    for record in (first, second):
        sizes = record["sizes"]
        assert record["forward_widths"] == sizes and sizes == {k: first["history"][-1][k] for k in ("d_head", "d_v")}
    grown = sizes["d_head"] + sizes["d_v"]  # every layer has as many key heads as value heads
    assert max(grown) > 2 and sum(grown) <= 4 * len(grown)  # it grew, within a mean head size of 4
    assert all(torch.equal(first["params"][k], second["params"][k]) for k in first["params"])


def test_auto_schedule_resumes_bit_equal_inside_a_window(auto_runs, out):
    """Step 6: one check done, inside the window of the check at step 8; the hparams of the resumed run's checkpoints
    record the checkpoint's sizes, not those the module was built with."""
    resumed = run(out, "fsdp2", "auto", "step=6.ckpt")
    assert_resumed_bit_equal(resumed, auto_runs)
    # The resumed run's first checkpoint, before its next check: the sizes the growth at step 4 left.
    first = read_checkpoint(out / "fsdp2_auto_from_step=6.ckpt_checkpoints" / "step=7.ckpt")
    grown = auto_runs[0]["history"][0]
    assert grown["step"] == 4 and grown["d_v"] != [2, 2]
    for key in ("d_head", "d_v"):  # one value stands for every layer
        recorded = first["hyper_parameters"][key]
        assert (recorded if isinstance(recorded, list) else [recorded] * len(grown[key])) == grown[key], key


@pytest.fixture(scope="module")
def mixed(out):
    """The FSDP2 run of `runs` under `fsdp_param_dtype: bfloat16`, both ranks."""
    return run(out, "fsdp2", "mixed")


def test_mixed_precision_computes_in_bfloat16_and_reduces_gradients_in_float32(mixed):
    """After both growths, forward multiplies bfloat16 W_Q and W_V in every layer: each grown block was sharded
    again with the policy (without it, its float32 weights would meet the bfloat16 activations and forward would
    fail). FSDP2 all-gathered the parameters in bfloat16 and reduce-scattered the gradients in float32, which the
    float32 DTensor gradients alone would not show: FSDP2 casts a reduced gradient to its parameter's dtype either
    way."""
    for record in mixed:
        assert record["forward_dtypes"] == {"w_q": [torch.bfloat16] * 2, "w_v": [torch.bfloat16] * 2}
        assert record["collectives"] == {"all_gather_single": {torch.bfloat16},
                                         "reduce_scatter_single": {torch.float32}}
        assert record["gradients"] == {("DTensor", torch.float32)}


def test_mixed_precision_keeps_float32_weights_and_adam_state_through_growth(mixed):
    """One step after the first growth every parameter and every Adam moment is a float32 DTensor (the gathered
    blocks were float32 master copies, grown and sharded as such), still one FSDP root."""
    for record in mixed:
        for name, held in record["layout"]["params"].items():
            assert held["dtensor"] and held["moments_placed_alike"] and held["moments"] == 2, name
            assert held["dtype"] == torch.float32 and held["moment_dtypes"] == {torch.float32}, name
        assert record["layout"]["roots"] == [""]


def test_mixed_precision_grows_the_scheduled_columns_as_in_float32(mixed, runs):
    """The events grow what the schedule says (2 columns a side, one layer each) on every rank, as the float32 run
    does, and forward computes with the grown widths. α is not compared: it is the loss comparison of candidates
    evaluated in bfloat16, whose round-off (2⁻⁸ relative) may order nearby candidates otherwise than float32 does."""
    sizes = [(e["event"], e["skipped"], e["d_head"], e["d_v"]) for e in events(mixed[0])]
    assert sizes == [(e["event"], e["skipped"], e["d_head"], e["d_v"]) for e in events(runs["fsdp2"][0])]
    assert events(mixed[1]) == events(mixed[0])
    for record in mixed:
        assert record["forward_widths"] == {"d_head": [4, 4], "d_v": [10, 10]} == record["sizes"]
        assert math.isfinite(record["val_loss"])


def model_parallel(data_parallel: int, tensor_parallel: int) -> ModelParallelStrategy:
    strategy = ModelParallelStrategy(data_parallel_size=data_parallel, tensor_parallel_size=tensor_parallel)
    strategy._device_mesh = FakeMesh(data_parallel, tensor_parallel)  # as its setup_environment leaves it
    return strategy


def fake_trainer(callbacks=()) -> SimpleNamespace:
    """What check_model_parallel reads of a trainer under ModelParallelStrategy(data_parallel_size=2), outside a fit
    (so resuming from nothing)."""
    return SimpleNamespace(strategy=model_parallel(2, 1), callbacks=list(callbacks))


@pytest.fixture
def one_rank_mesh():
    """A process group of this process alone (gloo) and its mesh: FSDP2 shards in-process, each shard whole."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_a_block_gathered_under_mixed_precision_holds_the_float32_master_weights(one_rank_mesh):
    """The growth reads and installs float32 tensors: the gathered copy holds the sharded float32 weights bit for
    bit, not their bfloat16 all-gather."""
    module = tiny_module(recall_data(), fsdp_param_dtype="bfloat16")
    want = {name: t.clone() for name, t in module.blocks()[0].state_dict().items()}
    shard_model(module, one_rank_mesh)
    got = plain_copy(module, 0).state_dict()
    assert all(got[name].dtype == torch.float32 and torch.equal(got[name], want[name]) for name in want)


def test_the_mixed_precision_policy_computes_in_bfloat16_and_reduces_in_float32():
    assert mixed_precision_policy("bfloat16") == MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                      reduce_dtype=torch.float32)
    assert mixed_precision_policy(None) == MixedPrecisionPolicy()


def test_an_unknown_fsdp_param_dtype_is_refused():
    with pytest.raises(ValueError, match=r"fsdp_param_dtype must be null \(no policy: compute in the weights' dtype\) "
                                         r"or one of 'bfloat16'; got 'bf16'"):
        tiny_module(recall_data(), fsdp_param_dtype="bf16")


def test_fsdp_param_dtype_is_refused_at_setup_without_model_parallel(tmp_path):
    """A single device (or DDP): no FSDP2 to apply the policy; the message names the strategy and autocast."""
    data = recall_data()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"fsdp_param_dtype='bfloat16' is FSDP2's mixed precision, which only "
                                         r"ModelParallelStrategy applies: train with strategy=ModelParallelStrategy\("
                                         r".*or set fsdp_param_dtype to null and precision='bf16-mixed'"):
        trainer.fit(tiny_module(data, fsdp_param_dtype="bfloat16"), data)


def test_fsdp_param_dtype_is_refused_with_low_precision_weights():
    module = tiny_module(recall_data(), fsdp_param_dtype="bfloat16")
    module._device_mesh = FakeMesh(2, 1)  # as ModelParallelStrategy's setup_environment leaves it
    module._trainer = SimpleNamespace(precision="bf16-true")
    with pytest.raises(ValueError, match="keeps the sharded weights and the optimizer state in float32, but "
                                         "precision='bf16-true' stores them in low precision: set precision='32-true'"):
        module.setup("fit")


@pytest.mark.parametrize("strategy", [FSDPStrategy, DeepSpeedStrategy])
def test_other_sharding_strategies_are_refused_naming_model_parallel(strategy):
    fake = SimpleNamespace(strategy=strategy.__new__(strategy), global_rank=0, world_size=1)
    with pytest.raises(RuntimeError, match=rf"cannot grow under {strategy.__name__}: .*Use strategy=ModelParallel"
                                           r"Strategy\(data_parallel_size=N, tensor_parallel_size=1\)"):
        GrowAttentionCallback(AtEpochs([1])).setup(fake, None, "fit")


def test_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 would split attention heads across ranks; set "
                                         "tensor_parallel_size=1 and data_parallel_size=4"):
        check_strategy(model_parallel(2, 2))
    check_strategy(model_parallel(2, 1))


@pytest.mark.parametrize("setting, mesh, callbacks, refusal", [
    ({}, FakeMesh(1, 2), [], "tensor_parallel_size=2 would split attention heads"),
    ({"compile": True}, FakeMesh(2, 1), [], "compile: true does not run under ModelParallelStrategy yet"),
    # A weight-averaging callback listed before the growth callback calls configure_model from its own setup.
    ({}, FakeMesh(2, 1), [EMAWeightAveraging()], "EMAWeightAveraging cannot be combined with growth under "
                                                 "ModelParallelStrategy yet"),
])
def test_configure_model_refuses_what_growth_under_fsdp2_cannot_follow(setting, mesh, callbacks, refusal):
    module = tiny_module(recall_data(), **setting)
    module._device_mesh = mesh  # as ModelParallelStrategy's setup_environment leaves it
    module._trainer = SimpleNamespace(callbacks=callbacks)
    with pytest.raises(ValueError, match=refusal):
        module.configure_model()


def test_a_module_without_blocks_is_refused_under_model_parallel_naming_ddp():
    """A growth under FSDP2 rebuilds the blocks it widens: a module without them is refused, naming what it lacks."""
    with pytest.raises(TypeError, match=r"LightningModule cannot grow under ModelParallelStrategy \(FSDP2\): it lacks "
                                        r"blocks, build_block, fsdp_policy \(lit_growattn.contract.ShardableModule\).*"
                                        r"strategy='ddp'"):
        check_model_parallel(fake_trainer(), L.LightningModule())


def test_a_hugging_face_module_is_accepted_under_model_parallel():
    needs_transformers()
    from lit_growattn.hf.module import HFCausalLM

    module = HFCausalLM(config=tiny_config("llama").to_dict())
    check_model_parallel(fake_trainer(), module)
    assert module.blocks() is module.model.model.layers


@pytest.mark.parametrize("callback, refusal", [
    (EMAWeightAveraging(), "EMAWeightAveraging cannot be combined with growth under ModelParallelStrategy yet.*Use "
                           "strategy='ddp' with EMAWeightAveraging"),
    (AttentionAnalysisCallback(), "AttentionAnalysisCallback does not run under ModelParallelStrategy yet.*Remove it "
                                  "from the callbacks, or use strategy='ddp'"),
])
def test_callbacks_that_do_not_follow_a_sharded_module_are_refused(callback, refusal):
    with pytest.raises(ValueError, match=refusal):
        check_model_parallel(fake_trainer([callback]), tiny_module(recall_data()))
    check_model_parallel(fake_trainer(), tiny_module(recall_data()))


def test_a_configure_model_of_ones_own_is_refused():
    class ShardsItsOwnWay(GrowAttentionLM):
        def configure_model(self):
            pass

    data = recall_data()
    module = ShardsItsOwnWay(vocab_size=data.vocab_size, block_size=data.max_seq_len, n_layer=2, n_head=2, n_embd=16,
                             d_head=2, d_v=8)
    with pytest.raises(ValueError, match="ShardsItsOwnWay overrides configure_model: under ModelParallelStrategy a "
                                         "growth re-shards the blocks it grows the project's way.*a custom "
                                         "configure_model is not supported yet"):
        check_model_parallel(fake_trainer(), module)


def test_growth_needs_the_module_and_every_block_sharded(one_rank_mesh):
    """At fit start, after configure_model: a growth re-shards the blocks it grows one group each."""
    module = tiny_module(recall_data())
    with pytest.raises(ValueError, match="the module itself is not sharded: let configure_model shard the module"):
        check_sharded_by_blocks(module)
    fully_shard(module.blocks()[0], mesh=one_rank_mesh)
    fully_shard(module, mesh=one_rank_mesh)
    with pytest.raises(ValueError, match=r"but blocks \[1\] are not sharded"):
        check_sharded_by_blocks(module)
    sharded = tiny_module(recall_data())
    shard_model(sharded, one_rank_mesh)
    check_sharded_by_blocks(sharded)


def test_a_failed_event_leaves_the_sharded_blocks_in_place(one_rank_mesh, monkeypatch):
    """An error inside the event, or in gathering a later block (out of memory), puts back the very block objects
    the optimizer's parameters belong to; and the grown copies cannot be sharded twice."""
    module = tiny_module(recall_data())
    shard_model(module, one_rank_mesh)
    sharded = list(module.blocks())

    def in_place() -> bool:
        return all(now is before for now, before in zip(module.blocks(), sharded, strict=True))

    with pytest.raises(ArithmeticError, match="the event failed"):
        with GatheredBlocks(module, [0, 1]):
            assert not any(map(is_sharded, module.blocks()))
            raise ArithmeticError("the event failed")
    assert in_place()

    build = module.build_block

    def out_of_memory_at_layer_1(layer):
        if layer == 1:
            raise MemoryError("out of memory")
        return build(layer)

    monkeypatch.setattr(module, "build_block", out_of_memory_at_layer_1)
    with pytest.raises(MemoryError):
        with GatheredBlocks(module, [0, 1]):
            pass
    assert in_place()

    with GatheredBlocks(module, [0]) as gathered:
        gathered.reshard()
        with pytest.raises(RuntimeError, match="reshard ran twice"):
            gathered.reshard()
    assert module.blocks()[0] is not sharded[0] and is_sharded(module.blocks()[0]) and module.blocks()[1] is sharded[1]


@pytest.mark.parametrize("model_type, sizes", [
    ("llama", dict(rotary_dim=4, head_sizes=[10, 12], v_head_sizes=[8, 11])),  # fewer rotary columns, grown widths
    ("gpt2", dict(head_sizes=[9, 10])),  # no RoPE; its decoder layers are transformer.h
    ("qwen2", dict(head_sizes=[10, 12])),  # query/key/value biases
    ("qwen3", dict(head_sizes=[10, 12], v_head_sizes=[8, 11])),  # q/k norms
    ("mistral", dict(head_sizes=[10, 12])),  # sliding-window attention
])
def test_a_gathered_hugging_face_layer_is_the_layer(one_rank_mesh, model_type, sizes):
    """`build_block` on meta, resized and loaded by `plain_copy`: the same tensors, and the rotary columns the layer
    keeps (which its state does not say), so that the copy computes what the sharded layer does."""
    needs_transformers()
    from lit_growattn.hf.growable import named_growables
    from lit_growattn.hf.module import HFCausalLM

    module = HFCausalLM(config=tiny_config(model_type).to_dict(), **sizes)
    layer = module.blocks()[1]
    cls = type(layer)
    want = {name: t.clone() for name, t in layer.state_dict().items()}
    ((_, kept),) = named_growables(layer)
    shard_model(module, one_rank_mesh)
    copy = plain_copy(module, 1)
    got = copy.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want)
    ((_, attention),) = named_growables(copy)
    assert (attention.rotary, attention.d_head, attention.value.d_v) == (kept.rotary, kept.d_head, kept.value.d_v)
    assert type(copy) is cls and not is_sharded(copy)  # not the subclass fully_shard gave the sharded layer


def test_a_fit_from_the_command_line_under_model_parallel_prints_no_library_notice(tmp_path):
    """One process, a mesh of one: the shipped config grows under ModelParallelStrategy from the command line, and
    the rewrite of `last.ckpt` (a distributed checkpoint folder) at every save leaves no torch notice in the output."""
    strategy = ('{"class_path": "lightning.pytorch.strategies.ModelParallelStrategy", '
                '"init_args": {"data_parallel_size": 1, "tensor_parallel_size": 1}}')
    done = run_command("fit", "--config", REPO / "configs/mqar_grow.yaml", f"--trainer.strategy={strategy}",
                       "--trainer.devices=1", "--trainer.max_epochs=3", "--trainer.limit_train_batches=4",
                       "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
                       "--trainer.callbacks.init_args.schedule.init_args.epochs=[1]",
                       "--trainer.callbacks.init_args.statistics.batches=2",
                       f"--trainer.logger.init_args.save_dir={tmp_path}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "growth at step 4 (epoch 1): d_head 2→4 per layer" in done.stdout
    assert len(list(tmp_path.rglob("last.ckpt/.metadata"))) == 1
    assert "Detected an existing checkpoint" not in done.stderr + done.stdout
    assert "Warning" not in done.stderr, done.stderr[-3000:]
