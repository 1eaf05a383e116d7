"""`kvq calibrate PASS --base ART`: a pass refuses, in one line and before its work, a base
it cannot use (its registry entry's `base` and `rules`), and still takes one it can."""

from __future__ import annotations

import json

import pytest

from kvq.artifacts.store import read_artifact
from kvq.calibrators.options import (
    IntactKVOptions,
    KVQuantOptions,
    PrefixQuantOptions,
    RotateOptions,
    SmoothAttentionOptions,
)
from kvq.calibrators.registry import get_pass
from kvq.errors import KvqError
from tests.cli.test_cli import _one_line_error, _run
from tests.conftest import calibrate

# name -> (its options, the base it is calibrated on): tiny Llama, 2 x 24 tokens each
BASES = {
    "kvquant": (KVQuantOptions(bits=3, fisher=False), None),  # NUQ state, no prefix
    "fp16": (RotateOptions(), None),  # K and V at full precision, a rotate transform
    "kivi": (RotateOptions(layout="kivi4-g16-r8"), None),  # quantized, a residual window
    "prefix": (PrefixQuantOptions(eta=2.0), None),  # int8 (no state) after a prefix
    "kvquant-prefix": (PrefixQuantOptions(eta=2.0), "kvquant"),  # NUQ state and a prefix
    "smooth": (SmoothAttentionOptions(), None),  # kv4-qserve (no state), a smooth transform
}


@pytest.fixture(scope="module")
def bases(llama_dir, calib_txt, tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    for name, (options, on) in BASES.items():  # a base's own base is made before it
        calibrate(llama_dir, str(calib_txt), root / name, options, on and root / on)
    return root


def _calibrate(name, llama_dir, calib_txt, out, *extra):
    args = ["--model", llama_dir, "--dataset", calib_txt, "--samples", 2, "--seqlen", 24]
    return _run("calibrate", name, *args, *extra, "--out", out)


@pytest.mark.parametrize(
    "name, base, flags, needles",
    [
        ("intactkv", None, (), ("intactkv needs a base", "--base ART")),
        ("intactkv", "fp16", (), ("intactkv cannot use the base (cache policy 'fp16')",
                                  "K and V at full precision")),
        ("intactkv", "kivi", (), ("(cache policy 'kivi4-g16-r8')", "residual window")),
        ("tune", None, (), ("tune needs a base", "--base ART")),
        ("tune", "prefix", (), ("tune cannot use the base (cache policy 'int8')",
                                "no vq or NUQ state")),
        ("tune", "kvquant-prefix", (), ("tune cannot use", "declares a prefix")),
        ("rotate", "kvquant", (), ("rotate cannot use the base (cache policy 'kvquant-nuq3')",
                                   "run it first in the chain")),
        ("auto", "kvquant", ("--bits", 4), ("rotate cannot use", "--no-rotate skips it")),
        ("smoothattention", "kvquant", (), ("smoothattention cannot use",
                                            "run it first in the chain")),
        ("rotate", "prefix", (), ("rotate cannot use", "prefix rows")),
        ("smoothattention", "prefix", (), ("smoothattention cannot use", "prefix rows")),
        ("rotate", "fp16", (), ("already carries a rotate transform",)),
        ("smoothattention", "smooth", (), ("already carries a smooth transform",)),
        ("act-scales", "kvquant", ("--layout", "int8"), ("act-scales cannot use",
                                                         "drop --layout")),
    ],
)  # fmt: skip
def test_a_base_the_pass_cannot_use_is_refused_in_one_line(
    bases, llama_dir, calib_txt, tmp_path, name, base, flags, needles
):
    with_base = ("--base", bases / base) if base else ()
    result = _calibrate(name, llama_dir, calib_txt, tmp_path / "out", *with_base, *flags)
    _one_line_error(result, *needles)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "name, base, flags",
    [
        ("intactkv", "kvquant", ("--steps", 1)),
        ("tune", "kvquant", ("--steps", 2, "--checkpoints", 1)),
        ("rotate", "smooth", ()),  # transforms only: the smoothing stays, values rotate
        ("smoothattention", "fp16", ()),
        ("act-scales", "kvquant", ()),  # the base's policy kept
        ("auto", "kvquant", ("--bits", 4, "--no-rotate")),
    ],
)
def test_a_base_the_pass_can_use_still_chains(
    bases, llama_dir, calib_txt, tmp_path, name, base, flags
):
    result = _calibrate(name, llama_dir, calib_txt, tmp_path / "out", "--base", bases / base,
                        *flags)  # fmt: skip
    assert result.exit_code == 0, result.stderr
    made = json.loads((tmp_path / "out" / "manifest.json").read_text())
    base_made = json.loads((bases / base / "manifest.json").read_text())
    assert [p["method"] for p in made["passes"]] == [
        *(p["method"] for p in base_made["passes"]),
        name,
    ]


def test_a_recipes_earlier_pass_is_the_base_it_checks(bases, llama_dir, calib_txt, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("samples: 2\nseqlen: 24\npasses:\n  - rotate\n  - intactkv: {steps: 1}\n")
    result = _run("calibrate", "recipe", recipe, "--model", llama_dir, "--dataset", calib_txt,
                  "--out", tmp_path / "out")  # fmt: skip
    _one_line_error(result, "intactkv cannot use the base (cache policy 'fp16')")
    assert not (tmp_path / "out").exists()


def test_the_manifest_alone_is_enough_to_check(bases):
    """The rules read the base's policy and tensor names only: a manifest will do, so a
    refusal need not wait for the model."""
    fp16 = read_artifact(bases / "fp16").manifest
    with pytest.raises(KvqError, match="K and V at full precision"):
        get_pass("intactkv").check_base(IntactKVOptions(), fp16.policy, fp16.tensors)
    kvquant = read_artifact(bases / "kvquant").manifest
    get_pass("intactkv").check_base(IntactKVOptions(), kvquant.policy, kvquant.tensors)
    with pytest.raises(KvqError, match="run it first in the chain"):
        get_pass("rotate").check_base(RotateOptions(), kvquant.policy, kvquant.tensors)
