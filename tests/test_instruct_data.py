"""Instruction data: labels on exactly the response tokens, chat template or plain template, truncation counted,
missing fields named, cache built once."""

import json

import pytest
import torch

from conftest import needs_transformers

needs_transformers()

from lit_growattn.data.instruct import PLAIN_TEMPLATE, InstructDataModule  # noqa: E402

from hf_helpers import instruct_tokenizer  # noqa: E402

ROWS = [{"problem": f"What is {a} + {b}?", "generated_solution": f"{a} + {b} = {a + b}. The answer is {a + b}.",
         "expected_answer": str(a + b)} for a, b in [(1, 2), (12, 7), (30, 45), (8, 9), (100, 23), (5, 5)]]


def write_jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(params=[True, False], ids=["chat_template", "plain"])
def tokenizer_dir(request, tmp_path):
    instruct_tokenizer(tmp_path / "tok", chat_template=request.param)
    return str(tmp_path / "tok")


def module(tmp_path, tokenizer_dir, **kwargs):
    kwargs = dict(tokenizer=tokenizer_dir, path=write_jsonl(tmp_path / "rows.jsonl"), val_size=2, batch_size=3,
                  max_length=64, cache_dir=str(tmp_path / "cache")) | kwargs
    dm = InstructDataModule(**kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_labels_are_exactly_the_response_and_eos(tmp_path, tokenizer_dir):
    dm = module(tmp_path, tokenizer_dir)
    tok = dm.tokenizer
    inputs, labels = next(iter(dm.train_dataloader()))
    assert inputs.shape == labels.shape
    seen = set()
    for ids, targets in zip(inputs, labels):
        supervised = targets != -100
        first, last = int(supervised.float().argmax()), int(supervised.nonzero().max())
        assert supervised[first:last + 1].all() and not supervised[:first].any()  # one response span
        assert torch.equal(targets[:-1][supervised[:-1]], ids[1:][supervised[:-1]])  # shifted once: target = next input
        assert targets[last] == tok.eos_token_id and (ids[last + 2:] == dm.pad_id).all()  # right padding after EOS
        prompt, response = tok.decode(ids[:first + 1]), tok.decode(targets[first:last])
        row = next(r for r in ROWS if r["generated_solution"] == response)
        seen.add(row["problem"])
        if tok.chat_template:
            assert prompt == f"<|user|>{row['problem']}\n<|assistant|>"
        else:
            assert prompt == "<s>" + PLAIN_TEMPLATE.format(prompt=row["problem"])
    assert len(seen) == len(inputs)


def test_over_long_example_is_truncated_and_counted(tmp_path, tokenizer_dir):
    rows = ROWS + [{"problem": "What is 1 + 1?", "generated_solution": "1 + 1 = 2. " * 40}]
    dm = module(tmp_path, tokenizer_dir, path=write_jsonl(tmp_path / "long.jsonl", rows), val_size=1, max_length=48)
    assert dm.num_truncated == 1 and dm.num_dropped == 0
    long = dm.val_sets[0][0]
    assert len(long["input_ids"]) == 48 and long["input_ids"][-1] != dm.tokenizer.eos_token_id
    assert all(len(e["input_ids"]) < 48 for e in dm.train_set)


def test_prompt_filling_max_length_is_dropped(tmp_path, tokenizer_dir):
    rows = ROWS + [{"problem": "What is 1 + 1? " * 30, "generated_solution": "2"}]
    dm = module(tmp_path, tokenizer_dir, path=write_jsonl(tmp_path / "p.jsonl", rows), max_length=64)
    assert (dm.num_truncated, dm.num_dropped) == (1, 1)
    assert len(dm.train_set) + len(dm.val_sets[0]) == len(ROWS)


def test_missing_field_names_the_fields(tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match=r"no field 'question'.*\['problem', 'generated_solution', 'expected_answer'\]"):
        module(tmp_path, tokenizer_dir, prompt_field="question")


def test_parquet_and_custom_fields_and_cache_reused(tmp_path, tokenizer_dir):
    from datasets import Dataset

    renamed = [{"q": r["problem"], "a": r["generated_solution"]} for r in ROWS]
    Dataset.from_list(renamed).to_parquet(str(tmp_path / "rows.parquet"))
    dm = module(tmp_path, tokenizer_dir, path=str(tmp_path / "rows.parquet"), prompt_field="q", response_field="a")
    assert len(dm.train_set) == len(ROWS) - 2
    cached = list((tmp_path / "cache").glob("instruct-*"))
    assert len(cached) == 1
    again = module(tmp_path, tokenizer_dir, path=str(tmp_path / "rows.parquet"), prompt_field="q", response_field="a")
    assert [e["input_ids"] for e in again.train_set] == [e["input_ids"] for e in dm.train_set]
    assert list((tmp_path / "cache").glob("instruct-*")) == cached


def test_cross_domain_text_windows(tmp_path, tokenizer_dir):
    (tmp_path / "other.txt").write_text("The quick brown fox. " * 100)
    dm = module(tmp_path, tokenizer_dir, val_texts={"fox": str(tmp_path / "other.txt")})
    assert dm.val_names == ["", "fox"]
    loaders = dm.val_dataloader()
    inputs, labels = next(iter(loaders[1]))
    assert inputs.shape[1] == 64 and torch.equal(labels[:, :-1], inputs[:, 1:])


def hub_folder(path, rows, split="train"):
    """A local folder `datasets.load_dataset` reads as it reads a hub dataset: passed where a hub name goes."""
    path.mkdir()
    write_jsonl(path / f"{split}.jsonl", rows)
    return str(path)


def test_cross_domain_hub_datasets_by_name_and_by_dict(tmp_path, tokenizer_dir):
    docs = [{"body": f"Document {i}: the fox jumps {i % 5} times.", "id": i} for i in range(60)]
    by_dict = {"hf_dataset": hub_folder(tmp_path / "hub", docs, split="test"), "hf_split": "test",
               "hf_text_field": "body"}
    by_name = hub_folder(tmp_path / "plain", [{"text": d["body"]} for d in docs])
    (tmp_path / "other.txt").write_text("The quick brown fox. " * 100)
    dm = module(tmp_path, tokenizer_dir, val_text_windows=3,
                val_texts={"file": str(tmp_path / "other.txt"), "math": by_dict, "prose": by_name})
    assert dm.val_names == ["", "file", "math", "prose"]
    tokens = dm.tokenizer("".join(d["body"] + "\n\n" for d in docs), add_special_tokens=False)["input_ids"]
    windows = [tokens[i * 65:(i + 1) * 65] for i in range(3)]  # max_length 64 inputs + their shifted targets
    for val_set in dm.val_sets[2:]:
        assert [e["input_ids"] for e in val_set] == [e["labels"] for e in val_set] == windows
    for loader in dm.val_dataloader()[1:]:
        inputs, labels = next(iter(loader))
        assert inputs.shape == (3, 64) and torch.equal(labels[:, :-1], inputs[:, 1:])


@pytest.mark.parametrize("value, error", [
    ("missing.txt", r"val_texts\['x'\] = '.*missing.txt' is not an existing text file, and as a hub dataset: "),
    ("hub", r"val_texts\['x'\] = '.*hub' is not an existing text file.*hf_text_field='text' is not a column "
            r".*\['body'\]"),
    ({"hf_dataset": "hub", "hf_feld": "body"},
     r"a dict with hf_dataset and optionally .* \(unknown keys \['hf_feld'\]\)"),
    ({"hf_dataset": "hub", "hf_text_field": "body", "hf_split": "dev"},
     r"val_texts\['x'\] = \{.*\}: ValueError: Unknown split \"dev\""),
])
def test_cross_domain_bad_value_fails_before_training_naming_both_readings(tmp_path, tokenizer_dir, value, error, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hub_folder(tmp_path / "hub", [{"body": "some text"}])
    with pytest.raises(ValueError, match=error):
        module(tmp_path, tokenizer_dir, val_texts={"x": value})
