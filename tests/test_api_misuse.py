"""The Python API under misuse: every public call with one argument mutated must end in a
`KvqError` (the argument was bad) or a correct result (it was fine), never another
exception type, never a bad argument accepted.

Each case takes a fresh cache holding a 2-sequence prompt, mutates one argument of one
call from a catalogue of bad and harmless values (each marked which it is), and sorts the
outcome into KvqError / correct / other. A harmless mutation that succeeds is checked for
being right: the cache still answers the next token, and a batch operation's rows give
the logits of a fresh cache that saw the selected sequences.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

import kvq
from kvq.calibrators.options import KVQuantOptions
from kvq.errors import KvqError
from tests.conftest import calibrate

CASES = 240
B, T = 2, 7  # the prompt every case starts from


@pytest.fixture(scope="module")
def world(tiny_model_dir, shared_data, tmp_path_factory):
    """A kvq-loaded tiny Llama, a KVQuant artifact (sparse exceptions, a sink) and a second
    model of another family."""
    model_dir = tiny_model_dir("llama")
    data = shared_data / "calibration" / "groups_merged.txt"
    art = tmp_path_factory.mktemp("misuse") / "ART"
    calibrate(model_dir, str(data), art, KVQuantOptions(bits=4, fisher=False, sink=1))
    model, _ = kvq.load_model(str(model_dir))
    other, _ = kvq.load_model(str(tiny_model_dir("qwen2")))
    return model, art, other


def _ids(b, t, seed):
    return torch.randint(3, 300, (b, t), generator=torch.Generator().manual_seed(seed))


PROMPT, STEP = _ids(B, T, 0), _ids(B, 1, 1)


@torch.no_grad()
def _filled(model, source):
    cache = kvq.make_cache(model, **source)
    model(PROMPT, cache=cache)
    return cache


@torch.no_grad()
def _next_logits(model, cache, rows=None):
    step = STEP if rows is None else STEP[rows]
    return model(step, cache=cache).logits


@torch.no_grad()
def _same_as_selected(model, source, cache, rows):
    """The cache after selecting `rows` answers as a fresh one fed those sequences."""
    fresh = kvq.make_cache(model, **source)
    model(PROMPT[rows], cache=fresh)
    torch.testing.assert_close(_next_logits(model, cache, rows), _next_logits(model, fresh, rows))


def _kv(model, b=B, heads=None, d=None, t=1, dtype=torch.float32):
    info = model._kvq_loaded.adapter.info
    shape = (b, info.num_kv_heads if heads is None else heads, t, d or info.head_dim)
    return torch.randn(shape).to(dtype)


# (name, harmless?, build the call: (model, source, cache, tmp, world) -> zero-arg callable,
#  check after success: (model, source, cache) -> None)
def _catalogue():
    c = []

    def add(name, ok, call, check=None):
        c.append((name, ok, call, check))

    # update(key, value, layer_idx): what transformers' attention hands a cache
    for dtype, ok in ((torch.int64, False), (torch.bool, False), (torch.float16, True),
                      (torch.bfloat16, True), (torch.uint8, False)):  # fmt: skip
        add(f"update dtype {dtype}", ok,
            lambda m, s, c, p, w, dt=dtype: lambda: c.update(_kv(m, dtype=dt), _kv(m, dtype=dt), 0))  # fmt: skip
    for kw in ({"heads": 2 * 2}, {"heads": 0}, {"d": 128}, {"d": 8}, {"b": 3}, {"b": 1}, {"t": 0}):
        add(f"update {kw}", False, lambda m, s, c, p, w, kw=kw: lambda: c.update(_kv(m, **kw), _kv(m, **kw), 0))  # fmt: skip
    for bad in (None, 1.5, [1.0], "k"):
        add(f"update key {bad!r}", False, lambda m, s, c, p, w, x=bad: lambda: c.update(x, _kv(m), 0))  # fmt: skip
    for idx in (-1, 99, 1.0, "0", None, True):
        add(f"update layer {idx!r}", False, lambda m, s, c, p, w, i=idx: lambda: c.update(_kv(m), _kv(m), i))  # fmt: skip
    add("update rank 3", False, lambda m, s, c, p, w: lambda: c.update(_kv(m)[0], _kv(m)[0], 0))
    add("update key/value differ", False, lambda m, s, c, p, w: lambda: c.update(_kv(m), _kv(m, t=2), 0))  # fmt: skip
    # forwards of another batch, a model of another family, a non-kvq model
    for b, ok in ((1, False), (3, False), (B, True)):
        add(f"forward batch {b}", ok, lambda m, s, c, p, w, b=b: lambda: m(_ids(b, 1, 5), cache=c),
            lambda m, s, c: _next_logits(m, c))  # fmt: skip
    add("another kvq model", False, lambda m, s, c, p, w: lambda: w[2](_ids(B, 1, 5), cache=c))
    add("a model without kvq attention", False, lambda m, s, c, p, w: _plain_forward(w[2], c))
    add("generate then one prompt", False,
        lambda m, s, c, p, w: lambda: m.generate(_ids(1, 4, 6), cache=c, max_new_tokens=2, do_sample=False))  # fmt: skip
    # batch operations
    for rows, ok in (([1], True), ([1, 0], True), ([0, 0, 1], True), ([2], False), ([-1], False),
                     ([], True)):  # fmt: skip
        for how in ("tensor", "list"):
            add(f"batch_select_indices {how} {rows}", ok,
                lambda m, s, c, p, w, r=rows, h=how: lambda: c.batch_select_indices(torch.tensor(r, dtype=torch.long) if h == "tensor" else r),
                (lambda m, s, c, r=rows: _same_as_selected(m, s, c, r)) if rows else None)  # fmt: skip
            add(f"reorder_cache {how} {rows}", ok,
                lambda m, s, c, p, w, r=rows, h=how: lambda: c.reorder_cache(torch.tensor(r, dtype=torch.long) if h == "tensor" else r),
                (lambda m, s, c, r=rows: _same_as_selected(m, s, c, r)) if rows else None)  # fmt: skip
    for bad in (torch.tensor([0.0, 1.0]), torch.tensor([True, False]), torch.tensor([[0, 1]]),
                ["a"], 1, None):  # fmt: skip
        add(f"batch_select_indices {bad!r}", False, lambda m, s, c, p, w, x=bad: lambda: c.batch_select_indices(x))  # fmt: skip
    for reps, ok in ((2, True), (1, True), (0, False), (-1, False), (1.5, False), ("2", False),
                     (True, False)):  # fmt: skip
        add(f"batch_repeat_interleave {reps!r}", ok, lambda m, s, c, p, w, r=reps: lambda: c.batch_repeat_interleave(r),
            lambda m, s, c, r=reps: _same_as_selected(m, s, c, [i for i in range(B) for _ in range(r)]))  # fmt: skip
    add("repeat then select", True,
        lambda m, s, c, p, w: lambda: (c.batch_repeat_interleave(2), c.batch_select_indices(torch.tensor([1, 2]))),
        lambda m, s, c: _same_as_selected(m, s, c, [0, 1]))  # fmt: skip
    for n, ok in ((-1, True), (0, True), (-T, True), (-100, True), (1, False), (1.5, False),
                  ("1", False), (None, False)):  # fmt: skip
        add(f"crop {n!r}", ok, lambda m, s, c, p, w, n=n: lambda: c.crop(n), lambda m, s, c: _next_logits(m, c))  # fmt: skip
    for bad in (torch.tensor([1, 0]), [True, False], torch.tensor([True])):
        add(f"release {bad!r}", False, lambda m, s, c, p, w, x=bad: lambda: c.release(x))
    # save and load
    add("save a file", True, lambda m, s, c, p, w: lambda: c.save(p / "s.safetensors"))
    for dest in ("dir", "missing", "artifact", 123, None):
        add(f"save to {dest!r}", False, lambda m, s, c, p, w, d=dest: lambda: c.save(_dest(d, p, w)))  # fmt: skip
    for src in ("missing", "junk", 5, "dir"):
        add(f"load {src!r}", False,
            lambda m, s, c, p, w, x=src: lambda: kvq.load_cache(_dest(x, p, w), m, **s))  # fmt: skip
    add("load into another model", False, lambda m, s, c, p, w: _save_then(c, p, lambda f: kvq.load_cache(f, w[2], **s)))  # fmt: skip
    add("load another layout", False,
        lambda m, s, c, p, w: _save_then(c, p, lambda f: kvq.load_cache(f, m, policy="int4" if "artifact" in s else "int8-pertoken")))  # fmt: skip
    # building caches and reading artifacts
    for kw, ok in (({"artifact": 123}, False), ({"policy": 4}, False), ({"policy": "nope"}, False),
                   ({"policy": "int8", "backend": "gpu"}, False), ({"policy": "int8", "backend": 1}, False),
                   ({"policy": None}, False), ({"policy": "int8", "artifact": "x"}, False),
                   ({"policy": "int8"}, True), ({"artifact": "/no/such/artifact"}, False)):  # fmt: skip
        add(f"make_cache {kw}", ok, lambda m, s, c, p, w, kw=kw: lambda: kvq.make_cache(m, **kw))
    add("make_cache of a model kvq did not load", False, lambda m, s, c, p, w: lambda: kvq.make_cache(torch.nn.Linear(2, 2), policy="int8"))  # fmt: skip
    for path in (7, None, "/no/such/artifact", "file"):
        add(f"load_artifact {path!r}", False, lambda m, s, c, p, w, x=path: lambda: kvq.load_artifact(_dest(x, p, w)))  # fmt: skip
    return c


def _dest(what, tmp, world):
    if what == "dir":
        return tmp
    if what == "missing":
        return tmp / "no" / "such.safetensors"
    if what == "artifact":
        return world[1] / "tensors.safetensors"
    if what == "junk" or what == "file":
        (tmp / "junk").write_bytes(b"\x00junk")
        return tmp / "junk"
    return what


def _save_then(cache, tmp, load):
    def go():
        cache.save(tmp / "s.safetensors")
        load(tmp / "s.safetensors")

    return go


def _plain_forward(model, cache):
    """A model whose attention is transformers' SDPA, handed the kvq cache."""

    def go():
        model.set_attn_implementation("sdpa")
        try:
            model(_ids(B, 1, 5), cache=cache)
        finally:
            model.set_attn_implementation("kvq")

    return go


def run_cases(world, tmp_path, cases: int = CASES, seed: int = 0) -> Counter:
    """Outcome classes of `cases` random mutations; "other: ..." keys name failures."""
    model, art, _ = world
    rng = random.Random(seed)
    catalogue = _catalogue()
    outcomes: Counter = Counter()
    sources = ({"artifact": art}, {"policy": "int8"})
    for i in range(cases):
        name, ok, call, check = catalogue[i] if i < len(catalogue) else rng.choice(catalogue)
        source = sources[i % 2] if i < 2 * len(catalogue) else rng.choice(sources)
        cache = _filled(model, source)
        tmp = tmp_path / f"case{i}"
        tmp.mkdir()
        try:
            with torch.no_grad():
                call(model, source, cache, tmp, world)()
        except KvqError as e:
            assert "\n" not in str(e), f"{name}: a message of several lines: {e}"
            outcomes["KvqError" if not ok else f"other: {name} refused: {e}"] += 1
            continue
        except Exception as e:  # noqa: BLE001 (the property: no other exception type)
            outcomes[f"other: {name} raised {type(e).__name__}: {str(e)[:120]}"] += 1
            continue
        if not ok:
            outcomes[f"other: {name} accepted"] += 1
            continue
        cache.abort()  # a direct update() leaves its rows pending: forget them
        if check is not None:
            try:
                check(model, source, cache)
            except Exception as e:  # noqa: BLE001
                outcomes[f"other: {name} wrong after success: {str(e)[:160]}"] += 1
                continue
        outcomes["correct"] += 1
    return outcomes


def test_misused_api_calls_end_in_kvq_error_or_a_correct_result(world, tmp_path):
    outcomes = run_cases(world, tmp_path)
    print(dict(outcomes))
    other = {k: v for k, v in outcomes.items() if k.startswith("other")}
    assert not other, other
    assert outcomes["KvqError"] > 0 and outcomes["correct"] > 0
    assert sum(outcomes.values()) == CASES


@pytest.mark.parametrize("source", ["policy", "artifact"])
def test_generate_under_inference_mode_matches_no_grad(world, tmp_path, source):
    """`torch.inference_mode()` is how servers call models; its tensors carry no version
    counter, so nothing in the cache may depend on one."""
    model, art, _ = world
    how = {"policy": "int8"} if source == "policy" else {"artifact": str(art)}

    def run(context):
        with context():
            cache = kvq.make_cache(model, **how)
            out = model.generate(PROMPT, cache=cache, max_new_tokens=4, do_sample=False)
            cache.save(tmp_path / f"{context.__name__}.safetensors")
            loaded = kvq.load_cache(tmp_path / f"{context.__name__}.safetensors", model, **how)
            return out, _next_logits(model, loaded, None)

    (out, logits), (ref_out, ref_logits) = run(torch.inference_mode), run(torch.no_grad)
    assert torch.equal(out, ref_out)
    torch.testing.assert_close(logits, ref_logits)
