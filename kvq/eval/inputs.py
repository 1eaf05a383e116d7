"""Checks of command-line input that need no model and no torch.

They run before the heavy imports and the model load (seconds together), so a typo is
reported at once; the library jobs run them too. The dataset is checked by reading it
(`kvq.data.text.read_corpus`), and the text read is handed to the job.
"""

from __future__ import annotations

from pathlib import Path

from kvq.errors import KvqError
from kvq.quant.schemes import (  # check_quantize: re-exported beside the other checks
    ACTIVATION_MODES,
    NAMED_POLICIES,
    check_quantize,  # noqa: F401
    named_policy,
)
from kvq.runtime.kernels.backend import check_choice

TASKS = ("ppl", "kld", "bytes")
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
    """Exactly one of an existing artifact or a known policy name, and a known backend."""
    check_choice(backend or "auto")
    if (artifact_path is None) == (policy is None):
        raise KvqError("give exactly one of --artifact or --policy")
    if policy is not None and policy not in NAMED_POLICIES:
        named_policy(policy, 1)  # raises the one-line "unknown policy" error
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
