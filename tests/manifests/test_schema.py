"""Manifest JSON: exact round trip, refusal by field name, generated JSON Schema."""

from __future__ import annotations

import copy
import json
from dataclasses import fields, replace

import jsonschema
import pytest

from kvq.errors import IncompatibleArtifact, KvqError
from kvq.manifests.identity import ArchitectureInfo, ModelIdentity, RopeInfo
from kvq.manifests.jsonschema import json_schema
from kvq.manifests.ledger import ByteLedger
from kvq.manifests.schema import (
    LATER_FIELDS,
    SCHEMA_VERSION,
    Calibration,
    DatasetInfo,
    Manifest,
    TensorEntry,
    manifest_from_json,
    manifest_to_json,
    new_manifest,
)
from kvq.quant.schemes import CachePolicy, LayerPolicy, QuantScheme, named_policy

NUM_LAYERS = 4


def make_identity() -> ModelIdentity:
    return ModelIdentity(
        model_type="gemma3_text",
        config_sha256="c" * 64,
        weights_sha256="e" * 64,
        tokenizer_sha256="f" * 64,
    )


def make_architecture() -> ArchitectureInfo:
    # Gemma-like: sliding layers with local theta, every 4th layer global.
    types = ("sliding_attention",) * 3 + ("full_attention",)
    rope = tuple(
        RopeInfo(theta=1e6 if t == "full_attention" else 1e4, rotary_dim=64, pairing="rotate-half")
        for t in types
    )
    return ArchitectureInfo(
        model_type="gemma3_text",
        num_layers=NUM_LAYERS,
        num_q_heads=4,
        num_kv_heads=1,
        head_dim=64,
        layer_types=types,
        sliding_window=512,
        rope=rope,
        qk_norm=True,
        qk_norm_offset_one=True,
    )


def channel_static_policy() -> CachePolicy:
    key = QuantScheme(format="int", bits=4, axis="channel", lifetime="static")
    value = QuantScheme(format="int", bits=4, axis="token", group_size=64)
    layer = LayerPolicy(key=key, value=value, key_stage="pre-rope", sink_tokens=1)
    return CachePolicy(name="channel-static-int4", layers=(layer,) * NUM_LAYERS)


def make_manifest(calibrated: bool = False, ledger: ByteLedger | None = None) -> Manifest:
    """A calibration-free int4 manifest, or a calibrated pre-RoPE per-channel one."""
    if calibrated:
        dataset = DatasetInfo(
            spec="wikitext2:train",
            text_sha256="a" * 64,
            windows_sha256="b" * 64,
            samples=16,
            seqlen=512,
            seed=0,
        )
        calibration = Calibration(
            method="channel_scales",
            dataset=dataset,
            options={"percentile": 99.9, "clip": True, "groups": 2, "note": None, "s": "x"},
            stage_seconds={"capture": 1.25, "fit": 0.5},
        )
        policy = channel_static_policy()
    else:
        calibration = Calibration(method="int4", dataset=None, options={}, stage_seconds={})
        policy = named_policy("int4", NUM_LAYERS)
    return new_manifest(
        model_spec="gemma3-270m",
        identity=make_identity(),
        architecture=make_architecture(),
        policy=policy,
        passes=(calibration,),
        ledger=ledger,
    )


LEDGER = ByteLedger(
    codes=4096, qparams=512, sparse=0, sink=256, residual=0, full_precision=0, tokens=64,
    fp16_bytes=32768,
)  # fmt: skip


def all_manifests() -> list[Manifest]:
    with_tensors = make_manifest(calibrated=True, ledger=LEDGER)
    index = {"k_scale.0": TensorEntry(dtype="float16", shape=(1, 64), sha256="0" * 64)}
    return [make_manifest(), with_tensors, replace(with_tensors, tensors=index)]


def through_json(m: Manifest) -> dict:
    return json.loads(json.dumps(manifest_to_json(m)))


@pytest.mark.parametrize("m", all_manifests())
def test_round_trip_is_exact(m):
    back = manifest_from_json(through_json(m))
    assert back == m
    assert isinstance(back.architecture.rope, tuple)
    assert isinstance(back.policy.layers, tuple)
    assert all(isinstance(e.shape, tuple) for e in back.tensors.values())


@pytest.mark.parametrize("m", all_manifests())
def test_manifests_validate_against_generated_schema(m):
    schema = json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(through_json(m), schema)


def test_schema_is_generated_from_the_dataclasses():
    defs = json_schema()["$defs"]
    for cls in (ArchitectureInfo, RopeInfo, Calibration, QuantScheme, LayerPolicy, ByteLedger):
        later = {n for c, n in LATER_FIELDS if c == cls.__name__}
        assert defs[cls.__name__]["required"] == [
            f.name for f in fields(cls) if f.name not in later
        ]
        assert set(defs[cls.__name__]["properties"]) == {f.name for f in fields(cls)}
    assert defs["QuantScheme"]["properties"]["axis"] == {
        "enum": ["token", "channel", "head", "tensor"]
    }


# Each dataclass's fields as schema 2 was first released. A field added since must be in
# LATER_FIELDS (its default meaning what older artifacts did) or bump SCHEMA_VERSION:
# otherwise every artifact users already have is refused as incompatible.
SCHEMA_2_FIELDS = {
    "QuantScheme": {"format", "bits", "axis", "symmetric", "group_size", "scale_dtype"}
    | {"lifetime", "fp8_format", "outlier_fraction", "qnorm"},
    "LayerPolicy": {"key", "value", "key_stage", "sink_tokens"},
    "CachePolicy": {"name", "layers", "version"},
    "ByteLedger": {"codes", "qparams", "sparse", "sink", "residual", "full_precision"}
    | {"tokens", "fp16_bytes"},
    "Calibration": {"method", "dataset", "options", "stage_seconds"},
}


@pytest.mark.parametrize("cls", [QuantScheme, LayerPolicy, CachePolicy, ByteLedger, Calibration])
def test_fields_added_within_schema_2_are_optional(cls):
    added = {f.name for f in fields(cls)} - SCHEMA_2_FIELDS[cls.__name__]
    assert added <= {n for c, n in LATER_FIELDS if c == cls.__name__}


def test_a_manifest_without_the_later_fields_reads_with_their_defaults():
    d = through_json(make_manifest(calibrated=True, ledger=LEDGER))
    for layer in d["policy"]["_data"]["layers"]:
        for side in ("key", "value"):
            for name in ("zero_point", "vector_dim"):
                del layer[side][name]
        del layer["residual_tokens"]
    del d["policy"]["_data"]["prefix"]
    back = manifest_from_json(d)
    assert back.policy == make_manifest(calibrated=True, ledger=LEDGER).policy


def edited(path: list, value=None, delete: bool = False) -> dict:
    """The calibrated manifest's JSON with one field replaced or deleted."""
    d = copy.deepcopy(through_json(make_manifest(calibrated=True, ledger=LEDGER)))
    node = d
    for key in path[:-1]:
        node = node[key]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


BAD = [
    # (edit, the field the refusal must name)
    (edited(["model_spec"], delete=True), "model_spec"),
    (edited(["architecture", "num_layers"], "4"), "architecture.num_layers"),
    (edited(["architecture", "qk_norm"], 1), "architecture.qk_norm"),
    (edited(["architecture", "rope", 1, "theta"], delete=True), "architecture.rope[1].theta"),
    (edited(["architecture", "rope", 2, "pairing"], "sideways"), "architecture.rope[2].pairing"),
    (edited(["identity", "extra"], "x"), "identity.extra"),
    (edited(["passes", 0, "dataset", "samples"], 1.5), "passes[0].dataset.samples"),
    (edited(["passes", 0, "options", "bad"], [1]), "passes[0].options[bad]"),
    (edited(["ledger", "codes"], True), "ledger.codes"),
    (edited(["policy", "_version"], 2), "policy._version"),
    (edited(["policy", "_data", "layers", 0, "key", "bits"], "4"), "policy._data.layers[0].key.bits"),
    (edited(["policy", "_data", "layers", 0, "sink_tokens"], delete=True), "policy._data.layers[0].sink_tokens"),
]  # fmt: skip


@pytest.mark.parametrize(("d", "field"), BAD, ids=[f for _, f in BAD])
def test_decoder_and_schema_both_refuse(d, field):
    with pytest.raises(IncompatibleArtifact) as err:
        manifest_from_json(d)
    assert err.value.field == field
    assert field in str(err.value)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(d, json_schema())


def test_schema_version_mismatch_is_named():
    d = through_json(make_manifest())
    d["schema_version"] = SCHEMA_VERSION + 1
    with pytest.raises(IncompatibleArtifact, match="schema_version") as err:
        manifest_from_json(d)
    assert (err.value.expected, err.value.found) == (SCHEMA_VERSION, SCHEMA_VERSION + 1)
    del d["schema_version"]
    with pytest.raises(IncompatibleArtifact, match="schema_version"):
        manifest_from_json(d)


def test_schema_1_manifests_still_read_as_a_one_pass_chain():
    d = through_json(make_manifest(calibrated=True, ledger=LEDGER))
    v1 = {k: v for k, v in d.items() if k != "passes"} | {
        "schema_version": 1,
        "calibration": d["passes"][0],
    }
    assert manifest_from_json(v1) == manifest_from_json(d)
    with pytest.raises(IncompatibleArtifact, match="regenerate the artifact"):
        manifest_from_json(d | {"schema_version": 0})


def test_well_typed_but_invalid_values_are_refused():
    # Types check out, the scheme's own rules do not: per-token must be dynamic.
    d = edited(["policy", "_data", "layers", 0, "value", "lifetime"], "static")
    with pytest.raises(IncompatibleArtifact, match="policy"):
        manifest_from_json(d)
    with pytest.raises(IncompatibleArtifact, match="ledger"):
        manifest_from_json(edited(["ledger", "sink"], -1))


def test_policy_must_cover_every_layer():
    d = through_json(make_manifest())
    d["policy"]["_data"]["layers"].pop()
    with pytest.raises(IncompatibleArtifact, match=r"policy\.layers: expected 4, found 3"):
        manifest_from_json(d)
    with pytest.raises(KvqError, match="layers"):
        new_manifest(
            model_spec="m",
            identity=make_identity(),
            architecture=make_architecture(),
            policy=named_policy("int8", NUM_LAYERS + 1),
            passes=(Calibration(method="int8", dataset=None, options={}, stage_seconds={}),),
        )


def test_policy_with_one_side_quantized():
    """`CachePolicy.only`: the other side of every layer at full precision, the rest kept."""
    from kvq.quant.schemes import FULL_PRECISION

    policy = named_policy("int4", 3, 64)
    assert policy.only("both") is policy
    keys, values = policy.only("keys"), policy.only("values")
    for layer, k, v in zip(policy.layers, keys.layers, values.layers, strict=True):
        assert (k.key, k.value) == (layer.key, FULL_PRECISION)
        assert (v.key, v.value) == (FULL_PRECISION, layer.value)
        assert k.sink_tokens == v.sink_tokens == layer.sink_tokens
        assert k.key_stage == v.key_stage == layer.key_stage
    assert keys.name == "int4 (keys only)"
    assert CachePolicy.from_json(json.loads(json.dumps(keys.to_json()))) == keys
    with pytest.raises(KvqError, match="--quantize must be one of both, keys, values"):
        policy.only("k")


def test_an_artifact_written_before_later_policy_fields_still_reads():
    """zero_point (QServe) and residual_tokens (KIVI) came within schema 2; an artifact
    written before them means their defaults; any other missing field is still refused."""
    m = make_manifest(calibrated=True)
    d = through_json(m)
    for layer in d["policy"]["_data"]["layers"]:
        layer.pop("residual_tokens")
        layer["key"].pop("zero_point")
        layer["value"].pop("zero_point")
    assert manifest_from_json(d) == m
    d["policy"]["_data"]["layers"][0].pop("sink_tokens")
    with pytest.raises(IncompatibleArtifact, match="sink_tokens"):
        manifest_from_json(d)
