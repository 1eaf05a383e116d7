"""`kvq run-eval` and `kvq generate` as library jobs returning plain data."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvq.errors import KvqError
from kvq.eval.quality import PROTOCOLS, evaluate
from kvq.manifests.ledger import ByteLedger
from kvq.models.loading import load_model
from kvq.pipeline import cache_for, load_artifact, load_windows
from kvq.progress import Progress
from kvq.quant.schemes import NAMED_POLICIES, named_policy
from kvq.runtime.kernels.backend import check_choice, resolve_backend

TASKS = ("ppl", "kld", "bytes")


def parse_tasks(tasks: str) -> tuple[str, ...]:
    chosen = tuple(t.strip() for t in tasks.split(",") if t.strip())
    unknown = [t for t in chosen if t not in TASKS]
    if unknown or not chosen:
        raise KvqError(f"unknown task(s) {unknown or tasks!r}; choose from {', '.join(TASKS)}")
    return chosen


def run_eval_job(
    model_spec: str,
    artifact_path: Path | None,
    policy: str | None,
    dataset: str,
    tasks: str,
    windows: int,
    seqlen: int,
    protocol: str,
    seed: int,
    data_dir: str | None,
    progress: Progress,
    backend: str | None = None,
) -> dict:
    chosen = parse_tasks(tasks)
    check_choice(backend or "auto")
    if protocol not in PROTOCOLS:
        raise KvqError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if (artifact_path is None) == (policy is None):
        raise KvqError("give exactly one of --artifact or --policy")
    if policy is not None and policy not in NAMED_POLICIES:
        named_policy(policy, 1)  # raises the one-line "unknown policy" error
    if artifact_path is not None and not Path(artifact_path).exists():
        raise KvqError(f"artifact {artifact_path} does not exist")
    start = time.perf_counter()
    with progress.stage("load model"):
        loaded = load_model(model_spec)
    artifact = None
    if artifact_path is not None:
        with progress.stage("load artifact"):
            artifact = load_artifact(artifact_path, loaded)
    with progress.stage("sample windows"):
        tw = load_windows(loaded, dataset, windows, seqlen, seed, data_dir)
    resolve_backend(backend, loaded.model.device)  # fail fast: e.g. triton without CUDA
    cache_for(loaded, artifact=artifact, policy=policy)  # fail fast on an unusable policy
    result = evaluate(
        loaded.model,
        tw.ids,
        lambda: cache_for(loaded, artifact=artifact, policy=policy, backend=backend),
        protocol,
        progress,
    )
    cache_policy = artifact.manifest.policy if artifact is not None else None
    return {
        "model": model_spec,
        "artifact": str(artifact_path) if artifact_path is not None else None,
        "policy": policy if policy is not None else cache_policy.name,
        "dataset": tw.source.spec,
        "dataset_sha256": tw.source.sha256,
        "windows_sha256": tw.fingerprint,
        "protocol": protocol,
        "windows": windows,
        "seqlen": seqlen,
        "seed": seed,
        "tasks": result.as_json(chosen),
        "seconds": {**progress.seconds, "total": round(time.perf_counter() - start, 3)},
    }


@torch.no_grad()
def generate_text(
    model_spec: str,
    artifact_path: Path | None,
    policy: str | None,
    prompt: str,
    max_new_tokens: int,
    backend: str | None = None,
) -> tuple[str, ByteLedger]:
    if (artifact_path is None) == (policy is None):
        raise KvqError("give exactly one of --artifact or --policy")
    loaded = load_model(model_spec)
    artifact = load_artifact(artifact_path, loaded) if artifact_path is not None else None
    resolve_backend(backend, loaded.model.device)
    cache = cache_for(loaded, artifact=artifact, policy=policy, backend=backend)
    inputs = loaded.tokenizer(prompt, return_tensors="pt")
    out = loaded.model.generate(
        **inputs, cache=cache, max_new_tokens=max_new_tokens, do_sample=False
    )
    text = loaded.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    return text, cache.nbytes()
