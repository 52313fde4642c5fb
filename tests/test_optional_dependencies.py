"""A test that needs an optional dependency skips without it on a plain `pip install .[dev]`, and fails where every
optional dependency is required (`make test`, CI), so that a broken install cannot pass by running fewer tests."""

import json

import pytest

from conftest import REPO, REQUIRE_OPTIONAL, needs_module

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
