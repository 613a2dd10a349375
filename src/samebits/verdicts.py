"""Verdicts and the exit codes they map to: one place for both.

A verdict is proof or nothing.  ``IDENTICAL``/``PASS`` are only ever given when every
byte that should have been compared was compared; a run that crashed, a stream that is
damaged or missing, or a window that compared nothing is ``INCOMPLETE`` (exit 2), never a
good verdict.  Members are strings, so ``result.verdict == "identical"`` and JSON output
keep working unchanged.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path, PurePath
from typing import Any, Callable, ClassVar

from samebits.errors import ConfigError

EXIT_OK, EXIT_BAD_VERDICT, EXIT_CANNOT_RUN = 0, 1, 2
# A step's result may come from a hardware fault (samebits.rerun: a transient fault, or a
# failed check that reproduces on this hardware): restart the job on other hardware.  The
# value Megatron's rerun state machine uses, so a scheduler can treat both alike.
EXIT_RERUN_ELSEWHERE = 16
# The live check (`samebits run --reference`, the recipe's --reference) stopped a run at its first
# step that differs from the reference run: the process, and `samebits run` around it, exit 3.
EXIT_STOPPED = 3


class Verdict(str, enum.Enum):
    """The outcome of a comparison or a check; ``exit_code`` is what the CLI returns."""

    IDENTICAL = "identical"  # every compared record equal, and something was compared
    DIVERGED = "diverged"  # a difference, with its evidence
    PASS = "pass"  # every guarantee checked held
    FAIL = "fail"  # a guarantee checked did not hold
    INCOMPLETE = "incomplete"  # could not decide: crashed run, damaged or missing data, empty window

    @property
    def exit_code(self) -> int:
        if self in (Verdict.IDENTICAL, Verdict.PASS):
            return EXIT_OK
        if self in (Verdict.DIVERGED, Verdict.FAIL):
            return EXIT_BAD_VERDICT
        return EXIT_CANNOT_RUN

    @property
    def good(self) -> bool:
        return self.exit_code == EXIT_OK

    def __str__(self) -> str:  # print the word, not "Verdict.IDENTICAL"
        return self.value


class ToDict:
    """The one serialiser: a result dataclass offers ``to_dict()``, plain JSON-ready values
    derived from its fields, in field order (enums by value, paths as strings, nested results
    by their own ``to_dict()``, sequences as lists, mappings with string keys).

    The exceptions are marked, never written out by hand: on a field,
    ``field(metadata=serialised(...))``; on the class, ``dict_extras()`` (computed entries) and
    ``dict_keys`` (the keys written and their order).  ``from_dict(data)`` reads a dictionary
    back by the same marks, so a reader never restates the schema; a key that names no field,
    a missing field or a wrong type is a `ConfigError` naming the file and the field.
    """

    #: The keys ``to_dict`` writes, in this order (None: every field's, in field order, then
    #: the extras).  A key names a field (by its ``serialised(key=...)`` if renamed) or an extra.
    dict_keys: ClassVar[tuple[str, ...] | None] = None
    #: The command whose summary this is (``"verify"``, ``"bisect"``, ...): written first, under
    #: ``"command"``, so a reader knows the file without guessing from its keys; None: not a summary.
    #: (Not named ``command``: results such as `RunInfo` hold a field of that name.)
    summary_of: ClassVar[str | None] = None

    def dict_extras(self) -> dict:
        """Computed entries, by key (plain values, or values `plain` makes plain)."""
        return {}

    def to_dict(self) -> dict:
        if not dataclasses.is_dataclass(self):
            raise NotImplementedError(f"{type(self).__name__} is not a dataclass: define its to_dict()")
        out = {}
        for item in dataclasses.fields(self):
            how: _Serialised = item.metadata.get(_METADATA_KEY, _DEFAULT)
            value = getattr(self, item.name)
            if how.skip or (how.omit_none and value is None):
                continue
            value = how.convert(value) if how.convert is not None else plain(value)
            if how.flatten:
                out.update(value)
            else:
                out[how.key or item.name] = value
        out.update((key, plain(value)) for key, value in self.dict_extras().items())
        if self.dict_keys is not None:
            out = {key: out[key] for key in self.dict_keys if key in out}
        command = type(self).summary_of
        return out if command is None else {"command": command, **out}

    @classmethod
    def from_dict(cls, data: Any, *, source: str | PurePath = "", where: str = ""):
        """The result that ``to_dict`` wrote as ``data``, read back by the same field marks and
        typed again by each field's annotation; computed entries are derived again, a skipped
        field takes its default.  ``source`` and ``where`` name the place in each error.  Names
        are held strictly: a key the result would not write back is a renamed field or a file
        of another version, and an error."""
        result = _read(cls, data, str(source), where)
        command = data.get("command")  # (a summary names its command: checked, not read)
        if command is not None and cls.summary_of is not None and command != cls.summary_of:
            raise _misread(str(source), _at(where, "command"), f"is {command!r}, not {cls.summary_of!r}: not a "
                           f"summary {cls.__name__} reads")
        _same_names({key: value for key, value in data.items() if key != "command"}, result.to_dict(), cls.__name__,
                    str(source), where)
        return result


@dataclasses.dataclass(frozen=True)
class _Serialised:
    key: str | None = None
    skip: bool = False
    omit_none: bool = False
    convert: Callable[[Any], Any] | None = None
    flatten: bool = False
    read: Callable[[Mapping], Any] | None = None


_METADATA_KEY = "samebits.to_dict"
_DEFAULT = _Serialised()


def serialised(*, key: str | None = None, skip: bool = False, omit_none: bool = False,
               convert: Callable[[Any], Any] | None = None, flatten: bool = False,
               read: Callable[[Mapping], Any] | None = None) -> dict:
    """Field metadata for a field `ToDict.to_dict` writes as an exception: under another ``key``,
    never (``skip``), not while None (``omit_none``), through ``convert``, or ``flatten``ed (a
    mapping's entries in its place); ``read`` gets a field not written as itself back from the
    whole written dictionary (`ToDict.from_dict`)."""
    if skip and (key is not None or omit_none or convert is not None or flatten):
        raise ValueError("serialised(skip=True) takes no other option but read: a skipped field is never written")
    if flatten and key is not None:
        raise ValueError("serialised(flatten=True) writes the field's entries, not the field: it takes no key")
    return {_METADATA_KEY: _Serialised(key, skip, omit_none, convert, flatten, read)}


def plain(value: Any) -> Any:
    """``value`` as plain JSON-ready data, the way `ToDict.to_dict` writes every field."""
    if value is None or isinstance(value, (bool, int, float, str)) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, enum.Enum):
        return value.value
    if callable(getattr(value, "to_dict", None)):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {item.name: plain(getattr(value, item.name)) for item in dataclasses.fields(value)}
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, Mapping):
        return {_plain_key(key): plain(item) for key, item in value.items()}
    if isinstance(value, (set, frozenset)):
        return [plain(item) for item in sorted(value, key=repr)]
    if isinstance(value, (list, tuple)):
        return [plain(item) for item in value]
    return value


def _read(cls: type, data: Any, source: str, where: str) -> Any:
    """``cls.from_dict``: strict on names (a renamed field never reads as absent) and on types."""
    if not isinstance(data, Mapping):
        raise _misread(source, where, f"must be an object ({cls.__name__}), found {json_type(data)}")
    hints = _hints(cls)
    fields = [item for item in dataclasses.fields(cls) if item.init]
    how = {item.name: item.metadata.get(_METADATA_KEY, _DEFAULT) for item in fields}
    # a field is read from its key when the class writes it there (not skipped, not flattened,
    # not left out of dict_keys: such a field is written inside an extra, if at all)
    keys = {(how[item.name].key or item.name): item for item in fields
            if not how[item.name].skip and not how[item.name].flatten and how[item.name].read is None
            and (getattr(cls, "dict_keys", None) is None or (how[item.name].key or item.name) in cls.dict_keys)}
    known = set(keys) | set(getattr(cls, "dict_keys", None) or ()) | {"command"}
    flat = [item for item in fields if how[item.name].flatten]
    values = {}
    for key, item in keys.items():
        if key in data:
            values[item.name] = _typed(data[key], hints.get(item.name, Any), source, _at(where, key))
        elif item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING:
            unknown = [name for name in data if name not in known]
            if unknown and not flat:  # the likeliest story: the field was renamed
                raise _misread(source, _at(where, unknown[0]), f"is not a field {cls.__name__} writes, and {key!r}, "
                               "which it always writes, is missing (renamed, or a file of another samebits version?)")
            raise _misread(source, _at(where, key), f"is missing ({cls.__name__} always writes it: renamed, or a "
                           "file of another samebits version?)")
    for item in flat:  # filled below, once the extras are known
        values[item.name] = {}
    for item in fields:
        if how[item.name].read is not None:
            try:
                values[item.name] = how[item.name].read(data)
            except ConfigError:
                raise
            except (KeyError, TypeError, ValueError, AttributeError) as err:
                raise _misread(source, _at(where, item.name), f"cannot be read back ({err!r})") from None
    try:
        result = cls(**values)
    except (TypeError, ValueError) as err:
        raise _misread(source, where or cls.__name__, f"cannot be read as {cls.__name__} ({err})") from None
    if flat:  # a flattened field holds the entries no other field and no extra writes
        claimed = set(keys) | {"command"} | set(result.dict_extras() if isinstance(result, ToDict) else ())
        for item in flat:
            object.__setattr__(result, item.name, {key: value for key, value in data.items() if key not in claimed})
    return result


def _same_names(data: Any, written: Any, name: str, source: str, where: str) -> None:
    """Every key of ``data``, at every depth, is one that ``written`` (what the result read from it
    writes) holds, with a value of the same JSON type (computed entries are not typed otherwise)."""
    if data is not None and written is not None and json_type(data) != json_type(written):
        raise _misread(source, where, f"must be {json_type(written)}, found {json_type(data)}")
    if isinstance(data, Mapping) and isinstance(written, Mapping):
        for key, value in data.items():
            if key not in written:
                raise _misread(source, _at(where, key), f"is not a field {name} writes (renamed, or a file of "
                               "another samebits version?)")
            _same_names(value, written[key], name, source, _at(where, key))
    elif isinstance(data, list) and isinstance(written, list):
        for index, (item, again) in enumerate(zip(data, written)):
            _same_names(item, again, name, source, f"{where}[{index}]")


def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s field annotations, resolved (a TYPE_CHECKING-only name reads as Any)."""
    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError):
        pass
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        scope = vars(sys.modules.get(klass.__module__, sys))
        for name, annotation in vars(klass).get("__annotations__", {}).items():
            try:
                hints[name] = eval(annotation, scope) if isinstance(annotation, str) else annotation
            except Exception:  # an annotation naming a type-checking-only import: taken as written
                hints[name] = Any
    return hints


def _typed(value: Any, annotation: Any, source: str, where: str) -> Any:
    """``value`` (plain JSON) as ``annotation`` says the field holds it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any or isinstance(annotation, typing.TypeVar) or annotation is object:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        arms = [arm for arm in args if arm is not type(None)]
        for arm in arms[:-1]:
            try:
                return _typed(value, arm, source, where)
            except ConfigError:
                continue
        return _typed(value, arms[-1], source, where)
    if origin is ClassVar or annotation is type(None):
        return value
    if value is None:
        raise _misread(source, where, f"must be {_expected(annotation)}, found null")
    if origin in (list, tuple, set, frozenset) or annotation in (list, tuple, set, frozenset):
        if not isinstance(value, list):
            raise _misread(source, where, f"must be a list, found {json_type(value)}")
        inner = args[0] if args and args[-1] is not Ellipsis or len(args) == 2 else Any
        items = [_typed(item, inner, source, f"{where}[{index}]") for index, item in enumerate(value)]
        return (origin or annotation)(items) if (origin or annotation) is not list else items
    if origin in (dict, Mapping) or annotation in (dict, Mapping) or origin is typing.get_origin(Mapping[str, int]):
        if not isinstance(value, Mapping):
            raise _misread(source, where, f"must be an object, found {json_type(value)}")
        key_type, item_type = args if len(args) == 2 else (Any, Any)
        return {_key(key, key_type, source, where): _typed(item, item_type, source, _at(where, key))
                for key, item in value.items()}
    if isinstance(annotation, type):
        return _instance(value, annotation, source, where)
    return value


def _instance(value: Any, annotation: type, source: str, where: str) -> Any:
    """``value`` as an instance of the class ``annotation``: an enum, a result or plain dataclass
    (its names checked once, by the outermost ``from_dict``), a path, a named tuple or a leaf."""
    if issubclass(annotation, enum.Enum):
        try:
            return annotation(value)
        except ValueError:
            raise _misread(source, where, f"{value!r} is not one of {', '.join(str(m.value) for m in annotation)}"
                           ) from None
    if dataclasses.is_dataclass(annotation):
        return _read(annotation, value, source, where)
    if issubclass(annotation, PurePath):
        return Path(_instance(value, str, source, where))
    if issubclass(annotation, tuple) and hasattr(annotation, "_fields") and isinstance(value, list):
        return annotation(*value)
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation in (bool, int, float, str) and (not isinstance(value, annotation) or (
            annotation is int and isinstance(value, bool))):
        raise _misread(source, where, f"must be {_expected(annotation)}, found {json_type(value)}")
    return value


def _key(key: str, key_type: Any, source: str, where: str) -> Any:
    """A mapping's key as written (a string) back as its type (an integer rank, an enum)."""
    if key_type is int:
        try:
            return int(key)
        except ValueError:
            raise _misread(source, _at(where, key), "must be keyed by an integer") from None
    if isinstance(key_type, type) and issubclass(key_type, enum.Enum):
        return _instance(key, key_type, source, _at(where, key))
    return key


def _at(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def _expected(annotation: Any) -> str:
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
            dict: "an object"}.get(annotation, getattr(annotation, "__name__", str(annotation)))


def json_type(value: Any) -> str:
    """What a JSON value is, in the words an error uses ("an object", "a list", "null", ...)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    return {dict: "an object", list: "a list", str: "a string", int: "a number", float: "a number"}.get(
        type(value), type(value).__name__)


def _misread(source: str, where: str, what: str) -> ConfigError:
    return ConfigError(f"{source or 'the result'}: field {where!r} {what}; is the file from this samebits version, "
                       "and whole?")


def milliseconds(seconds: Any) -> Any:
    """Seconds rounded to the millisecond (a number, or each value of a mapping of them)."""
    if isinstance(seconds, Mapping):
        return {_plain_key(key): round(value, 3) for key, value in seconds.items()}
    return round(seconds, 3)


def _plain_key(key: Any) -> str:
    if isinstance(key, enum.Enum):
        return str(key.value)
    return key if isinstance(key, str) else str(key)


__all__ = ["Verdict", "ToDict", "serialised", "plain", "milliseconds", "json_type", "EXIT_OK", "EXIT_BAD_VERDICT", "EXIT_CANNOT_RUN",
           "EXIT_RERUN_ELSEWHERE", "EXIT_STOPPED"]
