"""Golden digests: the 64-bit digest of every output and gradient of a deterministic function,
kept in ``<test dir>/__samebits__/<test file>.json``, so an intended numerical change is told
apart from noise.  ``update=True`` records instead; a file of another digest version is
refused, not compared (docs/testing.md).
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any, Callable

import torch

from samebits.errors import ConfigError
from samebits.fingerprint import DIGEST_VERSION, digest
from samebits.testing._bits import Leaf
from samebits.testing._harness import _producer, collect, seeded

SCHEMA = "samebits.golden/1"
DIRECTORY = "__samebits__"


def golden_path(test_file: str | Path) -> Path:
    test_file = Path(test_file)
    return test_file.parent / DIRECTORY / f"{test_file.name}.json"


def _environment() -> dict:
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine()}


def describe(leaves: list[Leaf]) -> dict[str, str]:
    """path -> "dtype shape digest" (tensors) or the value's repr (anything else)."""
    out = {}
    for leaf in leaves:
        if leaf.is_tensor:
            data = leaf.data.reshape(-1).view(torch.uint8)
            try:
                tensor = data.view(leaf.dtype).view(leaf.shape)
                value = f"{digest(tensor):016x}"
            except RuntimeError:  # a dtype without a view (shell dtypes): digest the raw bytes
                value = f"bytes {digest(data):016x}"
            out[leaf.path] = f"{str(leaf.dtype).removeprefix('torch.')} {list(leaf.shape)} {value}"
        else:
            out[leaf.path] = repr(leaf.data)
    return out


class GoldenFile:
    """The golden digests of one test file: read on first use, written by `save`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._data: dict | None = None
        self.changed = False

    def _load(self) -> dict:
        if self._data is None:
            if self.path.exists():
                try:
                    data = json.loads(self.path.read_text())
                except (OSError, ValueError) as err:
                    raise ConfigError(f"{self.path}: unreadable golden digest file ({err}); fix it or "
                                      "delete it and rerun with --samebits-update.") from None
                if data.get("schema") != SCHEMA:
                    raise ConfigError(f"{self.path}: schema {data.get('schema')!r}, expected {SCHEMA!r}; "
                                      "rerun with --samebits-update to rewrite it.")
                self._data = data
            else:
                self._data = self._empty()
        return self._data

    @staticmethod
    def _empty() -> dict:
        return {"schema": SCHEMA, "digest_version": DIGEST_VERSION, "recorded_with": _environment(), "tests": {}}

    def digest_version(self) -> int:
        """The digest version of the recorded digests (files written before it was recorded: 1)."""
        return self._load().get("digest_version", 1)

    def check(self, test: str, key: str, values: dict[str, str]) -> None:
        """Raise ``AssertionError`` unless ``values`` equal the recorded ones."""
        if not self.path.exists():
            raise AssertionError(f"no golden digests for {test} ({self.path} does not exist): run "
                                 "with --samebits-update and commit the file.")
        if self.digest_version() != DIGEST_VERSION:
            raise ConfigError(
                f"{self.path}: golden digests recorded with digest version {self.digest_version()}, this "
                f"samebits computes digest version {DIGEST_VERSION}: they cannot be compared (identical "
                "outputs would look changed). Re-record the file: rerun its tests with "
                "--samebits-update and commit it."
            )
        recorded = self._load()["tests"].get(test, {}).get(key)
        if recorded is None:
            raise AssertionError(f"no golden digests for {test} [{key}] in {self.path}: run with "
                                 "--samebits-update and commit the file.")
        changed = [path for path in values if recorded.get(path) != values[path]]
        gone = [path for path in recorded if path not in values]
        if not changed and not gone:
            return
        lines = [f"outputs changed: intended? rerun with --samebits-update and commit the new file "
                 f"({self.path}). {test} [{key}]: {len(changed) + len(gone)} of {len(recorded)} value(s) changed:"]
        lines += [f"  {path}: {recorded.get(path, '(new)')} -> {values[path]}" for path in changed[:12]]
        lines += [f"  {path}: {recorded[path]} -> (gone)" for path in gone[:12]]
        then, now = self._load().get("recorded_with", {}), _environment()
        if then != now:
            lines.append(f"  note: recorded with {then}, running with {now}: a torch or CPU change alone "
                         "can change bits")
        raise AssertionError("\n".join(lines))

    def record(self, test: str, key: str, values: dict[str, str]) -> None:
        data = self._load()
        if self.digest_version() != DIGEST_VERSION:  # old digests cannot be kept beside new ones
            data = self._data = self._empty()
            self.changed = True
        if data["tests"].get(test, {}).get(key) != values:
            data["tests"].setdefault(test, {})[key] = values
            data["recorded_with"] = _environment()
            self.changed = True

    def save(self) -> bool:
        """Write the file if anything was recorded; True if written."""
        if not self.changed:
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = self._load()
        data["tests"] = dict(sorted(data["tests"].items()))
        self.path.write_text(json.dumps(data, indent=1, sort_keys=False) + "\n")
        self.changed = False
        return True


class Golden:
    """The ``samebits_golden`` fixture of one test: ``check(value)`` or ``check(fn, *inputs)``."""

    def __init__(self, file: GoldenFile, test: str, *, update: bool):
        self.file, self.test, self.update = file, test, update
        self.keys: list[str] = []

    def check(self, value: Any, *inputs: Any, key: str = "result", grads: bool = True, seed: int = 0) -> dict:
        """Compare the digests of ``value`` (a tensor, a nested structure, a module) or of the
        outputs and gradients of ``value(*inputs)`` (a callable) with the recorded ones."""
        if key in self.keys:
            raise ConfigError(f"{self.test}: golden key {key!r} used twice; give each check its own key=.")
        self.keys.append(key)
        if callable(value) and not isinstance(value, torch.Tensor) and (inputs or not isinstance(value, torch.nn.Module)):
            produce: Callable = _producer(value, inputs, grads)
            with seeded(seed):
                result, sources = produce()
                leaves, _ = collect(result, grads=grads, grad_sources=sources)
        else:
            leaves, _ = collect(value, grads=grads)
        values = describe(leaves)
        (self.file.record if self.update else self.file.check)(self.test, key, values)
        return values
