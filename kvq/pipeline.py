"""The jobs behind the CLI: calibrate → artifact, artifact → cache, cache → eval.

Everything here is library code: it takes plain arguments and a `Progress`,
returns data, and raises `KvqError` for anything a user can get wrong. The CLI
only parses, calls and renders.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from kvq.calibrators.channel_scales import ChannelScalesOptions, calibrate_channel_scales
from kvq.calibrators.fisher import fisher_cached
from kvq.calibrators.kvquant import KVQuantOptions, calibrate_kvquant
from kvq.data.text import TextSource, read_corpus
from kvq.data.windows import TokenWindows, sample_windows
from kvq.errors import KvqError
from kvq.exporters.artifact import Artifact, check_model_compatible, read_artifact, write_artifact
from kvq.manifests.ledger import ByteLedger
from kvq.manifests.schema import (
    KVQ_VERSION,
    SCHEMA_VERSION,
    Calibration,
    DatasetInfo,
    Manifest,
)
from kvq.models.loading import LoadedModel, load_model
from kvq.progress import Progress
from kvq.quant.schemes import CachePolicy, named_policy
from kvq.runtime.cache import QuantizedKVCache, build_cache


def load_windows(
    loaded: LoadedModel,
    dataset: str,
    n: int,
    seqlen: int,
    seed: int,
    data_dir: str | None,
    corpus: tuple[str, TextSource] | None = None,
) -> TokenWindows:
    """n windows of seqlen tokens of `dataset`; `corpus`: its `read_corpus`, if read already."""
    check_context(loaded, seqlen, "--seqlen")
    text, source = corpus or read_corpus(dataset, n, seqlen, data_dir)
    return sample_windows(loaded.tokenizer, text, source, n=n, seqlen=seqlen, seed=seed)


def check_context(loaded: LoadedModel, tokens: int, what: str) -> None:
    """Refuse sequences longer than the model's context: beyond it the model was never
    trained, and its figures would describe extrapolation, not quantization."""
    context = loaded.adapter.max_positions
    if context is not None and tokens > context:
        raise KvqError(f"{what} asks for {tokens} tokens; the model's context is {context}")


@torch.no_grad()
def measure_ledger(
    loaded: LoadedModel, policy: CachePolicy, tensors: dict[str, Tensor], ids: Tensor
) -> ByteLedger:
    """Run one window through a real cache and read its ledger from the stored tensors."""
    cache = build_cache(loaded.model, policy, tensors, loaded.adapter)
    loaded.model(ids.to(loaded.model.device), cache=cache, use_cache=True)
    return cache.nbytes()


Fit = Callable[[LoadedModel, TokenWindows, Progress], tuple[CachePolicy, dict[str, Tensor]]]


def calibrate_job(
    method: str,
    fit: Fit,
    options: dict,
    model_spec: str,
    dataset: str,
    samples: int,
    seqlen: int,
    seed: int,
    out: Path,
    overwrite: bool,
    data_dir: str | None,
    progress: Progress,
    corpus: tuple[str, TextSource] | None = None,
) -> Artifact:
    """Load, sample, run `fit`, measure the ledger on a real cache, write the artifact atomically.
    corpus: `read_corpus` of the dataset when the caller has read it already."""
    if out.exists() and not overwrite:
        raise KvqError(f"output {out} exists; pass --overwrite to replace it")
    # a bad dataset fails before the model load
    corpus = corpus or read_corpus(dataset, samples, seqlen, data_dir)
    with progress.stage("load model"):
        loaded = load_model(model_spec)
    with progress.stage("sample windows"):
        windows = load_windows(loaded, dataset, samples, seqlen, seed, data_dir, corpus)
    policy, tensors = fit(loaded, windows, progress)
    with progress.stage("measure ledger"):
        static = {n: t for n, t in tensors.items() if n.startswith("layers.")}
        ledger = measure_ledger(loaded, policy, static, windows.ids[:1])
    dataset_info = DatasetInfo(
        spec=windows.source.spec,
        text_sha256=windows.source.sha256,
        windows_sha256=windows.fingerprint,
        samples=samples,
        seqlen=seqlen,
        seed=seed,
    )
    calibration = Calibration(
        method=method, dataset=dataset_info, options=options, stage_seconds=dict(progress.seconds)
    )
    manifest = Manifest(
        schema_version=SCHEMA_VERSION,
        kvq_version=KVQ_VERSION,
        created_utc=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        model_spec=model_spec,
        identity=loaded.identity,
        architecture=loaded.adapter.info,
        policy=policy,
        calibration=calibration,
        tensors={},
        ledger=ledger,
    )
    write_artifact(Artifact(manifest=manifest, tensors=tensors), out, overwrite=overwrite)
    return read_artifact(out)


def channel_scales_fit(options: ChannelScalesOptions) -> Fit:
    def fit(loaded: LoadedModel, windows: TokenWindows, progress: Progress):
        return calibrate_channel_scales(
            loaded.model, loaded.adapter, windows.ids, options, progress
        )

    return fit


def kvquant_fit(options: KVQuantOptions) -> Fit:
    def fit(loaded: LoadedModel, windows: TokenWindows, progress: Progress):
        fisher = None
        extra: dict[str, Tensor] = {}
        if options.fisher:
            info = fisher_cached(
                loaded.model,
                loaded.adapter,
                windows.ids,
                windows.fingerprint,
                loaded.identity.weights_sha256,
                progress,
                exclude_first=options.sink,
            )
            fisher = (info.key, info.value)
            extra = info.to_tensors()  # provenance: the sensitivities the codebooks used
        policy, tensors = calibrate_kvquant(
            loaded.model, loaded.adapter, windows.ids, options, progress, fisher
        )
        return policy, tensors | extra

    return fit


def load_artifact(path: str | Path, loaded: LoadedModel | None = None) -> Artifact:
    """Read and validate an artifact; with a model, also check it was made for that model."""
    artifact = read_artifact(Path(path))
    if loaded is not None:
        check_model_compatible(artifact.manifest, loaded.identity, loaded.adapter.info)
    return artifact


def cache_for(
    loaded: LoadedModel,
    artifact: Artifact | None = None,
    policy: str | None = None,
    backend: str | None = None,
    quantize: str = "both",
) -> QuantizedKVCache:
    """A fresh cache from a validated artifact or a named calibration-free policy.

    backend: attention backend "auto" | "triton" | "reference" (None: KVQ_BACKEND).
    quantize: "both", or "keys" / "values" to keep the other side at full precision
    (`CachePolicy.only`).
    """
    if (artifact is None) == (policy is None):
        raise KvqError("give exactly one of an artifact or a policy name")
    if artifact is not None:
        check_model_compatible(artifact.manifest, loaded.identity, loaded.adapter.info)
        static = {n: t for n, t in artifact.tensors.items() if n.startswith("layers.")}
        policy_obj = artifact.manifest.policy.only(quantize)
        return build_cache(loaded.model, policy_obj, static, loaded.adapter, backend)
    info = loaded.adapter.info
    named = named_policy(policy, info.num_layers, info.head_dim).only(quantize)
    return build_cache(loaded.model, named, {}, loaded.adapter, backend)
