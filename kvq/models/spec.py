"""What a MODEL spec names, decided without torch: the command line checks it before
importing anything heavy, so a typo in `--model` fails in well under a second.

  "gemma3-270m"   the packaged GGUF (see `kvq.models.loading`)
  path/to/x.gguf  a GGUF file
  path/to/dir     a Hugging Face directory with config.json
  org/name        a hub id, usable only if already in the local Hugging Face cache
"""

from __future__ import annotations

import os
import re
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
