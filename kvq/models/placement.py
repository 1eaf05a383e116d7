"""Models beyond one device: `--device-map` and `--max-memory`, through accelerate.

transformers dispatches the model (`from_pretrained(device_map=..., max_memory=...)`):
layers on several GPUs, or on the CPU, or on disk (loaded at each forward). accelerate's
hooks move activations between devices, so kvq's capture hooks, the cache and the
Fisher pass see each layer's tensors wherever that layer runs; inputs go to the device
of the input embeddings. The checks here run before torch loads.

    --device-map auto|balanced|balanced_low_0|sequential|FILE.json
                 FILE: {"module name": device}, device an int (GPU), "cpu", "disk",
                 "cuda:N" or "mps"
    --max-memory 0=70GiB,1=70GiB,cpu=200GiB    (per device: a size with B/KB/MB/GB/KiB/MiB/GiB/TiB)
"""

from __future__ import annotations

import atexit
import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvq.errors import KvqError

STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
_SIZE = re.compile(r"^\d+(\.\d+)?\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)$", re.IGNORECASE)
_DEVICE = re.compile(r"^(cpu|disk|mps|cuda(:\d+)?|\d+)$")


@dataclass(frozen=True)
class Placement:
    """Where the model's modules go; the default (None, None) is one device, as before."""

    device_map: str | dict[str, str | int] | None = None
    max_memory: dict[str | int, str] | None = None

    @property
    def dispatched(self) -> bool:
        return self.device_map is not None

    def load_kwargs(self) -> dict:
        """from_pretrained keyword arguments (a disk-offload folder if any module may go to
        disk: removed when the process exits)."""
        if self.device_map is None:
            return {}
        kw: dict = {"device_map": self.device_map}
        if self.max_memory is not None:
            kw["max_memory"] = self.max_memory
        if isinstance(self.device_map, str) or "disk" in self.device_map.values():
            folder = tempfile.mkdtemp(prefix="kvq-offload-")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            kw["offload_folder"] = folder
        return kw


def parse_placement(device_map: str | None, max_memory: str | None) -> Placement:
    """The placement the flags ask for, or a one-line KvqError (no torch needed)."""
    if max_memory is not None and device_map is None:
        raise KvqError("--max-memory needs --device-map (auto, balanced, ... or a FILE)")
    memory = _parse_memory(max_memory) if max_memory is not None else None
    if device_map is None or device_map in STRATEGIES:
        return Placement(device_map, memory)
    return Placement(_read_map(Path(device_map)), memory)


def _parse_memory(text: str) -> dict[str | int, str]:
    out: dict[str | int, str] = {}
    for item in text.split(","):
        device, sep, size = (s.strip() for s in item.partition("="))
        if not sep or not _DEVICE.match(device) or device == "disk" or not _SIZE.match(size):
            raise KvqError(
                f"--max-memory: {item.strip()!r} is not DEVICE=SIZE (e.g. 0=70GiB,cpu=200GiB)"
            )
        out[int(device) if device.isdigit() else device] = size.replace(" ", "")
    return out


def _read_map(path: Path) -> dict[str, str | int]:
    if not path.is_file():
        raise KvqError(
            f"--device-map {path}: not one of {', '.join(STRATEGIES)} and no such JSON file"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise KvqError(f"--device-map {path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not data:
        raise KvqError(f"--device-map {path}: expected an object of module name -> device")
    for name, device in data.items():
        ok = (type(device) is int and device >= 0) or (
            isinstance(device, str) and _DEVICE.match(device)
        )
        if not ok:
            raise KvqError(
                f"--device-map {path}: {name!r} -> {device!r} is not a GPU number, cpu, "
                "disk, cuda:N or mps"
            )
    return data


# --- run time (torch) ----------------------------------------------------------------------


def input_device(model):
    """Where a model's input ids go: the execution device of its input embeddings (for a
    dispatched model, whose first parameter may sit on disk as a meta tensor)."""
    import torch

    embed = model.get_input_embeddings()
    hook = getattr(embed, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device) if not isinstance(device, torch.device) else device
    weight = embed.weight
    return weight.device if weight.device.type != "meta" else torch.device("cpu")
