"""What a scenario returns: a frozen dataclass, and its one JSON form (`to_json`, `from_json`).

``results.json`` is written from ``to_json(result)``: the dataclass's fields by name, nested
dataclasses, lists and dicts alike. A field marked ``FLAT`` (``field(metadata=FLAT)``) puts its
own keys into its parent's, so a group of figures shared by several results (`HitRates`) keeps
the flat keys the report and `kvkeep plan --compare` read; a FLAT field that is None adds none.
A FLAT dict takes back the keys ending in its ``flat_suffix`` that no field claims.
``from_json(cls, to_json(r)) == r`` for every result, by the field types: keys no field
claims (the mode loop's ``server`` and ``profile``) are left out; a missing one is a ValueError.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

FLAT = {"flat": True}

T = TypeVar("T")


def flat_suffix(suffix: str) -> dict[str, Any]:
    """FLAT for a dict whose keys end in ``suffix`` (`HitRates.tiers`: ``ram_hit_rate``...)."""
    return {"flat": True, "suffix": suffix}


def to_json(value: Any) -> Any:
    """The JSON-ready form of a result (dicts, lists, numbers, strings). Pure."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            item = to_json(getattr(value, f.name))
            if f.metadata.get("flat"):
                out.update(item or {})
            else:
                out[f.name] = item
        return out
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    return value


def from_json(cls: type[T], data: Any) -> T:
    """The result ``to_json`` wrote as ``data``, rebuilt by ``cls``'s field types. A field
    typed by a dataclass may hold a subclass of it (restart's phases hold `Requeried`s):
    the most derived one whose keys ``data`` has. Raises ValueError naming a missing key."""
    value: T = _build(cls, data)
    return value


def _build(tp: Any, data: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        kinds = [a for a in args if a is not type(None)]
        fits = [a for a in kinds if not _is_class(a) or _has_keys(a, data)]
        return _build((fits or kinds)[0], data)
    if _is_class(tp):
        return _dataclass(_most_derived(tp, data), data)
    if origin is dict:
        return {k: _build(args[1], v) for k, v in data.items()} if args else dict(data)
    if origin is list:
        return [_build(args[0], v) for v in data] if args else list(data)
    if origin is tuple:
        each = args[:1] * len(data) if len(args) == 2 and args[1] is Ellipsis else args
        return tuple(_build(a, v) for a, v in zip(each, data, strict=True)) if args else tuple(data)
    return data  # a number, a string, None or Any: as JSON holds it


def _dataclass(cls: type, data: dict[str, Any], outer: frozenset[str] = frozenset()) -> Any:
    """``cls`` from the JSON object ``data``; ``outer``: the keys the objects it is FLAT in
    claim (a FLAT dict must not take them)."""
    if not isinstance(data, dict):
        raise ValueError(f"{cls.__name__}: want a JSON object, got {type(data).__name__}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    claimed = _claimed(cls) | outer
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp = hints[f.name]
        if f.metadata.get("flat"):
            suffix = f.metadata.get("suffix")
            if suffix is not None:  # a dict: the keys nothing else claims
                kwargs[f.name] = {
                    k: v for k, v in data.items() if k.endswith(suffix) and k not in claimed
                }
            elif _optional(tp) and not _has_keys(_optional(tp), data):
                kwargs[f.name] = None
            else:
                group = _optional(tp) or tp
                kwargs[f.name] = _dataclass(_most_derived(group, data), data, claimed)
        elif f.name in data:
            kwargs[f.name] = _build(tp, data[f.name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(f"{cls.__name__}: the results have no {f.name!r}")
    return cls(**kwargs)


def _is_class(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _optional(tp: Any) -> Any:
    """X of ``X | None``; None for a type that is not optional."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        return next(a for a in args if a is not type(None))
    return None


@functools.cache
def _claimed(cls: type) -> frozenset[str]:
    """Every key the JSON of ``cls`` holds by name: its fields', its FLAT groups' (not the
    keys of a FLAT dict, which vary)."""
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if not f.metadata.get("flat"):
            out.add(f.name)
        elif f.metadata.get("suffix") is None:
            out |= _claimed(_optional(tp) or tp)
    return frozenset(out)


@functools.cache
def _required(cls: type) -> frozenset[str]:
    """The keys the JSON of ``cls`` always holds: fields without defaults, and FLAT groups'
    that are not optional."""
    out: set[str] = set()
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if f.metadata.get("flat"):
            if f.metadata.get("suffix") is None and _optional(tp) is None:
                out |= _required(tp)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            out.add(f.name)
    return frozenset(out)


def _has_keys(cls: type, data: Any) -> bool:
    """Whether ``data`` holds the JSON of ``cls``: every key it always has, and for a class
    whose keys are all optional, at least one of them."""
    if not isinstance(data, dict):
        return False
    required = _required(cls)
    return required <= data.keys() if required else bool(_claimed(cls) & data.keys())


def _most_derived(cls: type, data: Any) -> type:
    """``cls``, or its most derived dataclass subclass whose own keys ``data`` holds."""
    best, subs = cls, typing.cast(list[type], cls.__subclasses__())
    for sub in subs:
        if _is_class(sub) and (_claimed(sub) - _claimed(cls)) & data.keys():
            found = _most_derived(sub, data)
            if len(_claimed(found)) > len(_claimed(best)):
                best = found
    return best
