import lightning as L
import pytest
import torch
import yaml
from conftest import needs_transformers
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
     "--d_head, --d_v or --kv_budget is required for --to mha (shrinking) and belongs to it alone"),
    (["--ckpt", "a.ckpt", "--to", "mha", "--out", "b.ckpt"],
     "--d_head, --d_v or --kv_budget is required for --to mha (shrinking) and belongs to it alone"),
    (["--ckpt", "a.ckpt", "--to", "dint", "--kv_budget", "2", "--out", "b.ckpt"],
     "--d_head, --d_v or --kv_budget is required for --to mha (shrinking) and belongs to it alone"),
    (["--pretrained", "folder", "--to", "mha", "--d_head", "2", "--out", "b"],
     "--pretrained shrinks to a budget, --kv_budget (the sizes --d_head/--d_v are for --ckpt)"),
    (["--ckpt", "a.ckpt", "--to", "mha", "--d_head", "2", "--kv_budget", "2", "--out", "b.ckpt"],
     "give the sizes (--d_head/--d_v) or a budget (--kv_budget), not both"),
    (["--ckpt", "a.ckpt", "--to", "mha", "--d_v", "2", "--calibration", "a.txt", "--out", "b.ckpt"],
     "--calibration weighs the allocation of --kv_budget; with --d_head/--d_v the sizes are given"),
    (["--ckpt", "a.ckpt", "--to", "mha", "--d_v", "2", "--sides", "value", "--out", "b.ckpt"],
     "--sides chooses what --kv_budget shrinks"),
    (["--ckpt", "a.ckpt", "--to", "mha", "--kv_budget", "2", "--calibration_length", "8", "--out", "b.ckpt"],
     "--calibration_sequences, --calibration_length, --tokenizer, --device go with --calibration"),
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
    assert str(error.value) == ("give d_head, d_v or kv_budget exactly when shrinking (to='mha'): the other targets "
                                "keep the head sizes")


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


# -- shrinking to a KV-cache budget (--kv_budget), by the weights or by the activations (--calibration) ------------

@pytest.fixture(scope="module")
def byte_ckpt(tmp_path_factory):
    """A weights-only checkpoint of a byte-level mha model (vocabulary 256: raw bytes need no tokenizer), its layers
    with d_head [3, 5] and d_v 8, and a calibration text."""
    from lit_growattn.commands.convert import save_weights

    torch.manual_seed(1)
    module = GrowAttentionLM(vocab_size=256, block_size=16, n_layer=2, n_head=2, n_embd=16, d_head=[3, 5], bias=True)
    folder = tmp_path_factory.mktemp("bytes")
    save_weights(module, folder / "bytes.ckpt")
    text = folder / "train.txt"
    text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(60)))
    return folder / "bytes.ckpt", text


def cache_mean(module, sides=("d_head", "d_v")):
    """The mean head size over the cache heads (2 per layer and side here: n_head = n_kv_head = 2)."""
    sizes = [*(module.head_sizes() if "d_head" in sides else []), *(module.value_sizes() if "d_v" in sides else [])]
    return sum(sizes) / len(sizes)


def test_a_budget_without_calibration_is_the_weight_svd_shrink_of_today(mha_ckpt, tmp_path):
    """The sizes are `allocate_ranks`' and the factors `shrink_form`'s / `shrink_values`' (weight SVD), bit for bit."""
    from lit_growattn.growth.shrink import allocate_ranks

    src, mha = mha_ckpt
    shrunk = convert_checkpoint(src, tmp_path / "k.ckpt", to="mha", kv_budget=2.5, sides="query_key")
    layers = [[(f.w_q, f.w_k, f.log_tau) for f in forms] for forms in mha.model.qk_forms()]
    d_head = allocate_ranks(layers, 2.5 * 2 * 2)
    assert shrunk.head_sizes() == d_head and sum(d_head) == 5 and shrunk.value_sizes() == [8, 8]
    by_sizes = convert_checkpoint(src, tmp_path / "sized.ckpt", to="mha", d_head=d_head)
    torch.testing.assert_close(shrunk.state_dict(), by_sizes.state_dict(), rtol=0, atol=0)
    both = convert_checkpoint(src, tmp_path / "both.ckpt", to="mha", kv_budget=4)
    assert cache_mean(both) <= 4 and cache_mean(both) > 4 - 1 / 4  # within the budget, less than a column left
    assert both.value_sizes() != [8, 8] and both.head_sizes() != [3, 5]
    by_sizes = convert_checkpoint(src, tmp_path / "sized2.ckpt", to="mha", d_head=both.head_sizes(),
                                  d_v=both.value_sizes())
    torch.testing.assert_close(both.state_dict(), by_sizes.state_dict(), rtol=0, atol=0)


def test_the_command_shrinks_to_a_budget_by_the_activations_and_says_what_it_kept(byte_ckpt, tmp_path, capsys):
    from lit_growattn.callback.calibration import calibration_moments
    from lit_growattn.growth.shrink import shrink_to_budget

    src, text = byte_ckpt
    out = tmp_path / "small.ckpt"
    main(["--ckpt", str(src), "--to", "mha", "--kv_budget", "3", "--calibration", str(text),
          "--calibration_sequences", "20", "--calibration_length", "12", "--out", str(out)])
    printed = capsys.readouterr().out
    small = GrowAttentionLM.load_from_checkpoint(out)
    assert cache_mean(small) <= 3 < cache_mean(small) + 1 / 4
    config = yaml.safe_load(out.with_suffix(".yaml").read_text())["init_args"]
    assert (config["d_head"], config["d_v"]) == (small.head_sizes(), small.value_sizes())
    sizes = (f"d_head {small.head_sizes()} (mean {sum(small.head_sizes()) / 2:g}), d_v {small.value_sizes()} "
             f"(mean {sum(small.value_sizes()) / 2:g}): {2 * sum(small.head_sizes() + small.value_sizes())} of 24 "
             "values per token (budget 3)")
    assert printed.startswith(f"wrote {out} and {out.with_suffix('.yaml')}: {sizes}; allocation by activation-whitened "
                              f"energy on 240 tokens of {text} (kept ")
    assert printed.endswith(f" % of the value output energy); fine-tune with\n  python -m lit_growattn fit --config "
                            f"<your run config> --model {out.with_suffix('.yaml')}\n")
    # What calibration gathers on the text's 20 evenly spaced windows of 13 bytes, shrunk to the budget: the same.
    module = GrowAttentionLM.load_from_checkpoint(src)
    tokens = torch.tensor(list(text.read_bytes()))
    starts = [round(k * (len(tokens) - 13) / 19) for k in range(20)]
    windows = torch.stack([tokens[s:s + 13] for s in starts])
    moments = calibration_moments(module, [(w[:, :-1], w[:, 1:]) for w in windows.split(16)], {"d_head", "d_v"})
    from lit_growattn.contract import growable_units

    shrink_to_budget(growable_units(module), 3, moments)
    torch.testing.assert_close(small.state_dict(), module.state_dict(), rtol=0, atol=0)
    # Without --calibration the weights decide, and the line says how to weigh by the activations instead.
    main(["--ckpt", str(src), "--to", "mha", "--kv_budget", "3", "--sides", "value", "--out", str(tmp_path / "v.ckpt")])
    printed = capsys.readouterr().out
    assert "values per token (budget 3); allocation by weight SVD energy (kept " in printed
    assert (" % of the value output energy; give --calibration FILE to weigh it by the activations); fine-tune"
            in printed)
    assert "d_head" not in printed.split(":")[1]


def test_a_budget_is_refused_before_any_work_naming_the_problem_and_the_fix(mha_ckpt, byte_ckpt, tmp_path,
                                                                           monkeypatch):
    from lit_growattn.commands import shrink

    def no_calibration(*args, **kwargs):
        raise AssertionError("calibration ran before the refusal")
    monkeypatch.setattr(shrink, "calibration_moments", no_calibration)
    src, text = byte_ckpt
    out = tmp_path / "out" / "x.ckpt"

    def refused(error_type=ValueError, **kwargs) -> str:
        with pytest.raises(error_type) as error:
            convert_checkpoint(src, out, to="mha", **kwargs)
        assert not out.parent.exists()  # nothing written, not even a partial file
        return str(error.value)

    assert refused(kv_budget=0.5, calibration=text) == ("a budget of 0.5 is below what the model must keep: one "
                                                        "column per layer and side (mean 1): give at least 1")
    assert refused(kv_budget=6, calibration=text) == ("the model's caches are already at mean 6 ≤ 6: nothing to "
                                                      "shrink (a budget never widens)")
    assert refused(kv_budget=4, sides="query_key") == ("the model's caches are already at mean 4 ≤ 4: nothing to "
                                                       "shrink (a budget never widens)")
    assert refused(kv_budget=3, d_v=2) == "give the sizes (d_head/d_v) or a budget (kv_budget), not both"
    assert refused(d_v=2, calibration=text) == ("calibration weighs the allocation of kv_budget; with d_head/d_v the "
                                                "sizes are given")
    assert refused(kv_budget=3, sides="keys") == "sides='keys': choose both, query_key, value"
    assert refused(kv_budget=3, calibration=text, calibration_sequences=0) == ("calibration_sequences must be at "
                                                                               "least 1, not 0")
    assert refused(FileNotFoundError, kv_budget=3, calibration=tmp_path / "none.txt") == (
        f"calibration {tmp_path / 'none.txt'} is not a file: give a text of the model's training distribution (its "
        "training split)")
    assert refused(kv_budget=3, calibration=text, calibration_length=17) == (
        f"calibration_length 17 exceeds the 16 positions {src} takes: give at most 16")
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert refused(kv_budget=3, calibration=short) == (f"{short} holds 9 tokens, fewer than one window of 17: give a "
                                                       "longer file or a smaller calibration_length")
    assert refused(FileNotFoundError, kv_budget=3, calibration=text, tokenizer=tmp_path / "tokenizer.json") == (
        f"tokenizer {tmp_path / 'tokenizer.json'} does not exist: give the tokenizer.json (or its folder) the model "
        "was trained with")
    with pytest.raises(ValueError) as error:  # a vocabulary that raw bytes do not fit, and no tokenizer given
        convert_checkpoint(mha_ckpt[0], out, to="mha", kv_budget=3, calibration=text)
    assert str(error.value) == (f"{mha_ckpt[0]} has a vocabulary of 32 tokens, not the 256 of raw bytes: give "
                                "tokenizer, the tokenizer.json (or its folder) the model was trained with, to read the "
                                "calibration text")
    with pytest.raises(ValueError) as error:
        main(["--ckpt", str(src), "--to", "mha", "--kv_budget", "3", "--calibration", str(text), "--out", str(text)])
    assert str(error.value) == (f"--out {text} is the calibration text --calibration ({text}), which is read to write "
                                "it: it is never overwritten, not even with --overwrite; give --out a path outside it")
    tokenizer = tmp_path / "tok" / "tokenizer.json"
    tokenizer.parent.mkdir()
    tokenizer.write_text("{}")
    with pytest.raises(ValueError) as error:
        main(["--ckpt", str(src), "--to", "mha", "--kv_budget", "3", "--calibration", str(text), "--tokenizer",
              str(tokenizer), "--out", str(tokenizer), "--overwrite"])
    assert str(error.value) == (f"--out {tokenizer} is the tokenizer --tokenizer ({tokenizer}), which is read to write "
                                "it: it is never overwritten, not even with --overwrite; give --out a path outside it")
    with pytest.raises(ValueError, match="is the tokenizer"):
        convert_checkpoint(src, tokenizer, to="mha", kv_budget=3, calibration=text, tokenizer=tokenizer,
                           overwrite=True)
    assert tokenizer.read_text() == "{}"
    # The Python arguments go together as the command's options do.
    assert refused(d_v=2, sides="value") == "sides chooses what kv_budget shrinks"
    assert refused(kv_budget=3, calibration_sequences=8, device="cpu") == (
        "calibration_sequences, device go with calibration: give the text to calibrate on, or leave them out")
    assert refused(kv_budget=3, tokenizer=tokenizer) == ("tokenizer goes with calibration: give the text to calibrate "
                                                         "on, or leave them out")
    # A device the calibration cannot run on.
    assert refused(kv_budget=3, calibration=text, device="gpu") == ("device gpu is not a device name: give cpu, or a "
                                                                    "device this machine has (e.g. cuda:0)")
    absent = refused(kv_budget=3, calibration=text, device="cuda:99")
    assert absent.startswith("device cuda:99 is not available here (") and absent.endswith(
        "): give cpu, or a device this machine has (e.g. cuda:0)")


@pytest.mark.parametrize("budget", ["nan", "inf", "-inf", "0", "-2"])
def test_a_budget_that_is_no_mean_head_size_or_a_missing_device_is_refused_before_the_model_is_read(
        byte_ckpt, tmp_path, monkeypatch, budget):
    def unread(*args, **kwargs):
        raise AssertionError("the checkpoint was read before the refusal")
    monkeypatch.setattr("lit_growattn.commands.convert.read_checkpoint", unread)
    src, text = byte_ckpt
    out = tmp_path / "x.ckpt"
    with pytest.raises(ValueError) as error:
        main(["--ckpt", str(src), "--to", "mha", f"--kv_budget={budget}", "--out", str(out)])
    assert str(error.value) == (f"--kv_budget {float(budget):g} is not a mean head size: give a finite number of "
                                "columns above 0, the mean head size over the cache heads to shrink to (e.g. 4)")
    with pytest.raises(ValueError) as error:
        convert_checkpoint(src, out, to="mha", kv_budget=float(budget), calibration=text)
    assert str(error.value).startswith(f"kv_budget {float(budget):g} is not a mean head size: ")
    with pytest.raises(ValueError) as error:
        main(["--ckpt", str(src), "--to", "mha", "--kv_budget", "3", "--calibration", str(text), "--device", "cuda:99",
              "--out", str(out)])
    assert str(error.value).startswith("--device cuda:99 is not available here (")
    with pytest.raises(ValueError) as error:
        main(["--ckpt", str(src), "--to", "mha", "--kv_budget", "3", "--calibration", str(text),
              "--calibration_sequences", "0", "--out", str(out)])
    assert str(error.value) == "--calibration_sequences must be at least 1, not 0"
    assert list(tmp_path.iterdir()) == []


def test_the_calibration_passes_over_fewer_layers_where_the_memory_is_short(byte_ckpt, tmp_path, capsys,
                                                                          monkeypatch):
    """Free memory for one layer's sums at a time: two passes, the same model, and the line says so."""
    src, text = byte_ckpt
    argv = ["--ckpt", str(src), "--to", "mha", "--kv_budget", "3", "--calibration", str(text),
            "--calibration_sequences", "8"]
    main([*argv, "--out", str(tmp_path / "one_pass.ckpt")])
    assert "per pass" not in capsys.readouterr().out
    monkeypatch.setattr("lit_growattn.commands.shrink.free_memory", lambda device: 1)
    main([*argv, "--out", str(tmp_path / "passes.ckpt")])
    printed = capsys.readouterr().out
    assert f"allocation by activation-whitened energy on 128 tokens of {text}, 1 layer per pass to fit cpu's memory " \
           "(kept " in printed
    torch.testing.assert_close(GrowAttentionLM.load_from_checkpoint(tmp_path / "passes.ckpt").state_dict(),
                               GrowAttentionLM.load_from_checkpoint(tmp_path / "one_pass.ckpt").state_dict())


def test_a_failure_while_writing_a_shrunk_checkpoint_leaves_nothing_behind(byte_ckpt, tmp_path, monkeypatch):
    src, text = byte_ckpt
    before = src.read_bytes()

    def full_disk(module, path):
        raise OSError("No space left on device")
    monkeypatch.setattr("lit_growattn.commands.convert.save_weights", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        main(["--ckpt", str(src), "--to", "mha", "--kv_budget", "3", "--calibration", str(text),
              "--calibration_sequences", "4", "--out", str(tmp_path / "small.ckpt")])
    with pytest.raises(OSError, match="No space left on device"):
        convert_checkpoint(src, tmp_path / "small.ckpt", to="mha", kv_budget=3)
    assert list(tmp_path.iterdir()) == [] and src.read_bytes() == before


def test_a_hugging_face_folder_shrinks_to_a_budget_and_loads_back(tmp_path, capsys, monkeypatch):
    """A Llama (4 query heads on 2 KV heads) grown by 4 NoPE columns behind its 8 rotary ones: shrunk by the
    activations, the written folder loads (after `import lit_growattn.hf`) as the model shrunk in memory, with the
    rotary columns as they were and the tokenizer copied; one that never grew shrinks its V cache only."""
    needs_transformers()
    import lit_growattn.hf  # noqa: F401  (registers the grown model types)
    from hf_helpers import load, same_model, saved_tiny_model, saved_tokenizer

    from lit_growattn.commands import shrink
    from lit_growattn.commands.export import copy_tokenizer
    from lit_growattn.hf.export import save_export
    from lit_growattn.hf.module import HFCausalLM

    text = "def shrink(model, budget):\n    return model.narrower(budget)\n"
    plain = saved_tiny_model("llama", tmp_path / "llama", vocab=300)
    saved_tokenizer(plain, [text] * 20, vocab_size=300)
    calibration = tmp_path / "train.txt"
    calibration.write_text(text * 30)
    with pytest.raises(ValueError) as error:
        main(["--pretrained", plain, "--to", "mha", "--kv_budget", "4", "--out", str(tmp_path / "x")])
    assert str(error.value) == (f"the query/key columns of {plain} are all rotary (RoPE rotates them by position, so "
                                "they are not one bilinear form of X′ and cannot be truncated): --sides value shrinks "
                                "its V cache; the K cache shrinks only by NoPE columns appended by growth")
    values, _ = shrink.shrink_pretrained(plain, tmp_path / "values", shrink.Budget(4, "value"))
    assert values.value_sizes() == [4, 4] and values.head_sizes() == [8, 8]
    same_model(load(tmp_path / "values"), values.model.eval())

    module = HFCausalLM(pretrained=plain)
    g = torch.Generator().manual_seed(0)
    for _, _, form in module.growable_forms():
        grow = lambda w: torch.cat([w.detach(), 0.3 * torch.randn(*w.shape[:2], 4, generator=g)], -1)  # noqa: E731
        form.set_weights(grow(form.w_q), grow(form.w_k), form.log_tau.detach())
    grown = tmp_path / "grown"
    grown.mkdir()
    save_export(module.model, grown)
    copy_tokenizer(plain, grown)
    budget = shrink.Budget(8, calibration=calibration, sequences=6, length=16)
    shrunk, _ = shrink.shrink_pretrained(grown, tmp_path / "small", budget)
    loaded = load(tmp_path / "small")
    same_model(loaded, shrunk.model.eval())
    assert (tmp_path / "small" / "tokenizer.json").read_bytes() == (grown / "tokenizer.json").read_bytes()
    sizes = shrunk.head_sizes() + shrunk.value_sizes()
    assert min(shrunk.head_sizes()) >= 8 and sum(sizes) / 4 <= 8 < sum(sizes) / 4 + 1 / 4 and sizes != [12, 12, 8, 8]
    for (_, _, before), (_, _, after) in zip(module.growable_forms(), shrunk.growable_forms()):
        for name in ("w_q", "w_k"):
            assert torch.equal(getattr(after, name)[..., :8], getattr(before, name)[..., :8])
    # Down to the 8 rotary columns, with the values at 8: the original widths, so the folder is a Llama again (its
    # config and class, which hold q_proj/k_proj/v_proj/o_proj), loaded by transformers alone as the shrunk model.
    native, line = shrink.shrink_pretrained(grown, tmp_path / "native", shrink.Budget(8, "query_key"))
    assert native.head_sizes() == native.value_sizes() == [8, 8] and "(model type llama, " in line
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert type(reloaded).__name__ == "LlamaForCausalLM" and "qk_head_sizes" not in reloaded.config.to_dict()
    same_model(reloaded, native.model.eval())
    # The command writes the same folder and says so; a failure while writing leaves nothing behind.
    main(["--pretrained", str(grown), "--to", "mha", "--kv_budget", "8", "--calibration", str(calibration),
          "--calibration_sequences", "6", "--calibration_length", "16", "--out", str(tmp_path / "cli")])
    printed = capsys.readouterr().out
    assert printed.startswith(f"wrote {tmp_path / 'cli'} (model type growattn_llama, tokenizer files tokenizer.json, "
                              f"tokenizer_config.json): d_head {shrunk.head_sizes()} (mean ")
    assert f"allocation by activation-whitened energy on 96 tokens of {calibration} (kept " in printed
    assert "% of the NoPE score energy (the rotary columns are kept whole), " in printed  # the rotary ones: never cut
    torch.testing.assert_close(load(tmp_path / "cli").state_dict(), loaded.state_dict(), rtol=0, atol=0)

    def full_disk(model, folder):
        raise OSError("No space left on device")
    monkeypatch.setattr("lit_growattn.hf.export.save_export", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        shrink.shrink_pretrained(grown, tmp_path / "never", budget)
    assert not [p for p in tmp_path.iterdir() if "never" in p.name]


def test_a_shrunk_folder_keeps_any_tokenizer_files_and_the_dtype_its_weights_were_stored_in(tmp_path):
    """A folder whose tokenizer has no tokenizer.json (sentencepiece's tokenizer.model, or vocab.json + merges.txt)
    gets those files; a bfloat16 folder is written in bfloat16, the model shrunk in float32 and then cast."""
    needs_transformers()
    from hf_helpers import load, saved_tiny_model
    from transformers import AutoModelForCausalLM

    from lit_growattn.commands import shrink
    from lit_growattn.hf.module import HFCausalLM

    bf16 = tmp_path / "bf16"
    load(saved_tiny_model("llama", tmp_path / "llama")).to(torch.bfloat16).save_pretrained(bf16)
    (bf16 / "vocab.json").write_text("{}")
    (bf16 / "merges.txt").write_text("#version: 0.2\n")
    shrunk, line = shrink.shrink_pretrained(bf16, tmp_path / "small", shrink.Budget(4, "value"))
    assert "(model type growattn_llama, tokenizer files vocab.json, merges.txt): d_v [4, 4] (mean 4)" in line
    assert (tmp_path / "small" / "merges.txt").read_text() == "#version: 0.2\n"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "small", dtype="auto")
    assert {p.dtype for p in loaded.parameters()} == {p.dtype for p in shrunk.parameters()} == {torch.bfloat16}
    torch.testing.assert_close(loaded.state_dict(), shrunk.model.state_dict(), rtol=0, atol=0)
    reference = HFCausalLM(pretrained=str(bf16))  # float32: shrunk in float32, then cast
    shrink.shrink_module(reference, shrink.Budget(4, "value"), "", None, (64, 64), 96)
    torch.testing.assert_close(shrunk.model.state_dict(), reference.to(torch.bfloat16).model.state_dict(),
                               rtol=0, atol=0)
    sentencepiece = tmp_path / "sp"
    load(saved_tiny_model("llama", sentencepiece))
    (sentencepiece / "tokenizer.model").write_bytes(b"\x0a\x00")
    _, line = shrink.shrink_pretrained(sentencepiece, tmp_path / "sp_small", shrink.Budget(4, "value"))
    assert "tokenizer files tokenizer.model)" in line and (tmp_path / "sp_small" / "tokenizer.model").is_file()
