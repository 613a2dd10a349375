"""Kernel and op coverage: every kernel a package defines has a byte test, recorded in a manifest.

Kernels (Triton ``@triton.jit`` functions, ``torch.library`` custom ops, autograd ``Function``
subclasses) are found by parsing the sources with `ast` (nothing imported); the manifest
``kernel-coverage.toml`` and what `check_coverage` fails on are in docs/testing.md.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib.util
import os
import textwrap
from pathlib import Path

try:  # Python 3.11+; on 3.10 the manifest cannot be read (said when it is asked for)
    import tomllib
except ImportError:  # pragma: no cover - 3.10
    tomllib = None

from samebits.errors import ConfigError
from samebits.verdicts import ToDict, Verdict, serialised

MANIFEST_NAME = "kernel-coverage.toml"
KINDS = ("triton", "custom_op", "autograd")


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str  # "<path relative to root>::<qualified name>"
    kind: str
    file: Path
    line: int
    source_hash: str


@dataclasses.dataclass
class Row:
    name: str
    kind: str
    tests: list[str]
    status: str  # "ok", "no test", "test missing", "changed without its test", "not recorded", "gone"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclasses.dataclass
class CoverageResult(ToDict):
    packages: list[str]
    manifests: list[str]
    rows: list[Row] = dataclasses.field(metadata=serialised(key="kernels"))
    updated: list[str] = dataclasses.field(default_factory=list)  # entries whose hashes --update wrote

    dict_keys = ("verdict", "exit_code", "packages", "manifests", "kernels", "updated")

    @property
    def ok(self) -> bool:
        return all(row.ok for row in self.rows) and bool(self.rows)

    @property
    def verdict(self) -> Verdict:
        if not self.rows:  # nothing was checked: never a PASS
            return Verdict.INCOMPLETE
        return Verdict.PASS if self.ok else Verdict.FAIL

    def dict_extras(self) -> dict:
        return {"verdict": self.verdict, "exit_code": self.verdict.exit_code}


# -- finding kernels ----------------------------------------------------------------------

def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Call):
        return _dotted(node.func)
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Name):
        return node.id
    return ""


def _triton_names(tree: ast.Module) -> set[str]:
    """Names under which this module can reach ``triton.jit`` (``import triton as t``, ``from triton import jit``)."""
    names = {"triton.jit", "triton.autotune", "triton.heuristics"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "triton" and alias.asname:
                    names |= {f"{alias.asname}.jit", f"{alias.asname}.autotune", f"{alias.asname}.heuristics"}
        elif isinstance(node, ast.ImportFrom) and node.module == "triton":
            names |= {alias.asname or alias.name for alias in node.names if alias.name in ("jit", "autotune")}
    return names


def _segment(lines: list[str], node: ast.AST) -> str:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return textwrap.dedent("\n".join(lines[first - 1: node.end_lineno]))


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def find_kernels(package_dir: Path, root: Path) -> list[Kernel]:
    """Every kernel defined in the ``.py`` files under ``package_dir`` (names relative to ``root``)."""
    kernels = []
    for path in sorted(package_dir.rglob("*.py")):
        text = path.read_text()
        try:
            tree = ast.parse(text, filename=str(path))
        except SyntaxError as err:
            raise ConfigError(f"{path}:{err.lineno}: cannot parse ({err.msg}); fix the file to check its kernels.") from None
        lines = text.splitlines()
        relative = os.path.relpath(path, root).replace(os.sep, "/")
        jit_names = _triton_names(tree)
        for node, qualname in _definitions(tree):
            kind = name = None
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for decorator in node.decorator_list:
                    dotted = _dotted(decorator)
                    if dotted in jit_names:
                        kind, name = "triton", qualname
                    elif dotted.endswith(("library.custom_op", "library.triton_op")) or dotted in ("custom_op", "triton_op"):
                        op = _first_string(decorator)
                        kind, name = "custom_op", op or qualname
            elif isinstance(node, ast.ClassDef):
                if any(_dotted(base) in ("torch.autograd.Function", "autograd.Function", "Function")
                       for base in node.bases):
                    kind, name = "autograd", qualname
            if kind is not None:
                kernels.append(Kernel(f"{relative}::{name}", kind, path, node.lineno, _hash(_segment(lines, node))))
        for node in ast.walk(tree):  # torch.library.define("ns::name", "(Tensor x) -> Tensor")
            if isinstance(node, ast.Call) and _dotted(node.func).endswith("library.define"):
                op = _first_string(node)
                if op:
                    kernels.append(Kernel(f"{relative}::{op}", "custom_op", path, node.lineno,
                                          _hash(_segment(lines, node))))
    return kernels


def _definitions(tree: ast.Module):
    """(node, qualified name) of every function and class, nested ones included, also those
    defined under an ``if``, ``try`` or ``with`` (``try: import triton`` ... ``@triton.jit``)."""
    def visit(statements, prefix):
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = f"{prefix}{node.name}"
                yield node, qualname
                yield from visit(node.body, f"{qualname}.")
            else:
                for field in ("body", "orelse", "finalbody"):
                    yield from visit(getattr(node, field, None) or [], prefix)
                for handler in getattr(node, "handlers", None) or []:
                    yield from visit(handler.body, prefix)

    yield from visit(tree.body, "")


def _first_string(call: ast.AST) -> str | None:
    if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.Constant) \
            and isinstance(call.args[0].value, str):
        return call.args[0].value
    return None


def _test_source(root: Path, test: str) -> str | None:
    """The source of a test ``path::function`` or ``path::Class::method`` (parameters ignored)."""
    path_text, _, qualname = test.partition("::")
    qualname = qualname.split("[", 1)[0]
    path = root / path_text
    if not qualname or not path.is_file():
        return None
    text = path.read_text()
    lines = text.splitlines()
    for node, name in _definitions(ast.parse(text, filename=str(path))):
        if name.replace(".", "::") == qualname:
            return _segment(lines, node)
    return None


# -- the manifest --------------------------------------------------------------------------

def package_dir(package: str) -> Path:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"{package!r} is not an importable package here; name a package (a folder with "
                          "__init__.py) on the Python path, e.g. `samebits coverage mypkg`.")
    return Path(list(spec.submodule_search_locations)[0])


def find_manifest(directory: Path) -> Path:
    found = sorted(directory.rglob(MANIFEST_NAME))
    if len(found) != 1:
        what = "no" if not found else f"{len(found)}"
        raise ConfigError(f"{what} {MANIFEST_NAME} inside {directory}: keep exactly one manifest in the package "
                          "(see docs/testing.md), or pass --manifest FILE.")
    return found[0]


@dataclasses.dataclass
class Manifest:
    path: Path
    root: Path
    entries: list[dict]

    @classmethod
    def read(cls, path: str | Path) -> "Manifest":
        path = Path(path)
        if tomllib is None:
            raise ConfigError(f"{path}: the kernel manifest is TOML, which needs Python 3.11+ (tomllib)")
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such manifest; create it (docs/testing.md) or pass --manifest.") from None
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML ({err}).") from None
        root = (path.parent / data.get("manifest", {}).get("root", ".")).resolve()
        entries = data.get("kernel", [])
        for number, entry in enumerate(entries, 1):
            missing = [key for key in ("name", "kind", "tests") if key not in entry]
            if missing or entry.get("kind") not in KINDS or not isinstance(entry.get("tests"), list):
                raise ConfigError(f"{path}: [[kernel]] number {number} ({entry.get('name', '?')}) needs name, "
                                  f"kind (one of {', '.join(KINDS)}) and tests (a list of test ids); "
                                  f"missing or bad: {missing or ['kind' if entry.get('kind') not in KINDS else 'tests']}.")
        return cls(path, root, entries)

    def write(self) -> None:
        lines = [f"# Kernels and their byte tests; checked by `samebits coverage` (docs/testing.md).",
                 "# Hashes are written by `samebits coverage --update`: never edit them by hand.",
                 "[manifest]", f"root = {_toml_string(os.path.relpath(self.root, self.path.parent))}", ""]
        for entry in sorted(self.entries, key=lambda e: e["name"]):
            lines += ["[[kernel]]", f"name = {_toml_string(entry['name'])}", f"kind = {_toml_string(entry['kind'])}",
                      "tests = [" + ", ".join(_toml_string(t) for t in entry["tests"]) + "]"]
            for key in ("kernel_hash", "tests_hash"):
                if entry.get(key):
                    lines.append(f"{key} = {_toml_string(entry[key])}")
            lines.append("")
        self.path.write_text("\n".join(lines))


def _toml_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# -- checking ------------------------------------------------------------------------------

def _tests_hash(root: Path, tests: list[str]) -> tuple[str | None, list[str]]:
    sources = [_test_source(root, test) for test in tests]
    missing = [test for test, source in zip(tests, sources) if source is None]
    return (_hash("\n\0\n".join(sources)) if not missing else None), missing


def _judge(kernel: Kernel | None, entry: dict | None, root: Path) -> Row:
    if entry is None:
        return Row(kernel.name, kernel.kind, [], "no test",
                   f"{kernel.file}:{kernel.line}: add a [[kernel]] entry with its byte test, then --update")
    name, kind, tests = entry["name"], entry["kind"], list(entry["tests"])
    if kernel is None:
        return Row(name, kind, tests, "gone", "no such kernel in the sources: remove the entry")
    if not tests:
        return Row(name, kind, tests, "no test", "the entry lists no test")
    tests_hash, missing = _tests_hash(root, tests)
    if missing:
        return Row(name, kind, tests, "test missing", f"no such test: {', '.join(missing)}")
    kernel_same, tests_same = entry.get("kernel_hash") == kernel.source_hash, entry.get("tests_hash") == tests_hash
    if kernel_same and tests_same:
        return Row(name, kind, tests, "ok")
    if not kernel_same and tests_same:
        return Row(name, kind, tests, "changed without its test",
                   "the kernel's source changed since its test was recorded, its test did not: extend the byte "
                   "test for the change, then --update")
    return Row(name, kind, tests, "not recorded",
               ("kernel and test changed" if not kernel_same else "the test changed")
               + ": run `samebits coverage --update` and commit the manifest")


def check_coverage(packages: list[str], *, manifest: str | os.PathLike | None = None,
                   update: bool = False) -> CoverageResult:
    """Judge every kernel of ``packages`` against the manifest (each package's own, or ``manifest``).

    ``update``: record the current source hashes of every entry first, except an entry whose
    kernel changed while its tests did not (that one stays failing until its test changes)."""
    if not packages:
        raise ConfigError("name at least one package, e.g. `samebits coverage samebits`.")
    groups: dict[Path, list[Path]] = {}
    for package in packages:
        directory = package_dir(package)
        path = Path(manifest) if manifest is not None else find_manifest(directory)
        groups.setdefault(path.resolve(), []).append(directory)
    rows, updated = [], []
    for path, directories in groups.items():
        book = Manifest.read(path)
        kernels = {k.name: k for directory in directories for k in find_kernels(directory, book.root)}
        # An entry for a kernel outside the packages checked (the manifest may serve a larger
        # package too) is not judged here: it is neither covered nor gone.
        entries = {entry["name"]: entry for entry in book.entries
                   if _within(book.root / entry["name"].split("::", 1)[0], directories)}
        if update:
            recorded = [name for name, entry in entries.items()
                        if _judge(kernels.get(name), entry, book.root).status == "not recorded"]
            for name in recorded:
                entries[name]["kernel_hash"] = kernels[name].source_hash
                entries[name]["tests_hash"] = _tests_hash(book.root, list(entries[name]["tests"]))[0]
            updated += recorded
            if recorded:
                book.write()
        rows += [_judge(kernels.get(name), entries.get(name), book.root)
                 for name in sorted(set(kernels) | set(entries))]
    return CoverageResult(list(packages), [str(p) for p in groups], rows, updated)


def _within(path: Path, directories: list[Path]) -> bool:
    path = path.resolve()
    return any(path.is_relative_to(directory.resolve()) for directory in directories)


def render_coverage(result: CoverageResult) -> str:
    """A short report for people: one line per kernel that is not ok, and the counts."""
    num_ok = sum(row.ok for row in result.rows)
    lines = [f"kernel coverage of {', '.join(result.packages)}: {result.verdict.value.upper()}: "
             f"{num_ok} of {len(result.rows)} kernel(s) byte-tested and recorded"
             + ("" if result.rows else " (no kernel and no manifest entry found: nothing was checked)")]
    lines += [f"  {'ok  ' if row.ok else 'FAIL'} {row.kind:<9} {row.name}"
              + (f": {row.status}: {row.detail}" if not row.ok else "") for row in result.rows]
    lines += [f"  recorded new hashes for {name}: commit the manifest" for name in result.updated]
    return "\n".join(lines)
