"""Task results kept on disk: a matrix of caches runs the baseline once, and a stopped
run resumes at the cell it stopped in.

Every run-eval task compares the unquantized model with a quantized cache in one
invocation. The unquantized side of a retrieval grid, a decode or a speculative run is the
same for every cache of a matrix, and on a CPU it is half the cost; an 8K retrieval grid
takes hours, and a run stopped in its last cell should not start again from the first.
With `kvq run-eval --result-cache DIR` a task asks the memo for each unit of work (a grid
cell, a prompt's decode): the first invocation computes and stores it, later ones read it
back.

An entry is keyed by everything its value depends on: the task and what it computed
(`what`), the input ids, the task's own parameters, the model's weights as they are now
(after an artifact's transforms, which change them), its config and tokenizer, and the
torch / transformers versions, dtype and device that produced the numbers. A quantized
entry is keyed as well by the cache (`cache_identity`: its policy, the artifact's tensors,
backend, quantized sides, prefix) and by kvq's own source (the modules its numbers run
through, not the CLI, exports or plots), so a changed runtime never serves an old figure. A change of any of them is a different key, never a stale hit.
Values are JSON (token ids, texts, counts); each entry is written whole (temporary file,
then rename) so an interrupted run leaves no half entry.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvq.errors import KvqError

if TYPE_CHECKING:  # torch and transformers load with the model, not with the CLI
    import torch

SCHEMA = "kvq.result-memo/1"
READABLE = (SCHEMA, "kvq.baseline-memo/1")  # the same entries, before quantized ones
SIDES = ("baseline", "quantized")


def _sha256_json(record: dict) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


# kvq source a memoized figure cannot depend on: the command line, exports, manifests
# (an artifact enters the key by its tensors and policy), advise, plots and report
# layout. Leaving them out keeps a long grid's cells across such changes. (Calibration
# code stays in: run-eval serves a declared prefix through it.)
NOT_IN_NUMBERS = ("cli/", "exporters/", "manifests/", "engines/advise.py", "eval/plots.py",
                  "eval/verdict.py", "eval/report_schema.py")  # fmt: skip


@functools.cache
def kvq_source_sha256() -> str:
    """sha256 over kvq's own Python source that the quantized side's numbers run through."""
    return source_sha256(Path(__file__).resolve().parents[1])  # the kvq package


def source_sha256(root: Path) -> str:
    """sha256 over path and bytes of every module under `root` but `NOT_IN_NUMBERS`."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if not name.startswith(NOT_IN_NUMBERS):
            digest.update(name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def cache_identity(policy, artifact, backend: str | None, quantize: str, prefix) -> str:
    """What makes two quantized caches give the same figures: the policy, the artifact's
    tensors (their sha256 from its manifest), the backend, the sides quantized, a prefix
    declared on top, and kvq's source."""
    return _sha256_json({
        "policy": policy.to_json(),
        "tensors": None if artifact is None
        else {k: v.sha256 for k, v in artifact.manifest.tensors.items()},
        "backend": backend or "auto",
        "quantize": quantize,
        "prefix": None if prefix is None else list(prefix.spec.token_ids),
        "kvq_source": kvq_source_sha256(),
    })  # fmt: skip


class ResultMemo:
    """folder None: nothing is kept, every result is computed (the default)."""

    def __init__(self, folder: Path | None = None):
        self.folder = None if folder is None else Path(folder)
        if self.folder is not None and self.folder.exists() and not self.folder.is_dir():
            raise KvqError(f"--result-cache: {self.folder} is a file, not a folder")
        # entries read back / computed (and stored, with a folder) this run, per side
        self.counts = {side: {"reused": 0, "computed": 0} for side in SIDES}

    @property
    def computed(self) -> int:
        return sum(c["computed"] for c in self.counts.values())

    @property
    def reused(self) -> int:
        return sum(c["reused"] for c in self.counts.values())

    def key(self, loaded, what: str, ids: torch.Tensor, params: dict, cache: str | None) -> str:
        """sha256 over what determines a result (see the module doc); cache: the quantized
        side's `cache_identity`, None for the baseline."""
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
        if cache is not None:  # absent for the baseline: its keys predate the field
            record["cache"] = cache
        return _sha256_json(record)

    def get(
        self,
        loaded,
        what: str,
        ids: torch.Tensor,
        params: dict,
        compute: Callable[[], Any],
        cache: str | None = None,
    ):
        """The stored value for this key, else compute() (stored when there is a folder).
        cache: the quantized side's `cache_identity`; None: the baseline's result."""
        count = self.counts["baseline" if cache is None else "quantized"]
        if self.folder is None:
            count["computed"] += 1
            return compute()
        key = self.key(loaded, what, ids, params, cache)
        path = self.folder / f"{key}.json"
        entry = _read(path)
        if entry is not None and entry.get("schema") in READABLE and entry.get("key") == key:
            count["reused"] += 1
            return entry["value"]
        value = compute()
        count["computed"] += 1
        self.folder.mkdir(parents=True, exist_ok=True)
        entry = {"schema": SCHEMA, "key": key, "what": what, "value": value}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry))
        os.replace(tmp, path)
        return value

    def as_json(self) -> dict:
        return {"folder": None if self.folder is None else str(self.folder), **self.counts}


def _read(path: Path) -> dict | None:
    """The entry at path; None when there is none or it is not one (then it is recomputed
    and written over)."""
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None
