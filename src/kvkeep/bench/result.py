"""What a scenario returns: a frozen dataclass, and its one JSON form (`to_json`).

``results.json`` is written from ``to_json(result)``: the dataclass's fields by name, nested
dataclasses, lists and dicts alike. A field marked ``FLAT`` (``field(metadata=FLAT)``) puts its
own keys into its parent's, so a group of figures shared by several results (`HitRates`) keeps
the flat keys the report and `kvkeep plan --compare` read; a FLAT field that is None adds none.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FLAT = {"flat": True}


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
