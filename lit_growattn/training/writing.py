"""Writing what the project makes for a user (a converted checkpoint, an exported or converted model folder) without
ever losing a user's files, whether a command (`export`, `convert`) or a Python function (`convert_checkpoint`,
`dint.models.convert_pretrained`, `hf.export.export`) writes it.

- `check_output` refuses, before any work: a target that overlaps what is read to make it (the same path, one
  inside the other), a file where a folder goes (or the reverse), and an existing target unless `overwrite` is
  given. Its messages name the fix as the caller spells it: `--overwrite` for a command's option (`--out`),
  `overwrite=True` for a Python argument (`out`).
- `new_folder` / `new_file` write into a temporary path beside the target (same parent, so the final rename is
  atomic) and rename it into place only once it is complete. An error removes the temporary path; a killed process
  leaves it (a hidden `.NAME.<id>.partial` beside the target) and the old target whole, and the next write to the
  same target removes it (so two writes to one target at the same time are not supported: the later one removes the
  earlier one's temporary path, which then fails; the old target stays whole either way).
- A target that is a symbolic link (or lies under one) is written through it: the folder or file it points to is
  replaced, and the link is kept, now pointing to the new content.
"""

from __future__ import annotations

import glob
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Literal


def check_output(out: str | os.PathLike, kind: Literal["folder", "file"], sources: dict[str, str | os.PathLike | None],
                 overwrite: bool, option: str = "--out") -> Path:
    """`out` as a Path, or a ValueError naming the problem and its fix. `sources`: what is read to make it, by a
    description (e.g. "the checkpoint"); a target overlapping one is refused even with `overwrite`. `option`: how
    the caller names `out`, a command's option (`--out`) or a Python argument (`out`)."""
    flag = "--overwrite" if option.startswith("--") else "overwrite=True"
    out = Path(out)
    target = out.resolve()
    for what, source in sources.items():
        if source is None:
            continue
        src = Path(source).resolve()
        relation = ("is" if target == src else "is inside" if target.is_relative_to(src)
                    else "holds" if src.is_relative_to(target) else None)
        if relation is not None:
            raise ValueError(f"{option} {out} {relation} {what} ({source}), which is read to write it: it is never "
                             f"overwritten, not even with {flag}; give {option} a path outside it")
    blocking = next((p for p in (target, *target.parents) if p.exists()), None)
    if blocking is not None and blocking != target and not blocking.is_dir():
        raise ValueError(f"{option} {out} lies inside {blocking}, which is a file, not a folder: give another path")
    if target.exists():
        if kind == "folder" and not target.is_dir():
            raise ValueError(f"{option} {out} is a file; it must name a folder (one that does not exist yet, or "
                             "an empty one): give another path")
        if kind == "file" and target.is_dir():
            raise ValueError(f"{option} {out} is a folder; it must name a file: give a file's path")
        if not overwrite and (kind == "file" or any(target.iterdir())):
            names = sorted(p.name for p in target.iterdir()) if kind == "folder" else []
            held = f" ({', '.join(names[:3])}{', …' if len(names) > 3 else ''})" if names else ""
            raise ValueError(f"{option} {out} already exists{held}: give {flag} to replace it (the old one "
                             "is kept until the new one is complete), or another path")
    return out


def _beside(path: Path, tag: str) -> Path:
    return path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.{tag}"


def _new_partial(out: Path) -> Path:
    """A fresh temporary path beside `out` (resolved by the caller, so that a link is written through), after
    removing the ones a killed earlier write to `out` left there."""
    out.parent.mkdir(parents=True, exist_ok=True)
    # Exactly _beside's names for `out`: `.a.*.partial` would also match the partials of a target `a.b`.
    for stale in out.parent.glob(f".{glob.escape(out.name)}.{'[0-9a-f]' * 8}.partial"):
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()
    return _beside(out, "partial")


@contextmanager
def new_folder(out: Path) -> Iterator[Path]:
    """Yields an empty folder to write into; on success it replaces `out` (an existing `out` is moved aside first
    and deleted last), on an error it is removed and `out` is untouched."""
    out = Path(out).resolve()
    partial = _new_partial(out)
    partial.mkdir()
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if not out.exists():
        partial.rename(out)
        return
    old = _beside(out, "old")
    out.rename(old)
    try:
        partial.rename(out)
    except BaseException:
        old.rename(out)
        shutil.rmtree(partial, ignore_errors=True)
        raise
    shutil.rmtree(old)


@contextmanager
def new_file(out: Path) -> Iterator[Path]:
    """Yields a path to write the file to; on success it replaces `out` (os.replace), on an error it is removed."""
    out = Path(out).resolve()
    partial = _new_partial(out)
    try:
        yield partial
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    os.replace(partial, out)
