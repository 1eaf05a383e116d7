"""Checks of command-line input that need no model and no torch.

They run before the heavy imports and the model load (seconds together), so a typo is
reported at once; the library jobs run them too. The dataset is checked by reading it
(`kvq.data.text.read_corpus`), and the text read is handed to the job.
"""

from __future__ import annotations

from pathlib import Path

from kvq.engines.formats import check_scaled, policy_by_name
from kvq.errors import KvqError
from kvq.eval.tasks import ALL_TASKS
from kvq.quant.schemes import (  # check_quantize: re-exported beside the other checks
    ACTIVATION_MODES,
    NAMED_POLICIES,
    check_quantize,  # noqa: F401
)
from kvq.runtime.kernels.backend import check_choice

TASKS = ALL_TASKS  # the window tasks (ppl, kld, bytes) and every registered task
# generated tokens: far beyond any model's context, so the model's own limit decides
MAX_NEW_TOKENS = 1 << 20
PROTOCOLS = ("prefill", "decode")


def parse_tasks(tasks: str) -> tuple[str, ...]:
    chosen = tuple(t.strip() for t in tasks.split(",") if t.strip())
    unknown = [t for t in chosen if t not in TASKS]
    if unknown or not chosen:
        raise KvqError(f"unknown task(s) {unknown or tasks!r}; choose from {', '.join(TASKS)}")
    return chosen


def check_protocol(protocol: str) -> None:
    if protocol not in PROTOCOLS:
        raise KvqError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")


def check_cache_source(artifact_path: Path | None, policy: str | None, backend: str | None):
    """Exactly one of an existing artifact or a known policy name (or both: an engine format
    whose engine loads scales, `kvq.engines.scaled`), and a known backend."""
    check_choice(backend or "auto")
    both = artifact_path is not None and policy is not None
    if both:
        check_scaled(policy)  # an engine format served with the artifact's scales
    elif artifact_path is None and policy is None:
        raise KvqError("give exactly one of --artifact or --policy")
    if policy is not None and not both and policy not in NAMED_POLICIES:
        policy_by_name(policy, 1)  # raises the one-line "unknown policy" error
    if artifact_path is not None and not Path(artifact_path).exists():
        raise KvqError(f"artifact {artifact_path} does not exist")


def check_prompt(prompt: str, max_new_tokens: int) -> None:
    """A prompt that encodes as UTF-8 (a lone surrogate does not), a bounded token count."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as e:
        raise KvqError(f"--prompt is not valid text ({e.reason} at character {e.start})") from None
    if max_new_tokens > MAX_NEW_TOKENS:
        raise KvqError(f"--max-new-tokens must be at most {MAX_NEW_TOKENS}, got {max_new_tokens}")


def check_activations(mode: str, artifact_path: Path | None) -> None:
    """--activations: none, a8-dynamic, or a8-static (its scales come from an artifact)."""
    if mode not in ACTIVATION_MODES:
        raise KvqError(f"--activations must be one of {', '.join(ACTIVATION_MODES)}, got {mode!r}")
    if mode == "a8-static" and artifact_path is None:
        raise KvqError(
            "--activations a8-static needs --artifact with static input scales "
            "(kvq calibrate act-scales)"
        )


def parse_contexts(text: str) -> tuple[int, ...]:
    """--contexts "1024,2048,4096": positive token counts, at least one."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise KvqError(f"--contexts must be a comma list of token counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise KvqError(f"--contexts must list at least one positive token count, got {text!r}")
    return tuple(sorted(set(values)))


def parse_depths(text: str) -> tuple[float, ...]:
    """--depths "0,0.5,1": where a needle sits in its haystack, each in [0, 1]."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise KvqError(
            f"--depths must be a comma list of numbers in [0, 1], got {text!r}"
        ) from None
    if not values:
        raise KvqError("--depths must list at least one depth in [0, 1]")
    bad = [v for v in values if not 0.0 <= v <= 1.0]
    if bad:
        raise KvqError(f"--depths must each lie in [0, 1] (0 = start, 1 = end), got {bad[0]}")
    return tuple(sorted(set(values)))


_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3,
          "mb": 10**6, "gb": 10**9}  # fmt: skip


def parse_bytes(text: str, flag: str = "--memory-budget") -> int:
    """ "24GiB", "512MB" or a plain byte count."""
    number = text.strip().rstrip("BbIiKkMmGg")
    unit = text.strip()[len(number) :].lower()
    try:
        value = float(number) * _UNITS[unit]
    except (ValueError, KeyError):
        raise KvqError(f"{flag} must be a size such as 24GiB or 512MB, got {text!r}") from None
    if not 1 <= value < 1 << 60:
        raise KvqError(f"{flag} must be a positive size, got {text!r}")
    return int(value)


def check_plot_dir(folder: Path | None) -> None:
    """--plot DIR: a folder (made if missing), never an existing file."""
    if folder is not None and Path(folder).exists() and not Path(folder).is_dir():
        raise KvqError(f"--plot {folder} is a file; give a folder for the PNG plots")
