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
