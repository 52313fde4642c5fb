"""The writing layer under `convert` and `export` (`lit_growattn.training.writing`): what it refuses and how each
message names the fix (the command's `--overwrite`, Python's `overwrite=True`); a write that fails halfway leaves
the old target byte-equal and nothing beside it; a killed write's leftovers go at the next write to the same
target (and only its own); a symbolic link is written through and kept."""

from __future__ import annotations

import re

import pytest

from lit_growattn.training.writing import check_output, new_file, new_folder


def snapshot(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def source(tmp_path):
    """A folder that something is made from: `a.bin` and `b.bin`."""
    folder = tmp_path / "source"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"a" * 10)
    (folder / "b.bin").write_bytes(b"b" * 10)
    return folder


@pytest.mark.parametrize("option, fix", [("--out", "--overwrite"), ("out", "overwrite=True")])
def test_a_target_overlapping_its_source_is_refused_even_with_overwrite(source, option, fix):
    for out, relation in ((source, "is"), (source / "sub", "is inside"), (source.parent, "holds"),
                          (source / "a.bin", "is inside")):
        for overwrite in (False, True):
            with pytest.raises(ValueError) as refused:
                check_output(out, "folder", {"the model folder": source, "nothing": None}, overwrite, option=option)
            assert str(refused.value) == (f"{option} {out} {relation} the model folder ({source}), which is read to "
                                          f"write it: it is never overwritten, not even with {fix}; give {option} "
                                          "a path outside it")


def test_a_link_to_the_source_is_the_source(source, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(source)
    with pytest.raises(ValueError, match=f"--out {link} is the model folder"):
        check_output(link, "folder", {"the model folder": source}, overwrite=True)


@pytest.mark.parametrize("option, fix", [("--out", "give --overwrite"), ("out", "give overwrite=True")])
def test_an_existing_target_needs_overwrite(source, tmp_path, option, fix):
    with pytest.raises(ValueError, match=re.escape(f"{option} {source} already exists (a.bin, b.bin): {fix} to replace "
                                                   "it (the old one is kept until the new one is complete), or "
                                                   "another path") + "$"):
        check_output(source, "folder", {}, overwrite=False, option=option)
    assert check_output(source, "folder", {}, overwrite=True, option=option) == source
    with pytest.raises(ValueError, match=re.escape(f"{option} {source / 'a.bin'} already exists: {fix} to replace")):
        check_output(source / "a.bin", "file", {}, overwrite=False, option=option)
    (tmp_path / "empty").mkdir()  # an empty folder holds no one's work
    assert check_output(tmp_path / "empty", "folder", {}, overwrite=False) == tmp_path / "empty"


def test_a_file_where_a_folder_goes_or_the_reverse_is_refused(source):
    with pytest.raises(ValueError, match=re.escape("is a file; it must name a folder (one that does not exist yet, "
                                                   "or an empty one): give another path") + "$"):
        check_output(source / "a.bin", "folder", {}, overwrite=True)
    with pytest.raises(ValueError, match="is a folder; it must name a file"):
        check_output(source, "file", {}, overwrite=True)
    with pytest.raises(ValueError, match=re.escape(f"lies inside {source / 'a.bin'}, which is a file")):
        check_output(source / "a.bin" / "x", "file", {}, overwrite=True)


def write_one_then_fail(folder):
    (folder / "one.bin").write_bytes(b"new one")
    raise OSError("disk full")  # before the second file


@pytest.mark.parametrize("existing", [True, False])
def test_a_folder_failing_halfway_leaves_the_old_one_and_nothing_beside_it(source, existing):
    out = source if existing else source.parent / "new"
    before = snapshot(source)
    with pytest.raises(OSError, match="disk full"):
        with new_folder(out, overwrite=True) as folder:
            assert folder.parent == out.parent and folder.name.startswith(f".{out.name}.") and not any(folder.iterdir())
            write_one_then_fail(folder)
    assert snapshot(source) == before
    assert sorted(p.name for p in source.parent.iterdir()) == ["source"]


def test_a_complete_folder_replaces_the_old_one(source):
    with new_folder(source, overwrite=True) as folder:
        (folder / "c.bin").write_bytes(b"c")
    assert snapshot(source) == {"c.bin": b"c"}
    assert sorted(p.name for p in source.parent.iterdir()) == ["source"]  # the old one is gone, not hidden


def test_a_file_failing_halfway_leaves_the_old_one(source):
    out = source / "a.bin"
    with pytest.raises(OSError, match="disk full"):
        with new_file(out, overwrite=True) as partial:
            partial.write_bytes(b"new")
            raise OSError("disk full")
    assert snapshot(source) == {"a.bin": b"a" * 10, "b.bin": b"b" * 10}
    with new_file(out, overwrite=True) as partial:
        partial.write_bytes(b"new")
    assert snapshot(source) == {"a.bin": b"new", "b.bin": b"b" * 10}


def test_a_killed_writes_leftovers_go_at_the_next_write_to_its_target_and_only_its_own(tmp_path):
    (tmp_path / ".out.0123abcd.partial").mkdir()  # left by a kill -9 while writing `out`
    (tmp_path / ".out.0123abcd.partial" / "model.safetensors").write_bytes(b"half")
    (tmp_path / ".out.4567cdef.partial").write_bytes(b"half")  # a file's
    others = [".out.v2.0123abcd.partial", ".out.notahex.partial", ".out.notahex.old", "out.0123abcd.partial"]
    for name in others:  # another target's (`out.v2`), or not of this layer's making
        (tmp_path / name).write_bytes(b"keep")
    with new_folder(tmp_path / "out", overwrite=False) as folder:
        (folder / "x").write_bytes(b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", *others])
    (tmp_path / ".f.0123abcd.partial").write_bytes(b"half")
    with new_file(tmp_path / "f", overwrite=False) as partial:
        partial.write_bytes(b"f")
    assert (tmp_path / "f").read_bytes() == b"f" and not (tmp_path / ".f.0123abcd.partial").exists()


def test_a_linked_folder_is_written_through_the_link(tmp_path):
    """`--out LINK --overwrite`, LINK a link to an earlier export: the folder it points to is replaced (atomically,
    beside itself), and LINK stays the same link."""
    real = tmp_path / "exports" / "v1"
    real.mkdir(parents=True)
    (real / "old.bin").write_bytes(b"old")
    link = tmp_path / "latest"
    link.symlink_to(real)
    with pytest.raises(OSError, match="disk full"):
        with new_folder(link, overwrite=True) as folder:
            assert folder.parent == real.parent  # beside the real folder: the rename stays on its file system
            write_one_then_fail(folder)
    assert link.is_symlink() and snapshot(real) == {"old.bin": b"old"}
    with new_folder(link, overwrite=True) as folder:
        (folder / "new.bin").write_bytes(b"new")
    assert link.is_symlink() and link.resolve() == real and snapshot(real) == {"new.bin": b"new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exports", "latest"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["v1"]


def test_a_linked_file_is_written_through_the_link(tmp_path):
    real = tmp_path / "v1.ckpt"
    real.write_bytes(b"old")
    link = tmp_path / "latest.ckpt"
    link.symlink_to(real)
    with new_file(link, overwrite=True) as partial:
        partial.write_bytes(b"new")
    assert link.is_symlink() and real.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest.ckpt", "v1.ckpt"]


def test_a_dangling_link_is_written_through_too(tmp_path):
    link = tmp_path / "latest"
    link.symlink_to(tmp_path / "v2")  # not written yet
    with new_folder(link, overwrite=True) as folder:
        (folder / "new.bin").write_bytes(b"new")
    assert link.is_symlink() and snapshot(tmp_path / "v2") == {"new.bin": b"new"}


@pytest.mark.parametrize("option, fix", [("--out", "--overwrite"), ("out", "overwrite=True")])
def test_a_target_appearing_while_it_is_written_is_kept_without_overwrite(tmp_path, option, fix):
    """check_output found no target, then another process wrote one (two exports to one --out): the first to finish
    keeps it, and the other's result is discarded, not put in its place."""
    def appeared(name):
        return re.escape(f"{option} {tmp_path / name} appeared while this one was written (another process wrote "
                         f"it): nothing was replaced, and what was written here is discarded; give {fix} to replace "
                         "it, or another path") + "$"

    with pytest.raises(FileExistsError, match=appeared("out")):
        with new_folder(tmp_path / "out", overwrite=False, option=option) as folder:
            (folder / "mine.bin").write_bytes(b"mine")
            (tmp_path / "out").mkdir()
            (tmp_path / "out" / "theirs.bin").write_bytes(b"theirs")
    assert snapshot(tmp_path) == {"out/theirs.bin": b"theirs"}
    with pytest.raises(FileExistsError, match=appeared("f")):
        with new_file(tmp_path / "f", overwrite=False, option=option) as partial:
            partial.write_bytes(b"mine")
            (tmp_path / "f").write_bytes(b"theirs")
    assert (tmp_path / "f").read_bytes() == b"theirs" and sorted(p.name for p in tmp_path.iterdir()) == ["f", "out"]
    with new_folder(tmp_path / "out", overwrite=True) as folder:  # what overwrite is for
        (folder / "mine.bin").write_bytes(b"mine")
    with new_file(tmp_path / "f", overwrite=True) as partial:
        partial.write_bytes(b"mine")
    assert snapshot(tmp_path) == {"f": b"mine", "out/mine.bin": b"mine"}


def test_a_folder_killed_between_its_two_renames_is_put_back_at_the_next_write(source):
    """A kill after `out` was moved aside to `.out.<id>.old` and before the new one took its place: the next write to
    `out` puts the old one back first, so check_output sees it (and refuses it without overwrite)."""
    before = snapshot(source)
    source.rename(source.parent / ".source.0123abcd.old")
    with pytest.warns(UserWarning, match=re.escape(f"{source} was missing: its previous version, which a write killed "
                                                   "while replacing it had moved aside to .source.0123abcd.old, is put "
                                                   "back")):
        with pytest.raises(ValueError, match=re.escape(f"--out {source} already exists (a.bin, b.bin)")):
            check_output(source, "folder", {}, overwrite=False)
    assert snapshot(source) == before and sorted(p.name for p in source.parent.iterdir()) == ["source"]
    source.rename(source.parent / ".source.0123abcd.old")
    with pytest.warns(UserWarning, match="is put back"):
        with new_folder(source, overwrite=True) as folder:  # new_folder alone puts it back too, before replacing it
            assert snapshot(source) == before
            (folder / "c.bin").write_bytes(b"c")
    assert snapshot(source) == {"c.bin": b"c"} and sorted(p.name for p in source.parent.iterdir()) == ["source"]


def test_an_old_folder_left_beside_its_replacement_goes_at_the_next_write(source):
    (source.parent / ".source.0123abcd.old").mkdir()  # killed after the new one was in place, before the deletion
    (source.parent / ".source.0123abcd.old" / "a.bin").write_bytes(b"old")
    check_output(source, "folder", {}, overwrite=True)
    assert sorted(p.name for p in source.parent.iterdir()) == ["source"]


def test_several_old_folders_and_no_target_are_left_to_the_user(tmp_path):
    for name in (".out.0123abcd.old", ".out.4567cdef.old"):
        (tmp_path / name).mkdir()
    with pytest.raises(FileExistsError, match=re.escape(f"{tmp_path / 'out'} is missing, and 2 earlier versions of it "
                                                        "are hidden beside it (.out.0123abcd.old, .out.4567cdef.old): "
                                                        "rename the one to keep to out and delete the others, "
                                                        "then write again") + "$"):
        check_output(tmp_path / "out", "folder", {}, overwrite=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.0123abcd.old", ".out.4567cdef.old"]


def test_an_old_folder_that_cannot_be_deleted_is_a_warning_naming_it(source, monkeypatch):
    import lit_growattn.training.writing as writing

    def refuse_old(path, *args, **kwargs):
        raise PermissionError(f"permission denied: {path}")

    monkeypatch.setattr(writing.shutil, "rmtree", refuse_old)
    with pytest.warns(UserWarning, match=re.escape(f"{source} is written, but its previous version could not be "
                                                   f"deleted (permission denied: {source.parent}/.source.")):
        with new_folder(source, overwrite=True) as folder:
            (folder / "c.bin").write_bytes(b"c")
    assert snapshot(source) == {"c.bin": b"c"}
    (old,) = source.parent.glob(".source.*.old")
    assert snapshot(old) == {"a.bin": b"a" * 10, "b.bin": b"b" * 10}


def test_a_file_system_without_hard_links_names_overwrite_as_the_way(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError("Operation not permitted")

    monkeypatch.setattr("os.link", no_links)
    with pytest.raises(OSError, match=re.escape(f"--out {tmp_path / 'f'} could not be hard-linked into place "
                                                "(Operation not permitted)") + ".*give --overwrite to have it renamed"):
        with new_file(tmp_path / "f", overwrite=False) as partial:
            partial.write_bytes(b"mine")
    assert not any(tmp_path.iterdir())
    with new_file(tmp_path / "f", overwrite=True) as partial:
        partial.write_bytes(b"mine")
    assert (tmp_path / "f").read_bytes() == b"mine"


def test_a_long_listing_of_an_existing_target_names_three_and_ellipsis(tmp_path):
    (tmp_path / "out").mkdir()
    for names, listed in (("abc", "a.bin, b.bin, c.bin"), ("abcd", "a.bin, b.bin, c.bin, …")):
        for name in names:
            (tmp_path / "out" / f"{name}.bin").write_bytes(b"x")
        with pytest.raises(ValueError, match=re.escape(f"--out {tmp_path / 'out'} already exists ({listed}): ")):
            check_output(tmp_path / "out", "folder", {}, overwrite=False)


def test_a_source_after_one_not_given_is_still_refused(source):
    # Sources the command did not get (None) are passed over, not the end of the list.
    with pytest.raises(ValueError, match=f"--out {source} is the model folder"):
        check_output(source, "folder", {"the tokenizer": None, "the model folder": source}, overwrite=True)


@pytest.mark.parametrize("writer", [new_folder, new_file])
def test_a_target_in_folders_that_do_not_exist_yet_is_written(tmp_path, writer):
    out = tmp_path / "runs" / "first" / "out"
    with writer(out, overwrite=False) as partial:
        (partial / "a.bin" if writer is new_folder else partial).write_bytes(b"a")
    assert (out / "a.bin" if writer is new_folder else out).read_bytes() == b"a"
