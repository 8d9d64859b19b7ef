"""Payload and output conversion between user types and the JSON stored in Postgres.

Payloads are validated and structured with cattrs before anything is written; outputs are
unstructured with the same converter. Structuring is strict: a number is not silently turned
into a string, and unknown keys are rejected, so a typo in a payload fails at the trigger
instead of inside a worker hours later.
"""

from __future__ import annotations

import json
import math
import re
import typing
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import cattrs
import cattrs.gen
from cattrs import cols
from cattrs.preconf.json import make_converter

from runlane._limits import DEFAULT_MAX_PAYLOAD_BYTES, describe_size
from runlane.errors import PayloadValidationError
from runlane.toolkit import shown

__all__ = [
    "MAX_DEPTH",
    "OutputNotSerializable",
    "OutputTooLarge",
    "decode_payload",
    "dump_json",
    "encode_output",
    "encode_payload",
    "encode_plain",
]


class OutputNotSerializable(Exception):
    """A handler returned a value that cannot be stored as JSON."""


class OutputTooLarge(OutputNotSerializable):
    """A value to store as an output is over the runtime's ``max_output_bytes``."""


def _strict_str(value: Any, _: type) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def _strict_int(value: Any, _: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    return value


def _strict_float(value: Any, _: type) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
    return float(value)


def _strict_bool(value: Any, _: type) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected a boolean, got {type(value).__name__}")
    return value


def _strict_uuid(value: Any, _: type) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    if not isinstance(value, str):
        raise TypeError(f"expected a UUID string, got {type(value).__name__}")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise ValueError(f"expected a UUID, got {shown(value)}") from None


def _not_text(hook: Any) -> Any:
    """Wrap a collection hook so a string or a mapping is refused: "abc" is iterable, but it
    is not the list ["a", "b", "c"]."""

    def structure(value: Any, target: Any) -> Any:
        if isinstance(value, str | bytes | Mapping):
            raise TypeError(f"expected a list, got {type(value).__name__}")
        return hook(value, target)

    return structure


def _object_only(cls: Any, converter: cattrs.Converter) -> Any:
    """The structure hook of an attrs class, refusing anything but a mapping of its fields
    (a list or None would otherwise fail with "'list' object has no attribute 'keys'")."""
    hook = cattrs.gen.make_dict_structure_fn(
        cls,
        converter,
        _cattrs_forbid_extra_keys=converter.forbid_extra_keys,
        _cattrs_detailed_validation=converter.detailed_validation,
    )

    def structure(value: Any, target: Any) -> Any:
        if not isinstance(value, Mapping):
            kind = type(value).__name__
            shown = "null" if value is None else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"
            raise TypeError(f"expected an object with the fields of {cls.__name__}, got {shown}")
        return hook(value, target)

    return structure


def _is_list_like(cls: Any) -> bool:
    return bool(cols.is_sequence(cls)) and typing.get_origin(cls) is not tuple


def _is_homogenous_tuple(cls: Any) -> bool:
    args = typing.get_args(cls)
    return typing.get_origin(cls) is tuple and len(args) == 2 and args[1] is Ellipsis


def _make_converter() -> cattrs.Converter:
    converter = make_converter(forbid_extra_keys=True)
    converter.register_structure_hook(str, _strict_str)
    converter.register_structure_hook(int, _strict_int)
    converter.register_structure_hook(float, _strict_float)
    converter.register_structure_hook(bool, _strict_bool)
    converter.register_structure_hook(uuid.UUID, _strict_uuid)
    converter.register_unstructure_hook(uuid.UUID, str)
    converter.register_structure_hook_factory(
        lambda cls: attrs.has(cls) and not typing.get_args(cls),
        lambda cls: _object_only(cls, converter),
    )
    converter.register_structure_hook_factory(
        _is_list_like, lambda cls: _not_text(cols.list_structure_factory(cls, converter))
    )
    converter.register_structure_hook_factory(
        _is_homogenous_tuple,
        lambda cls: _not_text(cols.homogenous_tuple_structure_factory(cls, converter)),
    )
    return converter


converter = _make_converter()


# a \u0000 escape that is not itself escaped: Postgres jsonb cannot hold the NUL character
_NUL_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

# one encoder for every value (json.dumps with these options builds a new one per call)
_ENCODER = json.JSONEncoder(
    allow_nan=False, check_circular=False, separators=(",", ":"), ensure_ascii=False
)


def _c_encode() -> Callable[[Any], str] | None:
    """_ENCODER.encode without the C encoder it builds on every call: that encoder made
    once (the arguments JSONEncoder.iterencode passes it for _ENCODER's options), the same
    text and errors at less than half the cost of a small payload's encode. None when the
    C accelerator is missing (then _ENCODER.encode)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # pragma: no cover - CPython ships it
        return None
    chunks = make(
        None,  # markers: check_circular=False
        _ENCODER.default,
        json.encoder.encode_basestring,  # ensure_ascii=False
        None,  # indent
        ":",
        ",",
        False,  # sort_keys
        False,  # skipkeys
        False,  # allow_nan
    )
    return lambda value: "".join(chunks(value, 0))


_encode: Callable[[Any], str] = _c_encode() or _ENCODER.encode

# deeper values are refused: Python's encoders recurse (and fail near 1,000 levels), and no
# task's arguments need it
MAX_DEPTH = 100

# isinstance against a tuple is several times faster than against a union; the common
# scalars are skipped before it (a list of 5,000,000 numbers: 1.8 s -> 0.25 s)
_CONTAINERS = (dict, list, tuple)
_SCALARS = frozenset({str, int, float, bool, type(None)})


_TOO_DEEP = f"it is nested more than {MAX_DEPTH} levels deep (or contains itself); flatten it"


def _check_plain(value: Any) -> bool:
    """Refuse non-string object keys (``json.dumps`` would turn 1 into "1") and nesting
    deeper than MAX_DEPTH (a value that contains itself too), without recursion or user
    code. Returns whether ``value`` holds only plain dicts, lists, tuples and scalars; when
    False, _dump walks it again through _plain_copy."""
    if type(value) in _SCALARS:
        return True
    if type(value) not in _CONTAINERS:
        return False
    plain = True
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(_TOO_DEEP)
        children: Any = item
        if type(item) is dict:
            for key in item:
                if type(key) is not str:
                    plain = _str_key(key)
            children = item.values()
        # a container of scalars only (most are, and the largest): one pass in C, a third
        # of the Python loop's cost (a list of 17,000,000 numbers: 2.1 s -> 0.7 s)
        if _SCALARS.issuperset(map(type, children)):
            continue
        for child in [c for c in children if type(c) not in _SCALARS]:
            if type(child) in _CONTAINERS:
                stack.append((child, depth + 1))
            else:
                plain = False
    return plain


def _plain_copy(value: Any, depth: int = 1) -> Any:
    """``value`` with every dict, list and tuple (subclasses too) copied as a plain one, each
    read once as the JSON encoder reads it, so what _check_plain checks is what is encoded
    however a subclass overrides its methods."""
    if depth > MAX_DEPTH:
        raise ValueError(_TOO_DEEP)
    if type(value) in _SCALARS:
        return value
    if isinstance(value, dict):
        pairs = dict.items(value) if type(value) is dict else value.items()
        return {key: _plain_copy(child, depth + 1) for key, child in pairs}
    if isinstance(value, list | tuple):
        items = list.__iter__(value) if isinstance(value, list) else tuple.__iter__(value)
        return [_plain_copy(child, depth + 1) for child in items]
    return value


def _str_key(key: Any) -> bool:
    """False for a key of a str subclass (plain JSON, not a plain value); refuses others."""
    if isinstance(key, str):
        return False
    raise TypeError(
        f"object keys must be strings (JSON has no other kind), got the "
        f"{type(key).__name__} key {shown(key)}; convert keys with str() or send a list of pairs"
    )


def _all_plain(value: Any) -> bool:
    """Whether the converter would change nothing in ``value``, nor _check_plain refuse it."""
    try:
        return _check_plain(value)
    except (TypeError, ValueError):
        return False


def _dump(value: Any, *, checked: bool = False, hint: bool = True) -> tuple[str, int]:
    """``value`` as JSON text and the size of that text in UTF-8 bytes.

    NaN, infinities, the NUL character, lone surrogates, non-string object keys and values
    nested too deeply are refused (ValueError or TypeError), as Postgres ``jsonb`` would
    refuse or JSON would change them; ``checked``: _all_plain said so already; ``hint``:
    a value of another type says which to use (the caller says it otherwise)."""
    if not checked and not _check_plain(value):
        value = _plain_copy(value)
        _check_plain(value)
    try:
        text = _encode(value)
    except TypeError as exc:
        if hint and "is not JSON serializable" in str(exc):
            raise TypeError(
                f"{exc}; use JSON values (dicts with string keys, lists, strings, numbers, "
                "booleans, None) or an attrs instance of the task's schema"
            ) from None
        raise
    except RecursionError:
        raise ValueError(
            f"it is nested too deeply (limit {MAX_DEPTH} levels); flatten it"
        ) from None
    except ValueError as exc:
        if "integer string conversion" in str(exc):
            raise ValueError(
                "an integer has more than 4300 digits; send such a number as a string"
            ) from None
        if "Out of range float" in str(exc):
            raise ValueError(
                "NaN and infinite floats cannot be stored as JSON; send None or a string instead"
            ) from None
        raise
    if "\\u0000" in text and _NUL_ESCAPE.search(text):
        raise ValueError("strings stored as JSON cannot contain the NUL character (\\x00)")
    if text.isascii():
        return text, len(text)
    try:
        return text, len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"strings stored as JSON must be valid Unicode; found {text[exc.start]!r}, a "
            "lone surrogate"
        ) from None


def dump_json(value: Any) -> str:
    """Serialize plain JSON values; NaN, infinities, the NUL character, lone surrogates,
    non-string object keys and values nested too deeply are rejected, as Postgres ``jsonb``
    would reject them or JSON would change them."""
    return _dump(value)[0]


# what the converter and the encoder raise for a value they cannot take; anything else
# (a NameError from an annotation that no longer resolves, a hook with no handler, a
# container whose iteration fails) is named with its type
_EXPECTED = (cattrs.BaseValidationError, TypeError, ValueError, KeyError, AttributeError)


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or a description when the exception's ``__str__`` itself fails."""
    try:
        return str(exc)
    except Exception as failure:  # a user type's __str__: anything is possible
        return f"<str() of this {type(exc).__name__} raised {type(failure).__name__}>"


def _said(exc: BaseException) -> str:
    """exception_text, with the exception's type when it is not one the converter means."""
    text = exception_text(exc)
    return text if isinstance(exc, _EXPECTED) else f"{type(exc).__name__}: {text}"


def _problems(exc: BaseException) -> list[str]:
    if isinstance(exc, cattrs.BaseValidationError):
        try:
            return list(cattrs.transform_error(exc, path="payload"))
        except Exception:  # a user error inside: say what we can
            return [f"payload: {_said(exc)}"]
    return [f"payload: {_said(exc)}"]


def encode_payload(
    task_id: str,
    schema: type[Any] | None,
    payload: Any,
    max_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
) -> str:
    """Validate ``payload`` against ``schema`` and return its JSON text.

    ``payload`` is an instance of ``schema`` or a mapping that cattrs can structure into it.
    An instance is round-tripped too, so a field holding the wrong type is caught here.
    Its JSON text must be at most ``max_bytes`` bytes in UTF-8.
    """
    if schema is not None and not isinstance(payload, schema) and attrs.has(type(payload)):
        problem = f"payload is a {type(payload).__name__}, but the task expects {schema.__name__}"
        raise PayloadValidationError(task_id, [problem])
    try:
        if schema is None:
            plain = payload
        elif isinstance(payload, schema):
            plain = converter.unstructure(payload, schema)
            converter.structure(plain, schema)
        else:
            plain = converter.unstructure(converter.structure(payload, schema), schema)
        text, size = _dump(plain)
    except Exception as exc:  # user types and hooks: anything they raise refuses the payload
        raise PayloadValidationError(task_id, _problems(exc)) from exc
    if size > max_bytes:
        problem = describe_size("payload", size, "max_payload_bytes", max_bytes)
        raise PayloadValidationError(task_id, [problem])
    return text


def decode_payload(task_id: str, schema: type[Any] | None, stored: Any) -> Any:
    """Structure a stored payload back into the task's schema for its handler."""
    if schema is None:
        return stored
    try:
        return converter.structure(stored, schema)
    except Exception as exc:  # a schema changed since: whatever it raises fails the run
        raise PayloadValidationError(task_id, _problems(exc)) from exc


def encode_plain(value: Any, max_bytes: int | None, *, what: str) -> str:
    """Plain JSON values only, as a task without a schema takes its payload: nothing is
    converted (a set, bytes, a date or an attrs instance is refused). Errors as for
    encode_output."""
    try:
        text, size = _dump(value, hint=False)
    except Exception as exc:  # user types: whatever encoding them raises refuses the value
        raise OutputNotSerializable(
            f"{what} (a {type(value).__name__}) cannot be stored as JSON ({_said(exc)}); use "
            "dicts with string keys, lists, strings, numbers, booleans or None (nothing is "
            "converted: pass list(...) of a set, attrs.asdict(...) of an attrs instance)"
        ) from exc
    if max_bytes is not None and size > max_bytes:
        raise OutputTooLarge(describe_size(what, size, "max_output_bytes", max_bytes))
    return text


def encode_output(value: Any, max_bytes: int | None = None, *, what: str = "the output") -> str:
    """Unstructure a value (a handler's return value, a step's output, a wait token's
    output; ``what`` names it in errors) to JSON text, or raise OutputNotSerializable;
    OutputTooLarge when its JSON text is over ``max_bytes`` bytes in UTF-8 (None: no limit)."""
    kind = type(value).__name__
    try:
        if _all_plain(value):  # the converter would change nothing: skip its walk
            text, size = _dump(value, checked=True)
        else:
            text, size = _dump(converter.unstructure(value))
    except RecursionError as exc:
        raise OutputNotSerializable(
            f"{what} (a {kind}) is nested too deeply to store as JSON (limit {MAX_DEPTH} "
            "levels); flatten it"
        ) from exc
    except Exception as exc:  # user types: whatever converting them raises refuses the value
        raise OutputNotSerializable(
            f"{what} (a {kind}) cannot be stored as JSON ({_said(exc)}); use attrs instances, "
            "dicts with string keys, lists, strings, numbers, booleans or None"
        ) from exc
    if max_bytes is not None and size > max_bytes:
        raise OutputTooLarge(describe_size(what, size, "max_output_bytes", max_bytes))
    return text
