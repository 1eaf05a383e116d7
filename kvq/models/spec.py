"""What a MODEL spec names, decided without torch: the command line checks it before
importing anything heavy, so a typo in `--model` fails in well under a second.

  "gemma3-270m"   the packaged GGUF (see `kvq.models.loading`)
  path/to/x.gguf  a GGUF file
  path/to/dir     a Hugging Face directory with config.json
  org/name        a hub id, usable only if already in the local Hugging Face cache
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Literal

from kvq.errors import KvqError

DEFAULT_MODEL = "gemma3-270m"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

Kind = Literal["packaged", "gguf", "dir", "hub"]


def model_kind(spec: str) -> Kind:
    """Which kind of MODEL `spec` is; KvqError (one line) when it names nothing usable."""
    if spec == DEFAULT_MODEL:
        return "packaged"
    path = Path(spec).expanduser()
    if spec.endswith(".gguf"):
        if not path.is_file():
            raise KvqError(f"model path {spec!r} does not exist")
        check_gguf_header(path, spec)
        return "gguf"
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise KvqError(f"model directory {spec!r} has no config.json")
        return "dir"
    # "org/name" is a hub id; only things that cannot be one are treated as missing paths.
    # (A bare os.sep test would misread every "org/name" hub id as a path.)
    if path.exists() or spec.startswith((".", "/", "~")) or not _HUB_ID.match(spec):
        raise KvqError(f"model path {spec!r} does not exist")
    return "hub"


_GGUF_VERSIONS = (2, 3)  # what the GGUF reader of transformers reads
# the smallest a metadata entry (key length, type, a 1-byte value) and a tensor entry (name
# length, dimension count, type, offset) can be: counts beyond what the file can hold are lies
_MIN_KV_BYTES, _MIN_TENSOR_BYTES = 8 + 4 + 1, 8 + 4 + 4 + 8


def check_gguf_header(path: Path, spec: str) -> None:
    """Refuse a file whose 24-byte GGUF header is missing, of another version, or claims more
    entries than its size can hold, before the reader trusts those counts."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(24)
    except OSError as e:
        raise KvqError(f"cannot read model {spec!r} ({e.strerror or e})") from None
    bad = f"model {spec!r} is not a readable GGUF"
    if len(head) < 24:
        raise KvqError(f"{bad}: {size} bytes, shorter than a GGUF header")
    if head[:4] != b"GGUF":
        raise KvqError(f"{bad}: it does not start with the GGUF magic bytes")
    version, tensors, kvs = struct.unpack("<IQQ", head[4:])
    if version not in _GGUF_VERSIONS:
        raise KvqError(f"{bad}: version {version} (readable: 2 and 3, little-endian)")
    if 24 + tensors * _MIN_TENSOR_BYTES + kvs * _MIN_KV_BYTES > size:
        raise KvqError(
            f"{bad}: it claims {tensors} tensors and {kvs} metadata entries, "
            f"more than its {size} bytes can hold (truncated or corrupt)"
        )


def cache_root() -> Path:
    """$KVQ_CACHE, default ~/.cache/kvq."""
    return Path(os.environ.get("KVQ_CACHE") or "~/.cache/kvq").expanduser()


def declared_context(spec: str) -> int | None:
    """The model's context (max_position_embeddings) when its config.json is on disk: a
    model directory, or the packaged model once converted; None when only loading says."""
    kind = model_kind(spec)
    folder = {"dir": Path(spec).expanduser(), "packaged": cache_root() / "models" / spec}
    config = folder[kind] / "config.json" if kind in folder else None
    if config is None or not config.is_file():
        return None
    try:
        raw = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # loading will say what is wrong with it
    raw = raw.get("text_config", raw) if isinstance(raw, dict) else {}
    n = raw.get("max_position_embeddings") if isinstance(raw, dict) else None
    return n if isinstance(n, int) and n > 0 else None


def check_fits_context(spec: str, tokens: int, what: str) -> None:
    """Refuse `tokens` past the model's context before the model loads, when its config
    says what that is (`declared_context`); the loaded model is checked again either way."""
    refuse_past_context(tokens, declared_context(spec), what)


def refuse_past_context(tokens: int, context: int | None, what: str) -> None:
    """Beyond its context the model was never trained: its figures would describe
    extrapolation, not quantization. The one rule before and after the model loads."""
    if context is not None and tokens > context:
        raise KvqError(f"{what} asks for {tokens} tokens; the model's context is {context}")


def check_model_spec(spec: str) -> None:
    """Refuse a MODEL that cannot load offline: a missing path, or a hub id that is not in
    the local Hugging Face cache (there is no network to fetch it)."""
    if model_kind(spec) == "hub" and not _in_hub_cache(spec):
        raise KvqError(
            f"model {spec!r} not found locally and the hub is unreachable (offline); "
            "pass a local directory, a .gguf file or 'gemma3-270m'"
        )


def _in_hub_cache(repo_id: str) -> bool:
    home = os.environ.get("HF_HOME") or os.path.join("~", ".cache", "huggingface")
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(home, "hub")
    folder = "models--" + repo_id.replace("/", "--")
    return (Path(hub).expanduser() / folder).is_dir()
