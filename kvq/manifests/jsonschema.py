"""The manifest's JSON Schema, generated from the dataclass type hints.

Nothing here restates a field: the schema is derived from `Manifest` and the
dataclasses it nests (and from `CachePolicy`, `LayerPolicy`, `QuantScheme` for
the policy's `_data`), so adding a field to a dataclass adds it to the schema.
Every field is required (but those added within a schema version, whose defaults
earlier artifacts meant) and no others are allowed, matching the decoder in
`kvq.manifests.schema`, which refuses missing and unknown fields alike.
"""

from __future__ import annotations

import inspect
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Literal, Union

from kvq.manifests.schema import LATER_FIELDS, SCHEMA_VERSION, Manifest
from kvq.quant.schemes import SCHEME_VERSION, CachePolicy

DRAFT = "https://json-schema.org/draft/2020-12/schema"

_SCALARS = {
    int: "integer",
    float: "number",
    str: "string",
    bool: "boolean",
    type(None): "null",
}


def json_schema() -> dict[str, Any]:
    """A draft 2020-12 JSON Schema for `manifest_to_json` output of this schema version."""
    defs: dict[str, Any] = {}
    root = _dataclass_schema(Manifest, defs)
    # The one constraint type hints cannot say: this schema describes version N only.
    root["properties"]["schema_version"] = {"const": SCHEMA_VERSION}
    return {"$schema": DRAFT, "title": "kvq artifact manifest", **root, "$defs": defs}


def _schema(tp: Any, defs: dict[str, Any]) -> dict[str, Any]:
    """The schema of one type hint; dataclasses go to `defs` and are referenced."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is CachePolicy:
        return _policy_schema(defs)
    if is_dataclass(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # reserve the name first: guards against recursion
            defs[tp.__name__] = _dataclass_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    if origin in (Union, types.UnionType):
        members = [_schema(a, defs) for a in args]
        if all(set(m) == {"type"} for m in members):  # plain types: one compact list
            return {"type": [m["type"] for m in members]}
        return {"anyOf": members}
    if origin is Literal:
        return {"enum": list(args)}
    if origin in (tuple, list):
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            raise TypeError(f"only homogeneous tuple[X, ...] is supported, got {tp}")
        return {"type": "array", "items": _schema(args[0], defs)}
    if origin is dict:
        if args[0] is not str:
            raise TypeError(f"JSON object keys are strings, got {tp}")
        return {"type": "object", "additionalProperties": _schema(args[1], defs)}
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    raise TypeError(f"no JSON Schema for type hint {tp!r}")


def _dataclass_schema(cls: type, defs: dict[str, Any]) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in fields(cls)]
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {name: _schema(hints[name], defs) for name in names},
        # fields added within the schema version may be absent (see schema.LATER_FIELDS)
        "required": [n for n in names if (cls.__name__, n) not in LATER_FIELDS],
        "additionalProperties": False,
    }
    doc = inspect.getdoc(cls)
    if doc:
        schema["description"] = doc.split("\n\n")[0]
    return schema


def _policy_schema(defs: dict[str, Any]) -> dict[str, Any]:
    """The versioned envelope `CachePolicy.to_json` writes around the dataclass."""
    if "CachePolicy" not in defs:
        defs["CachePolicy"] = {}
        defs["CachePolicy"] = _dataclass_schema(CachePolicy, defs)
    return {
        "type": "object",
        "properties": {
            "_type": {"const": "CachePolicy"},
            "_version": {"const": SCHEME_VERSION},
            "_data": {"$ref": "#/$defs/CachePolicy"},
        },
        "required": ["_type", "_version", "_data"],
        "additionalProperties": False,
    }
