"""What a user reads when a checkpoint file is refused (training/checkpoint.py) or a run diverged
(training/divergence.py): the whole message, since the message is all the user gets. Fast unit tests, also in the
mutation selection (docs/testing.md)."""

import pickle

import pytest
import torch

from lit_growattn.training.checkpoint import damaged, read_checkpoint, refusal
from lit_growattn.training.divergence import ADVICE, TrainingDiverged, check_finite_weights, first_names, non_finite


def test_a_file_of_python_objects_is_refused_naming_the_first_object_and_what_to_do():
    error = pickle.UnpicklingError("Weights only load failed. ... Unsupported global: GLOBAL collections.OrderedDict "
                                   "was not an allowed global by default. Please use weights_only=False ...")
    assert str(refusal("run.ckpt", error)) == (
        "run.ckpt holds Python objects such as collections.OrderedDict beyond tensors and plain containers; loading "
        "them could run code from the file, so it is refused. If you trust the file, save only its tensors and plain "
        "values (a checkpoint's 'state_dict' and 'hyper_parameters') to a new file.")


def test_a_pickle_that_names_no_object_is_called_damaged_or_not_torch_save():
    assert str(refusal("run.ckpt", pickle.UnpicklingError("invalid load key, 'x'."))) == (
        "run.ckpt cannot be read as a file of tensors and plain containers: it is damaged (truncated or overwritten?) "
        "or not written by torch.save (a plain pickle could run code when loaded, so it is refused); use another "
        "file, e.g. an earlier checkpoint of the same run")


def test_an_archive_that_is_not_a_pickle_is_refused_as_code():
    assert str(refusal("model.pt", RuntimeError("weights_only ... TorchScript archive"))) == (
        "model.pt is not a file of tensors and plain containers (a TorchScript archive?); it is refused, since "
        "loading it could run code from the file")


def test_a_damaged_checkpoint_is_named_with_what_to_use_instead(tmp_path):
    assert str(damaged(tmp_path / "last.ckpt")) == (
        f"checkpoint {str(tmp_path / 'last.ckpt')!r} is damaged (truncated or overwritten?) and cannot be read; use "
        "another checkpoint, e.g. an earlier one of the same run")
    path = tmp_path / "cut.ckpt"
    torch.save({"state_dict": {"w": torch.ones(64)}}, path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError) as refused:
        read_checkpoint(path)
    assert str(refused.value) == str(damaged(path))


def test_first_names_lists_three_and_marks_the_rest():
    assert first_names([]) == ""
    assert first_names(["a"]) == "a"
    assert first_names(["a", "b", "c"]) == "a, b, c"
    assert first_names(["a", "b", "c", "d"]) == "a, b, c, …"


def test_non_finite_weights_are_named_in_the_order_of_the_module():
    module = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    with torch.no_grad():
        module[0].bias[1] = float("nan")
        module[2].weight[0, 0] = float("-inf")
    named = list(module.named_parameters()) + [("steps", torch.tensor([1, 2]))]  # an integer tensor is never checked
    assert non_finite(named) == ["0.bias", "2.weight"]
    assert non_finite([]) == []
    with pytest.raises(TrainingDiverged) as diverged:
        check_finite_weights(module, step=7)
    assert str(diverged.value) == (
        "training diverged: 2 parameter tensors are non-finite at step 7 (0.bias, 2.weight), so no checkpoint is "
        f"written (those already written keep their finite weights). {ADVICE}")
    with torch.no_grad():
        module[0].bias[1], module[2].weight[0, 0] = 0.0, 0.0
    check_finite_weights(module, step=8)  # finite: nothing raised


def test_init_from_a_missing_file_says_so(tmp_path):
    from lit_growattn.training.checkpoint import load_weights

    with pytest.raises(FileNotFoundError) as missing:
        load_weights(torch.nn.Linear(2, 2), str(tmp_path / "nope.ckpt"))
    assert str(missing.value) == (f"init_from={str(tmp_path / 'nope.ckpt')!r} does not exist; give the path of a "
                                  "checkpoint file")


def test_a_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError) as missing:
        read_checkpoint(tmp_path / "gone.ckpt")
    assert str(missing.value) == f"no checkpoint file at {str(tmp_path / 'gone.ckpt')!r}; give the path of a .ckpt file"


def test_a_folder_that_is_no_distributed_checkpoint_is_named(tmp_path):
    """A folder without torch's `.metadata` (tests/test_distributed_checkpoint.py reads one with it)."""
    from lit_growattn.training.checkpoint import load_weights

    folder = tmp_path / "epoch=2-step=6.ckpt"
    folder.mkdir()
    want = (f"{str(folder)!r} is a folder without a .metadata file, so neither a checkpoint file nor a distributed "
            "checkpoint: give a .ckpt file, or a checkpoint folder written by ModelParallelStrategy")
    for read in (read_checkpoint, lambda path: load_weights(torch.nn.Linear(2, 2), str(path))):
        with pytest.raises(ValueError) as refused:
            read(folder)
        assert str(refused.value) == want


def test_resuming_the_former_value_layout_is_refused_with_both_ways_on():
    from types import SimpleNamespace

    from lit_growattn.training.checkpoint import refuse_resuming_former_value_layout

    fitting = SimpleNamespace(_trainer=object(), trainer=SimpleNamespace(state=SimpleNamespace(fn="fit")))
    former = {"state_dict": {"blocks.0.attn.v.weight": torch.zeros(1)}}
    with pytest.raises(ValueError) as refused:
        refuse_resuming_former_value_layout(fitting, former, ".attn.v.weight", "v and o")
    assert str(refused.value) == (
        "this checkpoint stores the attention's value and output projections as the modules v and o, which this "
        "version keeps per head (W_V, W_O) so that the value side can grow: its weights load, but its optimizer state "
        "cannot resume. Continue from its weights with `--model.init_args.init_from=<ckpt>` (a new optimizer), or "
        "resume it with the version that wrote it")
    refuse_resuming_former_value_layout(fitting, {}, ".attn.v.weight", "v and o")  # no state_dict: nothing to refuse
    validating = SimpleNamespace(_trainer=object(), trainer=SimpleNamespace(state=SimpleNamespace(fn="validate")))
    refuse_resuming_former_value_layout(validating, former, ".attn.v.weight", "v and o")  # loads, no optimizer


def _init_from(module, state_dict, tmp_path, **hyper_parameters) -> str:
    """The message of load_weights (init_from) for a checkpoint of `state_dict` and `hyper_parameters`."""
    from lit_growattn.training.checkpoint import load_weights

    path = tmp_path / "other.ckpt"
    torch.save({"state_dict": state_dict, **({"hyper_parameters": hyper_parameters} if hyper_parameters else {})}, path)
    with pytest.raises(ValueError) as error:
        load_weights(module, str(path))
    prefix = f"init_from={str(path)!r} holds the weights of another model ("
    assert str(error.value).startswith(prefix)
    return str(error.value)[len(prefix):]


def test_init_from_another_model_names_its_differences_and_the_settings_that_fit_it(tmp_path):
    from lit_growattn.module import GrowAttentionLM

    small = GrowAttentionLM(vocab_size=32, block_size=8, n_layer=1, n_embd=16, n_head=2, d_head=4)
    wide = GrowAttentionLM(vocab_size=32, block_size=8, n_layer=2, n_embd=32, n_head=2, d_head=4, warmup_steps=3)
    state = wide.state_dict()
    # 2 layers there, 1 here: the second layer's weights are unknown here; the first's are of another shape.
    unknown = sorted(k for k in state if k.startswith("model.blocks.1."))
    shaped = sorted(k for k in small.state_dict() if state[k].shape != small.state_dict()[k].shape)
    # The class path as the CLI records it: the same class as here.
    assert _init_from(small, state, tmp_path, **wide.hparams, _class_path="lit_growattn.module.GrowAttentionLM") == (
        f"{len(unknown)} weights unknown here, {len(shaped)} of another shape, such as {shaped[0]} "
        f"{tuple(state[shaped[0]].shape)} there, {tuple(small.state_dict()[shaped[0]].shape)} here): build this model "
        "as the checkpoint's was, --model.init_args.n_layer=2, --model.init_args.n_embd=32; or give a checkpoint of a "
        "model built like it")  # warmup_steps differs too, but shapes no weight
    # Only missing weights, and no hyperparameters recorded (a checkpoint of weights alone): the example is the
    # first missing weight.
    partial = {k: v for k, v in small.state_dict().items() if k != "model.lm_head.weight"}
    missing = sorted(small.state_dict().keys() - partial.keys())
    assert _init_from(small, partial, tmp_path) == (
        f"1 weights missing, such as {missing[0]}): give a checkpoint of a model built like this one (the same model "
        "class and settings)")


def test_init_from_a_checkpoint_of_another_class_names_both(tmp_path):
    from lit_growattn.module import GrowAttentionLM

    small = GrowAttentionLM(vocab_size=32, block_size=8, n_layer=1, n_embd=16, n_head=2, d_head=4)
    assert _init_from(small, {"model.other.weight": torch.zeros(2)}, tmp_path,
                      _class_path="lit_growattn.hf.module.HFCausalLM") == (
        f"{len(small.state_dict())} weights missing, 1 weights unknown here, such as "
        f"{min(small.state_dict())}): it is a checkpoint of lit_growattn.hf.module.HFCausalLM, not of GrowAttentionLM: "
        "give a checkpoint of GrowAttentionLM")
    # A module without hparams (any torch module): the settings cannot be compared.
    linear = torch.nn.Linear(2, 3)
    assert _init_from(linear, {"weight": torch.zeros(2, 2), "bias": torch.zeros(3)}, tmp_path) == (
        "1 of another shape, such as weight (2, 2) there, (3, 2) here): give a checkpoint of a model built like this "
        "one (the same model class and settings)")
