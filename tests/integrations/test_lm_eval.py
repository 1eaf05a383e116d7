"""The `kvq` lm-eval model type: a local task run through lm-eval's own evaluator, baseline
and kvq caches, on the tiny random llama (its accuracy means nothing; its loglikelihoods
tell the caches apart)."""

from __future__ import annotations

from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from kvq.errors import KvqError  # noqa: E402
from kvq.integrations import lm_eval as kvq_lm_eval  # noqa: E402  (registers "kvq")

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"  # its YAMLs name the jsonl from REPO
MC, GEN = "kvq_tiny_mc", "kvq_tiny_gen"
RUNS = {"baseline": None, "fp16": "policy=fp16", "int8": "policy=int8", "int2": "policy=int2"}


@pytest.fixture(scope="module")
def llama(tiny_model_dir):
    return str(tiny_model_dir("llama"))


@pytest.fixture
def at_repo(monkeypatch, tmp_path):
    """Run from the repository root (the tasks' data path), with the datasets cache (lm-eval
    loads the jsonl through `datasets`) in a temporary folder rather than the user's."""
    import datasets

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")


def evaluate(model_args: str, tasks=(MC,)) -> dict:
    return lm_eval.simple_evaluate(
        model="kvq",
        model_args=model_args,
        tasks=list(tasks),
        task_manager=TaskManager(include_path=str(DATA), include_defaults=False),
        device="cpu",
        log_samples=True,
        verbosity="ERROR",
    )


def loglikelihoods(results: dict) -> list[float]:
    """Every (question, choice) loglikelihood, in document order."""
    return [resp[0][0] for doc in results["samples"][MC] for resp in doc["resps"]]


@pytest.fixture(scope="module")
def runs(llama, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        import datasets

        mp.chdir(REPO)
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("datasets"))
        return {
            name: evaluate(f"pretrained={llama}" + (f",{extra}" if extra else ""), (MC, GEN))
            for name, extra in RUNS.items()
        }


def test_kvq_is_a_registered_lm_eval_model():
    assert get_model("kvq") is kvq_lm_eval.KvqLM


def test_every_run_scores_every_item(runs):
    for name, results in runs.items():
        assert results["results"][MC]["sample_len"] == 8, name
        assert 0 <= results["results"][MC]["acc,none"] <= 1, name
        assert "exact_match,none" in results["results"][GEN], name
        assert len(loglikelihoods(results)) == 32, name  # 8 items x 4 choices
        assert all(isinstance(doc["resps"][0][0], str) for doc in results["samples"][GEN]), name
    info = runs["int2"]["config"]
    assert info["kvq_policy"] == "int2" and info["kvq_artifact"] is None


def test_fp16_policy_is_exactly_the_baseline(runs):
    base, fp16 = runs["baseline"], runs["fp16"]
    assert loglikelihoods(fp16) == loglikelihoods(base)
    assert fp16["results"][MC]["acc,none"] == base["results"][MC]["acc,none"]
    generated = [[doc["resps"] for doc in r["samples"][GEN]] for r in (base, fp16)]
    assert generated[0] == generated[1]


def test_quantized_caches_change_the_loglikelihoods(runs):
    """Proof the forwards read the kvq cache: int2 moves every score more than int8 does."""
    base = loglikelihoods(runs["baseline"])

    def error(name):
        return max(abs(a - b) for a, b in zip(loglikelihoods(runs[name]), base, strict=True))

    assert 0 < error("int8") < error("int2")


def test_an_artifact_is_checked_and_served(llama, data, tmp_path, at_repo):
    from kvq.calibrators.options import ChannelScalesOptions
    from tests.conftest import calibrate

    art = tmp_path / "ART"
    calibrate(llama, data, art, ChannelScalesOptions(bits=4, value_group=8, sink=1))
    results = evaluate(f"pretrained={llama},artifact={art}")
    assert len(loglikelihoods(results)) == 32
    assert results["config"]["kvq_artifact"] == str(art)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (",revision=main", "unknown model_args revision"),
        (",policy=int8,artifact=ART", "artifact or policy in model_args, not both"),
        (",policy=int9", "unknown policy 'int9'"),
    ],
)
def test_bad_model_args_are_one_line_errors(llama, extra, message):
    with pytest.raises(KvqError, match=message) as info:
        get_model("kvq").create_from_arg_string(f"pretrained={llama}{extra}", {"device": "cpu"})
    assert "\n" not in str(info.value)


def test_the_cli_entry_point_says_a_kvq_error_in_one_line(llama, monkeypatch, capsys, at_repo):
    argv = ["lm_eval", "--model", "kvq", "--model_args", f"pretrained={llama},foo=1",
            "--tasks", MC, "--include_path", str(DATA)]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)

    class LocalTasksOnly(TaskManager):  # indexing lm-eval's built-in tasks costs 4 s
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr("lm_eval.tasks.TaskManager", LocalTasksOnly)
    with pytest.raises(SystemExit) as info:
        kvq_lm_eval.main()
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvq: error: --model kvq: unknown model_args foo;")
