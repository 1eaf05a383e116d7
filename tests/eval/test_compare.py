"""`kvq compare`'s table from reports as plain data: cost columns side by side only where
the figures are comparable."""

from __future__ import annotations

from kvq.eval.compare import table


def _report(policy: str, slowdown: dict, ratios: list) -> dict:
    memory = [{"context": 1024, "cache": "baseline"}]
    memory += [
        {"context": 1024 * (i + 1), "cache": policy, "ratio": r} for i, r in enumerate(ratios)
    ]
    return {"policy": policy, "tasks": {"latency": {"slowdown": slowdown},
                                        "memory": {"rows": memory}}}  # fmt: skip


def test_slowdown_columns_are_the_contexts_every_report_measured():
    a = _report("int8", {"1024": 1.2, "4096": 1.3, "16384": 1.4}, [0.51, 0.5])
    b = _report("demo", {"1024": 1.5, "4096": 1.7}, [0.29])
    columns, rows = table([a, b])
    assert columns == ["cache", "memory ratio", "slowdown @1024", "slowdown @4096"]
    assert rows == [["int8", 0.5, 1.2, 1.3], ["demo", 0.29, 1.5, 1.7]]


def test_reports_without_cost_tasks_have_no_cost_columns():
    quality = {"policy": "int8", "tasks": {"ppl": {"ratio": 1.01}, "kld": {"mean": 0.002}}}
    columns, rows = table([quality])
    assert columns == ["cache", "ppl ratio", "KLD"] and rows == [["int8", 1.01, 0.002]]
