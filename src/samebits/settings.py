"""Every ``SAMEBITS_*`` environment variable, in one registry: name, type, parser, doc.

Code reads a variable with `read(name)`, which parses it one way and raises `ConfigError`
naming the variable, the value and what is allowed.  docs/settings.md is generated from this
table (`render_markdown`; a test keeps them equal).  What to record is one declaration,
`RecordingSpec`, from which the variables, the CLI options and the Recorder's keywords come.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
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


# -- what to record: one declaration for the Recorder's keywords, the variables and the options --


def _steps(value, source: str) -> tuple[int, int | None]:
    if isinstance(value, tuple) and len(value) == 2:  # already a window: (start, stop)
        start, stop = value
        return parse_steps(range(start, stop) if stop is not None else f"{start}:", source)
    return parse_steps(value, source)


def _phases(value, source: str) -> frozenset[str] | None:
    if value is None:
        return None
    return frozenset(parse_list(value, source) if isinstance(value, str) else value)


def _patterns(value, source: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return parse_list(value, source)
    return tuple(p.strip() for p in value or () if p.strip())


def _size_cap(value, source: str) -> int | None:
    cap = parse_int(value, source) if isinstance(value, str) else value
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ConfigError(
            f"{source}={cap!r}: the size cap is a positive number of bytes (tensors larger than it keep "
            "shape and dtype but no digest, so their values are never compared). Leave it unset to digest "
            "every tensor.")
    return cap


def _window_text(window: tuple[int, int | None]) -> str | None:
    start, stop = window
    return None if window == (0, None) else f"{start}:{'' if stop is None else stop}"


def _set_text(values) -> str | None:
    if values is None:
        return None
    if not values:  # an empty SAMEBITS_* variable means "every one": it cannot say "none"
        raise ConfigError("an empty selection (no rank, no phase) cannot be passed on in the environment, "
                          "where an empty value selects every one; turn recording off instead "
                          "(SAMEBITS_DISABLE=1).")
    return ",".join(str(v) for v in sorted(values))


@dataclass(frozen=True)
class Option:
    """How one field of `RecordingSpec` is spelled outside Python: its variable (``env``), its
    option (``flag``; ``repeatable``: each use adds) and its help (``doc``).  ``normalise``
    checks text or a Python value; ``text`` is the variable's text (None: leave it unset)."""

    env: str
    type: str
    doc: str
    flag: str
    metavar: str
    normalise: Callable[[Any, str], Any]
    text: Callable[[Any], str | None]
    repeatable: bool = False


def _option(default, **option) -> Any:
    return field(default=default, metadata={"option": Option(**option)})


@dataclass(frozen=True)
class RecordingSpec:
    """What a Recorder records: every field declared once, with its ``SAMEBITS_*`` variable and
    its option of `samebits run`/`verify` (`Option`).  Values may be text, as the variable holds
    them (``steps="100:200"``), or Python values; they are checked and kept in one form, a bad
    one a `ConfigError` naming the field.  `from_env`/`to_env`, `add_to_argparse`/`from_args`.
    """

    steps: tuple[int, int | None] = _option(
        (0, None), env="SAMEBITS_STEPS", type="steps", flag="--record-steps", metavar="START:STOP",
        doc="record only steps START <= step < STOP (either may be empty)", normalise=_steps, text=_window_text)
    ranks: frozenset[int] | None = _option(
        None, env="SAMEBITS_RANKS", type="ranks", flag="--ranks", metavar="LIST",
        doc="record only these ranks, e.g. `0,2,4-7`", normalise=parse_ranks, text=_set_text)
    phases: frozenset[str] | None = _option(
        None, env="SAMEBITS_PHASES", type="list", flag="--phases", metavar="LIST",
        doc="record only these phases, e.g. `grads,params` (default: all; `samebits show RUN --records` lists "
            "them)", normalise=_phases, text=_set_text)
    include: tuple[str, ...] = _option(
        (), env="SAMEBITS_INCLUDE", type="list", flag="--include", metavar="GLOB", repeatable=True,
        doc="record only tensors whose `phase/name` or name matches one of these globs, e.g. "
            "`params/*,*.router.*` (default: all)", normalise=_patterns, text=lambda v: ",".join(v) or None)
    exclude: tuple[str, ...] = _option(
        (), env="SAMEBITS_EXCLUDE", type="list", flag="--exclude", metavar="GLOB", repeatable=True,
        doc="do not record tensors whose `phase/name` or name matches one of these globs, e.g. "
            "`optimizer/*` (applied after SAMEBITS_INCLUDE)", normalise=_patterns, text=lambda v: ",".join(v) or None)
    max_tensor_bytes: int | None = _option(
        None, env="SAMEBITS_MAX_TENSOR_BYTES", type="int", flag="--max-tensor-bytes", metavar="N",
        doc="tensors larger than this many bytes keep shape and dtype but no digest: their values are not "
            "compared, so a comparison that meets one is incomplete", normalise=_size_cap,
        text=lambda v: None if v is None else str(v))

    def __post_init__(self) -> None:
        for name, option in self.options().items():
            object.__setattr__(self, name, option.normalise(getattr(self, name), name))

    @staticmethod
    def options() -> dict[str, Option]:
        """Field name -> its `Option`, in declaration order."""
        return {f.name: f.metadata["option"] for f in dataclasses.fields(RecordingSpec)}

    @classmethod
    def settings(cls) -> list[Setting]:
        """The registry's entries for the spec's variables."""
        return [Setting(f.metadata["option"].env, f.metadata["option"].type, f.metadata["option"].doc, f.default)
                for f in dataclasses.fields(cls)]

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "RecordingSpec":
        """The spec the ``SAMEBITS_*`` variables of ``environ`` give (unset or empty: the default)."""
        env = os.environ if environ is None else environ
        return cls(**{name: option.normalise(env[option.env], option.env) for name, option in cls.options().items()
                      if env.get(option.env, "").strip()})

    def to_env(self) -> dict[str, str | None]:
        """Each variable's text (None at the default: unset it); `from_env` gives this spec back."""
        return {option.env: option.text(getattr(self, name)) for name, option in self.options().items()}

    def replace(self, **values) -> "RecordingSpec":
        """This spec with the fields given as not None replaced (checked as in the constructor)."""
        return dataclasses.replace(self, **{name: value for name, value in values.items() if value is not None})

    @classmethod
    def add_to_argparse(cls, parser: argparse.ArgumentParser, *, flags: Mapping[str, str] | None = None,
                        title: str = "what to record") -> None:
        """Add one checked option per field to ``parser`` (group ``title``); ``flags`` renames some
        (field name -> option) where the declared one is taken.  `from_args` reads them back."""
        group = parser.add_argument_group(title)
        for name, option in cls.options().items():
            flag = (flags or {}).get(name, option.flag)
            group.add_argument(flag, dest=f"record_{name}", default=None, metavar=option.metavar,
                               type=_checked_text(option, flag), action="append" if option.repeatable else "store",
                               help=option.doc.replace("`", "").replace("SAMEBITS_INCLUDE", "--include")
                               + (" (repeatable)" if option.repeatable else ""))

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "RecordingSpec":
        """The spec of the options `add_to_argparse` added (an option not given: the default)."""
        given = {name: getattr(args, f"record_{name}", None) for name in cls.options()}
        return cls(**{name: option.normalise(",".join(given[name]) if option.repeatable else given[name], option.flag)
                      for name, option in cls.options().items() if given[name] is not None})


def _checked_text(option: Option, flag: str) -> Callable[[str], str]:
    """An argparse ``type``: the text, once ``option`` accepts it (argparse names the flag)."""
    def check(text: str) -> str:
        try:
            option.normalise(text, flag)
        except ConfigError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text

    return check


REGISTRY: dict[str, Setting] = _declare(
    # recording (the Recorder and zero-code recording)
    Setting("SAMEBITS_DIR", "path", "where streams go (the Recorder's `directory`)"),
    Setting("SAMEBITS_DISABLE", "bool", "turn recording off (zero cost)", False),
    *RecordingSpec.settings(),  # what to record: SAMEBITS_STEPS, _RANKS, _PHASES, _INCLUDE, _EXCLUDE, _MAX_TENSOR_BYTES
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
    # layout invariance in a user's trainer (samebits.integrations.torchtitan)
    Setting("SAMEBITS_LAYOUT", "text", "set by `samebits verify --across CELLS -- CMD`: the layout cell a run "
            "trains at (`single`, `fsdp2`, ...), read by samebits' torchtitan config", "", area="invariance"),
    Setting("SAMEBITS_INVARIANT", "bool", "`0` keeps samebits' torchtitan config to the layout, without the "
            "invariant step (`verify --across` sets it for the negative controls)", True, area="invariance"),
    # the probe
    Setting("SAMEBITS_PROBE_DIR", "path", "set by `samebits probe -- CMD`: where each process writes its "
            "findings", area="probe"),
    Setting("SAMEBITS_PROBE_STEPS", "int", "how many optimizer steps `samebits probe -- CMD` probes", area="probe"),
    Setting("SAMEBITS_PROBE_NAMESPACES", "list", "operator namespaces the probe runs several times (default: aten, prims, samebits)",
            area="probe"),
    # test hooks
    Setting("SAMEBITS_TEST_PERTURB", "text", "`step=S,rank=R,op=ID[,phase=P]` nudges the first output of that "
            "op or collective by one ulp (to test that tracing finds it)", "", area="test hooks", test_only=True),
    Setting("SAMEBITS_TEST_FAULT_SITE", "list", "hook sites of zero-code recording whose own work raises (to test "
            "that samebits never changes the program: each becomes a gap, the verdict INCOMPLETE; sites: "
            "samebits.stream.gaps.SITES)", (), area="test hooks", test_only=True),
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
             "`0/false/no/off`; a bad value is an error naming the variable, never ignored.", "",
             "What to record (" + ", ".join(f"`{o.env}`" for o in RecordingSpec.options().values()) + ") is",
             "`samebits.RecordingSpec`: the same choice as a Recorder's `spec=` and as the options",
             "(" + ", ".join(f"`{o.flag}`" for o in RecordingSpec.options().values()) + ") of `samebits run`"
             " and `verify`.", ""]
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


__all__ = ["Setting", "REGISTRY", "RecordingSpec", "Option", "read", "is_set", "parse_bool", "parse_int",
           "parse_steps", "parse_ranks", "parse_list", "render_markdown"]

if __name__ == "__main__":  # pragma: no cover
    print(render_markdown())
