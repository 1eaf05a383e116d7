"""`kvq compare REPORT.json ...`: one table over run-eval reports of the same model, tasks
and data (rows: caches; columns: each task's headline figure, bytes, latency) and a Pareto
plot of quality against bytes. No torch: reports are plain JSON."""

from __future__ import annotations

import json
from pathlib import Path

from kvq.errors import KvqError

# column -> how to read it from a report's tasks (None where the task did not run)
COLUMNS = {
    "bytes ratio": lambda t: t["bytes"]["ratio"],
    "ppl ratio": lambda t: t["ppl"]["ratio"],
    "KLD": lambda t: t["kld"]["mean"],
    "passkey acc": lambda t: t["passkey"]["quantized_accuracy"],
    "needle acc": lambda t: t["needle"]["quantized_accuracy"],
    "decode agree": lambda t: t["decode"]["mean_agreement"],
    "draft accept": lambda t: t["speculative"]["quantized_draft"]["quantized_acceptance"],
    "attn out err": lambda t: t["attention"]["mean_output_rel_error"],
    "slowdown": lambda t: max(t["latency"]["slowdown"].values()),
}
_SAME = (("model", "models"), ("dataset_sha256", "data"), ("windows_sha256", "windows"))


def load_reports(paths: list[Path]) -> list[dict]:
    """Read run-eval reports and refuse, in one line, a set that does not compare."""
    if len(paths) < 1:
        raise KvqError("compare needs at least one report")
    reports = []
    for path in paths:
        try:
            report = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise KvqError(f"{path}: not a readable run-eval report ({e})") from None
        if not isinstance(report, dict) or not isinstance(report.get("tasks"), dict):
            raise KvqError(f"{path}: not a run-eval report (no tasks section)")
        reports.append(report)
    first = reports[0]
    for path, report in zip(paths[1:], reports[1:], strict=True):
        for key, what in _SAME:
            if report.get(key) != first.get(key):
                raise KvqError(
                    f"{path} and {paths[0]} are reports of different {what} "
                    f"({str(report.get(key))[:24]} vs {str(first.get(key))[:24]}); compare "
                    "reports of one model on one dataset"
                )
        if sorted(report["tasks"]) != sorted(first["tasks"]):
            raise KvqError(
                f"{path} ran tasks {sorted(report['tasks'])}, {paths[0]} ran "
                f"{sorted(first['tasks'])}; compare reports of the same tasks"
            )
    return reports


def table(reports: list[dict]) -> tuple[list[str], list[list]]:
    """(column names, rows): the cache's name, then each column the reports have."""
    columns = [c for c, read in COLUMNS.items() if _read(read, reports[0]["tasks"]) is not None]
    rows = []
    for r in reports:
        name = r.get("artifact") or r.get("policy")
        rows.append([name, *(_read(COLUMNS[c], r["tasks"]) for c in columns)])
    return ["cache", *columns], rows


def _read(read, tasks: dict):
    try:
        return float(read(tasks))
    except (KeyError, TypeError, ValueError):
        return None


def pareto_plot(reports: list[dict], path: Path) -> Path:
    """KLD (or the perplexity ratio) against bytes per token relative to fp16, each cache
    a point, the Pareto front (no other cache both smaller and better) drawn through."""
    from kvq.eval.plots import pyplot

    quality = "KLD" if _read(COLUMNS["KLD"], reports[0]["tasks"]) is not None else "ppl ratio"
    points = []
    for r in reports:
        x, y = _read(COLUMNS["bytes ratio"], r["tasks"]), _read(COLUMNS[quality], r["tasks"])
        if x is None or y is None:
            raise KvqError("a Pareto plot needs the bytes task and ppl or kld in every report")
        points.append((x, y, r.get("artifact") or r.get("policy")))
    front = [p for p in points if not any(q[0] <= p[0] and q[1] < p[1] or q[0] < p[0] and q[1] <= p[1] for q in points)]  # fmt: skip
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for x, y, name in points:
        ax.scatter(x, y)
        ax.annotate(str(name)[-28:], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front.sort()
    ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="grey", label="Pareto front")
    ax.set_xlabel("K/V bytes per token (fraction of fp16)")
    ax.set_ylabel(quality + " (lower is better)")
    ax.set_title(f"quality against bytes · {reports[0].get('model')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
