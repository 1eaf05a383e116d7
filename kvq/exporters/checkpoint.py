"""Write a Hugging Face checkpoint with extra tensors and files, atomically.

A serving export is the model's own `save_pretrained` folder (weights, config, tokenizer)
plus the K/V scale tensors under the names an engine reads, a quantization config and
kvq's provenance marker. It is built in a hidden sibling folder and swapped into place
(`kvq.artifacts.paths`), so `--out` holds the previous export or the new one, never a
half-written folder.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import safetensors.torch
from torch import Tensor

from kvq.artifacts import paths
from kvq.errors import KvqError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
EXTRA_SHARD = "kv_cache_scales.safetensors"


def write_checkpoint(
    model,
    tokenizer,
    out: Path,
    tensors: dict[str, Tensor],
    edit_config: Callable[[dict], None],
    files: dict[str, dict],
    overwrite: bool,
) -> Path:
    """save_pretrained(model, tokenizer) + `tensors` (added to the weights) + `edit_config`
    applied to config.json + JSON `files` (name -> content), swapped into `out`."""
    out = paths.claim(Path(out), overwrite, paths.check_export_replaceable)
    tmp = paths.sibling(out, "tmp")
    tmp.mkdir()
    old: Path | None = None
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _add_tensors(tmp, {n: t.detach().cpu().contiguous() for n, t in tensors.items()})
        config = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
        edit_config(config)
        for name, content in {"config.json": config, **files}.items():
            text = json.dumps(content, indent=2, sort_keys=False, allow_nan=False) + "\n"
            (tmp / name).write_text(text, encoding="utf-8")
        old = paths.swap_into_place(tmp, out)
    finally:
        if old is None and os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    if old is not None:
        paths.remove_tree(old)
    return out


def _add_tensors(folder: Path, tensors: dict[str, Tensor]) -> None:
    """Put `tensors` beside the saved weights: into the single weights file, or, for a
    sharded checkpoint, into a shard of their own listed in the index (engines and
    transformers load the shards the index names)."""
    if not tensors:
        return
    if (folder / SINGLE_FILE).is_file():
        weights = safetensors.torch.load_file(str(folder / SINGLE_FILE))
        clash = sorted(weights.keys() & tensors.keys())
        if clash:
            raise KvqError(f"the model already has a tensor named {clash[0]}")
        safetensors.torch.save_file(
            {**weights, **tensors}, str(folder / SINGLE_FILE), metadata={"format": "pt"}
        )
        _readable_like_config(folder / SINGLE_FILE)
        return
    index_path = folder / INDEX_FILE
    if not index_path.is_file():
        raise KvqError(f"save_pretrained wrote neither {SINGLE_FILE} nor {INDEX_FILE}")
    index = json.loads(index_path.read_text(encoding="utf-8"))
    clash = sorted(index["weight_map"].keys() & tensors.keys())
    if clash:
        raise KvqError(f"the model already has a tensor named {clash[0]}")
    safetensors.torch.save_file(tensors, str(folder / EXTRA_SHARD), metadata={"format": "pt"})
    _readable_like_config(folder / EXTRA_SHARD)
    index["weight_map"].update(dict.fromkeys(tensors, EXTRA_SHARD))
    index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def _readable_like_config(path: Path) -> None:
    """safetensors writes 0600; an engine running as another user must read the weights as
    it reads config.json (which save_pretrained wrote under the umask)."""
    shutil.copymode(path.parent / "config.json", path)


def read_checkpoint_tensors(folder: Path) -> dict[str, Tensor]:
    """Every tensor of a checkpoint folder (single file or shards), by name."""
    folder = Path(folder)
    if (folder / SINGLE_FILE).is_file():
        return safetensors.torch.load_file(str(folder / SINGLE_FILE))
    index = json.loads((folder / INDEX_FILE).read_text(encoding="utf-8"))
    out: dict[str, Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        out.update(safetensors.torch.load_file(str(folder / shard)))
    return out
