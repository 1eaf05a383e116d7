"""--baseline-cache: the unquantized side of a generation task is computed once, read back
on the next run with the same figures, and never served to a different model or input."""

from __future__ import annotations

import json

import pytest
import torch

import kvq
from kvq.errors import KvqError
from kvq.eval.baseline_memo import BaselineMemo
from kvq.eval.tasks import get_task
from kvq.eval.tasks.base import EvalParams, TaskContext
from kvq.progress import Progress
from tests.conftest import _FALLBACK_TEXT, CALIBRATION_TXT
from tests.eval.counting import CountingProgress

COARSE = "int2"  # diverges from the baseline on the tiny models: the two sides differ
GRIDS = {
    "decode": dict(contexts=(32,), new_tokens=12, prompts=2),
    "speculative": dict(contexts=(32,), new_tokens=12, prompts=2),
    "needle": dict(contexts=(96, 128), depths=(0.0, 1.0), trials=2),
}


@pytest.fixture(scope="module")
def text() -> str:
    return (
        CALIBRATION_TXT.read_text(encoding="utf-8") if CALIBRATION_TXT.is_file() else _FALLBACK_TEXT
    )


@pytest.fixture(scope="module")
def gemma(tiny_model_dir):
    return kvq.load_model(str(tiny_model_dir("gemma3")))[0]


def _run(model, name, text, memo, progress=None) -> dict:
    ctx = TaskContext(
        loaded=model._kvq_loaded,
        make_cache=lambda: kvq.make_cache(model, policy=COARSE),
        cache_name=COARSE,
        text=text,
        params=EvalParams(**GRIDS[name]),
        progress=progress or Progress(),
        memo=memo,
    )
    return get_task(name).run(ctx)


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_a_stored_baseline_gives_the_same_section(gemma, text, tmp_path, name):
    first = BaselineMemo(tmp_path / "memo")
    want = _run(gemma, name, text, first)
    assert first.reused == 0 and first.computed > 0
    stored = sorted(p.name for p in (tmp_path / "memo").iterdir())
    assert len(stored) == first.computed and all(n.endswith(".json") for n in stored)

    again, progress = BaselineMemo(tmp_path / "memo"), CountingProgress()
    got = _run(gemma, name, text, again, progress)
    assert again.computed == 0 and again.reused == first.computed
    assert got == want  # the quantized side is recomputed; the baseline read back
    assert progress.advanced == sum(progress.totals.values())  # the bar still ends full
    assert sorted(p.name for p in (tmp_path / "memo").iterdir()) == stored  # no temp files


def test_without_a_folder_everything_is_computed(gemma, text, tmp_path):
    memo = BaselineMemo()
    stored = BaselineMemo(tmp_path / "memo")
    assert _run(gemma, "decode", text, memo) == _run(gemma, "decode", text, stored)
    assert memo.reused == 0 and memo.computed == stored.computed


def test_changed_weights_or_inputs_miss(gemma, text, tmp_path):
    memo = BaselineMemo(tmp_path / "memo")
    loaded = gemma._kvq_loaded
    ids = torch.arange(8)[None]  # [1, 8]
    calls = []

    def compute():
        calls.append(1)
        return len(calls)

    assert memo.get(loaded, "t", ids, {"n": 1}, compute) == 1
    assert memo.get(loaded, "t", ids, {"n": 1}, compute) == 1  # read back
    assert memo.get(loaded, "t", ids + 1, {"n": 1}, compute) == 2  # other ids
    assert memo.get(loaded, "t", ids, {"n": 2}, compute) == 3  # other parameters
    weight = gemma.model.norm.weight
    kept = weight.detach().clone()
    with torch.no_grad():
        weight.add_(1.0)  # e.g. an artifact's transform folded into the weights
    try:
        assert memo.get(loaded, "t", ids, {"n": 1}, compute) == 4
    finally:
        with torch.no_grad():
            weight.copy_(kept)
    assert memo.get(loaded, "t", ids, {"n": 1}, compute) == 1  # the original weights again
    assert len(calls) == 4


def test_a_corrupt_or_foreign_entry_is_recomputed(gemma, tmp_path):
    memo = BaselineMemo(tmp_path)
    loaded, ids = gemma._kvq_loaded, torch.arange(4)[None]
    key = memo.key(loaded, "t", ids, {})
    (tmp_path / f"{key}.json").write_text(json.dumps({"schema": "other", "value": 99}))
    assert memo.get(loaded, "t", ids, {}, lambda: 7) == 7
    assert memo.get(loaded, "t", ids, {}, lambda: 8) == 7


def test_a_file_is_refused_as_the_folder(tmp_path):
    path = tmp_path / "memo"
    path.write_text("x")
    with pytest.raises(KvqError, match="is a file, not a folder"):
        BaselineMemo(path)


def test_an_unreadable_entry_is_recomputed(gemma, tmp_path):
    memo = BaselineMemo(tmp_path)
    loaded, ids = gemma._kvq_loaded, torch.arange(4)[None]
    (tmp_path / f"{memo.key(loaded, 't', ids, {})}.json").write_text("{not json")
    assert memo.get(loaded, "t", ids, {}, lambda: 5) == 5
