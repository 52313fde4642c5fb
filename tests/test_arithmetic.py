"""The generated arithmetic set: every worked answer is right and ends in a checkable final answer."""

import pytest

from lit_growattn.data.arithmetic import ArithmeticDataModule, exact_answer_accuracy, extract_answer, make_rows

from conftest import needs_transformers
from hf_helpers import instruct_tokenizer


def test_worked_answers_are_correct_and_extractable():
    rows = make_rows(300, seed=1)
    assert {r["problem"].split()[3] for r in rows} == {"+", "-", "*"}
    for r in rows:
        a, op, b = r["problem"].removeprefix("What is ").removesuffix("?").split()
        truth = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert extract_answer(r["generated_solution"]) == truth == int(r["expected_answer"])
        for step in r["generated_solution"].split(". ")[:-1]:  # every intermediate equation holds
            lhs, rhs = step.rstrip(".").split(" = ")
            assert eval(lhs) == int(rhs)  # noqa: S307 - digits and + - * only
    assert make_rows(50, seed=1) == rows[:50] and make_rows(50, seed=2) != rows[:50]


def test_exact_answer_accuracy():
    assert exact_answer_accuracy(["so The answer is 12.", "The answer is -3.", "no idea", "The answer is 7."],
                                 ["12", -3, "5", "8"]) == 0.5
    with pytest.raises(ValueError):
        exact_answer_accuracy([], [])


def test_arithmetic_module_reads_generated_rows(tmp_path):
    needs_transformers()
    instruct_tokenizer(tmp_path / "tok", chat_template=False)
    dm = ArithmeticDataModule(str(tmp_path / "tok"), num_examples=40, val_size=8, cache_dir=str(tmp_path / "c"))
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_set) == 32 and len(dm.val_sets[0]) == 8 and dm.num_truncated == 0
    problems = dm.held_out_problems()
    assert len(problems) == 8
    first = dm.tokenizer.decode(dm.val_sets[0][0]["input_ids"])
    assert problems[0][0] in first and f"The answer is {problems[0][1]}." in first
