"""Bad instruction data fails before training with the file, the line (the row, from 0, for Parquet, a JSON array or
a hub dataset), the field and what to do: through InstructDataModule, and through `python -m lit_growattn fit` with
the tiny SFT config."""

import json
import re

import pytest

from conftest import REPO, needs_transformers

needs_transformers()

from lit_growattn.__main__ import main as command_line  # noqa: E402
from lit_growattn.data.instruct import InstructDataModule  # noqa: E402

from hf_helpers import instruct_tokenizer, saved_tiny_model  # noqa: E402

GOOD = [json.dumps({"problem": f"What is {i} + 1?", "generated_solution": f"{i} + 1 = {i + 1}."}).encode()
        for i in range(6)]
NEEDS = "every row needs text in 'problem' and 'generated_solution'; fix or remove the row"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    instruct_tokenizer(folder, chat_template=False)
    return str(folder)


def jsonl(path, *lines: bytes) -> str:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return str(path)


def prepare(tmp_path, tokenizer, path, **kwargs) -> InstructDataModule:
    dm = InstructDataModule(tokenizer=tokenizer, path=path, val_size=1, cache_dir=str(tmp_path / "cache"), **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("lines, error", [
    pytest.param([b"  ", b""], "has no rows: it needs one JSON object per line, with fields 'problem' and "
                 "'generated_solution'", id="only-blank-lines"),
    pytest.param([*GOOD[:3], b'{"problem": "What is 0?", "generated_solution": null}', *GOOD[3:]],
                 f"line 4: 'generated_solution' is null: {NEEDS}", id="null-response"),
    pytest.param([GOOD[0], b'{"problem": "What is 0?"}', *GOOD[1:]],
                 "line 2 has no field 'generated_solution'; its fields are ['problem']: fix or remove the row, or "
                 "set --data.prompt_field / --data.response_field to the fields holding them", id="missing-response"),
    pytest.param([*GOOD[:4], b'{"problem": "Caf\xe9?", "generated_solution": "yes"}', *GOOD[4:]],
                 "line 5 is not UTF-8 (byte 0xe9 in field 'problem'): save the file as UTF-8", id="not-utf8"),
    pytest.param([*GOOD[:2], b'{"problem": "What is 0?", "generated_solution": "0"', *GOOD[2:]],
                 "line 3 is not valid JSON (Expecting ',' delimiter at column 52): fix or remove it (JSON Lines "
                 "hold one whole object per line)", id="malformed"),
    pytest.param([*GOOD[:2], b"", b'{"problem": "What is 3 + 4?", "generated_solution": 7}', *GOOD[2:]],
                 f"line 4: 'generated_solution' is 7 (int), not text: {NEEDS}", id="integer-response-after-blank"),
    pytest.param([*GOOD, b'{"problem": " ", "generated_solution": "0"}'], f"line 7: 'problem' is empty: {NEEDS}",
                 id="empty-prompt"),
    pytest.param([GOOD[0], b'["What is 0?", "0"]', *GOOD[1:]],
                 "line 2 is ['What is 0?', '0'] (list), not an object: each row must be one JSON object with fields "
                 "'problem' and 'generated_solution'",
                 id="not-an-object"),
])
def test_bad_jsonl_names_file_line_and_field(tmp_path, tokenizer, lines, error):
    path = jsonl(tmp_path / "rows.jsonl", *lines)
    with pytest.raises(ValueError, match=re.escape(f"{path} {error}")):
        prepare(tmp_path, tokenizer, path)
    assert not list((tmp_path / "cache").glob("instruct-*"))  # nothing half-built is taken for the data later


def test_empty_file_is_refused_when_the_module_is_built(tmp_path, tokenizer):
    path = jsonl(tmp_path / "rows.jsonl")
    with pytest.raises(ValueError, match=re.escape(f"instruction file {path!r} is empty: it needs one example per "
                                                   "row, with text in 'problem' and 'generated_solution'")):
        InstructDataModule(tokenizer=tokenizer, path=path)


def test_fixed_row_is_read_again(tmp_path, tokenizer):
    path = jsonl(tmp_path / "rows.jsonl", *GOOD, b'{"problem": "What is 0?", "generated_solution": null}')
    with pytest.raises(ValueError, match="line 7: 'generated_solution' is null"):
        prepare(tmp_path, tokenizer, path)
    jsonl(tmp_path / "rows.jsonl", *GOOD, b'{"problem": "What is 0?", "generated_solution": "0"}')
    dm = prepare(tmp_path, tokenizer, path)
    assert len(dm.train_set) + len(dm.val_sets[0]) == 7


def test_other_fields_and_rows_past_max_examples_are_not_read(tmp_path, tokenizer):
    """Only the two fields of the rows used are read: other fields may differ between files and rows in their names
    and types (the datasets JSON loader refuses both, the latter beside a blank line)."""
    first = jsonl(tmp_path / "a.jsonl", GOOD[0], b"", b'{"problem": "p", "generated_solution": "s", "answer": 1}',
                  b'{"problem": "p", "generated_solution": "s", "answer": "one"}')
    second = jsonl(tmp_path / "b.jsonl", b'{"problem": "p", "generated_solution": "s", "source": [1]}', GOOD[1],
                   b'{"problem": "p", "generated_solution": null}')
    dm = prepare(tmp_path, tokenizer, [first, second], max_examples=5)
    assert len(dm.train_set) + len(dm.val_sets[0]) == 5


def test_byte_order_mark_is_no_row_and_pretty_printed_json_names_the_first_line(tmp_path, tokenizer):
    dm = prepare(tmp_path, tokenizer, jsonl(tmp_path / "bom.jsonl", b"\xef\xbb\xbf" + GOOD[0], *GOOD[1:]))
    assert len(dm.train_set) + len(dm.val_sets[0]) == len(GOOD)
    array = tmp_path / "bom.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps([json.loads(line) for line in GOOD], indent=2).encode())
    dm = prepare(tmp_path, tokenizer, str(array))
    assert len(dm.train_set) + len(dm.val_sets[0]) == len(GOOD)
    pretty = tmp_path / "pretty.jsonl"
    pretty.write_text("".join(json.dumps(json.loads(line), indent=2) + "\n" for line in GOOD))
    with pytest.raises(ValueError, match=re.escape(f"{pretty} line 1 is not valid JSON (Expecting property name "
                                                   "enclosed in double quotes at column 2): fix or remove it (JSON "
                                                   "Lines hold one whole object per line)")):
        prepare(tmp_path, tokenizer, str(pretty))


def test_bad_row_in_a_later_file_names_that_file_and_its_line(tmp_path, tokenizer):
    first = jsonl(tmp_path / "a.jsonl", *GOOD)
    second = jsonl(tmp_path / "b.jsonl", GOOD[0], b"", b'{"problem": "What is 0?", "generated_solution": 0.5}')
    with pytest.raises(ValueError, match=re.escape(f"{second} line 3: 'generated_solution' is 0.5 (float), not text")):
        prepare(tmp_path, tokenizer, [first, second])


def test_json_array_row_is_named_by_its_index(tmp_path, tokenizer):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([json.loads(line) for line in GOOD[:2]] + [{"problem": "What is 0?"}]))
    with pytest.raises(ValueError, match=re.escape(f"{path} row 2 (from 0) has no field 'generated_solution'")):
        prepare(tmp_path, tokenizer, str(path))


def parquet(path, rows) -> str:
    from datasets import Dataset

    Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def test_parquet_null_names_the_row_and_the_configured_field(tmp_path, tokenizer):
    rows = [{"q": f"What is {i}?", "a": str(i)} for i in range(5)]
    rows[2]["a"] = None
    path = parquet(tmp_path / "rows.parquet", rows)
    with pytest.raises(ValueError, match=re.escape(f"{path} row 2 (from 0): 'a' is null: every row needs "
                                                   "text in 'q' and 'a'; fix or remove the row")):
        prepare(tmp_path, tokenizer, path, prompt_field="q", response_field="a")


def test_parquet_without_the_column_lists_its_columns(tmp_path, tokenizer):
    path = parquet(tmp_path / "rows.parquet", [{"q": f"What is {i}?", "answer": str(i)} for i in range(5)])
    error = (f"{path} has no field 'a'; its fields are ['q', 'answer']: set --data.prompt_field / "
             "--data.response_field to the fields holding them")
    with pytest.raises(ValueError, match=re.escape(error)):
        prepare(tmp_path, tokenizer, path, prompt_field="q", response_field="a")


def test_parquet_file_that_is_not_one_or_has_no_rows_is_named(tmp_path, tokenizer):
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"\n".join(GOOD))
    with pytest.raises(ValueError, match=re.escape(f"{path} is not a Parquet file pyarrow can read (")):
        prepare(tmp_path, tokenizer, str(path))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"problem": pa.array([], pa.string()), "generated_solution": pa.array([], pa.string())}),
                   path)
    with pytest.raises(ValueError, match=re.escape(f"{path} has no rows")):
        prepare(tmp_path, tokenizer, str(path))


def test_hub_dataset_row_is_named_by_split_and_index(tmp_path, tokenizer):
    hub = tmp_path / "hub"  # a folder `datasets.load_dataset` reads as it reads a hub dataset
    hub.mkdir()
    jsonl(hub / "train.jsonl", *GOOD[:3], b'{"problem": "What is 3?", "generated_solution": 3}')
    dm = InstructDataModule(tokenizer=tokenizer, hf_dataset=str(hub), val_size=1, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=re.escape(f"{hub} (split 'train') row 3 (from 0): 'generated_solution' is "
                                                   "3 (int), not text")):
        dm.prepare_data()


def test_directory_mixed_formats_and_one_field_for_both_are_refused_when_the_module_is_built(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=re.escape(f"instruction file {str(tmp_path)!r} is a directory: list its "
                                                   f"files, e.g. --data.path '[{tmp_path}/a.jsonl")):
        InstructDataModule(tokenizer=tokenizer, path=str(tmp_path))
    files = [jsonl(tmp_path / "a.jsonl", *GOOD), parquet(tmp_path / "b.parquet", [{"problem": "p"}])]
    with pytest.raises(ValueError, match="mix JSON and Parquet: give files of one format"):
        InstructDataModule(tokenizer=tokenizer, path=files)
    with pytest.raises(ValueError, match="prompt_field and response_field are both 'text': name the two fields"):
        InstructDataModule(tokenizer=tokenizer, path=files[0], prompt_field="text", response_field="text")


# -- the user's path: `python -m lit_growattn fit` with the tiny SFT config, in this process ----------------------

@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    saved_tiny_model("llama", folder, vocab=len(instruct_tokenizer(folder, chat_template=False)))
    return folder


@pytest.mark.parametrize("lines, error", [
    pytest.param([], "rows.jsonl' is empty: it needs one example per row", id="empty"),
    pytest.param([*GOOD[:2], b'{"problem": "What is 0?", generated_solution: "0"}', *GOOD[2:]],
                 "rows.jsonl line 3 is not valid JSON (Expecting property name enclosed in double quotes at column "
                 "27): fix or remove it", id="malformed"),
])
def test_fit_refuses_bad_rows_before_training(tmp_path, llama, capsys, monkeypatch, lines, error):
    monkeypatch.delenv("LIT_GROWATTN_DEBUG", raising=False)
    path = jsonl(tmp_path / "rows.jsonl", *lines)
    code = command_line(["fit", "--config", str(REPO / "configs" / "hf_llama_dint_sft_tiny.yaml"),
                         f"--model.init_args.pretrained={llama}", f"--data.init_args.tokenizer={llama}",
                         f"--data.init_args.path={path}", f"--data.init_args.cache_dir={tmp_path / 'cache'}",
                         f"--trainer.logger.init_args.save_dir={tmp_path / 'logs'}",
                         f"--trainer.default_root_dir={tmp_path}"])
    stderr = capsys.readouterr().err
    assert code == 1, stderr[-2000:]
    report = stderr[stderr.index("error:"):]
    assert error in report.splitlines()[0] and "Traceback" not in stderr, report
    assert not list(tmp_path.rglob("*.ckpt"))
