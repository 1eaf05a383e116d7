"""Baseline results kept on disk, so a matrix of caches runs the unquantized side once.

Every run-eval task compares the unquantized model with a quantized cache in one
invocation. The unquantized side of a retrieval grid, a decode or a speculative run is the
same for every cache of a matrix, and on a CPU it is half the cost. With
`kvq run-eval --baseline-cache DIR` a task asks the memo for it: the first invocation
computes and stores it, later ones read it back.

An entry is keyed by everything its value depends on: the task and what it computed
(`what`), the input ids, the task's own parameters, the model's weights as they are now
(after an artifact's transforms, which change them), its config and tokenizer, and the
torch / transformers versions, dtype and device that produced the numbers. A change of any
of them is a different key, never a stale hit. Values are JSON (token ids, texts, counts);
each entry is written whole (temporary file, then rename) so an interrupted run leaves no
half entry.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvq.errors import KvqError

if TYPE_CHECKING:  # torch and transformers load with the model, not with the CLI
    import torch

SCHEMA = "kvq.baseline-memo/1"


class BaselineMemo:
    """folder None: nothing is kept, every baseline is computed (the default)."""

    def __init__(self, folder: Path | None = None):
        self.folder = None if folder is None else Path(folder)
        if self.folder is not None and self.folder.exists() and not self.folder.is_dir():
            raise KvqError(f"--baseline-cache: {self.folder} is a file, not a folder")
        self.reused = 0  # entries read back this run
        self.computed = 0  # entries computed this run (and stored, with a folder)

    def key(self, loaded, what: str, ids: torch.Tensor, params: dict) -> str:
        """sha256 over what determines a baseline result (see the module doc)."""
        import torch
        import transformers

        from kvq.models.fingerprint import weights_sha256

        model = loaded.model
        first = next(model.parameters())
        record = {
            "what": what,
            "ids": hashlib.sha256(
                ids.detach().to("cpu").contiguous().numpy().tobytes()
            ).hexdigest(),
            "ids_shape": list(ids.shape),
            "params": params,
            "weights": weights_sha256(model),
            "config": loaded.identity.config_sha256,
            "tokenizer": loaded.identity.tokenizer_sha256,
            "dtype": str(first.dtype),
            "device": first.device.type,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        text = json.dumps(record, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    def get(self, loaded, what: str, ids: torch.Tensor, params: dict, compute: Callable[[], Any]):
        """The stored value for this key, else compute() (stored when there is a folder)."""
        if self.folder is None:
            self.computed += 1
            return compute()
        key = self.key(loaded, what, ids, params)
        path = self.folder / f"{key}.json"
        entry = _read(path)
        if entry is not None and entry.get("schema") == SCHEMA and entry.get("key") == key:
            self.reused += 1
            return entry["value"]
        value = compute()
        self.computed += 1
        self.folder.mkdir(parents=True, exist_ok=True)
        entry = {"schema": SCHEMA, "key": key, "what": what, "value": value}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, path)
        return value

    def as_json(self) -> dict:
        return {
            "folder": None if self.folder is None else str(self.folder),
            "reused": self.reused,
            "computed": self.computed,
        }


def _read(path: Path) -> dict | None:
    """The entry at path; None when there is none or it is not one (then it is recomputed
    and written over)."""
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None
