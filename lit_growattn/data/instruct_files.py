"""Instruction rows (prompt, response) read from local files: JSON Lines line by line (or a JSON array), Parquet by the
two columns. Each row is checked as it is read; a file or row that cannot be read as prompt/response text raises
BadInstructionData, naming the file, the line or row, the field and what to do (`InstructDataModule` reads them).
"""

from __future__ import annotations

import codecs
import itertools
import json
import re
import reprlib
from collections.abc import Iterator
from pathlib import Path


class BadInstructionData(ValueError):
    """A row or file that cannot be read as prompt/response text; the message says where and what to do."""


def not_text(value) -> str | None:
    """Why a field's value cannot be a prompt or a response, None if it can (non-empty text)."""
    if value is None:
        return "is null"
    if not isinstance(value, str):
        return f"is {reprlib.repr(value)} ({type(value).__name__}), not text"
    return None if value.strip() else "is empty"


def refuse_missing_fields(where: str, fields: tuple[str, str], present: list[str], fix: str = "") -> None:
    missing = [f for f in fields if f not in present]
    if missing:
        raise BadInstructionData(f"{where} has no field {', '.join(map(repr, missing))}; its fields are {present}: "
                                 f"{fix}set --data.prompt_field / --data.response_field to the fields holding them")


def json_rows(path: str, fields: tuple[str, str]) -> Iterator[tuple[str, object, object]]:
    """(where, prompt, response) of each row of a JSON Lines file (or a JSON array); any other field is ignored."""
    rows = 0
    for place, row in _json_records(path):
        if not isinstance(row, dict):
            raise BadInstructionData(f"{path} {place} is {reprlib.repr(row)} ({type(row).__name__}), not an object: "
                                     f"each row must be one JSON object with fields {fields[0]!r} and {fields[1]!r}")
        refuse_missing_fields(f"{path} {place}", fields, list(row), fix="fix or remove the row, or ")
        rows += 1
        yield f"{path} {place}", row[fields[0]], row[fields[1]]
    if not rows:
        raise BadInstructionData(f"{path} has no rows: it needs one JSON object per line, with fields "
                                 f"{fields[0]!r} and {fields[1]!r}")


def _json_records(path: str) -> Iterator[tuple[str, object]]:
    """Each row of a JSON Lines file (or of a JSON array) parsed, with where it is: "line 7" ("row 3 (from 0)" in an
    array). A line that is not UTF-8 or not JSON raises BadInstructionData naming it."""
    with open(path, "rb") as f:
        if f.read(4096).removeprefix(codecs.BOM_UTF8).lstrip().startswith(b"["):
            f.seek(0)
            array = _parse_json(path, f.read(), first_line=1)
            yield from ((f"row {i} (from 0)", row) for i, row in enumerate(array))
            return
        f.seek(0)
        for number, line in enumerate(f, 1):
            if line.strip():  # a blank line holds no row
                yield f"line {number}", _parse_json(path, line.rstrip(b"\r\n"), first_line=number)


def _parse_json(path: str, data: bytes, first_line: int):
    try:
        return json.loads(data.decode("utf-8-sig"))  # -sig: a byte order mark, as some editors write, is no row
    except UnicodeDecodeError as err:
        line = first_line + data.count(b"\n", 0, err.start)
        keys = re.findall(rb'"((?:[^"\\]|\\.)*)"\s*:', data[data.rfind(b"\n", 0, err.start) + 1:err.start])
        field = f" in field {keys[-1].decode('utf-8', 'replace')!r}" if keys else ""
        raise BadInstructionData(f"{path} line {line} is not UTF-8 (byte 0x{data[err.start]:02x}{field}): save the "
                                 "file as UTF-8") from None
    except json.JSONDecodeError as err:
        raise BadInstructionData(f"{path} line {first_line + err.lineno - 1} is not valid JSON ({err.msg} at column "
                                 f"{err.colno}): fix or remove it (JSON Lines hold one whole object per line)") from None


def parquet_rows(path: str, fields: tuple[str, str]) -> Iterator[tuple[str, object, object]]:
    """(where, prompt, response) of each row of a Parquet file; only the two columns are read."""
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:
        raise BadInstructionData(f"{path} is not a Parquet file pyarrow can read ({type(err).__name__}: {err})") \
            from None
    refuse_missing_fields(path, fields, parquet.schema_arrow.names)
    if parquet.metadata.num_rows == 0:
        raise BadInstructionData(f"{path} has no rows")
    batches = parquet.iter_batches(columns=list(fields))
    pairs = itertools.chain.from_iterable(zip(b.column(fields[0]).to_pylist(), b.column(fields[1]).to_pylist())
                                          for b in batches)
    for index, (prompt, response) in enumerate(pairs):
        yield f"{path} row {index} (from 0)", prompt, response


def file_format(path: str) -> str | None:
    suffix = Path(path).suffix.lower()
    return {".jsonl": "json", ".json": "json", ".parquet": "parquet"}.get(suffix)
