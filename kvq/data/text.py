"""Raw text for calibration and evaluation, with a record of where it came from.

A DATASET spec is "wikitext2" (the WikiText-2 raw test split, the perplexity corpus of the
KV-quantization papers) or a local .txt / .jsonl / .parquet file. There is no network: the
wikitext2 file is looked up locally, and the HF datasets cache is only a last resort.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from kvq.errors import KvqError
from kvq.jsonio import strict_loads

WIKITEXT2 = "wikitext2"
_WIKITEXT2_FILE = Path("wikitext-2-raw") / "wiki.test.raw"
SUPPORTED_SUFFIXES = (".txt", ".jsonl", ".parquet")
# seeds reach torch.Generator and scikit-learn's KMeans, whose random_state is < 2**32
SEED_LIMIT = 1 << 32


def check_seed(seed: int) -> None:
    if not 0 <= seed < SEED_LIMIT:
        raise KvqError(f"--seed must be in [0, 2**32), got {seed}")


@dataclass(frozen=True)
class TextSource:
    """Provenance of a text: the spec given, the file read (None for the HF cache), its sha256."""

    spec: str
    path: str | None
    sha256: str  # of the text's UTF-8 bytes (equals the file's sha256 for .txt/wikitext2)


def load_text(spec: str, data_dir: str | None = None) -> tuple[str, TextSource]:
    """The whole text of `spec` and its TextSource; KvqError if missing, unsupported or empty."""
    if spec == WIKITEXT2:
        text, path = _wikitext2(data_dir)
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise KvqError(f"dataset file {spec!r} does not exist")
        text = _read_file(path)
        path = str(path.resolve())
    if not text.strip():
        raise KvqError(f"dataset {spec!r} contains no text")
    return text, TextSource(spec=spec, path=path, sha256=_sha256(text))


def read_corpus(spec: str, n: int, seqlen: int, data_dir: str | None) -> tuple[str, TextSource]:
    """`load_text(spec)` to sample n windows of seqlen tokens from, after checking n and
    seqlen: read before any model loads (no torch here), so bad input fails at once."""
    if n <= 0:
        raise KvqError(f"number of windows must be positive, got {n}")
    if seqlen < 2:
        raise KvqError(f"--seqlen must be at least 2, got {seqlen}")
    return load_text(spec, data_dir=data_dir)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _wikitext2(data_dir: str | None) -> tuple[str, str | None]:
    dirs = [d for d in (data_dir, os.environ.get("KVQ_DATA_DIR")) if d]
    for d in dirs:
        f = Path(d).expanduser() / _WIKITEXT2_FILE
        if f.is_file():
            try:
                return _read_exact(f), str(f.resolve())
            except UnicodeDecodeError as e:
                raise KvqError(f"{f} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        return "".join(_hf_cached_wikitext2()["text"]), None  # rows already end in "\n"
    except Exception:  # any failure means "not available offline"
        where = dirs[0] if dirs else "<dir>"
        raise KvqError(
            f"wikitext2 not found: put wiki.test.raw under {where}/wikitext-2-raw/ and pass "
            "--data-dir or set KVQ_DATA_DIR (no network to fetch it)"
        ) from None


def _read_exact(path: Path) -> str:
    """UTF-8 text byte for byte: read_text() would turn the stray \\r in wiki.test.raw into
    \\n, changing tokens and making the sha differ from the file's published sha256."""
    return path.read_bytes().decode("utf-8")


def _hf_cached_wikitext2():
    """WikiText-2 test split from the HF datasets cache, in offline mode.

    Without offline mode `load_dataset` retries the unreachable hub for ~25 s before failing.
    The flags are module constants read at import time, so they are patched and restored.
    """
    import datasets
    import huggingface_hub.constants as hub_constants

    saved = datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub_constants.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    finally:
        datasets.config.HF_HUB_OFFLINE, hub_constants.HF_HUB_OFFLINE = saved


def _read_file(path: Path) -> str:
    suffix = path.suffix.lower()
    try:
        if suffix == ".txt":
            return _read_exact(path)
        if suffix == ".jsonl":
            return _read_jsonl(path)
        if suffix == ".parquet":
            return _read_parquet(path)
    except UnicodeDecodeError as e:
        raise KvqError(f"dataset file {str(path)!r} is not UTF-8 text ({e.reason})") from e
    raise KvqError(
        f"unsupported dataset file {str(path)!r}: expected one of {', '.join(SUPPORTED_SUFFIXES)} "
        "or 'wikitext2'"
    )


def _read_jsonl(path: Path) -> str:
    """Concatenate the "text" field of every line, each ending in a newline."""
    parts = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = strict_loads(line)
            except ValueError as e:
                raise KvqError(f"{path.name}:{n}: invalid JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise KvqError(f'{path.name}:{n}: expected an object with a string "text" field')
            parts.append(row["text"] if row["text"].endswith("\n") else row["text"] + "\n")
    return "".join(parts)


def _read_parquet(path: Path) -> str:
    """Concatenate the "text" column, each row ending in a newline."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path, columns=["text"])
    except Exception as e:  # pyarrow raises several types for a bad file or a missing column
        raise KvqError(f'cannot read a "text" column from {path.name}: {e}') from e
    rows = [r for r in table.column("text").to_pylist() if r is not None]
    bad = next((r for r in rows if not isinstance(r, str)), None)
    if bad is not None:
        raise KvqError(
            f'{path.name}: the "text" column holds {type(bad).__name__} values, not strings'
        )
    return "".join(r if r.endswith("\n") else r + "\n" for r in rows if r)
