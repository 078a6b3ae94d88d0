"""Typed store configuration with one parser.

A store declares a frozen dataclass subclassing ``StoreConfig``. ``parse_config`` turns a
plain mapping (JSON from SGLang's extra config, LMCache adapter params, CLI flags) into it:
unknown keys, missing required keys, wrong types and values outside a closed set are
``ConfigError``s that name the key and the accepted values. Sizes accept ``"4gb"``-style
strings (``Size`` fields); choices are ``Literal[...]`` fields.

Bounds every store gets from here: numbers are finite (no NaN, no inf), floats are 0..1e9,
sizes are at most ``MAX_SIZE``, ``Port`` fields are 0..65535, and any int or float field may
carry ``Range(lo, hi)`` (``Annotated[int, Range(1, 1024)]``).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Annotated, Any, Literal, Mapping, TypeVar, Union, get_args, get_origin

from kvconnect.connectors.errors import ConfigError, UnknownConfigKey


class _SizeMarker:
    pass


SIZE = _SizeMarker()
Size = Annotated[int, SIZE]
"""An int of bytes; accepts ``4096``, ``"4096"``, ``"4gb"``, ``"512 MiB"``, ``"1.5g"``."""

MAX_SIZE = 1 << 50
"""The largest size any option takes (1 PiB): a typo such as ``1e30`` is an error, not a
multi-exabyte allocation attempt."""


@dataclasses.dataclass(frozen=True)
class Range:
    """``Annotated[int | float, Range(lo, hi)]``: the accepted closed interval."""

    lo: float
    hi: float

    def check(self, value: Any, key: str, where: str | None) -> Any:
        if not self.lo <= value <= self.hi:
            raise ConfigError(key, f"{value!r} is out of range", f"{_num(self.lo)}..{_num(self.hi)}", where)
        return value


def port_arg(lo: int = 0):
    """An argparse ``type``: a TCP port ``lo``..65535, checked like ``Port`` options."""
    import argparse

    def parse(text: str) -> int:
        try:
            return Range(lo, 65535).check(int(text), "port", None)
        except (ValueError, ConfigError):
            raise argparse.ArgumentTypeError(f"{text!r} is not a port {lo}..65535") from None
    return parse


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


MAX_FLOAT = 1e9
"""The largest float option (they are seconds: ~31 years)."""

Port = Annotated[int, Range(0, 65535)]
"""A TCP port (0: any free port)."""

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
    "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30,
    "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, key: str = "size", where: str | None = None) -> int:
    """Bytes from an int or a string such as ``"4gb"`` (binary units, as Mooncake/SGLang),
    0..``MAX_SIZE``."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a size, got {value!r}", "an int of bytes or e.g. '4gb'", where)
    n = None
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _UNITS:
            n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n is None:
        raise ConfigError(key, f"cannot read {value!r} as a size",
                          "an int of bytes or a number with unit b/kb/mb/gb/tb (e.g. '4gb')", where)
    if not 0 <= n <= MAX_SIZE:
        raise ConfigError(key, f"size {value!r} is out of range", f"0..{MAX_SIZE} bytes (1 PiB)", where)
    return n


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    """Base of every store's typed config."""


C = TypeVar("C")


def field_doc(help: str, **kw: Any) -> dict[str, Any]:
    """Dataclass field metadata: ``field(default=..., metadata=field_doc("..."))``."""
    return {"help": help, **kw}


def _is_optional(tp: Any) -> tuple[bool, Any]:
    origin = get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) < len(get_args(tp)) and len(args) == 1:
            return True, args[0]
    return False, tp


def _coerce(value: Any, tp: Any, key: str, where: str | None) -> Any:
    optional, tp = _is_optional(tp)
    if value is None:
        if optional:
            return None
        raise ConfigError(key, "must not be null", None, where)
    origin = get_origin(tp)
    if origin is Annotated:
        base, *marks = get_args(tp)
        out = parse_size(value, key, where) if any(m is SIZE for m in marks) else _coerce(value, base, key, where)
        for m in marks:
            if isinstance(m, Range) and out is not None:
                m.check(out, key, where)
        return out
    if origin is Literal:
        choices = get_args(tp)
        if value in choices:
            return value
        if isinstance(value, str) and value.lower() in choices:
            return value.lower()
        raise ConfigError(key, f"invalid value {value!r}", [str(c) for c in choices], where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(key, f"expected a boolean, got {value!r}", ["true", "false"], where)
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(key, f"expected an integer, got {value!r}", None, where)
        if isinstance(value, int):
            return value
        if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]+\s*", value):
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(key, f"expected an integer, got {value!r}", None, where)
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(key, f"expected a number, got {value!r}", None, where)
        out = None
        if isinstance(value, (int, float)):
            out = float(value)
        elif isinstance(value, str):
            try:
                out = float(value)
            except ValueError:
                pass
        if out is None:
            raise ConfigError(key, f"expected a number, got {value!r}", None, where)
        if not (math.isfinite(out) and 0 <= out <= MAX_FLOAT):  # "inf" seconds overflow timer APIs
            raise ConfigError(key, f"{value!r} is out of range", f"a finite number 0..{MAX_FLOAT:g}", where)
        return out
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(key, f"expected a string, got {value!r}", None, where)
    if origin in (list, tuple) or tp in (list, tuple):
        args = get_args(tp)
        if isinstance(value, str):
            value = [v for v in (s.strip() for s in value.split(",")) if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"expected a list, got {value!r}", None, where)
        inner = args[0] if args else Any
        items = [v if inner is Any else _coerce(v, inner, key, where) for v in value]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected an object, got {value!r}", None, where)
        return dict(value)
    if tp is Any:
        return value
    raise TypeError(f"unsupported config field type {tp!r} for {key!r}")


def config_fields(config_class: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(config_class) if f.init}


def parse_config(config_class: type[C], options: Mapping[str, Any], *, where: str | None = None,
                 ignore: typing.Collection[str] = ()) -> C:
    """Validate ``options`` into ``config_class``.

    Args:
        config_class: a dataclass (normally a ``StoreConfig`` subclass).
        options: plain mapping; keys in ``ignore`` are skipped (keys the caller consumed).
        where: prefix for error messages, e.g. ``"store 'hf3fs'"``.
    Raises:
        UnknownConfigKey, ConfigError: naming the key and the accepted values.
    """
    if not isinstance(options, Mapping):
        raise ConfigError("<root>", f"expected an object of options, got {type(options).__name__}", None, where)
    fields = config_fields(config_class)
    hints = typing.get_type_hints(config_class, include_extras=True)
    for key in options:
        if key not in fields and key not in ignore:
            raise UnknownConfigKey(key, fields, where)
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name in options:
            kwargs[name] = _coerce(options[name], hints[name], name, where)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
            raise ConfigError(name, "is required", None, where)
    try:
        return config_class(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:  # __post_init__ checks that raised a bare error
        raise ConfigError(_named_key(str(e), fields), str(e), None, where) from e


def _named_key(message: str, fields: Mapping[str, Any]) -> str:
    """The option a bare ``__post_init__`` error message starts with (else ``<root>``)."""
    first = re.split(r"[\s:]", message.strip(), maxsplit=1)[0]
    return first if first in fields else "<root>"


def describe_config(config_class: type) -> list[tuple[str, str, str, str]]:
    """(key, type, default, help) rows for docs and ``kvconnect stores``."""
    rows = []
    hints = typing.get_type_hints(config_class, include_extras=True)
    for name, f in config_fields(config_class).items():
        tp = hints[name]
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = repr(f.default_factory())  # type: ignore[misc]
        else:
            default = "required"
        inner = _is_optional(tp)[1]
        if get_origin(inner) is Annotated:
            tname = "size" if SIZE in get_args(inner)[1:] else getattr(get_args(inner)[0], "__name__", "int")
        else:
            tname = getattr(tp, "__name__", str(tp))
        rows.append((name, str(tname).replace("typing.", ""), default, f.metadata.get("help", "")))
    return rows
