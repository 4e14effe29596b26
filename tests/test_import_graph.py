"""The package's import graph, read from the source with `ast`: no import loop anywhere in `dual_cache` (the library
and `eval/`, installed as `dual_cache.eval`); the library's packages in one order, bottom to top (`LEVELS`: a package
imports only those below it, a failure names the file, line and both packages of each import against it); and the
library imports nothing from `dual_cache.eval`, not even inside a function (docs/architecture.md: evaluation sits on
top; the CLI reaches it through the `dual_cache.commands` entry-point group).

Every `import` statement counts, at module level or inside a function or class body (under `if TYPE_CHECKING:` too:
a type-only import of the evaluation code still ties the library to it). `from pkg import name` is an
edge to `pkg.name` when that is a module of the package, else to `pkg`; relative imports are resolved against the
importing module's package. Importing `a.b.c` also runs `a` and `a.b`'s `__init__`, but those edges are not drawn:
a loop through a package's `__init__` shows up as the package importing its submodule and the submodule importing a
name from the package."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = "dual_cache"
EVAL = "dual_cache.eval"
# where each top-level package's source lives (pyproject's [tool.setuptools.package-dir])
SOURCES = {LIBRARY: ROOT / "dual_cache", EVAL: ROOT / "eval"}


def module_files() -> dict[str, Path]:
    """Every module of the package: dotted name → source file (`__init__.py` names the package itself)."""
    modules = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an `ImportFrom` names (relative levels resolved against `module`'s package)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The package's modules `module` imports, anywhere in its source: imported module → first line number."""
    edges: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, path.name == "__init__.py", node)
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.name` style leftovers: the longest known prefix
                target = target.rpartition(".")[0]
            if target and target != module:
                edges.setdefault(target, node.lineno)
    return edges


def import_graph() -> dict[str, dict[str, int]]:
    modules = module_files()
    return {module: imports_of(module, path, modules) for module, path in modules.items()}


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each as one loop through them."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(node):  # recursive: the package has a few hundred modules at most
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(_loop(graph, sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def _loop(graph: dict[str, dict[str, int]], component: list[str]) -> list[str]:
    """One closed path through a strongly connected component, from its first member back to it (breadth-first)."""
    members = set(component)
    start = component[0]
    parents = {start: None}
    frontier = [start]
    while frontier:
        next_frontier = []
        for node in frontier:
            for target in sorted(graph[node]):
                if target == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return list(reversed(path)) + [start]
                if target in members and target not in parents:
                    parents[target] = node
                    next_frontier.append(target)
        frontier = next_frontier
    raise AssertionError(f"{component} is not strongly connected")


def _describe(graph, loop, modules) -> str:
    steps = [f"  {source} ({modules[source].relative_to(ROOT)}:{graph[source][target]}) imports {target}"
             for source, target in zip(loop, loop[1:])]
    return "\n".join(steps)


def test_module_names_are_read_from_both_source_folders():
    modules = module_files()
    assert {"dual_cache", "dual_cache.cache", "dual_cache.cache.cache", "dual_cache.eval",
            "dual_cache.eval.quality.harness"} <= set(modules)


def test_resolution_of_relative_and_from_imports(tmp_path):
    """`from . import x` (x a module) is an edge to the module; `from .pkg import name` (name not a module) to the
    package; `import a.b.name`-style leftovers to the longest known module."""
    modules = {"p": tmp_path / "__init__.py", "p.a": tmp_path / "a.py", "p.sub": tmp_path / "sub" / "__init__.py",
               "p.sub.b": tmp_path / "sub" / "b.py"}
    source = ("from . import a\nfrom .sub import b, helper\ndef f():\n    from ..a import thing\n"
              "import p.sub.b.attr\n")
    (tmp_path / "sub").mkdir()
    modules["p.sub.b"].write_text(source)
    assert imports_of("p.sub.b", modules["p.sub.b"], modules) == {"p.sub": 1, "p.a": 4}
    init = tmp_path / "sub" / "__init__.py"
    init.write_text("from . import b\nfrom .b import helper\nfrom .. import a\n")
    assert imports_of("p.sub", init, modules) == {"p.sub.b": 1, "p.a": 3}


def test_a_loop_is_found_as_a_closed_path():
    graph = {"m.a": {"m.b": 3}, "m.b": {"m.c": 5}, "m.c": {"m.a": 7, "m.d": 8}, "m.d": {}, "m.e": {"m.a": 1}}
    assert cycles(graph) == [["m.a", "m.b", "m.c", "m.a"]]
    assert cycles({"m.a": {"m.b": 1}, "m.b": {}}) == []


def test_no_import_loop():
    """A loop makes the import order decide whether a name exists yet (a partially initialised module)."""
    modules = module_files()
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import loops (each line: the module, where, what it imports):\n" + "\n\n".join(
        _describe(graph, loop, modules) for loop in found) + (
        "\nCut each loop at one edge: import the name from the module that defines it rather than from a package "
        "whose __init__ imports the importer back, or move the shared piece into a module of its own that both "
        "import.")


def test_library_imports_nothing_from_eval():
    """The library (everything under dual_cache/ but eval/) must run without the evaluation code: eval imports the
    library, never the other way round."""
    modules = module_files()
    graph = import_graph()
    found = [f"  {source} ({modules[source].relative_to(ROOT)}:{line}) imports {target}"
             for source, edges in sorted(graph.items()) if not _in_eval(source)
             for target, line in sorted(edges.items()) if _in_eval(target)]
    assert not found, "the library imports the evaluation code:\n" + "\n".join(found) + (
        "\nMove the code that needs dual_cache.eval into eval/ (a command: register it in pyproject's "
        "[project.entry-points.\"dual_cache.commands\"] so `dual-decoder` still lists it), or move what the library "
        "needs from eval/ down into dual_cache/.")


def _in_eval(module: str) -> bool:
    return module == EVAL or module.startswith(EVAL + ".")


def test_installed_eval_commands_are_pyprojects():
    """`dual-decoder` finds the evaluation's commands through the `dual_cache.commands` entry points that pip wrote
    from pyproject.toml; an installation older than the table lacks commands (or names moved modules)."""
    import tomllib
    from importlib.metadata import entry_points

    from dual_cache.cli.main import EVAL_COMMANDS

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][EVAL_COMMANDS]
    installed = {entry.name: entry.value for entry in entry_points(group=EVAL_COMMANDS)}
    assert installed == declared, (
        f"the installed {EVAL_COMMANDS} entry points {installed} differ from pyproject.toml's {declared}: reinstall "
        "(`make install`, or `pip install -e .`) so `dual-decoder` lists the evaluation's commands")
    modules = module_files()
    for name, value in declared.items():
        module = value.partition(":")[0]
        assert _in_eval(module) and module in modules, (
            f"entry point {name} = {value!r}: name a module of dual_cache.eval (eval/); the library's own commands are "
            "added by dual_cache/cli/main.py's build_parser")


# The library's packages, bottom to top (docs/architecture.md, "Packages"). A module may import its own package and the
# packages of the levels below its package's, never a package beside it (the same level) or above it. A top-level
# module (`config.py`) is a level of its own; "" is `dual_cache/__init__.py`, the public names; `dual_cache.eval` sits
# on top of everything (test_library_imports_nothing_from_eval).
LEVELS = (
    ("runtime", "kernels"),
    ("engine", "host", "model"),
    ("selection",),
    ("config",),
    ("transfer",),
    ("layer",),
    ("cache",),
    ("generate",),
    ("serving",),
    ("cli",),
    ("",),
    ("custom_generate",),
)
LEVEL = {package: level for level, packages in enumerate(LEVELS) for package in packages}


def package_of(module: str) -> str:
    """The library package (or top-level module) a module belongs to: `dual_cache.host.store` → `host`,
    `dual_cache.config` → `config`, `dual_cache` → ""."""
    return module.split(".")[1] if module.count(".") else ""


def order_violations(graph: dict[str, dict[str, int]], files: dict[str, Path]) -> list[str]:
    """Every import of a library module from a package at its importer's level or above, as
    `file:line: importer (package) imports target (package), beside / above it`."""
    found = []
    for source, edges in sorted(graph.items()):
        if _in_eval(source):
            continue
        for target, line in sorted(edges.items()):
            if _in_eval(target) or package_of(source) == package_of(target):
                continue
            here, there = LEVEL[package_of(source)], LEVEL[package_of(target)]
            if there >= here:
                where = files[source].relative_to(ROOT) if source in files else source
                found.append(f"  {where}:{line}: {source} ({package_of(source) or 'dual_cache/__init__.py'}) imports "
                             f"{target} ({package_of(target) or 'dual_cache/__init__.py'}), "
                             f"{'beside' if there == here else 'above'} it")
    return found


def test_every_package_has_a_level():
    """A new package or top-level module of dual_cache/ takes its place in LEVELS before anything imports it."""
    modules = module_files()
    unplaced = sorted({package_of(m) for m in modules if not _in_eval(m)} - set(LEVEL))
    assert not unplaced, (f"dual_cache/ has packages or top-level modules without a level: {unplaced}; add each to "
                          "LEVELS in tests/test_import_graph.py and to docs/architecture.md's package list")
    assert sorted(LEVEL) == sorted({package_of(m) for m in modules if not _in_eval(m)}), (
        "LEVELS names packages that do not exist: " + ", ".join(sorted(set(LEVEL) - {package_of(m) for m in modules})))


def test_an_import_against_the_order_is_named_with_its_line(tmp_path):
    graph = {"dual_cache.host.store": {"dual_cache.layer.layer": 12, "dual_cache.runtime.streams": 3},
             "dual_cache.layer.layer": {"dual_cache.host.store": 5, "dual_cache.layer.call": 6},
             "dual_cache.layer.call": {}, "dual_cache.runtime.streams": {"dual_cache.kernels": 9},
             "dual_cache.kernels": {}}
    files = {name: ROOT / "dual_cache" / (name.split(".", 1)[1].replace(".", "/") + ".py") for name in graph}
    assert order_violations(graph, files) == [
        "  dual_cache/host/store.py:12: dual_cache.host.store (host) imports dual_cache.layer.layer (layer), above it",
        "  dual_cache/runtime/streams.py:9: dual_cache.runtime.streams (runtime) imports dual_cache.kernels (kernels), "
        "beside it",
    ]


def test_packages_import_only_the_levels_below_them():
    """The package order: lower packages never import higher ones, nor their neighbours on the same level, so each
    can be read, tested and changed knowing only what is below it."""
    found = order_violations(import_graph(), module_files())
    assert not found, "imports against the package order (LEVELS, bottom to top: " + " → ".join(
        ", ".join(p or "dual_cache/__init__.py" for p in level) for level in LEVELS) + "):\n" + "\n".join(found) + (
        "\nMove the imported piece down to a package below the importer, or the importing code up; where a module "
        "belongs elsewhere, move it (git mv) and update LEVELS only with a reason in docs/architecture.md.")
