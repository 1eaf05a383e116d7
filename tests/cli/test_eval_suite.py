"""run-eval's task suite through the command line: flags, refusals, plots, the verdict kept
beside the artifact, and `kvq compare` over several reports."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.test_cli import _one_line_error, _quick_calibrate, _run


def _eval(llama_dir, shared_data, *extra):
    base = ["run-eval", "--model", llama_dir, "--data-dir", shared_data, "--windows", 2,
            "--seqlen", 24]  # fmt: skip
    return _run(*base, *extra)


@pytest.fixture(scope="module")
def art(llama_dir, calib_txt, tmp_path_factory):
    out = tmp_path_factory.mktemp("suite") / "ART"
    assert _quick_calibrate(llama_dir, calib_txt, "--v-group", 8, "--out", out).exit_code == 0
    return out


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--tasks", "passkey", "--contexts", "64,1000000"], "--contexts asks for 1000000 tokens"),
        (["--tasks", "passkey", "--depths", "0,1.5"], "--depths must each lie in [0, 1]"),
        (["--tasks", "passkey", "--depths", ","], "--depths must list at least one"),
        (["--tasks", "passkey", "--contexts", "a,b"], "--contexts must be a comma list"),
        (["--tasks", "nope"], "unknown task"),
        (["--budget", "ppl"], "is not KEY=LIMIT"),
        (["--budget", "ppl=x"], "needs a number"),
        (["--memory-budget", "lots"], "--memory-budget must be a size"),
        (["--trials", "0"], "--trials must be positive"),
    ],
)
def test_bad_suite_flags_are_one_line(llama_dir, shared_data, args, needle):
    _one_line_error(_eval(llama_dir, shared_data, "--policy", "int8", *args), needle)


@pytest.mark.parametrize("flag", ["--plot", "--result-cache"])
def test_a_folder_that_is_a_file_is_refused(llama_dir, shared_data, tmp_path, flag):
    (tmp_path / "f").write_text("x")
    result = _eval(llama_dir, shared_data, "--policy", "int8", flag, tmp_path / "f")
    _one_line_error(result, "is a file")


def test_long_window_tasks_report_position_and_interval(art, llama_dir, shared_data, tmp_path):
    report = tmp_path / "r.json"
    result = _eval(llama_dir, shared_data, "--artifact", art, "--json", report,
                   "--plot", tmp_path / "plots", "--budget", "ppl=1000,kld=-1")  # fmt: skip
    assert result.exit_code == 0, result.output
    r = json.loads(report.read_text())
    rows = r["tasks"]["ppl"]["by_position"]
    assert sum(x["tokens"] for x in rows) == r["tasks"]["ppl"]["scored_tokens"]
    low, high = r["tasks"]["ppl"]["interval95"]["ppl_ratio"]
    assert low <= r["tasks"]["ppl"]["ratio"] <= high
    assert [x["verdict"] for x in r["verdict"]["rows"]] == ["PASS", "FAIL"]
    assert r["verdict"]["overall"] == "FAIL" and r["verdict"]["source"] == "--budget"
    assert (tmp_path / "plots" / "ppl_by_position.png").read_bytes()[:4] == b"\x89PNG"
    assert r["plots"] == [str(tmp_path / "plots" / "ppl_by_position.png")]
    import jsonschema

    from kvq.eval.report_schema import REPORT_SCHEMA

    jsonschema.validate(r, REPORT_SCHEMA)
    prov = r["provenance"]
    assert prov["model"]["weights_sha256"] and prov["versions"]["torch"]
    assert prov["cache_policy"]["name"] == r["policy"] and prov["seed"] == 0
    # the verdict is kept beside the artifact, not in it, and inspect shows it
    kept = json.loads((art.parent / "ART.last-eval.json").read_text())
    assert kept["verdict"]["overall"] == "FAIL"
    shown = _run("inspect", art)
    assert shown.exit_code == 0 and "last run-eval" in shown.output and "FAIL" in shown.output


def test_compare_tables_reports_and_refuses_mismatches(art, llama_dir, shared_data, tmp_path):
    paths = []
    for i, source in enumerate((["--artifact", art], ["--policy", "int8"], ["--policy", "int4"])):
        paths.append(tmp_path / f"r{i}.json")
        assert _eval(llama_dir, shared_data, *source, "--json", paths[-1]).exit_code == 0
    result = _run(
        "compare", *paths, "--plot", tmp_path / "pareto.png", "--json", tmp_path / "t.json"
    )
    assert result.exit_code == 0, result.output
    table = json.loads((tmp_path / "t.json").read_text())
    assert table["columns"][:4] == ["cache", "bytes ratio", "ppl ratio", "KLD"]
    assert [row[0] for row in table["rows"]] == [str(art), "int8", "int4"]
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    other = tmp_path / "other.json"
    r = json.loads(paths[1].read_text())
    other.write_text(json.dumps(r | {"model": "another"}))
    _one_line_error(_run("compare", paths[0], other), "different models")
    fewer = tmp_path / "fewer.json"
    fewer.write_text(json.dumps(r | {"tasks": {"ppl": r["tasks"]["ppl"]}}))
    _one_line_error(_run("compare", paths[0], fewer), "same tasks")
    _one_line_error(_run("compare", paths[1], fewer), "both report ppl for int8")


def test_compare_merges_the_reports_of_one_cache(art, llama_dir, shared_data, tmp_path):
    """A cache's retrieval run and its perplexity run are one row of the table."""
    grid = ["--contexts", "96", "--depths", "0", "--trials", 1]
    runs = {}
    for cache, source in (("a", ["--artifact", art]), ("i", ["--policy", "int8"])):
        for tasks in ("ppl,kld,bytes", "needle"):
            runs[cache, tasks] = tmp_path / f"{cache}-{tasks}.json"
            extra = grid if tasks == "needle" else []
            result = _eval(llama_dir, shared_data, *source, "--tasks", tasks, *extra,
                           "--json", runs[cache, tasks])  # fmt: skip
            assert result.exit_code == 0, result.output + result.stderr
    out = tmp_path / "t.json"
    result = _run("compare", *runs.values(), "--json", out, "--plot", tmp_path / "p.png")
    assert result.exit_code == 0, result.output
    table = json.loads(out.read_text())
    assert table["columns"] == ["cache", "bytes ratio", "ppl ratio", "KLD", "needle acc"]
    assert [row[0] for row in table["rows"]] == [str(art), "int8"]
    assert all(v is not None for row in table["rows"] for v in row)
    lonely = _run("compare", runs["a", "ppl,kld,bytes"], runs["a", "needle"], runs["i", "needle"])
    _one_line_error(lonely, "same tasks")


def test_every_task_runs_through_the_command_line(art, llama_dir, shared_data, tmp_path):
    import jsonschema

    from kvq.eval.report_schema import REPORT_SCHEMA
    from kvq.eval.tasks import REGISTRY

    report, plots = tmp_path / "r.json", tmp_path / "plots"
    tasks = ",".join(["ppl", "kld", "bytes", *REGISTRY])
    result = _eval(llama_dir, shared_data, "--artifact", art, "--tasks", tasks,
                   "--contexts", "96,128", "--depths", "0,1", "--trials", 2, "--new-tokens", 8,
                   "--prompts", 2, "--memory-budget", "1MiB", "--json", report, "--plot", plots)  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    r = json.loads(report.read_text())
    jsonschema.validate(r, REPORT_SCHEMA)
    assert set(r["tasks"]) == {"ppl", "kld", "bytes", *REGISTRY}
    cells = r["tasks"]["passkey"]["cells"]
    assert {(c["context"], c["depth"]) for c in cells} == {(96, 0), (96, 1), (128, 0), (128, 1)}
    assert {row["cache"] for row in r["tasks"]["latency"]["rows"]} == {"baseline", str(art)}
    for path in r["plots"]:
        assert Path(path).read_bytes()[:4] == b"\x89PNG"
    assert len(r["plots"]) >= 5
    for name in REGISTRY:  # each task's summary rows reach the terminal table
        assert r["tasks"][name]["seconds"] >= 0


def test_a_task_without_windows_runs_alone(art, llama_dir, shared_data, tmp_path):
    """--tasks passkey alone (no perplexity windows) writes its report; it used to fail at
    the very end, after the whole grid had run."""
    report = tmp_path / "r.json"
    result = _eval(llama_dir, shared_data, "--artifact", art, "--tasks", "passkey",
                   "--contexts", "96", "--depths", "0", "--trials", 1, "--json", report)  # fmt: skip
    assert result.exit_code == 0, result.output + result.stderr
    r = json.loads(report.read_text())
    assert set(r["tasks"]) == {"passkey"} and r["prefix"] is None and r["windows_sha256"] is None


def test_a_matrix_of_caches_runs_the_baseline_once(art, llama_dir, shared_data, tmp_path):
    """--result-cache: the second cache of a matrix reads the unquantized side back."""
    memo = tmp_path / "memo"
    grid = ["--tasks", "passkey,decode", "--contexts", "96", "--depths", "0,1", "--trials", 2,
            "--new-tokens", 8, "--prompts", 2, "--result-cache", memo]  # fmt: skip
    reports = {}
    for name, cache in (("a", ["--policy", "int8"]), ("b", ["--artifact", art])):
        reports[name] = tmp_path / f"{name}.json"
        result = _eval(llama_dir, shared_data, *cache, *grid, "--json", reports[name])
        assert result.exit_code == 0, result.output + result.stderr
    a, b = (json.loads(reports[n].read_text()) for n in "ab")
    computed, reused = {"reused": 0, "computed": 3}, {"reused": 3, "computed": 0}
    assert a["result_cache"] == {"folder": str(memo), "baseline": computed, "quantized": computed}
    assert b["result_cache"] == {"folder": str(memo), "baseline": reused, "quantized": computed}
    for task in ("passkey", "decode"):  # the same baseline figures on both reports
        key = "baseline_correct" if task == "passkey" else "ppl_baseline_continuation"
        rows = (a["tasks"][task], b["tasks"][task])
        if task == "passkey":
            assert [c[key] for c in rows[0]["cells"]] == [c[key] for c in rows[1]["cells"]]
        else:
            assert rows[0][key] == rows[1][key]
