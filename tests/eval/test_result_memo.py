"""--result-cache: each side of a generation task's cell is computed once, read back on
the next run with the same figures (a stopped grid resumes), and never served to a
different model, input, cache or kvq source."""

from __future__ import annotations

import json

import pytest
import torch

import kvq
from kvq.errors import KvqError
from kvq.eval.result_memo import ResultMemo, cache_identity, kvq_source_sha256, source_sha256
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


def _run(model, name, text, memo, progress=None, key=None, **grid) -> dict:
    ctx = TaskContext(
        loaded=model._kvq_loaded,
        make_cache=lambda: kvq.make_cache(model, policy=COARSE),
        cache_name=COARSE,
        text=text,
        params=EvalParams(**(GRIDS[name] | grid)),
        progress=progress or Progress(),
        memo=memo,
        cache_key=key,
    )
    return get_task(name).run(ctx)


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_a_stored_baseline_gives_the_same_section(gemma, text, tmp_path, name):
    first = ResultMemo(tmp_path / "memo")
    want = _run(gemma, name, text, first)
    assert first.reused == 0 and first.computed > 0
    stored = sorted(p.name for p in (tmp_path / "memo").iterdir())
    assert len(stored) == first.computed and all(n.endswith(".json") for n in stored)

    again, progress = ResultMemo(tmp_path / "memo"), CountingProgress()
    got = _run(gemma, name, text, again, progress)
    assert again.computed == 0 and again.reused == first.computed
    assert got == want  # the quantized side is recomputed; the baseline read back
    assert progress.advanced == sum(progress.totals.values())  # the bar still ends full
    assert sorted(p.name for p in (tmp_path / "memo").iterdir()) == stored  # no temp files


def test_without_a_folder_everything_is_computed(gemma, text, tmp_path):
    memo = ResultMemo()
    stored = ResultMemo(tmp_path / "memo")
    assert _run(gemma, "decode", text, memo) == _run(gemma, "decode", text, stored)
    assert memo.reused == 0 and memo.computed == stored.computed


def test_changed_weights_or_inputs_miss(gemma, text, tmp_path):
    memo = ResultMemo(tmp_path / "memo")
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
    memo = ResultMemo(tmp_path)
    loaded, ids = gemma._kvq_loaded, torch.arange(4)[None]
    key = memo.key(loaded, "t", ids, {}, None)
    (tmp_path / f"{key}.json").write_text(json.dumps({"schema": "other", "value": 99}))
    assert memo.get(loaded, "t", ids, {}, lambda: 7) == 7
    assert memo.get(loaded, "t", ids, {}, lambda: 8) == 7


def test_a_file_is_refused_as_the_folder(tmp_path):
    path = tmp_path / "memo"
    path.write_text("x")
    with pytest.raises(KvqError, match="is a file, not a folder"):
        ResultMemo(path)


def test_an_unreadable_entry_is_recomputed(gemma, tmp_path):
    memo = ResultMemo(tmp_path)
    loaded, ids = gemma._kvq_loaded, torch.arange(4)[None]
    (tmp_path / f"{memo.key(loaded, 't', ids, {}, None)}.json").write_text("{not json")
    assert memo.get(loaded, "t", ids, {}, lambda: 5) == 5


def _key(model, policy=COARSE) -> str:
    return cache_identity(kvq.make_cache(model, policy=policy).policy, None, None, "both", None)


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_a_stored_quantized_side_gives_the_same_section(gemma, text, tmp_path, name):
    key = _key(gemma)
    first = ResultMemo(tmp_path / "memo")
    want = _run(gemma, name, text, first, key=key)
    assert first.counts["quantized"]["computed"] > 0
    again, progress = ResultMemo(tmp_path / "memo"), CountingProgress()
    assert _run(gemma, name, text, again, progress, key=key) == want
    assert again.computed == 0 and again.reused == first.computed  # nothing run again
    assert progress.advanced == sum(progress.totals.values())


def test_a_stopped_grid_resumes_at_its_next_cell(gemma, text, tmp_path):
    """A grid that stopped after its 96-token cells runs only the 128-token ones."""
    key, folder = _key(gemma), tmp_path / "memo"
    _run(gemma, "needle", text, ResultMemo(folder), key=key, contexts=(96,))
    memo = ResultMemo(folder)
    whole = _run(gemma, "needle", text, memo, key=key)
    cells = len(GRIDS["needle"]["depths"])  # per context, one entry per side
    assert memo.counts["baseline"] == {"reused": cells, "computed": cells}
    assert memo.counts["quantized"] == {"reused": cells, "computed": cells}
    assert whole == _run(gemma, "needle", text, ResultMemo(), key=key)  # as if never stopped


def test_another_cache_or_source_recomputes_the_quantized_side(gemma, text, tmp_path, monkeypatch):
    folder = tmp_path / "memo"
    _run(gemma, "needle", text, ResultMemo(folder), key=_key(gemma))
    other = ResultMemo(folder)
    _run(gemma, "needle", text, other, key=_key(gemma, "int8"))
    assert other.counts["quantized"]["reused"] == 0 and other.counts["baseline"]["computed"] == 0
    before = _key(gemma)
    # kvq's runtime changed: the same cache is another key
    monkeypatch.setattr("kvq.eval.result_memo.kvq_source_sha256", lambda: "0" * 64)
    assert _key(gemma) != before
    edited = ResultMemo(folder)
    _run(gemma, "needle", text, edited, key=_key(gemma))
    assert edited.counts["quantized"]["reused"] == 0


def test_the_source_fingerprint_covers_kvq_modules():
    assert len(kvq_source_sha256()) == 64 and kvq_source_sha256() == kvq_source_sha256()


def test_the_source_fingerprint_follows_the_runtime_not_the_cli(tmp_path):
    for name in ("runtime/codec.py", "cli/app.py", "eval/plots.py", "eval/tasks/needle.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x = 1\n")
    before = source_sha256(tmp_path)
    for name in ("cli/app.py", "eval/plots.py"):  # a figure cannot depend on these
        (tmp_path / name).write_text("x = 2\n")
    assert source_sha256(tmp_path) == before
    for name in ("runtime/codec.py", "eval/tasks/needle.py"):
        (tmp_path / name).write_text("x = 2\n")
        assert source_sha256(tmp_path) != before
        before = source_sha256(tmp_path)
