"""The JSON Schema of a `kvq run-eval --json` report: what other tools may rely on.

    python -m kvq.eval.report_schema > run-eval.schema.json

Only the documented parts are required; tasks add fields freely (additionalProperties).
"""

from __future__ import annotations

import json

_NUMBER = {"type": "number"}
_INT = {"type": "integer", "minimum": 0}
_STR = {"type": "string"}


def _obj(required: dict, **extra) -> dict:
    return {"type": "object", "required": sorted(required), "properties": required, **extra}


_CELL = _obj({"context": _INT, "depth": {"type": "number", "minimum": 0, "maximum": 1},
              "trials": _INT, "baseline_correct": _INT, "quantized_correct": _INT})  # fmt: skip
_RETRIEVAL = _obj({"cells": {"type": "array", "items": _CELL}})
_POSITION = _obj({"start": _INT, "end": _INT, "kld": _NUMBER, "nll_delta": _NUMBER})
_LATENCY_ROW = _obj({"context": _INT, "cache": _STR, "ms_per_token": _NUMBER})

REPORT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "kvq run-eval report",
    **_obj({
        "model": _STR,
        "policy": _STR,
        "dataset": _STR,
        "tasks": {
            "type": "object",
            "properties": {
                "ppl": _obj({"baseline": _NUMBER, "quantized": _NUMBER, "ratio": _NUMBER,
                             "by_position": {"type": "array", "items": _POSITION}}),
                "kld": _obj({"mean": _NUMBER, "top1_agreement": _NUMBER}),
                "passkey": _RETRIEVAL,
                "needle": _RETRIEVAL,
                "latency": _obj({"rows": {"type": "array", "items": _LATENCY_ROW}}),
            },
        },
        "plots": {"type": "array", "items": _STR},
        "verdict": _obj({"overall": {"enum": ["PASS", "FAIL"]}, "rows": {"type": "array"}}),
        "provenance": _obj({
            "model": _obj({"config_sha256": _STR, "weights_sha256": _STR}),
            "cache_policy": _obj({"name": _STR}),
            "backend": _STR, "device": _STR, "hardware": {"type": "object"},
            "versions": {"type": "object"}, "dataset": _obj({"sha256": _STR}),
            "seed": {"type": "integer"}, "baseline": _STR,
        }),
    }),
}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(REPORT_SCHEMA, indent=2))
