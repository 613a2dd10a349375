"""Every ``SAMEBITS_*`` environment variable, in one registry: name, type, parser, doc.

Settings reach the processes a command starts (torchrun workers, zero-code recording, the
probe) through the environment.  Each variable is declared here once; code reads it with
`read(name)`, which parses it the one way and raises `ConfigError` naming the variable, the
value and what is allowed.  docs/settings.md is generated from this table (`render_markdown`)
and a test keeps the two equal, and checks that no module reads an undeclared variable.

    from samebits import settings
    settings.read("SAMEBITS_STEPS")      # -> (start, stop) or the default
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from samebits.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def parse_bool(text: str, source: str) -> bool:
    """The one truthiness rule: 1/true/yes/on or 0/false/no/off/empty (any case)."""
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{source}={text!r} is not a yes/no value; write 1 or 0.")


def parse_int(text: str, source: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(f"{source}={text!r} must be an integer.") from None


def parse_steps(spec: str | range | None, source: str) -> tuple[int, int | None]:
    """A step window START:STOP (stop exclusive, either side may be empty; ``5`` is step 5)."""
    if spec is None or spec == "":
        return 0, None
    if isinstance(spec, range):
        if spec.step != 1:
            raise ConfigError(f"{source}: a step window must be contiguous, got {spec}")
        return spec.start, spec.stop
    text = str(spec).strip()
    try:
        if ":" in text:
            start_text, stop_text = text.split(":", 1)
            start = int(start_text) if start_text.strip() else 0
            stop = int(stop_text) if stop_text.strip() else None
        else:
            start = int(text)
            stop = start + 1
    except ValueError:
        raise ConfigError(
            f"{source}={spec!r} is not a step window; write START:STOP (stop exclusive, "
            "either side may be empty), e.g. '100:200' or '5'."
        ) from None
    if start < 0 or (stop is not None and stop <= start):
        raise ConfigError(f"{source}={spec!r} is an empty or negative step window.")
    return start, stop


def parse_ranks(spec: str | Iterable[int] | None, source: str = "ranks") -> frozenset[int] | None:
    """A rank list such as ``0,2,4-7``; None (every rank) when empty."""
    if spec is None or spec == "":
        return None
    if not isinstance(spec, str):
        return frozenset(int(r) for r in spec)
    ranks: set[int] = set()
    try:
        for part in spec.split(","):
            part = part.strip()
            if "-" in part:
                low, high = part.split("-", 1)
                ranks.update(range(int(low), int(high) + 1))
            elif part:
                ranks.add(int(part))
    except ValueError:
        raise ConfigError(f"{source}={spec!r} is not a rank list; write e.g. '0,2,4-7'.") from None
    return frozenset(ranks)


def parse_list(text: str, source: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _text(text: str, source: str) -> str:
    return text.strip()


_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "bool": parse_bool, "int": parse_int, "steps": parse_steps, "ranks": parse_ranks,
    "list": parse_list, "text": _text, "path": _text,
}


@dataclass(frozen=True)
class Setting:
    """One environment variable: its type (a key of the parser table), default and meaning."""

    name: str
    type: str
    doc: str
    default: Any = None
    area: str = "recording"
    test_only: bool = False  # a hook for samebits' own tests: never set it in real runs

    def parse(self, text: str | None) -> Any:
        if text is None or text.strip() == "":
            return self.default
        return _PARSERS[self.type](text, self.name)


def _declare(*settings: Setting) -> dict[str, Setting]:
    return {s.name: s for s in settings}


REGISTRY: dict[str, Setting] = _declare(
    # recording (the Recorder and zero-code recording)
    Setting("SAMEBITS_DIR", "path", "where streams go (the Recorder's `directory`)"),
    Setting("SAMEBITS_DISABLE", "bool", "turn recording off (zero cost)", False),
    Setting("SAMEBITS_STEPS", "steps", "record only steps START <= step < STOP (either may be empty)", (0, None)),
    Setting("SAMEBITS_RANKS", "ranks", "record only these ranks, e.g. `0,2,4-7`"),
    Setting("SAMEBITS_PHASES", "list", "record only these phases, e.g. `grads,params` (default: all)"),
    Setting("SAMEBITS_INCLUDE", "list", "record only tensors whose `phase/name` or name matches one of these "
            "globs, e.g. `params/*,*.router.*` (default: all)"),
    Setting("SAMEBITS_EXCLUDE", "list", "do not record tensors whose `phase/name` or name matches one of these "
            "globs, e.g. `optimizer/*` (applied after SAMEBITS_INCLUDE)"),
    Setting("SAMEBITS_MAX_TENSOR_BYTES", "int", "tensors larger than this keep shape and dtype but no digest"),
    Setting("SAMEBITS_FLUSH_STEPS", "int", "write to the OS at least every N steps", 1),
    Setting("SAMEBITS_RUN_ID", "text", "the run id written in each stream header (default: the launcher's, or new)"),
    Setting("SAMEBITS_AUTORECORD", "bool", "set by `samebits run`/`verify -- CMD`: record every Python process "
            "of the command without code changes", False),
    Setting("SAMEBITS_COMMAND", "text", "the recorded command line, kept in the stream header"),
    Setting("SAMEBITS_APPEND", "bool", "continue existing streams as a new segment (a resumed process)", False),
    Setting("SAMEBITS_STEP_OFFSET", "int", "the first step number of a resumed process (`samebits run "
            "--step-offset`)", 0),
    Setting("SAMEBITS_REFERENCE", "path", "a run to check each step against live; the first divergent step "
            "stops the run"),
    # tracing
    Setting("SAMEBITS_TRACE", "text", "tracing rung: `off` (default), `phases`, `modules`, `ops` (each includes "
            "the ones before it)", area="tracing"),
    Setting("SAMEBITS_TRACE_STEPS", "steps", "trace only steps START:STOP (`5` is step 5 alone)", (0, None),
            area="tracing"),
    Setting("SAMEBITS_TRACE_RANKS", "ranks", "trace only these ranks, e.g. `0,2-3`", area="tracing"),
    Setting("SAMEBITS_TRACE_MODULE", "text", "trace modules and ops only inside this module subtree (an FQN)",
            "", area="tracing"),
    Setting("SAMEBITS_TRACE_STACK", "bool", "remember each traced op's call site (`trace-rank-N.json`)", False,
            area="tracing"),
    Setting("SAMEBITS_TRACE_DUMP_OP", "text", "`step=S,rank=R,id=ID[,phase=P]`: save that event's inputs and "
            "outputs (`dump-rank-R-step-S.pt`)", "", area="tracing"),
    Setting("SAMEBITS_TRACE_DUMP_DIR", "path", "where dumps and call-site files go (default: the run directory)",
            area="tracing"),
    Setting("SAMEBITS_TRACE_STOP_AFTER", "int", "end the process (exit code 0) once step S is written",
            area="tracing"),
    # the probe
    Setting("SAMEBITS_PROBE_DIR", "path", "set by `samebits probe -- CMD`: where each process writes its "
            "findings", area="probe"),
    Setting("SAMEBITS_PROBE_STEPS", "int", "how many optimizer steps `samebits probe -- CMD` probes", area="probe"),
    Setting("SAMEBITS_PROBE_NAMESPACES", "list", "operator namespaces the probe runs twice (default: aten)",
            area="probe"),
    # test hooks
    Setting("SAMEBITS_TEST_PERTURB", "text", "`step=S,rank=R,op=ID[,phase=P]` nudges the first output of that "
            "op or collective by one ulp (to test that tracing finds it)", "", area="test hooks", test_only=True),
    Setting("SAMEBITS_TEST_DROP_RNG", "list", "random states a checkpoint load leaves out (to test that a lost "
            "RNG is caught)", (), area="test hooks", test_only=True),
    Setting("SAMEBITS_TEST_FLIP", "text", "`step=S,rank=R,op=OP[,mode=M][,call=N]` (M: once or always) flips one bit of "
            "the first output of that aten op's N-th call in that step (`samebits.rerun`: once is a transient fault, "
            "always a persistent one)", "", area="test hooks", test_only=True),
    Setting("SAMEBITS_TEST_SAVE_PAUSE_S", "text", "seconds to sleep between writing a checkpoint's shards and "
            "committing it (to test crash safety)", "", area="test hooks", test_only=True),
)


def _setting(name: str) -> Setting:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"{name} is not a samebits setting; the settings are listed in docs/settings.md.") from None


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of ``name`` from ``environ`` (default: the process environment)."""
    env = os.environ if environ is None else environ
    return _setting(name).parse(env.get(name))


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    _setting(name)
    return bool(env.get(name, "").strip())


def render_markdown() -> str:
    """docs/settings.md, generated from `REGISTRY`."""
    lines = ["# Settings: every `SAMEBITS_*` environment variable", "",
             "Generated from `src/samebits/settings.py` (`python -m samebits.settings > docs/settings.md`);",
             "a test keeps this page equal to the registry. Yes/no values take `1/true/yes/on` or",
             "`0/false/no/off`; a bad value is an error naming the variable, never ignored.", ""]
    areas: dict[str, list[Setting]] = {}
    for setting in REGISTRY.values():
        areas.setdefault(setting.area, []).append(setting)
    for area, members in areas.items():
        lines += [f"## {area[0].upper() + area[1:]}", "", "| variable | type | default | meaning |", "|---|---|---|---|"]
        for s in members:
            default = "" if s.default in (None, "", ()) else f"`{s.default}`"
            lines.append(f"| `{s.name}` | {s.type} | {default} | {s.doc} |")
        lines.append("")
    return "\n".join(lines)


__all__ = ["Setting", "REGISTRY", "read", "is_set", "parse_bool", "parse_int", "parse_steps", "parse_ranks",
           "parse_list", "render_markdown"]

if __name__ == "__main__":  # pragma: no cover
    print(render_markdown())
