"""`kvq calibrate tune`: end-to-end KL tuning of a vq / NUQ base's float state."""

from __future__ import annotations

import pytest
import torch

from kvq.artifacts.store import read_artifact
from kvq.calibrators.options import KVQuantOptions, TuneOptions, VQOptions
from kvq.calibrators.tune import _Tuner
from kvq.models.loading import load_model
from kvq.pipeline import cache_for, load_windows
from tests.cli.test_cli import _one_line_error, _run
from tests.conftest import calibrate, make_tiny_model, tiny_tokenizer

SAMPLES, SEQLEN = 4, 32
# a random model at the default init is nearly uniform (KL to its quantized self ~1e-8):
# larger weights give it peaked distributions that quantization visibly moves
SHARP = dict(initializer_range=0.5)


@pytest.fixture(scope="module")
def sharp_dir(tmp_path_factory):
    """family -> a saved tiny model with SHARP weights."""
    built = {}

    def get(family: str):
        if family not in built:
            out = tmp_path_factory.mktemp(f"sharp-{family}")
            make_tiny_model(family, **SHARP).save_pretrained(out)
            tiny_tokenizer().save_pretrained(out)
            built[family] = out
        return built[family]

    return get


BASES = {
    "vq": VQOptions(bits=2, fisher=False),
    "nuq": KVQuantOptions(bits=2, fisher=False),  # Q-Norm levels decode
    # evenly spaced levels, no Q-Norm: the codebook itself is tuned (and kept sorted)
    "uniform": KVQuantOptions(bits=2, fisher=False, nonuniform=False, qnorm=False),
}


@pytest.fixture(scope="module")
def bases(sharp_dir, data, tmp_path_factory):
    """(family, kind) -> a 2-bit base artifact folder (see BASES)."""
    tmp = tmp_path_factory.mktemp("tune")
    made = {}

    def get(family: str, kind: str):
        if (family, kind) not in made:
            out = tmp / f"{family}-{kind}"
            calibrate(sharp_dir(family), data, out, BASES[kind], samples=SAMPLES, seqlen=SEQLEN)
            made[(family, kind)] = out
        return made[(family, kind)]

    return get


def _tune(model_dir, data, base, out, samples=SAMPLES, seqlen=SEQLEN, **options):
    calibrate(model_dir, data, out, TuneOptions(**options), base, samples=samples, seqlen=seqlen)
    return read_artifact(out)


@torch.no_grad()
def _heldout_kl(loaded, artifact, ids) -> float:
    """Mean KL(exact || runtime cache) per position over windows `ids` [N, T]: real packed
    codes, reference attention."""
    total = 0.0
    for w in range(ids.shape[0]):
        x = ids[w : w + 1]
        exact = torch.log_softmax(loaded.model(x, use_cache=False).logits[0].float(), -1)
        cache = cache_for(loaded, artifact, backend="reference")
        quant = torch.log_softmax(
            loaded.model(x, cache=cache, use_cache=True).logits[0].float(), -1
        )
        total += float((exact.exp() * (exact - quant)).sum(-1).mean())
    return total / ids.shape[0]


def test_tuning_lowers_the_runtime_caches_kl_on_heldout_text(sharp_dir, bases, data, tmp_path):
    """A 2-bit NUQ base with evenly spaced levels: the tuned levels serve windows the pass
    never saw with a lower KL, through the real cache; the artifact keeps the base's
    policy and tensor names and changes only the tuned float state."""
    model_dir = sharp_dir("llama")
    base_dir = bases("llama", "uniform")
    base = read_artifact(base_dir)
    tuned = _tune(model_dir, data, base_dir, tmp_path / "tuned", samples=8, seqlen=48, steps=40,
                  lr=3e-3)  # fmt: skip
    loaded = load_model(str(model_dir))
    ids = load_windows(loaded, data, 3, 48, 7, None).ids  # another sampling seed
    before = _heldout_kl(loaded, base, ids)
    after = _heldout_kl(loaded, tuned, ids)
    assert after < 0.9 * before, (before, after)
    report = tuned.manifest.passes[-1].report
    assert report["heldout_kld_after"] < report["heldout_kld_before"]
    # same policy (name aside) and tensors; only codebooks and the key normaliser move
    assert list(tuned.manifest.policy.layers) == list(base.manifest.policy.layers)
    assert tuned.manifest.policy.name == base.manifest.policy.name + "-tuned"
    assert tuned.tensors.keys() == base.tensors.keys()
    changed = {n for n in base.tensors if not torch.equal(base.tensors[n], tuned.tensors[n])}
    assert any(n.endswith(".codebook") for n in changed), changed
    assert all(n.rsplit(".", 1)[1] in ("codebook", "scale", "center") for n in changed), changed
    for n in changed:
        assert tuned.tensors[n].dtype == base.tensors[n].dtype
    for n in tuned.tensors:  # still valid codebooks: strictly increasing
        if n.endswith(".codebook"):
            assert (tuned.tensors[n][1:] > tuned.tensors[n][:-1]).all()
    entry = tuned.manifest.passes[-1]
    assert entry.method == "tune"
    assert entry.options["method"] == "tuned end-to-end on KL (40 steps)"
    # the runtime decodes it unchanged: generate through a real cache
    cache = cache_for(loaded, tuned, backend="reference")
    prompt = ids[:1, :12]
    out = loaded.model.generate(prompt, past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 16)


def test_no_scales_leaves_the_key_normaliser(sharp_dir, bases, data, tmp_path):
    base = read_artifact(bases("llama", "uniform"))
    tuned = _tune(sharp_dir("llama"), data, bases("llama", "uniform"), tmp_path / "t",
                  samples=8, seqlen=48, steps=20, lr=3e-3, scales=False)  # fmt: skip
    for n, t in base.tensors.items():
        if n.endswith((".scale", ".center")):
            assert torch.equal(tuned.tensors[n], t), n
    levels = [n for n in base.tensors if n.endswith(".codebook")]
    assert levels and any(not torch.equal(base.tensors[n], tuned.tensors[n]) for n in levels)


@pytest.mark.parametrize("kind", ["vq", "nuq"])
def test_the_training_forward_is_the_runtime_caches_forward(sharp_dir, bases, data, kind):
    """What the pass optimises is what the runtime serves: the differentiable forward's
    logits equal the real cache's (packed codes, reference attention), and every tuned
    tensor receives a gradient."""
    model_dir = sharp_dir("gemma3")
    art = read_artifact(bases("gemma3", kind))
    loaded = load_model(str(model_dir))
    ids = load_windows(loaded, data, 1, 40, 3, None).ids
    tuner = _Tuner(loaded, art.manifest.policy, art.tensors, scales=True)
    with torch.no_grad():
        runtime = loaded.model(ids, cache=tuner.runtime_cache(tuner.static), use_cache=True).logits
        exact = loaded.model(ids, use_cache=False).logits
    train = loaded.model(ids, cache=tuner.cache(), use_cache=True).logits
    assert (exact - runtime).abs().max() > 0.1  # the cache quantizes visibly
    # equal up to float32 rounding (the runtime's attention sums in another order; these
    # sharp logits run to tens)
    torch.testing.assert_close(train.detach(), runtime, atol=2e-3, rtol=1e-4)
    train.square().mean().backward()
    for p in tuner.parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_refusals(sharp_dir, bases, data, tmp_path):
    model_dir = sharp_dir("llama")
    args = ["--model", model_dir, "--dataset", data, "--samples", 2, "--seqlen", 16]
    # no base
    _one_line_error(_run("calibrate", "tune", *args, "--out", tmp_path / "a"), "--base")
    # a base with no quantized state to tune (an fp16 layout)
    fp16 = tmp_path / "fp16"
    assert _run("calibrate", "rotate", *args, "--out", fp16).exit_code == 0
    result = _run("calibrate", "tune", *args, "--base", fp16, "--out", tmp_path / "b")
    _one_line_error(result, "no vq or NUQ state")
    assert not (tmp_path / "b").exists()
    # bad options, before any model loads
    _one_line_error(
        _run("calibrate", "tune", *args, "--steps", 0, "--out", tmp_path / "c"), "--steps"
    )
    _one_line_error(_run("calibrate", "tune", *args, "--lr", 0, "--out", tmp_path / "d"), "--lr")
    # one window: none left to hold out
    one = ["--model", model_dir, "--dataset", data, "--samples", 1, "--seqlen", 16]
    base = bases("llama", "vq")
    result = _run("calibrate", "tune", *one, "--base", base, "--out", tmp_path / "e")
    _one_line_error(result, "2 calibration windows")


def test_when_no_checkpoint_beats_the_base_its_state_is_kept_bit_for_bit(sharp_dir, bases, data,
                                                                       tmp_path):  # fmt: skip
    base = read_artifact(bases("llama", "vq"))
    # two huge steps: the held-out KL can only rise
    kept = _tune(sharp_dir("llama"), data, bases("llama", "vq"), tmp_path / "x", steps=2, lr=0.9,
                 checkpoints=1)  # fmt: skip
    report = kept.manifest.passes[-1].report
    assert report["chosen_step"] == 0
    assert report["heldout_kld_after"] == report["heldout_kld_before"]
    assert report["heldout_kld_checkpoints"][0] > report["heldout_kld_before"]
    assert kept.manifest.policy == base.manifest.policy  # no "-tuned": nothing was
    for n, t in base.tensors.items():
        assert torch.equal(kept.tensors[n], t), n


def test_the_cli_runs_it(sharp_dir, bases, data, tmp_path):
    args = ["--model", sharp_dir("llama"), "--dataset", data, "--samples", 8, "--seqlen", 48]
    out = tmp_path / "cli"
    result = _run("calibrate", "tune", *args, "--base", bases("llama", "uniform"), "--steps", 10,
                  "--lr", 3e-3, "--out", out)  # fmt: skip
    assert result.exit_code == 0, result.output
    art = read_artifact(out)
    assert art.manifest.passes[-1].options["steps"] == 10
    assert [p.method for p in art.manifest.passes] == ["kvquant", "tune"]
