import lightning as L
import pytest
import torch
import yaml
from torch.utils.data import DataLoader, TensorDataset

from lit_growattn.commands.convert import convert_checkpoint, main
from lit_growattn.module import GrowAttentionLM


def batch(seed, n=8):
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, 32, (n, 12), generator=g)
    labels = torch.roll(inputs, -1, dims=1)
    labels[:, -1] = -100
    return inputs, labels


@pytest.fixture(scope="module")
def mha_ckpt(tmp_path_factory):
    """A real Lightning checkpoint of a briefly trained mha model whose layers have different d_head."""
    torch.manual_seed(0)
    module = GrowAttentionLM(vocab_size=32, block_size=12, n_layer=2, n_embd=16, n_head=2, d_head=[3, 5], bias=True,
                             warmup_steps=1)
    trainer = L.Trainer(accelerator="cpu", max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(TensorDataset(*batch(0, 24)), batch_size=8),
                DataLoader(TensorDataset(*batch(1, 8)), batch_size=8))
    path = tmp_path_factory.mktemp("ckpt") / "mha.ckpt"
    trainer.save_checkpoint(path)
    return path, module.eval()


# The converted model is fitted for its outputs alone, with no validation data.
@pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`:UserWarning")
@pytest.mark.parametrize("to, args", [("lowrank_dint", {"rank": 2}), ("dint", {})])
def test_converted_model_starts_with_identical_outputs(mha_ckpt, tmp_path, to, args):
    src, mha = mha_ckpt
    convert_checkpoint(src, tmp_path / "new.ckpt", to=to, **args)
    new = GrowAttentionLM.load_from_checkpoint(tmp_path / "new.ckpt").eval()
    assert new.hparams.attention == to and new.model.head_sizes() == [3, 5]
    assert all((block.attn.lam == 0).all() for block in new.model.blocks)
    inputs, _ = batch(1)
    with torch.no_grad():
        torch.testing.assert_close(new(inputs), mha(inputs), atol=1e-6, rtol=0)


def test_fine_tuning_the_converted_model_lowers_the_loss_and_moves_lambda(mha_ckpt, tmp_path):
    src, _ = mha_ckpt
    convert_checkpoint(src, tmp_path / "new.ckpt", to="lowrank_dint", rank=2)
    model = GrowAttentionLM.load_from_checkpoint(tmp_path / "new.ckpt")
    optimizer = torch.optim.AdamW(model.parameter_groups(), lr=1e-2)
    inputs, labels = batch(2)
    losses = []
    for _ in range(8):
        loss = model.loss(model(inputs), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all((block.attn.lam.abs() > 1e-4).all() for block in model.model.blocks)


def test_conversion_is_reproducible_and_leaves_the_global_rng_alone(mha_ckpt, tmp_path):
    src, _ = mha_ckpt
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = convert_checkpoint(src, tmp_path / "a.ckpt", rank=2, seed=7)
    assert torch.rand(1) == before
    b = convert_checkpoint(src, tmp_path / "b.ckpt", rank=2, seed=7)
    torch.testing.assert_close(a.state_dict(), b.state_dict())


def test_only_mha_converts_to_dint_variants(mha_ckpt, tmp_path):
    src, _ = mha_ckpt
    with pytest.raises(ValueError, match="can convert mha to dint, lowrank_dint, mha, not 'diff'"):
        convert_checkpoint(src, tmp_path / "x.ckpt", to="diff")
    convert_checkpoint(src, tmp_path / "dint.ckpt", to="dint")
    with pytest.raises(ValueError, match="is a 'dint' checkpoint; only mha can be converted"):
        convert_checkpoint(tmp_path / "dint.ckpt", tmp_path / "y.ckpt", rank=2)


def test_main_writes_the_checkpoint_and_its_model_config(mha_ckpt, tmp_path):
    src, _ = mha_ckpt
    out = tmp_path / "new.ckpt"
    main(["--ckpt", str(src), "--to", "lowrank_dint", "--rank", "2", "--d2_ratio", "0.25", "--out", str(out)])
    assert GrowAttentionLM.load_from_checkpoint(out).hparams.attention_args == {"rank": 2, "d2_ratio": 0.25,
                                                                                "lambda_init": 0.0}
    config = yaml.safe_load(out.with_suffix(".yaml").read_text())
    assert config["class_path"] == "lit_growattn.module.GrowAttentionLM"
    args = config["init_args"]
    assert args["attention"] == "lowrank_dint" and args["d_head"] == [3, 5] and args["init_from"] == str(out.resolve())
    assert "vocab_size" not in args and "block_size" not in args  # linked from the data by the CLI
    with pytest.raises(SystemExit):
        main(["--ckpt", str(src), "--to", "lowrank_dint", "--out", str(out)])  # no --rank


def test_shrunk_model_keeps_the_closest_form_per_head(mha_ckpt, tmp_path):
    src, mha = mha_ckpt
    convert_checkpoint(src, tmp_path / "same.ckpt", to="mha", d_head=[3, 5])
    same = GrowAttentionLM.load_from_checkpoint(tmp_path / "same.ckpt").eval()
    inputs, _ = batch(1)
    with torch.no_grad():
        torch.testing.assert_close(same(inputs), mha(inputs), atol=1e-5, rtol=0)

    convert_checkpoint(src, tmp_path / "small.ckpt", to="mha", d_head=2)
    small = GrowAttentionLM.load_from_checkpoint(tmp_path / "small.ckpt")
    assert small.hparams.d_head == [2, 2] and small.model.head_sizes() == [2, 2]
    for old, new in zip(mha.model.qk_forms(), small.model.qk_forms()):
        m, m_new = old[0].bilinear().double(), new[0].bilinear().double()
        s = torch.linalg.svdvals(m)
        error = (m - m_new).square().sum((-2, -1))
        torch.testing.assert_close(error, s[:, 2:].square().sum(-1), rtol=1e-4, atol=1e-8)
        torch.testing.assert_close(new[0].log_tau, old[0].log_tau)


def test_shrinking_refuses_widening_and_wrong_lengths(mha_ckpt, tmp_path):
    src, _ = mha_ckpt
    with pytest.raises(ValueError, match="cannot widen it to 4"):
        convert_checkpoint(src, tmp_path / "x.ckpt", to="mha", d_head=4)
    with pytest.raises(ValueError, match="d_head has 3 entries"):
        convert_checkpoint(src, tmp_path / "x.ckpt", to="mha", d_head=[1, 1, 1])
    with pytest.raises(ValueError, match="exactly when shrinking"):
        convert_checkpoint(src, tmp_path / "x.ckpt", to="lowrank_dint", rank=2, d_head=2)


def test_shrinking_the_value_side_keeps_each_heads_closest_w_m(mha_ckpt, tmp_path):
    src, mha = mha_ckpt
    assert mha.value_sizes() == [8, 8]
    convert_checkpoint(src, tmp_path / "same.ckpt", to="mha", d_v=8)
    same = GrowAttentionLM.load_from_checkpoint(tmp_path / "same.ckpt").eval()
    inputs, _ = batch(1)
    with torch.no_grad():
        torch.testing.assert_close(same(inputs), mha(inputs), atol=1e-5, rtol=0)  # exact at full rank

    convert_checkpoint(src, tmp_path / "small.ckpt", to="mha", d_v=[3, 5], d_head=2)
    small = GrowAttentionLM.load_from_checkpoint(tmp_path / "small.ckpt")
    assert small.hparams.d_v == [3, 5] and small.value_sizes() == [3, 5] and small.head_sizes() == [2, 2]
    for old, new, r in zip(mha.model.blocks, small.model.blocks, (3, 5)):
        m, m_new = old.attn.value.matrix().double(), new.attn.value.matrix().double()
        s = torch.linalg.svdvals(m)
        error = (m - m_new).square().sum((-2, -1))
        torch.testing.assert_close(error, s[:, r:].square().sum(-1), rtol=1e-4, atol=1e-8)  # Eckart–Young
    with pytest.raises(ValueError, match="value head size 8; shrinking cannot widen it to 9"):
        convert_checkpoint(src, tmp_path / "x.ckpt", to="mha", d_v=9)


def test_the_convert_command_shrinks_the_value_side(mha_ckpt, tmp_path):
    src, _ = mha_ckpt
    out = tmp_path / "small.ckpt"
    main(["--ckpt", str(src), "--to", "mha", "--d_v", "4", "--out", str(out)])
    assert GrowAttentionLM.load_from_checkpoint(out).value_sizes() == [4, 4]
    assert yaml.safe_load(out.with_suffix(".yaml").read_text())["init_args"]["d_v"] == [4, 4]


# -- the command line as a user meets it -------------------------------------------------------------------------

PROG = "python -m lit_growattn convert"


@pytest.mark.parametrize("argv, message", [
    (["--ckpt", "a.ckpt", "--to", "lowrank_dint", "--out", "b.ckpt"], "--rank is required for lowrank_dint"),
    (["--ckpt", "a.ckpt", "--to", "dint", "--rank", "2", "--out", "b.ckpt"], "--rank and --d2_ratio belong to lowrank_dint"),
    (["--ckpt", "a.ckpt", "--to", "dint", "--d_head", "2", "--out", "b.ckpt"],
     "--d_head or --d_v is required for --to mha (shrinking) and belongs to it alone"),
    (["--ckpt", "a.ckpt", "--to", "mha", "--out", "b.ckpt"],
     "--d_head or --d_v is required for --to mha (shrinking) and belongs to it alone"),
    (["--pretrained", "folder", "--to", "mha", "--d_head", "2", "--out", "b"],
     "--pretrained converts to dint or lowrank_dint (shrinking is for --ckpt)"),
    (["--to", "dint", "--out", "b.ckpt"], "one of the arguments --ckpt --pretrained is required"),
    (["--ckpt", "a.ckpt", "--to", "dint"], "the following arguments are required: --out"),
    (["--ckpt", "a.ckpt", "--to", "dint", "--seed", "one", "--out", "b.ckpt"], "argument --seed: invalid int value: 'one'"),
])
def test_the_command_line_refuses_options_that_do_not_go_together(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"{PROG}: error: {message}"


def test_the_command_line_refuses_an_unknown_target(capsys):
    with pytest.raises(SystemExit):
        main(["--ckpt", "a.ckpt", "--to", "diff", "--out", "b.ckpt"])
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"{PROG}: error: argument --to: invalid choice: 'diff'")


def test_the_command_converts_as_the_function_does_to_lowrank_dint_with_seed_0_by_default(mha_ckpt, tmp_path):
    src, _ = mha_ckpt
    main(["--ckpt", str(src), "--rank", "2", "--out", str(tmp_path / "cli.ckpt")])
    from_cli = GrowAttentionLM.load_from_checkpoint(tmp_path / "cli.ckpt")
    from_python = convert_checkpoint(src, tmp_path / "py.ckpt", rank=2)
    assert from_cli.hparams.attention == from_python.hparams.attention == "lowrank_dint"
    torch.testing.assert_close(from_cli.state_dict(), from_python.state_dict(), atol=0, rtol=0)
    # --seed reaches the second map: seed 3 is the function's seed 3, and not seed 0's draw.
    main(["--ckpt", str(src), "--rank", "2", "--seed", "3", "--out", str(tmp_path / "cli3.ckpt")])
    seed_3 = GrowAttentionLM.load_from_checkpoint(tmp_path / "cli3.ckpt").state_dict()
    torch.testing.assert_close(seed_3, convert_checkpoint(src, tmp_path / "py3.ckpt", rank=2, seed=3).state_dict(),
                               atol=0, rtol=0)
    qk2 = "model.blocks.0.attn.qk2.up_q"
    assert not torch.equal(seed_3[qk2], from_cli.state_dict()[qk2])


def test_the_command_shrinks_each_layer_to_its_own_size_and_says_how_to_fine_tune(mha_ckpt, tmp_path, capsys):
    src, _ = mha_ckpt
    out = tmp_path / "small.ckpt"
    main(["--ckpt", str(src), "--to", "mha", "--d_head", "3", "2", "--out", str(out)])
    assert GrowAttentionLM.load_from_checkpoint(out).head_sizes() == [3, 2]
    config = out.with_suffix(".yaml")
    assert capsys.readouterr().out == (f"wrote {out} and {config}; fine-tune with\n"
                                       f"  python -m lit_growattn fit --config <your run config> --model {config}\n")


def test_the_command_names_the_model_config_it_would_overwrite(mha_ckpt, tmp_path):
    src, _ = mha_ckpt
    out, config = tmp_path / "new.ckpt", tmp_path / "new.yaml"
    config.write_text("mine")
    with pytest.raises(ValueError) as error:
        main(["--ckpt", str(src), "--to", "dint", "--out", str(out)])
    assert str(error.value) == (f"--out's model config {config} already exists: give --overwrite to replace it (the "
                                "old one is kept until the new one is complete), or another path")
    assert config.read_text() == "mine" and not out.exists()
    with pytest.raises(ValueError) as error:
        main(["--ckpt", str(src), "--to", "dint", "--out", str(tmp_path / "other.yaml")])
    assert str(error.value) == (f"--out {tmp_path / 'other.yaml'} ends in .yaml, the name of the model config written beside the "
                                "checkpoint: give the checkpoint's name, e.g. converted.ckpt")


def test_the_model_config_is_never_written_onto_the_checkpoint_read(mha_ckpt, tmp_path):
    src, _ = mha_ckpt
    named_yaml = tmp_path / "weights.yaml"  # a checkpoint whose name is the config's that --out weights.ckpt has
    named_yaml.write_bytes(src.read_bytes())
    with pytest.raises(ValueError) as error:
        main(["--ckpt", str(named_yaml), "--to", "dint", "--out", str(tmp_path / "weights.ckpt")])
    assert str(error.value) == (f"--out's model config {named_yaml} is the checkpoint --ckpt ({named_yaml}), which is "
                                "read to write it: it is never overwritten, not even with --overwrite; give --out's "
                                "model config a path outside it")
    assert named_yaml.read_bytes() == src.read_bytes()


def test_a_failure_before_the_checkpoint_is_placed_is_reported_as_it_is(mha_ckpt, tmp_path, monkeypatch):
    src, _ = mha_ckpt

    def full_disk(module, path):
        raise OSError("No space left on device")
    monkeypatch.setattr("lit_growattn.commands.convert.save_weights", full_disk)
    with pytest.raises(OSError) as error:
        main(["--ckpt", str(src), "--to", "dint", "--out", str(tmp_path / "new.ckpt")])
    assert str(error.value) == "No space left on device"
    assert list(tmp_path.iterdir()) == []


def another_process_writes(path, monkeypatch) -> None:
    """While convert saves its weights, another process writes `path`."""
    from lit_growattn.commands import convert

    save = convert.save_weights

    def save_while_another_process_writes(module, partial):
        path.write_text("another process's")
        save(module, partial)
    monkeypatch.setattr(convert, "save_weights", save_while_another_process_writes)


def test_a_model_config_that_appears_during_the_conversion_is_kept_and_named(mha_ckpt, tmp_path, monkeypatch):
    """The checkpoint is in place when its config cannot be: the error says which file is which, and how to redo it."""
    src, _ = mha_ckpt
    out, config = tmp_path / "new.ckpt", tmp_path / "new.yaml"
    another_process_writes(config, monkeypatch)
    with pytest.raises(OSError) as error:
        main(["--ckpt", str(src), "--to", "dint", "--out", str(out)])
    appeared = (f"--out's model config {config} appeared while this one was written (another process wrote it): "
                "nothing was replaced, and what was written here is discarded; give --overwrite to replace it, or "
                "another path")
    assert str(error.value) == (f"{out} is the new checkpoint, but its model config could not be put in place, so "
                                f"{config} is not its config ({appeared}): run the conversion again with --overwrite")
    assert config.read_text() == "another process's"
    assert GrowAttentionLM.load_from_checkpoint(out).hparams.attention == "dint"


def test_the_function_names_its_dst_path_argument(mha_ckpt, tmp_path, monkeypatch):
    src, _ = mha_ckpt
    dst = tmp_path / "new.ckpt"
    dst.write_text("mine")
    with pytest.raises(ValueError) as error:
        convert_checkpoint(src, dst, to="dint")
    assert str(error.value) == (f"dst_path {dst} already exists: give overwrite=True to replace it (the old one is "
                                "kept until the new one is complete), or another path")
    dst.unlink()
    another_process_writes(dst, monkeypatch)
    with pytest.raises(FileExistsError) as error:
        convert_checkpoint(src, dst, to="dint")
    assert str(error.value).startswith(f"dst_path {dst} appeared while this one was written")
    assert str(error.value).endswith("give overwrite=True to replace it, or another path")
    assert dst.read_text() == "another process's"


# -- what convert refuses to read --------------------------------------------------------------------------------

def test_a_file_that_is_not_a_growattentionlm_checkpoint_is_refused_naming_it(mha_ckpt, tmp_path):
    src, _ = mha_ckpt
    ckpt = torch.load(src, weights_only=True)
    for missing in ("hyper_parameters", "state_dict"):
        path = tmp_path / f"no_{missing}.ckpt"
        torch.save({k: v for k, v in ckpt.items() if k != missing}, path)
        with pytest.raises(ValueError) as error:
            convert_checkpoint(path, tmp_path / "x.ckpt", to="dint")
        assert str(error.value) == (f"{path} is not a checkpoint of lit_growattn's GrowAttentionLM (it has no "
                                    "hyper_parameters and state_dict): give a checkpoint written by "
                                    "`python -m lit_growattn fit`")


def test_a_checkpoint_missing_weights_or_with_others_is_refused_naming_the_file_and_the_weights(mha_ckpt, tmp_path):
    src, _ = mha_ckpt
    ckpt = torch.load(src, weights_only=True)
    state = ckpt["state_dict"]
    state["val_metric.total"] = torch.zeros(())  # not the model's: ignored, as an evaluation metric's state is
    path = tmp_path / "with_metric.ckpt"
    torch.save(ckpt, path)
    assert convert_checkpoint(path, tmp_path / "fine.ckpt", to="dint").head_sizes() == [3, 5]
    for changed, expected in ((("model.blocks.1.attn.qk.log_tau", None), "missing ['model.blocks.1.attn.qk.log_tau'], "
                                                                         "unexpected []"),
                              (("model.blocks.0.attn.extra", torch.zeros(2)), "missing [], unexpected "
                                                                               "['model.blocks.0.attn.extra']")):
        damaged = dict(state)
        key, value = changed
        if value is None:
            del damaged[key]
        else:
            damaged[key] = value
        torch.save({**ckpt, "state_dict": damaged}, path)
        with pytest.raises(ValueError) as error:
            convert_checkpoint(path, tmp_path / "x.ckpt", to="dint")
        assert str(error.value) == f"{path} does not fit dint: {expected}"


def test_shrinking_names_the_checkpoint_whose_layers_it_counts(mha_ckpt, tmp_path):
    src, _ = mha_ckpt
    with pytest.raises(ValueError) as error:
        convert_checkpoint(src, tmp_path / "x.ckpt", to="mha", d_v=[1, 1, 1])
    assert str(error.value) == f"d_v has 3 entries but {src} has 2 layers"
    with pytest.raises(ValueError) as error:
        convert_checkpoint(src, tmp_path / "x.ckpt", to="mha", d_head=[3, 6])
    assert str(error.value) == "layer 1 has head size 5; shrinking cannot widen it to 6 (grow it instead)"
    with pytest.raises(ValueError) as error:
        convert_checkpoint(src, tmp_path / "x.ckpt", to="lowrank_dint", rank=2, d_v=2)
    assert str(error.value) == ("give d_head or d_v exactly when shrinking (to='mha'): the other targets keep the "
                                "head sizes")


def test_dint_takes_each_layers_head_size_from_the_weights_when_the_hparams_lag(mha_ckpt, tmp_path):
    """A checkpoint whose recorded d_head is not its weights' (a run that grew without recording it), and which
    leaves the default attention (mha) out: the second map of each layer gets the layer's head size from the
    weights."""
    src, mha = mha_ckpt
    ckpt = torch.load(src, weights_only=True)
    ckpt["hyper_parameters"]["d_head"] = 8  # not [3, 5]
    del ckpt["hyper_parameters"]["attention"]
    path = tmp_path / "lagging.ckpt"
    torch.save(ckpt, path)
    dint = convert_checkpoint(path, tmp_path / "dint.ckpt", to="dint")
    assert [block.attn.qk2.w_q.shape[-1] for block in dint.model.blocks] == [3, 5]
    inputs, _ = batch(1)
    with torch.no_grad():
        torch.testing.assert_close(dint.eval()(inputs), mha(inputs), atol=1e-6, rtol=0)
