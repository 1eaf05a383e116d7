"""`kvq run-eval` and `kvq generate` as library jobs returning plain data."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvq.artifacts.compat import load_artifact
from kvq.calibrators.options import parse_prefix_ids
from kvq.calibrators.prefix_state import ids_prefix
from kvq.data.text import TextSource, read_corpus
from kvq.errors import KvqError
from kvq.eval.inputs import (
    check_activations,
    check_cache_source,
    check_plot_dir,
    check_protocol,
    check_quantize,
    parse_tasks,
)
from kvq.eval.plots import write_plots
from kvq.eval.provenance import provenance
from kvq.eval.quality import evaluate
from kvq.eval.result_memo import ResultMemo, cache_identity
from kvq.eval.tasks import WINDOW_TASKS, get_task
from kvq.eval.tasks.base import EvalParams, TaskContext
from kvq.eval.verdict import default_budget, verdict
from kvq.manifests.ledger import ByteLedger
from kvq.models.loading import load_model
from kvq.models.placement import Placement, input_device
from kvq.pipeline import apply_transforms, cache_for, check_context, load_windows
from kvq.progress import Progress
from kvq.runtime.activations import quantized_linear_inputs, static_scales
from kvq.runtime.kernels.backend import resolve_backend
from kvq.runtime.prefix import user_tokens


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
    corpus: tuple[str, TextSource] | None = None,
    quantize: str = "both",
    placement: Placement | None = None,
    activations: str = "none",
    prefix_ids: str | None = None,
    params: EvalParams | None = None,
    plot_dir: Path | None = None,
    budget: dict[str, float] | None = None,
    memo: ResultMemo | None = None,
) -> dict:
    """corpus: `read_corpus` of the dataset when the caller has read it already.
    quantize: "both", or "keys" / "values" alone (the other side at full precision).
    activations: "none", "a8-dynamic" or "a8-static" (`kvq.runtime.activations`).
    prefix_ids: "2,107": declare a prefix of these ids (exact K/V rows from the model,
    `prefix_state.ids_prefix`) on a policy or artifact that declares none; None or
    "none": only the artifact's own declared prefix, if any. Either way the cache serves
    the prefix and only the window's own tokens are scored.
    params: the grid of the registered tasks (`kvq.eval.tasks`); plot_dir: where their
    PNG plots go (None: no plots); budget: limits per figure (`kvq.eval.verdict`; None:
    the defaults for the cache's mean code bits); memo: where the results of the generation
    tasks are kept and reused, per cell (`kvq.eval.result_memo`; None: always computed)."""
    chosen = parse_tasks(tasks)
    params = params or EvalParams(seed=seed)
    check_plot_dir(plot_dir)
    windowed = [t for t in chosen if t in WINDOW_TASKS]
    check_protocol(protocol)
    check_quantize(quantize)
    check_activations(activations, artifact_path)
    explicit_prefix = None if prefix_ids is None else parse_prefix_ids(prefix_ids)
    check_cache_source(artifact_path, policy, backend)
    # a bad dataset fails before the model load
    corpus = corpus or read_corpus(dataset, windows, seqlen, data_dir)
    start = time.perf_counter()
    with progress.stage("load model"):
        loaded = load_model(model_spec, placement=placement)
    artifact = None
    if artifact_path is not None:
        with progress.stage("load artifact"):
            artifact = load_artifact(artifact_path, loaded)
        apply_transforms(loaded, artifact.tensors, progress)  # shown as "apply <kind>"
    others = [get_task(t) for t in chosen if t not in WINDOW_TASKS]
    if others:  # a context past the model's is refused before any work
        check_context(loaded, max(params.contexts), "--contexts")
    tw = None
    if windowed:
        with progress.stage("sample windows"):
            tw = load_windows(loaded, dataset, windows, seqlen, seed, data_dir, corpus)
    resolve_backend(backend, input_device(loaded.model))  # fail fast: e.g. triton without CUDA
    declared = None if artifact is None else artifact.manifest.policy.prefix
    if explicit_prefix and declared is not None:
        raise KvqError(
            f"--prefix-ids: the artifact declares its own prefix {list(declared.token_ids)} "
            f"({declared.source}), which it serves; drop --prefix-ids"
        )
    extra = None
    if explicit_prefix:
        with progress.stage("extract prefix K/V"):
            extra = ids_prefix(loaded, explicit_prefix)

    def make_cache():
        return cache_for(loaded, artifact=artifact, policy=policy, backend=backend,
                         quantize=quantize, prefix=extra)  # fmt: skip

    first_cache = make_cache()  # fail fast on an unusable policy
    spec = first_cache.policy.prefix
    sections: dict = {}
    prefix = None  # [P] the declared prefix's ids, served before every window
    if windowed:
        ids, prefix = served_windows(loaded, spec, tw.ids)
        scales = None
        if activations == "a8-static":
            scales = static_scales(artifact.tensors, loaded.adapter)

        def around():
            return quantized_linear_inputs(loaded.adapter, activations, scales, backend)

        result = evaluate(
            loaded.model, ids, make_cache, protocol, progress, around=around, prefix=prefix
        )
        sections = result.as_json(tuple(windowed))
    cache_name = str(artifact_path) if policy is None else policy
    if artifact_path is not None and policy is not None:
        cache_name = f"{policy} + {artifact_path}"
    memo = memo or ResultMemo()
    key = cache_identity(first_cache.policy, artifact, backend, quantize, extra)
    ctx = TaskContext(
        loaded, make_cache, cache_name, corpus[0], params, progress, backend, memo, key
    )
    for task in others:
        began = time.perf_counter()
        sections[task.name] = task.run(ctx) | {"seconds": round(time.perf_counter() - began, 3)}
    plots = write_plots(sections, plot_dir, chosen) if plot_dir is not None else []
    cache_policy = first_cache.policy
    bits = mean_code_bits(cache_policy)
    limits = budget or default_budget(bits)
    rows = verdict(sections, limits)
    judged = {
        "budget": limits,
        "source": "--budget" if budget else f"defaults for {bits:.2f} mean code bits",
        "rows": rows,
        "overall": "PASS" if all(r["verdict"] == "PASS" for r in rows) else "FAIL",
    }
    linear_path = "reference fake-quant"
    if resolve_backend(backend, input_device(loaded.model)) == "triton":
        linear_path = "triton W8A8 GEMM (weights INT8 per channel)"
    return {
        "model": model_spec,
        "artifact": str(artifact_path) if artifact_path is not None else None,
        "policy": policy if policy is not None else cache_policy.name,
        "dataset": corpus[1].spec,
        "dataset_sha256": corpus[1].sha256,
        "windows_sha256": None if tw is None else tw.fingerprint,
        "protocol": protocol,
        "quantize": quantize,
        "activations": {
            "mode": activations,
            "format": None if activations == "none" else "int8 symmetric",
            "granularity": {"none": None, "a8-dynamic": "token", "a8-static": "tensor"}[
                activations
            ],
            "linears": 0 if activations == "none" else len(loaded.adapter.decoder_linears()),
            "path": None if activations == "none" else linear_path,
        },
        "windows": windows,
        "seqlen": seqlen,
        "seed": seed,
        "prefix": None if prefix is None else prefix.tolist(),
        "prefix_source": None if spec is None else spec.source,
        "tasks": sections,
        "plots": [str(p) for p in plots],
        "result_cache": memo.as_json(),
        "verdict": judged,
        "provenance": provenance(loaded, cache_policy, backend, params, corpus[1], chosen),
        "seconds": {**progress.seconds, "total": round(time.perf_counter() - start, 3)},
    }


def mean_code_bits(policy) -> float:
    """The policy's code bits per stored element, K and V of every layer averaged (16 for a
    side kept at full precision): what picks the default budget."""
    bits = [s.bits if s.stored else 16 for lp in policy.layers for s in (lp.key, lp.value)]
    return sum(bits) / len(bits)


def last_eval_path(artifact: Path) -> Path:
    """Where the last evaluation's summary of an artifact is kept: beside the artifact's
    folder, never inside it (its hashes stay valid)."""
    artifact = Path(artifact)
    return artifact.with_name(artifact.name + ".last-eval.json")


def served_windows(loaded, spec, windows: torch.Tensor):
    """(the windows' user tokens [N, L'], the prefix ids [P] or None) for a cache whose
    policy declares `spec` (a `PrefixSpec` or None): a window's BOS goes when the prefix
    supplies it."""
    if spec is None:
        return windows, None
    bos = getattr(loaded.tokenizer, "bos_token_id", None)
    ids = user_tokens(windows, spec, bos)
    return ids, torch.tensor(spec.token_ids, dtype=torch.long)


@dataclass(frozen=True)
class Generation:
    text: str  # the new tokens, decoded
    new_tokens: int
    seconds: float  # prefill + decode, model loading excluded
    ledger: ByteLedger  # the cache after the last step
    transforms: tuple[str, ...] = ()  # model transforms the artifact applied, by kind
    model_dtype: str = "float32"  # the activations' dtype: what full-precision rows keep


@torch.no_grad()
def generate_text(
    model_spec: str,
    artifact_path: Path | None,
    policy: str | None,
    prompt: str,
    max_new_tokens: int,
    backend: str | None = None,
) -> Generation:
    check_cache_source(artifact_path, policy, backend)
    loaded = load_model(model_spec)
    artifact = load_artifact(artifact_path, loaded) if artifact_path is not None else None
    resolve_backend(backend, input_device(loaded.model))
    transforms = apply_transforms(loaded, artifact.tensors) if artifact is not None else ()
    cache = cache_for(loaded, artifact=artifact, policy=policy, backend=backend)
    inputs = loaded.tokenizer(prompt, return_tensors="pt")
    if artifact is not None and artifact.manifest.policy.prefix is not None:
        # the cache supplies the prefix (and with it the BOS, when it starts with one)
        ids, _ = served_windows(loaded, artifact.manifest.policy.prefix, inputs["input_ids"])
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    prompt_len = inputs["input_ids"].shape[1]
    hidden = (
        0 if artifact is None else len(getattr(artifact.manifest.policy.prefix, "token_ids", ()))
    )
    check_context(
        loaded,
        hidden + prompt_len + max_new_tokens,
        f"a {hidden}-token prefix + {prompt_len}-token prompt + --max-new-tokens",
    )
    start = time.perf_counter()
    out = loaded.model.generate(
        **inputs, cache=cache, max_new_tokens=max_new_tokens, do_sample=False
    )
    seconds = time.perf_counter() - start
    new = out[0, inputs["input_ids"].shape[1] :]  # [N]
    text = loaded.tokenizer.decode(new, skip_special_tokens=True)
    dtype = str(next(loaded.model.parameters()).dtype).removeprefix("torch.")
    return Generation(text, int(new.numel()), seconds, cache.nbytes(), transforms, dtype)
