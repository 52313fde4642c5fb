"""The import rules, read from the source with ast: no import cycle in the package or among the scripts, and the
settings import nothing above them.

The graph holds every import statement, lazy ones inside functions and those under `if TYPE_CHECKING:` included: a
cycle of type-only imports still means two modules that each need the other. Left out: the parent packages that
importing `a.b` runs first (every module would then sit in a cycle with the package's `__init__`, which gathers the
public names).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, needs_transformers


def module_names(root: Path, package: str | None) -> dict[str, Path]:
    """Dotted name → file of every module under root (a package's name for its __init__.py)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join([package, *parts] if package else parts)] = path
    assert names, f"no module under {root}: nothing to check"
    return names


def imported(tree: ast.AST, known: dict[str, Path]) -> set[str]:
    """The known modules that a module's import statements name (`from a import b` names `a.b` when that is a module)."""
    found: set[str] = set()

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update(f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module
                         for alias in node.names)
    return found & set(known)


def import_graph(root: Path, package: str | None) -> dict[str, set[str]]:
    known = module_names(root, package)
    return {name: imported(ast.parse(path.read_text()), known) - {name} for name, path in known.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module that importing `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def cycles(root: Path, package: str | None) -> list[list[str]]:
    graph = import_graph(root, package)
    found, state = [], {}  # state: 1 on the current path, 2 done

    def walk(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(graph[name]):
            if state.get(dep) == 1:
                found.append([*path[path.index(dep):], dep])
            elif dep not in state:
                walk(dep, [*path, dep])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            walk(name, [name])
    return found


def test_the_package_has_no_import_cycle():
    assert cycles(REPO / "lit_growattn", "lit_growattn") == []


def test_the_scripts_and_studies_have_no_import_cycle():
    assert cycles(REPO / "scripts", None) == []
    studies = [study for study in (REPO / "studies").iterdir() if study.is_dir()]
    assert studies
    for study in studies:  # each study's folder with the modules it shares with the others
        assert cycles(study, None) == []


def test_the_check_finds_a_cycle(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import d\n")
    (tmp_path / "d.py").write_text("import c\n")
    (tmp_path / "e.py").write_text("import a\n")
    assert cycles(tmp_path, None) == [["a", "b", "a"], ["c", "d", "c"]]


def test_the_settings_import_nothing_above_them():
    """The settings are the one place of every default and allowed value: the training machinery reads them,
    never the other way round."""
    graph = import_graph(REPO / "lit_growattn", "lit_growattn")
    imported_by_settings = reachable(graph, "lit_growattn.callback.settings")
    assert not {m for m in imported_by_settings if m.startswith("lit_growattn.callback")}


# The package's layers, lowest first: a module may import its own layer and those below, never one above.
LAYERS = [
    ("lit_growattn.growth",),  # pure torch: the growth maths
    ("lit_growattn.model", "lit_growattn.attention"),
    ("lit_growattn.callback.settings", "lit_growattn.training", "lit_growattn.analysis", "lit_growattn.data"),
    ("lit_growattn.callback", "lit_growattn.module"),
    ("lit_growattn.hf", "lit_growattn.dint"),
    ("lit_growattn.commands", "lit_growattn.__main__"),
    ("lit_growattn.callbacks", "lit_growattn.settings", "lit_growattn.growing"),  # old paths, kept working
]


def layer(module: str) -> int:
    return next(i for i, prefixes in enumerate(LAYERS) for p in prefixes if module == p or module.startswith(p + "."))


def test_no_module_imports_a_layer_above_its_own():
    graph = import_graph(REPO / "lit_growattn", "lit_growattn")
    graph.pop("lit_growattn")  # the package's __init__ gathers the public names from every layer
    upward = sorted((m, dep) for m, deps in graph.items() for dep in deps if dep != "lit_growattn" and layer(dep) > layer(m))
    assert upward == []


def test_the_top_level_holds_only_the_public_entry_points():
    assert sorted(p.name for p in (REPO / "lit_growattn").glob("*.py")) == [
        "__init__.py", "__main__.py", "analysis.py", "callbacks.py", "module.py", "settings.py"]


@pytest.mark.parametrize("first", ["lit_growattn.dint.attention", "lit_growattn.dint.models"])
def test_the_hugging_face_packages_import_in_any_order_and_register_every_model_type(first):
    """lit_growattn.hf registers the DINT model types that lit_growattn.dint defines on top of it: importing either
    first must work (a fresh interpreter each, since the order is what is tested; every other test imports
    lit_growattn.hf first)."""
    needs_transformers()
    code = (f"import {first}, lit_growattn.hf\n"
            "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
            "print(sorted(t for t in CONFIG_MAPPING if t.startswith(('dint_', 'growattn_'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    types = eval(done.stdout)  # noqa: S307 - our own subprocess's printed list
    assert {"dint_llama", "dint_qwen3", "growattn_llama", "growattn_gpt2"} <= set(types)


def test_reachable_follows_imports_through_other_modules(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import c\n")
    (tmp_path / "c.py").write_text("")
    (tmp_path / "d.py").write_text("import a\n")
    assert reachable(import_graph(tmp_path, None), "a") == {"b", "c"}
