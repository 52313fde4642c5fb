"""Writing what the project makes for a user (a converted checkpoint, an exported or converted model folder) without
ever losing a user's files, whether a command (`export`, `convert`) or a Python function (`convert_checkpoint`,
`dint.models.convert_pretrained`, `hf.export.export`) writes it.

- `check_output` refuses, before any work: a target that overlaps what is read to make it (the same path, one
  inside the other), a file where a folder goes (or the reverse), and an existing target unless `overwrite` is
  given. Its messages name the fix as the caller spells it: `--overwrite` for a command's option (`--out`),
  `overwrite=True` for a Python argument (`out`). It first undoes what a killed write to the target left (below).
- `new_folder` / `new_file` write into a temporary path beside the target (same parent, so the final rename is
  atomic) and rename it into place only once it is complete. An error removes the temporary path.
- They are given `overwrite` too, since a target can appear after `check_output` (another process, or two writes
  to one `--out` at once): without it, the finishing step refuses an existing target (a rename onto a non-empty
  folder fails; a file is hard-linked into place, which fails if the name is taken), and the new result is
  discarded with a FileExistsError worded as `check_output`'s. Where a file system has no hard links, a file is
  written only with `overwrite`, and the error says so.
- Replacing a folder takes two renames (the old folder aside to a hidden `.NAME.<id>.old`, the new one into
  place) and then deletes the old one; a failure to delete it is a warning that names it. A killed process leaves
  a hidden `.NAME.<id>.partial` (the old target whole), or, killed between the two renames, no target and the old
  folder in its `.old`. The next write to the same target (its `check_output`, or `new_folder` / `new_file`)
  removes the partials, puts a lone `.old` back when the target is missing (with a warning), and deletes `.old`
  leftovers when the target is there. Until that next write, the target is missing: the window is two renames
  long, and nothing closes it but that write. Two writes to one target at the same time are not supported: one
  may remove the other's temporary path, which then fails; no one's finished target is lost either way.
- A target that is a symbolic link (or lies under one) is written through it: the folder or file it points to is
  replaced, and the link is kept, now pointing to the new content.
"""

from __future__ import annotations

import glob
import os
import shutil
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Literal


def check_output(out: str | os.PathLike, kind: Literal["folder", "file"], sources: dict[str, str | os.PathLike | None],
                 overwrite: bool, option: str = "--out") -> Path:
    """`out` as a Path, or a ValueError naming the problem and its fix. `sources`: what is read to make it, by a
    description (e.g. "the checkpoint"); a target overlapping one is refused even with `overwrite`. `option`: how
    the caller names `out`, a command's option (`--out`) or a Python argument (`out`)."""
    flag = _flag(option)
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
    if target.parent.is_dir():
        _recover(target)  # before looking at the target: a folder a killed write hid is put back first
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


def _leftovers(out: Path, tag: str) -> list[Path]:
    # Exactly _beside's names for `out`: `.a.*.partial` would also match the partials of a target `a.b`.
    return sorted(out.parent.glob(f".{glob.escape(out.name)}.{'[0-9a-f]' * 8}.{tag}"))


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


def _recover(out: Path) -> None:
    """Undoes what a killed write to `out` (resolved) left beside it: its temporary paths go, and the previous
    folder that a replacement had moved aside goes back to `out` if `out` is missing (the kill came between the
    two renames), or goes if `out` is there (the kill came after the new one was in place)."""
    for stale in _leftovers(out, "partial"):
        _remove(stale)
    olds = _leftovers(out, "old")
    if os.path.lexists(out):
        for old in olds:
            _remove(old)
    elif len(olds) == 1:
        olds[0].rename(out)
        warnings.warn(f"{out} was missing: its previous version, which a write killed while replacing it had moved "
                      f"aside to {olds[0].name}, is put back")
    elif olds:  # only writes to `out` at the same time make several: which one is the user's is not known here
        raise FileExistsError(f"{out} is missing, and {len(olds)} earlier versions of it are hidden beside it "
                              f"({', '.join(p.name for p in olds)}): rename the one to keep to {out.name} and "
                              "delete the others, then write again")


def _new_partial(out: Path) -> Path:
    """A fresh temporary path beside `out` (resolved by the caller, so that a link is written through), after
    undoing what a killed earlier write to `out` left there."""
    out.parent.mkdir(parents=True, exist_ok=True)
    _recover(out)
    return _beside(out, "partial")


def _flag(option: str) -> str:
    return "--overwrite" if option.startswith("--") else "overwrite=True"


def _appeared(out: Path, option: str) -> FileExistsError:
    return FileExistsError(f"{option} {out} appeared while this one was written (another process wrote it): nothing "
                           f"was replaced, and what was written here is discarded; give {_flag(option)} to replace "
                           "it, or another path")


@contextmanager
def new_folder(out: str | os.PathLike, overwrite: bool, option: str = "--out") -> Iterator[Path]:
    """Yields an empty folder to write into; on success it replaces `out` (an existing `out` is moved aside first
    and deleted last), on an error it is removed and `out` is untouched. Without `overwrite`, an `out` that is not
    an empty folder when the writing is done (check_output had found none) is kept, and the new folder discarded:
    a FileExistsError worded as check_output's, `option` naming `out` as the caller does."""
    given, out = Path(out), Path(out).resolve()
    partial = _new_partial(out)
    partial.mkdir()
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if not overwrite or not out.exists():
        try:
            partial.rename(out)  # onto an existing folder only if it is empty; never onto a file
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
            if os.path.lexists(out):
                raise _appeared(given, option) from None
            raise
        return
    old = _beside(out, "old")
    out.rename(old)
    try:
        partial.rename(out)
    except BaseException:
        old.rename(out)
        shutil.rmtree(partial, ignore_errors=True)
        raise
    try:
        shutil.rmtree(old)
    except OSError as error:  # the new folder is in place: only the old one's space is not given back
        warnings.warn(f"{out} is written, but its previous version could not be deleted ({error}): delete {old}")


@contextmanager
def new_file(out: str | os.PathLike, overwrite: bool, option: str = "--out") -> Iterator[Path]:
    """Yields a path to write the file to; on success it replaces `out` (os.replace), on an error it is removed.
    Without `overwrite`, an `out` that exists when the writing is done is kept, and the new file discarded, as
    new_folder does."""
    given, out = Path(out), Path(out).resolve()
    partial = _new_partial(out)
    try:
        yield partial
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    try:
        if overwrite:
            os.replace(partial, out)
            return
        try:
            os.link(partial, out)  # unlike a rename, refuses an existing `out`
        except FileExistsError:
            raise _appeared(given, option) from None
        except OSError as error:  # e.g. a file system without hard links; os.replace needs none
            raise OSError(f"{option} {given} could not be hard-linked into place ({error}), the way that never "
                          f"replaces a file another process wrote meanwhile: give {_flag(option)} to have it renamed "
                          "into place instead") from None
    finally:
        partial.unlink(missing_ok=True)  # a failed rename's partial, or the link's second name
