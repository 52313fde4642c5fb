"""A generated arithmetic instruction set (made in code, no download) and its exact-answer accuracy.

Problems are `a + b`, `a - b` (a ≥ b) and `a * c` (c one digit) with a, b below `max_operand`. Each worked answer
splits the second operand into tens and units, adds (or subtracts, or multiplies) the parts one at a time, and
ends with `The answer is N.` — the line `extract_answer` reads, so accuracy is an exact comparison of integers.
Rows have the fields of nvidia/OpenMathInstruct-2 (`problem`, `generated_solution`, `expected_answer`), so the
instruction module reads them with its default field names.
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterable
from pathlib import Path

from lit_growattn.data.instruct import DEFAULT_CACHE, InstructDataModule

ANSWER = re.compile(r"The answer is (-?\d+)\.")


def worked_row(a: int, op: str, b: int) -> dict[str, str]:
    tens, units = b - b % 10, b % 10
    if op == "+":
        result, steps = a + b, f"{a} + {tens} = {a + tens}. {a + tens} + {units} = {a + b}."
    elif op == "-":
        result, steps = a - b, f"{a} - {tens} = {a - tens}. {a - tens} - {units} = {a - b}."
    else:
        a_tens, a_units = a - a % 10, a % 10
        result = a * b
        steps = f"{a_tens} * {b} = {a_tens * b}. {a_units} * {b} = {a_units * b}. {a_tens * b} + {a_units * b} = {result}."
    return {"problem": f"What is {a} {op} {b}?", "generated_solution": f"{steps} The answer is {result}.",
            "expected_answer": str(result)}


def make_rows(num_examples: int, seed: int, max_operand: int = 100) -> list[dict[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(num_examples):
        op = rng.choice("+-*")
        a, b = rng.randrange(max_operand), rng.randrange(10 if op == "*" else max_operand)
        rows.append(worked_row(max(a, b), op, min(a, b)) if op == "-" else worked_row(a, op, b))
    return rows


def extract_answer(text: str) -> int | None:
    """The integer of the first `The answer is N.` in text, None when there is none."""
    match = ANSWER.search(text)
    return int(match.group(1)) if match else None


def exact_answer_accuracy(generations: Iterable[str], expected: Iterable[str | int]) -> float:
    """Fraction of generations whose extracted answer equals the expected integer (no answer counts as wrong)."""
    pairs = list(zip(generations, expected, strict=True))
    if not pairs:
        raise ValueError("exact_answer_accuracy needs at least one generation")
    return sum(extract_answer(g) == int(e) for g, e in pairs) / len(pairs)


def write_jsonl(path: str | os.PathLike, rows: list[dict]) -> str:
    """Writes rows under a temporary name, then renames: ranks writing the same file never see half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    return str(path)


class ArithmeticDataModule(InstructDataModule):
    """The instruction module on `num_examples` generated arithmetic problems (the last `val_size` held out).

    Args:
        num_examples: Problems generated (training and validation together).
        data_seed: Seeds the problems (`seed` seeds the training order).
        max_operand: Operands are below this.
        Every other argument as `InstructDataModule` (without a dataset source).
    """

    def __init__(self, tokenizer: str, num_examples: int = 2000, data_seed: int = 0, max_operand: int = 100,
                 cache_dir: str | None = None, **kwargs) -> None:
        folder = Path(cache_dir or DEFAULT_CACHE).expanduser() / "arithmetic"
        path = folder / f"arithmetic-{num_examples}-{data_seed}-{max_operand}.jsonl"
        if not path.is_file():
            write_jsonl(path, make_rows(num_examples, data_seed, max_operand))
        super().__init__(tokenizer, path=str(path), cache_dir=cache_dir, **kwargs)
        self.rows_path = str(path)

    def held_out_problems(self) -> list[tuple[str, str]]:
        """(problem, expected answer) of the last `val_size` generated rows: the prompts to generate from when
        measuring exact-answer accuracy."""
        rows = [json.loads(line) for line in Path(self.rows_path).read_text().splitlines()]
        return [(r["problem"], r["expected_answer"]) for r in rows[len(rows) - self.val_size:]]
