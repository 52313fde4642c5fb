"""A test that needs an optional dependency skips without it on a plain `pip install .[dev]`, and fails where every
optional dependency is required (`make test`, CI), so that a broken install cannot pass by running fewer tests."""

import json

import pytest

from conftest import REPO, REQUIRE_OPTIONAL, needs_module, needs_shakespeare, require_shakespeare

MISSING = "lit_growattn_no_such_module"  # stands for an optional dependency that is not installed


@pytest.fixture
def plain_install(monkeypatch):
    monkeypatch.delenv(REQUIRE_OPTIONAL, raising=False)
    monkeypatch.delenv("CI", raising=False)


def test_a_missing_optional_module_skips_on_a_plain_install(plain_install):
    with pytest.raises(pytest.skip.Exception, match=f"{MISSING} is not installed \\(the hf extra\\)"):
        needs_module(MISSING, extra="hf")


@pytest.mark.parametrize("variable, value", [(REQUIRE_OPTIONAL, "1"), ("CI", "true")])
def test_a_missing_optional_module_fails_where_optional_dependencies_are_required(plain_install, monkeypatch,
                                                                                  variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(pytest.fail.Exception, match=f"{MISSING} cannot be imported .* install the hf extra, "
                                                    r"pip install -e '\.\[dev,hf\]'"):
        needs_module(MISSING, extra="hf")


@pytest.mark.parametrize("required", [False, True])
def test_an_installed_optional_module_is_returned(plain_install, monkeypatch, required):
    if required:
        monkeypatch.setenv(REQUIRE_OPTIONAL, "1")
    assert needs_module("json", extra="hf") is json


def test_make_test_requires_the_optional_dependencies_it_installs():
    makefile = (REPO / "Makefile").read_text()
    install = next(line for line in makefile.splitlines() if "pip install -e" in line)
    recipe = makefile.split("\ntest:", 1)[1].splitlines()[1]
    assert ".[dev,hf]" in install and f"{REQUIRE_OPTIONAL}=1 " in recipe


# The shared corpus (../shared/data/tinyshakespeare.txt) is an optional input like the optional dependencies:
# the tests marked needs_shakespeare skip without it, and fail where optional inputs are required.

def test_a_missing_shared_corpus_skips_on_a_plain_install(plain_install, tmp_path):
    with pytest.raises(pytest.skip.Exception, match="nope.txt is not beside this clone"):
        require_shakespeare(tmp_path / "nope.txt")


@pytest.mark.parametrize("variable, value", [(REQUIRE_OPTIONAL, "1"), ("CI", "true")])
def test_a_missing_shared_corpus_fails_where_optional_inputs_are_required(plain_install, monkeypatch, tmp_path,
                                                                          variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(pytest.fail.Exception, match="nope.txt is not beside this clone, and .* requires every "
                                                    "optional input: put the shared folder beside the clone"):
        require_shakespeare(tmp_path / "nope.txt")


@pytest.mark.parametrize("required", [False, True])
def test_a_present_shared_corpus_runs_the_test(plain_install, monkeypatch, tmp_path, required):
    if required:
        monkeypatch.setenv(REQUIRE_OPTIONAL, "1")
    (tmp_path / "corpus.txt").write_text("to be")
    assert require_shakespeare(tmp_path / "corpus.txt") is None


class MarkedItem:
    """What pytest_runtest_setup reads of a test: its marks."""

    def __init__(self, *marks):
        self.marks = {mark.name: mark for mark in marks}

    def get_closest_marker(self, name):
        return self.marks.get(name)


@pytest.mark.parametrize("marks, outcome", [((needs_shakespeare.mark,), pytest.fail.Exception), ((), None)])
def test_the_needs_shakespeare_mark_is_checked_before_its_tests(plain_install, monkeypatch, tmp_path, marks, outcome):
    import conftest

    monkeypatch.setattr(conftest, "SHAKESPEARE", tmp_path / "nope.txt")
    monkeypatch.setenv("CI", "true")
    if outcome is None:
        assert conftest.pytest_runtest_setup(MarkedItem(*marks)) is None
    else:
        with pytest.raises(outcome, match="nope.txt is not beside this clone"):
            conftest.pytest_runtest_setup(MarkedItem(*marks))


def test_the_lightning_releases_published_with_credential_stealing_code_are_never_installed():
    """lightning 2.6.2 and 2.6.3 (advisory GHSA-w37p-236h-pfx3): the dependency excludes them, and the
    installed version is not one of them."""
    import tomllib
    from importlib.metadata import version

    from packaging.requirements import Requirement

    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (lightning,) = [Requirement(d) for d in dependencies if Requirement(d).name == "lightning"]
    assert not any(lightning.specifier.contains(bad) for bad in ("2.6.2", "2.6.3"))
    assert lightning.specifier.contains("2.6.6")  # the version the project is tested with
    assert version("lightning") not in ("2.6.2", "2.6.3")
