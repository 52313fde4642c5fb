"""The import rules, read from the source with ast: the package's declared layers (LAYERS), no import cycle in the
package or among the scripts and studies, no import of an old path kept for users (COMPAT), and a bottom free of
Lightning, transformers and matplotlib.

The graph holds every import statement: lazy ones inside functions, relative ones, and those under
`if TYPE_CHECKING:` (a cycle of type-only imports still means two modules that each need the other). Importing
`a.b.c` runs `a/__init__.py` and `a/b/__init__.py` first, so it is an edge to those packages too, except to the
importer's own ancestors: Python runs them before the importer, and every module would otherwise sit in a cycle with
the `__init__` that gathers its package's public names.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, needs_transformers

PACKAGE = "lit_growattn"

# The package's rooms, lowest layer first. A module may import its own room and the layers below it; the rooms of one
# layer are siblings, and neither imports the other.
LAYERS = [
    ["growth", "contract"],  # pure torch: the growth maths | the protocols a growable model keeps
    ["attention"],  # the attention variants
    ["model"],  # the GPT and GPTConfig
    ["training"],  # Lightning glue shared by the LightningModules
    ["data", "analysis"],  # data modules | attention measurements
    ["module", "hf"],  # GrowAttentionLM | Hugging Face models
    ["callback.settings"],  # every setting of the callback, and nothing else of the callback
    ["callback", "dint"],  # the callback and what it runs | DINT conversions and the entropy callback
    ["commands"],
    ["facade"],  # the root package's public names, and the old paths
]
# Old import paths kept for users' code and configs: each is an alias of the module that moved (growing.schedule and
# growing.event, split in two, re-export their names). Nothing of the project imports them.
COMPAT = {
    "lit_growattn.model.contract", "lit_growattn.dint.attention", "lit_growattn.callbacks", "lit_growattn.settings",
    *(f"lit_growattn.growing.{m}" for m in ("schedule", "event", "window", "memory", "report", "trainer_ops", "averaging")),
}
# Modules that sit in a room other than their name says (the longest dotted prefix listed here or in LAYERS wins).
PLACED = {
    "": "facade",  # lit_growattn/__init__.py
    "__main__": "commands",
    "growing": "facade",  # the package of old paths
    **{old.removeprefix(PACKAGE + "."): "facade" for old in COMPAT},
}
PURE = ["growth", "contract", "attention", "model"]  # rooms that run without Lightning, transformers and matplotlib
HEAVY = {"lightning", "pytorch_lightning", "transformers", "matplotlib"}


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


def imported_names(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The absolute names that a module's import statements import (`from a import b` names `a.b` when that is a
    known module, else `a`)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative to the module's package (a package's __init__ is its own package)
                package = name.split(".")[:len(name.split(".")) - (path.name != "__init__.py") - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return found


def runs(target: str, importer: str) -> set[str]:
    """`target` and the packages that importing it runs first, less the importer's ancestors and itself; a name
    taken from an ancestor's `__init__` (`target` is that ancestor) needs it to have run, so that edge stays."""
    parts = target.split(".")
    prefixes = {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
    own = importer.split(".")
    return (prefixes - {".".join(own[:i]) for i in range(1, len(own) + 1)}) | ({target} - {importer})


def import_graph(root: Path, package: str | None) -> dict[str, set[str]]:
    known = module_names(root, package)
    return {name: {dep for target in imported_names(name, path, known) for dep in runs(target, name) if dep in known}
            for name, path in known.items()}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module that importing `start` imports, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def cycles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The groups of modules that import each other, directly or through others."""
    reach = {name: reachable(graph, name) for name in graph}
    return {frozenset(m for m in reach[name] if name in reach[m]) for name in graph if name in reach[name]}


def position(module: str, layers: list[list[str]] = LAYERS, placed: dict[str, str] = PLACED) -> tuple[int, str]:
    """(layer, room) of a module: its room is the longest dotted prefix of its name below the package that is placed
    or is a room (the package itself is placed as ""; a module under it is never placed by that)."""
    parts = module.split(".")[1:]
    for prefix in [".".join(parts[:i]) for i in range(len(parts), 0, -1)] or [""]:
        room = placed.get(prefix, prefix)
        for n, rooms in enumerate(layers):
            if room in rooms:
                return n, room
    raise LookupError(f"{module} is in no layer: add its room to LAYERS or PLACED")


def misplaced(graph: dict[str, set[str]], **where) -> set[tuple[str, str]]:
    """Imports that point up a layer, or into a sibling room."""
    found = set()
    for module, deps in graph.items():
        layer, room = position(module, **where)
        for dep in deps:
            dep_layer, dep_room = position(dep, **where)
            if dep_layer > layer or (dep_layer == layer and dep_room != room):
                found.add((module, dep))
    return found


def package_graph() -> dict[str, set[str]]:
    return import_graph(REPO / PACKAGE, PACKAGE)


def test_every_module_is_in_a_layer():
    for module in package_graph():
        position(module)


def test_no_import_points_up_a_layer_or_into_a_sibling_room():
    assert misplaced(package_graph()) == set()


def test_the_package_has_no_import_cycle():
    assert cycles(package_graph()) == set()


def test_nothing_imports_an_old_path():
    graph = package_graph()
    in_package = {(m, dep) for m, deps in graph.items() if m not in COMPAT for dep in deps & COMPAT}
    assert in_package == set()
    known = module_names(REPO / PACKAGE, PACKAGE)
    for folder in ("scripts", "studies"):
        for name, path in module_names(REPO / folder, None).items():
            olds = {dep for target in imported_names(name, path, known) for dep in runs(target, name)} & COMPAT
            assert not olds, f"{path} imports the old path {', '.join(sorted(olds))}"


def test_the_bottom_layers_need_no_lightning_transformers_or_matplotlib():
    known = module_names(REPO / PACKAGE, PACKAGE)
    for name, path in known.items():
        if position(name)[1] in PURE and name not in COMPAT:
            heavy = {target.split(".")[0] for target in imported_names(name, path, known)} & HEAVY
            assert not heavy, f"{name} imports {', '.join(sorted(heavy))}"


def test_the_scripts_and_studies_have_no_import_cycle():
    assert cycles(import_graph(REPO / "scripts", None)) == set()
    studies = [study for study in (REPO / "studies").iterdir() if study.is_dir()]
    assert studies
    for study in studies:  # each study's folder with the modules it shares with the others
        assert cycles(import_graph(study, None)) == set()


def test_the_checks_find_a_cycle_through_an_init_and_an_upward_import(tmp_path):
    root = tmp_path / "pkg"
    for folder in (root, root / "low", root / "high"):
        folder.mkdir()
    (root / "__init__.py").write_text("")
    (root / "low" / "__init__.py").write_text("")
    (root / "low" / "base.py").write_text("def f():\n    from ..high import thing\n")  # lazy, relative, upward
    (root / "high" / "__init__.py").write_text("from pkg.low.base import f\n")
    (root / "high" / "top.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.low.base\n")
    graph = import_graph(root, "pkg")
    assert graph["pkg.high.top"] == {"pkg.low", "pkg.low.base"}  # the package that the import runs first, too
    assert cycles(graph) == {frozenset({"pkg.high", "pkg.low.base"})}
    assert misplaced(graph, layers=[["low"], ["high"], ["facade"]], placed={"": "facade"}) == {("pkg.low.base", "pkg.high")}
    assert misplaced(graph, layers=[["low", "high"], ["facade"]], placed={"": "facade"}) == {
        ("pkg.low.base", "pkg.high"), ("pkg.high", "pkg.low"), ("pkg.high", "pkg.low.base"),
        ("pkg.high.top", "pkg.low"), ("pkg.high.top", "pkg.low.base")}


def test_the_check_finds_a_cycle_among_plain_modules(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import g\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import d\n")
    (tmp_path / "d.py").write_text("import c\n")
    (tmp_path / "e.py").write_text("import a\n")
    assert cycles(import_graph(tmp_path, None)) == {frozenset({"a", "b"}), frozenset({"c", "d"})}


def test_a_module_out_of_every_layer_is_named():
    with pytest.raises(LookupError, match="pkg.stray is in no layer"):
        position("pkg.stray", layers=[["low"], ["facade"]], placed={"": "facade"})
    assert position("pkg", layers=[["low"], ["facade"]], placed={"": "facade"}) == (1, "facade")


def test_a_name_taken_from_a_parent_packages_init_is_an_edge_to_it(tmp_path):
    root = tmp_path / "pkg"
    (root / "low").mkdir(parents=True)
    (root / "__init__.py").write_text("from pkg.low.base import X\n")
    (root / "low" / "__init__.py").write_text("")
    (root / "low" / "base.py").write_text("from pkg import Y\nX = 1\n")
    assert cycles(import_graph(root, "pkg")) == {frozenset({"pkg", "pkg.low.base"})}


def test_the_top_level_holds_only_the_public_entry_points():
    assert sorted(p.name for p in (REPO / PACKAGE).glob("*.py")) == [
        "__init__.py", "__main__.py", "analysis.py", "callbacks.py", "contract.py", "module.py", "settings.py"]
    # callbacks.py and settings.py are old paths (COMPAT): each is an alias of its module in callback/


@pytest.mark.parametrize("first", ["lit_growattn.dint.attention", "lit_growattn.dint.models", "lit_growattn.hf.dint"])
def test_any_module_of_the_hugging_face_side_registers_every_model_type(first):
    """Importing any of them runs lit_growattn.hf, which registers the grown and the DINT model types (a fresh
    interpreter each, since what is imported first is what is tested; every other test imports lit_growattn.hf
    first)."""
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
