"""The jobs behind the CLI: calibrate → artifact, artifact → cache, cache → eval.

Everything here is library code: it takes plain arguments and a `Progress`,
returns data, and raises `KvqError` for anything a user can get wrong. The CLI
only parses, calls and renders.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import Tensor

from kvq.artifacts.compat import check_model_compatible, load_artifact
from kvq.artifacts.paths import check_artifact_out
from kvq.artifacts.store import Artifact, read_artifact, tensor_index, write_artifact
from kvq.calibrators.base import ChainState, FitContext, tensor_kind
from kvq.calibrators.options import PassOptions
from kvq.calibrators.registry import get_pass, transform_function
from kvq.data.text import TextSource, read_corpus
from kvq.data.windows import TokenWindows, sample_windows
from kvq.engines.formats import policy_by_name
from kvq.errors import KvqError
from kvq.manifests.ledger import ByteLedger
from kvq.manifests.schema import Calibration, DatasetInfo, new_manifest
from kvq.models.loading import LoadedModel, load_model
from kvq.models.placement import Placement, input_device
from kvq.models.spec import refuse_past_context
from kvq.progress import Progress
from kvq.quant.qparams import count_floored
from kvq.quant.schemes import CachePolicy
from kvq.runtime.cache import QuantizedKVCache, build_cache, unit_scales
from kvq.runtime.prefix import Prefix, check_tokenizer, load_prefix


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
    refuse_past_context(tokens, loaded.adapter.max_positions, what)


@torch.no_grad()
def measure_ledger(
    loaded: LoadedModel, policy: CachePolicy, tensors: dict[str, Tensor], ids: Tensor
) -> ByteLedger:
    """Run one window through a real cache and read its ledger from the stored tensors
    (`tensors`: the policy's state and its prefix rows, if any)."""
    from kvq.runtime.prefix import prefix_from_tensors, user_tokens

    static = {n: t for n, t in tensors.items() if tensor_kind(n) == "policy"}
    prefix = prefix_from_tensors(policy.prefix, tensors, policy.num_layers)
    cache = build_cache(loaded.model, policy, static, loaded.adapter, prefix=prefix)
    ids = user_tokens(ids, policy.prefix, getattr(loaded.tokenizer, "bos_token_id", None))
    loaded.model(ids.to(input_device(loaded.model)), cache=cache, use_cache=True)
    return cache.nbytes()


@dataclass(frozen=True)
class CalibrationRequest:
    """One `kvq calibrate` run: a chain of passes (one, or a recipe's list) on one model and
    one calibration text, optionally starting from the artifact `base`."""

    passes: tuple[PassOptions, ...]  # each options object names its pass (NAME)
    model_spec: str
    dataset: str
    out: Path
    samples: int = 16
    seqlen: int = 512
    seed: int = 0
    overwrite: bool = False
    data_dir: str | None = None
    base: Path | None = None
    placement: Placement = Placement()  # --device-map / --max-memory; default one device


def calibrate_job(
    request: CalibrationRequest,
    progress: Progress,
    corpus: tuple[str, TextSource] | None = None,
) -> Artifact:
    """Load, sample, run each pass on the model as transformed by the passes before it,
    measure the ledger on a real cache, write the artifact atomically.
    corpus: `read_corpus` of the dataset when the caller has read it already."""
    r = replace(request, passes=tuple(p for o in request.passes for p in o.chain()))
    if not r.passes:
        raise KvqError("a calibration needs at least one pass")
    # a bad destination or dataset fails before the model load
    out = check_artifact_out(r.out, r.overwrite)
    base = None if r.base is None else load_artifact(r.base)  # the model is checked below
    first = r.passes[0]  # a base the first pass cannot use is refused before the model loads
    if base is None:
        get_pass(first.NAME).check_base(first, None)
    else:
        get_pass(first.NAME).check_base(first, base.manifest.policy, base.tensors)
    corpus = corpus or read_corpus(r.dataset, r.samples, r.seqlen, r.data_dir)
    with progress.stage("load model"):
        loaded = load_model(r.model_spec, placement=r.placement)
    state, chain = None, []
    if base is not None:
        with progress.stage("load base artifact"):
            check_model_compatible(base.manifest, loaded.identity, loaded.adapter.info)
            apply_transforms(loaded, base.tensors)
        state = ChainState(base.manifest.policy, dict(base.tensors))
        chain = list(base.manifest.passes)
    with progress.stage("sample windows"):
        windows = load_windows(loaded, r.dataset, r.samples, r.seqlen, r.seed, r.data_dir, corpus)
    dataset_info = DatasetInfo(
        spec=windows.source.spec,
        text_sha256=windows.source.sha256,
        windows_sha256=windows.fingerprint,
        samples=r.samples,
        seqlen=r.seqlen,
        seed=r.seed,
    )
    seen: dict[str, float] = {}
    for i, options in enumerate(r.passes):
        options = keys_the_model_can_rotate(options, loaded)
        state = run_pass(loaded, windows, options, progress, state)
        if i == len(r.passes) - 1:
            with progress.stage("measure ledger"):
                ledger = measure_ledger(loaded, state.policy, state.tensors, windows.ids[:1])
        # each pass records the stages that ran since the one before (the first: loading too)
        seconds = {k: v for k, v in progress.seconds.items() if seen.get(k) != v}
        seen = dict(progress.seconds)
        chain.append(
            Calibration(options.NAME, dataset_info, options.as_dict(), seconds, state.report)
        )
    manifest = new_manifest(
        model_spec=r.model_spec,
        identity=loaded.identity,
        architecture=loaded.adapter.info,
        policy=state.policy,
        passes=tuple(chain),
        ledger=ledger,
    )
    write_artifact(Artifact(manifest=manifest, tensors=state.tensors), out, overwrite=r.overwrite)
    return read_artifact(out)


def keys_the_model_can_rotate(options: PassOptions, loaded: LoadedModel) -> PassOptions:
    """Pre-RoPE keys need RoPE over the whole head (the runtime rotates with half-head
    tables); a partial-rotary model (Phi-4-mini, StableLM) has the pass quantize its keys
    after RoPE instead, as the manifest's options then say."""
    rope = loaded.adapter.info.rope
    if getattr(options, "key_stage", None) != "pre-rope":
        return options
    if all(r.rotary_dim == loaded.adapter.head_dim for r in rope):
        return options
    logging.getLogger("kvq").warning(
        "%s: RoPE turns %d of %d channels; its keys are quantized after RoPE",
        options.NAME,
        min(r.rotary_dim for r in rope),
        loaded.adapter.head_dim,
    )
    return replace(options, key_stage="post-rope")


def run_pass(
    loaded: LoadedModel,
    windows: TokenWindows,
    options: PassOptions,
    progress: Progress,
    base: ChainState | None = None,
) -> ChainState:
    """Run one registered pass on `loaded` (the chain's transforms already applied) and
    return the chain's new state; the pass's own transforms are applied to the model too,
    so the next pass sees them."""
    entry = get_pass(options.NAME)
    # what the pass declares it needs of a base (`PassEntry.check_base`), before its work
    if base is None:
        entry.check_base(options, None)
    else:
        entry.check_base(options, base.policy, base.tensors)
    context = FitContext(loaded, windows, options, progress, base, weights_key(loaded, base))
    result = entry.load_fit()(context)
    new_transforms = {n: t for n, t in result.tensors.items() if tensor_kind(n) == "transform"}
    if base is None:
        if result.policy is None:
            raise KvqError(f"{options.NAME} needs a base artifact (--base) for its cache policy")
        state = ChainState(result.policy, dict(result.tensors))
    else:
        carried = base.of_kind("transform") | base.of_kind("activation")
        if result.policy is None:  # the pass only transforms: the base's policy stays
            state = ChainState(base.policy, dict(base.tensors) | result.tensors)
        elif result.policy.prefix is None and base.policy.prefix is not None:
            # a new layout keeps the base's prefix: declared state, like a transform
            policy = result.policy.with_prefix(base.policy.prefix)
            state = ChainState(policy, carried | base.of_kind("prefix") | result.tensors)
        else:
            state = ChainState(result.policy, carried | result.tensors)
    apply_transforms(loaded, new_transforms)
    state.report = dict(result.report) | floored_note(options.NAME, result.tensors)
    return state


def floored_note(name: str, tensors: dict[str, Tensor]) -> dict[str, int]:
    """The manifest note for a pass's static scales that calibration raised to their dtype's
    smallest normal (a nearly silent channel, head or tensor: stored-scale policy,
    `kvq.quant.qparams`). No clipping follows from it, so a note and a debug line, not a
    warning; {} when there are none."""
    floored = sum(count_floored(t) for n, t in tensors.items() if n.endswith("scale"))
    if not floored:
        return {}
    logging.getLogger("kvq").debug(
        "kvq: %s: %d static scales raised to their dtype's smallest normal", name, floored
    )
    return {"scales_at_smallest_normal": floored}


def weights_key(loaded: LoadedModel, base: ChainState | None) -> str:
    """The model's weights as the chain has transformed them: the original weights'
    fingerprint, plus the transform tensors' hashes."""
    transforms = base.of_kind("transform") if base is not None else {}
    if not transforms:
        return loaded.identity.weights_sha256
    index = tensor_index(transforms)
    text = loaded.identity.weights_sha256 + "".join(f"{n}:{e.sha256}" for n, e in index.items())
    return hashlib.sha256(text.encode()).hexdigest()


def apply_transforms(
    loaded: LoadedModel, tensors: dict[str, Tensor], progress: Progress | None = None
) -> tuple[str, ...]:
    """Fold an artifact's model transforms (e.g. SmoothAttention's scales) into `loaded`,
    each by the function its kind registers, as a progress stage ("apply smooth").

    A model never takes a transform twice: the one it carries is remembered by the hash of
    its tensors, so applying the same artifact again is a no-op and a different one of
    the same kind is refused (load the model afresh for it).
    """
    kinds: dict[str, dict[str, Tensor]] = {}
    for name, t in tensors.items():
        if tensor_kind(name) == "transform":
            kinds.setdefault(name.split(".")[2], {})[name] = t
    applied = loaded.model.__dict__.setdefault("_kvq_transforms", {})  # kind -> digest
    done = []
    for kind, group in sorted(kinds.items()):
        digest = hashlib.sha256(repr(sorted(tensor_index(group).items())).encode()).hexdigest()
        if applied.get(kind) == digest:
            continue  # this very transform is in the weights already
        if kind in applied:
            raise KvqError(
                f"the model already carries a different {kind} transform; load it afresh"
            )
        with (progress or Progress()).stage(f"apply {kind}"):
            transform_function(kind)(loaded, group)
        applied[kind] = digest
        done.append(kind)
    return tuple(done)


def artifact_prefix(loaded: LoadedModel, artifact: Artifact) -> Prefix | None:
    """The artifact's declared prefix (`kvq.runtime.prefix.Prefix`), checked against the
    model's tokenizer; None when it declares none."""
    prefix = load_prefix(artifact)
    if prefix is not None:
        check_tokenizer(prefix.spec, loaded.identity.tokenizer_sha256)
    return prefix


def cache_for(
    loaded: LoadedModel,
    artifact: Artifact | None = None,
    policy: str | None = None,
    backend: str | None = None,
    quantize: str = "both",
    prefix: Prefix | None = None,
) -> QuantizedKVCache:
    """A fresh cache from a validated artifact or a named calibration-free policy (both: an
    engine format with the artifact's scales, `kvq.engines.scaled`).

    backend: attention backend "auto" | "triton" | "reference" (None: KVQ_BACKEND).
    quantize: "both", or "keys" / "values" to keep the other side at full precision
    (`CachePolicy.only`).
    prefix: a prefix to declare on a policy or artifact that declares none (run-eval's
    --prefix-ids, `prefix_state.ids_prefix`), checked against the model's tokenizer.
    """
    if artifact is not None and policy is not None:  # an engine format, the artifact's scales
        from kvq.engines.scaled import engine_cache

        return engine_cache(loaded, artifact, policy, backend, quantize, prefix)
    if artifact is None and policy is None:
        raise KvqError("give an artifact or a policy name")
    if prefix is not None:
        check_tokenizer(prefix.spec, loaded.identity.tokenizer_sha256)
        if artifact is not None and artifact.manifest.policy.prefix is not None:
            raise KvqError("the artifact declares a prefix of its own: no second one")
    if artifact is not None:
        check_model_compatible(artifact.manifest, loaded.identity, loaded.adapter.info)
        applied = apply_transforms(loaded, artifact.tensors)  # once per model, then a no-op
        if applied:  # the caller's model object changed: say so
            logging.getLogger("kvq").warning(
                "kvq: folded the artifact's model transforms (%s) into the model's weights",
                ", ".join(applied),
            )
        static = {n: t for n, t in artifact.tensors.items() if tensor_kind(n) == "policy"}
        policy_obj = artifact.manifest.policy.only(quantize)
        if prefix is None:
            prefix = artifact_prefix(loaded, artifact)
        else:
            policy_obj = policy_obj.with_prefix(prefix.spec)
        cache = build_cache(loaded.model, policy_obj, static, loaded.adapter, backend, prefix)
        # the whole artifact (transforms folded into the weights included) names the state
        index = {n: e.sha256 for n, e in sorted(artifact.manifest.tensors.items())}
        cache.identity["artifact"] = hashlib.sha256(json.dumps(index).encode()).hexdigest()
        return cache
    info = loaded.adapter.info
    named = policy_by_name(policy, info.num_layers, info.head_dim).only(quantize)
    if prefix is not None:
        named = named.with_prefix(prefix.spec)
    return build_cache(loaded.model, named, unit_scales(named), loaded.adapter, backend, prefix)
