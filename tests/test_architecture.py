"""The import contract of docs/architecture.md, checked on the source: layers only point down.

Every `import samebits...` in src/samebits is read with `ast` (module level and inside
functions alike; `importlib.import_module("samebits...")` and the command line's `lazy(...)`
declarations too) and mapped to the component it names.  The test fails on an edge that points
up a layer, on a cycle between components, on a library module other than the command line
(the composition root) importing the reference recipe, on the recipe importing a private
module, on a package importing another's private module or name, and on a samebits import
tucked inside a function (the usual way to dodge a cycle).  There is no list of exceptions:
fix the edge instead.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "samebits"

# Low to high.  A component may import components of its own layer (as long as no cycle
# forms) and of the layers below it, never above.
LAYERS: list[tuple[str, set[str]]] = [
    ("foundation", {"errors", "verdicts", "visible", "settings", "defaults", "_torchutil", "_lazy_exports", "_cdll"}),
    ("digest", {"fingerprint"}),
    ("bottom", {"kernels", "stream", "determinism", "checkpoint", "invariant", "replicas", "rerun",
                "_inject"}),
    ("comparison", {"compare"}),
    ("middle", {"trace"}),
    ("recording", {"autorecord"}),
    ("runners", {"runners", "testing"}),
    ("entry points", {"cli", "__main__", "_inject.sitecustomize", "samebits"}),
]
CLIENTS = {"recipes", "integrations"}  # use the public API like a user's script; nothing in the library imports them
# ... except the command line, the composition root: it builds the runners' command templates
# from the recipe's command line (cli/_recipe.py), so `samebits verify` runs the recipe.
CLIENT_USERS = {"recipes": {"cli"}}
# Components whose own name starts with "_": the foundation's torch helpers and the
# PYTHONPATH helper, imported by name like any module.
UNDERSCORED_COMPONENTS = {"_torchutil", "_lazy_exports", "_cdll", "_inject"}
LAYER_OF = {component: index for index, (_, members) in enumerate(LAYERS) for component in members}

# Modules a function may import lazily: they import an optional heavy dependency (Triton) at
# load time, so importing them at module level would make that dependency mandatory.
LAZY_OK = {"samebits.kernels._triton_gemm", "samebits.kernels._triton_combine", "samebits.kernels._triton_digest"}
# The pytest plugin loads in every pytest run of the environment: its hooks load the byte-test
# modules (which import torch) only in a session that uses them (tests/test_testing.py checks
# that loading the plugin imports no torch).
LAZY_OK |= {"samebits.testing._harness", "samebits.testing._golden"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:]) if "." in name else Path()
    return (SRC / relative).with_suffix(".py").is_file() or (SRC / relative / "__init__.py").is_file()


def _component(module: str) -> str:
    """The unit of the contract a module belongs to (`samebits.stream.reader` -> "stream")."""
    parts = module.split(".")
    if len(parts) == 1:
        return "samebits"
    if parts[1] == "_inject" and len(parts) > 2 and parts[2] == "sitecustomize":
        return "_inject.sitecustomize"  # run by Python at start-up, never imported by samebits
    return parts[1]


def _imports():
    """Yield (importing file, imported samebits module, line, inside a function)."""
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        where = str(path.relative_to(SRC.parent))
        tree = ast.parse(path.read_text(), filename=str(path))
        function_lines = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)) or _is_lazy_declaration(inner):
                        function_lines.add(inner.lineno)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = package[: len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                # `from samebits.kernels import _triton_gemm` imports a module: name it.
                targets = [f"{target}.{a.name}" if _is_module(f"{target}.{a.name}") else target
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif _is_lazy_declaration(node):  # `x = lazy("samebits.compare", "x")` (cli/_lazy.py)
                targets = [node.args[0].value]
            elif _is_lazy_exports(node):  # `lazy_exports(__name__, _TABLE, globals(), load_first=...)`
                for target in _lazy_exports_targets(node, module, tree):
                    yield (module, where), target, node.lineno, False
                continue
            elif _dynamic_import(node, module) is not None:  # importlib.import_module("samebits.kernels")
                # Loading by name (a PEP 562 facade, plugins, registrations) is an edge of the
                # graph; being dynamic, it is allowed inside a function.
                yield (module, where), _dynamic_import(node, module), node.lineno, False
                continue
            else:
                continue
            for target in targets:
                if target == "samebits" or target.startswith("samebits."):
                    yield (module, where), target, node.lineno, node.lineno in function_lines


def _dynamic_import(node: ast.AST, module: str) -> str | None:
    """The samebits module an ``importlib.import_module(...)`` call loads: a string literal, or
    an f-string's constant prefix (``{__name__}`` is the calling module), to its last whole
    module (``f"samebits.testing.{name}"`` -> samebits.testing).  None for another call, a
    target named by a variable, or one outside samebits."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"):
        return None
    argument = node.args[0]
    if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
        target = argument.value
    elif isinstance(argument, ast.JoinedStr):
        prefix = ""
        for part in argument.values:
            if isinstance(part, ast.Constant):
                prefix += str(part.value)
            elif isinstance(part.value, ast.Name) and part.value.id == "__name__":
                prefix += module
            else:
                break
        target = prefix.rsplit(".", 1)[0] if not prefix.endswith(".") else prefix[:-1]
        if "." not in prefix:
            return None
    else:
        return None
    return target if target == "samebits" or target.startswith("samebits.") else None


def _is_lazy_declaration(node: ast.AST) -> bool:
    """A call ``lazy("samebits.module", "name", ...)``: an import of that module, made on first use."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "lazy"
            and bool(node.args) and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))


def _is_lazy_exports(node: ast.AST) -> bool:
    """A call ``lazy_exports(...)`` (samebits._lazy_exports): a package facade's imports on first use."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "lazy_exports"


def _lazy_exports_targets(node: ast.Call, package: str, tree: ast.Module) -> list[str]:
    """The modules a ``lazy_exports(__name__, TABLE, globals(), load_first=...)`` call loads: each
    submodule its module-level ``TABLE`` names (``"_digest"`` or ``("_native", "available")``), and
    ``load_first``."""
    table = next(statement.value for statement in tree.body if isinstance(statement, ast.Assign)
                 and any(isinstance(name, ast.Name) and name.id == node.args[1].id for name in statement.targets))
    submodules = {(value.elts[0] if isinstance(value, ast.Tuple) else value).value for value in table.values}
    first = [keyword.value.value for keyword in node.keywords if keyword.arg == "load_first"]
    return sorted(f"{package}.{submodule}" for submodule in submodules) + first


def _where(source: tuple[str, str], line: int) -> str:
    return f"{source[1]}:{line}"


def _graph():
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for module, target, line, _ in _imports():
        source = _component(module[0])
        dest = _component(target)  # `samebits` alone (or a name from it) is the public facade
        if dest != source:
            edges[source][dest].append(_where(module, line))
    return edges


def test_every_component_has_a_layer():
    components = {_component(_module_name(p)) for p in SRC.rglob("*.py")}
    unplaced = sorted(c for c in components if c not in LAYER_OF and c not in CLIENTS)
    assert not unplaced, f"components not placed in a layer of docs/architecture.md: {unplaced}"


def test_layers_only_point_down():
    upward = []
    for source, targets in _graph().items():
        if source in CLIENTS:
            continue
        for dest, where in targets.items():
            if dest in CLIENTS and source in CLIENT_USERS.get(dest, ()):
                continue  # the command line composes the recipe with the runners
            if dest in CLIENTS:
                upward.append(f"{source} -> {dest} (the recipe is a client, not a library part): {where[0]}")
            elif source in LAYER_OF and dest in LAYER_OF and LAYER_OF[dest] > LAYER_OF[source]:
                upward.append(f"{source} ({LAYERS[LAYER_OF[source]][0]}) -> {dest} "
                              f"({LAYERS[LAYER_OF[dest]][0]}): {', '.join(where[:3])}")
    assert not upward, "imports pointing up a layer:\n" + "\n".join(sorted(upward))


def test_no_cycles_between_components():
    graph = {source: set(targets) for source, targets in _graph().items()}
    cycles = []
    for start in sorted(graph):
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph.get(node, ())):
                if nxt == start:
                    cycles.append(" -> ".join(path + [start]))
                elif nxt not in path and nxt > start:  # report each cycle once, from its smallest node
                    stack.append((nxt, path + [nxt]))
    assert not cycles, "import cycles between components:\n" + "\n".join(cycles)


def test_no_imports_inside_functions_to_dodge_cycles():
    lazy = sorted({f"{_where(module, line)} imports {target}" for module, target, line, inside in _imports()
                   if inside and target not in LAZY_OK})
    assert not lazy, ("samebits imports inside functions (move them to the top of the module; if "
                      "that makes a cycle, the layering is wrong):\n" + "\n".join(lazy))


def test_recipes_use_only_the_public_api():
    private = [f"{_where(module, line)} imports {target}" for module, target, line, _ in _imports()
               if _component(module[0]) in CLIENTS and _component(target) not in CLIENTS
               and any(part.startswith("_") for part in target.split(".")[1:])]
    assert not private, "the reference recipe imports private modules:\n" + "\n".join(private)


def test_only_the_cli_imports_the_recipe():
    """`runs/` takes command templates and knows no program; the command line builds the
    recipe's (the composition root).  A library module outside cli/ importing the recipe
    fails; cli/ may, and does."""
    graph = _graph()
    users = sorted(f"{source} -> recipes: {', '.join(where[:3])}" for source, targets in graph.items()
                   for dest, where in targets.items()
                   if dest == "recipes" and source not in CLIENTS and source not in CLIENT_USERS["recipes"])
    assert not users, "library modules importing the reference recipe (build its command in cli/):\n" + "\n".join(users)
    assert "recipes" in graph["cli"]  # the rule is live: the command line does import it


@pytest.mark.parametrize("source", ["runners", "cli"])
def test_the_recipe_rule_catches_a_library_import(source, monkeypatch):
    real = _graph()
    planted = {**real, source: {**real.get(source, {}), "recipes": ["planted.py:1"]}}
    monkeypatch.setitem(globals(), "_graph", lambda: planted)
    if source == "cli":
        test_only_the_cli_imports_the_recipe()
        test_layers_only_point_down()
    else:
        with pytest.raises(AssertionError, match="runners -> recipes: planted"):
            test_only_the_cli_imports_the_recipe()
        with pytest.raises(AssertionError, match="runners -> recipes"):
            test_layers_only_point_down()


def test_dynamic_imports_count_as_imports():
    """`importlib.import_module("samebits.kernels")` and the cli's plugin loading
    (f"{__name__}.{name}") are edges of the graph."""
    edges = {(module[0], target) for module, target, _, _ in _imports()}
    assert ("samebits", "samebits.kernels") in edges
    assert {("samebits", "samebits.compare"), ("samebits.fingerprint", "samebits.fingerprint._native"),
            ("samebits.testing", "samebits.testing._harness")} <= edges  # tables of lazy_exports
    assert ("samebits.cli", "samebits.cli") in edges
    assert _dynamic_import(ast.parse('importlib.import_module(f"samebits.testing.{m}")').body[0].value, "x") == \
        "samebits.testing"
    assert _dynamic_import(ast.parse("importlib.import_module(name)").body[0].value, "x") is None


def _private_imports():
    """Yield (file:line, what) for each import, from another component, of a module or a
    name that starts with "_" (dunder names aside): private to its package."""
    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    for (module, where), target, line, _ in _imports():
        source, dest = _component(module), _component(target)
        if source == dest or dest in UNDERSCORED_COMPONENTS or source.split(".")[0] == dest:
            continue
        if any(private(part) for part in target.split(".")[2:]):
            yield f"{where}:{line}", target
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("samebits"):
                target, names = node.module, [alias.name for alias in node.names]
            elif _is_lazy_declaration(node):
                target = node.args[0].value
                names = [arg.value for arg in node.args[1:] if isinstance(arg, ast.Constant)]
            else:
                continue
            if _component(module) == _component(target) or _component(target) in UNDERSCORED_COMPONENTS:
                continue
            for name in names:
                if private(name) and not _is_module(f"{target}.{name}"):  # a module is named above
                    yield f"{path.relative_to(SRC.parent)}:{node.lineno}", f"{target}.{name}"


def test_no_cross_package_private_imports():
    """A `_`-prefixed module or name is private to its package: another package uses the
    package's public names (Hypothesis' `internal/`).  The foundation's `_torchutil` and the
    `_inject` helper are components named with an underscore, imported like any other."""
    found = sorted(f"{where} imports {what}" for where, what in _private_imports())
    assert not found, "imports of another package's private modules or names:\n" + "\n".join(found)


def test_the_private_import_check_sees_modules_and_names(tmp_path, monkeypatch):
    planted = tmp_path / "samebits" / "runners" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("from samebits.trace._origin import find_origins\nfrom samebits.runners.verify import RunInfo\n"
                       "from samebits.stream import _format\nfrom samebits.compare import _private_name\n"
                       "from samebits._torchutil import rank_and_world_size\nfrom samebits.runners import _launch\n")
    monkeypatch.setitem(globals(), "SRC", tmp_path / "samebits")
    found = {what for _, what in _private_imports()}
    assert found == {"samebits.trace._origin", "samebits.stream._format", "samebits.compare._private_name"}, found


@pytest.mark.parametrize("bad", ["up", "cycle"])
def test_the_checker_catches_violations(bad, monkeypatch):
    """The contract test itself can fail: plant an upward edge or a cycle in the layer map."""
    if bad == "up":  # pretend compare sat below stream: compare -> stream now points up
        monkeypatch.setitem(LAYER_OF, "compare", LAYER_OF["stream"] - 1)
        with pytest.raises(AssertionError, match="compare .* -> stream"):
            test_layers_only_point_down()
    else:
        real = _graph()
        monkeypatch.setitem(globals(), "_graph", lambda: {**real, "errors": {"compare": ["planted"]}})
        with pytest.raises(AssertionError, match="errors"):
            test_no_cycles_between_components()


def test_one_serialiser_name():
    """Results serialise with `to_dict()`, and nothing defines a second name for it."""
    defined = [str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if "def to_json(" in path.read_text()]
    assert defined == []

    from samebits.compare import Divergence
    from samebits.verdicts import ToDict

    divergence = Divergence(step=3, rank=0, reason="content")
    assert isinstance(divergence, ToDict)
    assert not hasattr(divergence, "to_json")


def test_lazy_declarations_count_as_imports():
    """`x = lazy("samebits.compare", "x")` in the command line is an edge of the graph like an import."""
    edges = {(module[0], target) for module, target, _, _ in _imports()}
    assert ("samebits.cli.diff", "samebits.compare") in edges
    assert "compare" in _graph()["cli"]


# -- small rooms (issue 36) ------------------------------------------------------------------

MAX_FILE_LINES, MAX_FUNCTION_LINES = 800, 80


def _oversized(root: Path) -> tuple[list[str], dict[str, int]]:
    """Files over the line limit, and functions over theirs as {"path::name": lines}."""
    files, functions = [], {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(root.parent).as_posix()
        if text.count("\n") > MAX_FILE_LINES:
            files.append(rel)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    functions[f"{rel.removeprefix('samebits/')}::{node.name}"] = lines
    return files, functions


def test_rooms_stay_small(tmp_path):
    """No file over 800 lines; no function over 80 but the hot paths docs/architecture.md names
    under "Small rooms" (and the check fails on a planted long function)."""
    doc = (SRC.parent.parent / "docs" / "architecture.md").read_text()
    rule = doc.split("**Small rooms.**", 1)[1].split("\n- **", 1)[0]
    named = set(re.findall(r"`([\w/]+\.py::\w+)`", rule))
    files, functions = _oversized(SRC)
    assert not files, f"source files over {MAX_FILE_LINES} lines: {files}"
    assert set(functions) <= named, f"functions over {MAX_FUNCTION_LINES} lines not named in the doc: " \
                                    f"{sorted(set(functions) - named)}"
    planted = tmp_path / "samebits" / "long.py"
    planted.parent.mkdir()
    planted.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert _oversized(planted.parent)[1] == {"long.py::f": MAX_FUNCTION_LINES + 1}
