"""`kvq compare REPORT.json ...`: one table over run-eval reports of the same model and data
(rows: caches, each cache's reports merged; columns: each task's headline figure, bytes,
latency) and a Pareto plot of quality against bytes. No torch: reports are plain JSON."""

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
    # the memory task's measured K/V bytes against fp16, at its longest context
    "memory ratio": lambda t: [r for r in t["memory"]["rows"] if "ratio" in r][-1]["ratio"],
}
_SAME = (("model", "models"), ("dataset_sha256", "data"))


def load_reports(paths: list[Path]) -> list[dict]:
    """Read run-eval reports, one per cache after merging: the reports of one cache (the
    needle grid and the 8K perplexity of one artifact, say) become one row. Refused in one
    line: reports of other models or data, one task reported twice for a cache, windows
    that differ, caches that ran different tasks."""
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
    caches, source = _merged(paths, reports)
    windows = {c["windows_sha256"] for c in caches.values() if c.get("windows_sha256")}
    if len(windows) > 1:
        raise KvqError(
            "the reports scored different windows (--windows/--seqlen/--seed differ); "
            "compare perplexity over the same windows"
        )
    names = list(caches)
    for name in names[1:]:
        if sorted(caches[name]["tasks"]) != sorted(caches[names[0]]["tasks"]):
            raise KvqError(
                f"{source[name]} ran tasks {sorted(caches[name]['tasks'])}, {source[names[0]]} "
                f"ran {sorted(caches[names[0]]['tasks'])}; compare reports of the same tasks"
            )
    return list(caches.values())


def cache_name(report: dict) -> str:
    return str(report.get("artifact") or report.get("policy"))


def _merged(paths: list[Path], reports: list[dict]) -> tuple[dict[str, dict], dict[str, str]]:
    """{cache: its reports merged}, {cache: the files it came from}, in first-seen order."""
    caches: dict[str, dict] = {}
    source: dict[str, str] = {}
    for path, report in zip(paths, reports, strict=True):
        name = cache_name(report)
        if name not in caches:
            caches[name] = {**report, "tasks": dict(report["tasks"])}
            source[name] = str(path)
            continue
        merged = caches[name]
        twice = sorted(set(merged["tasks"]) & set(report["tasks"]))
        if twice:
            raise KvqError(
                f"{path} and {source[name]} both report {', '.join(twice)} for {name}; "
                "pass one of them"
            )
        merged["tasks"].update(report["tasks"])
        merged["windows_sha256"] = merged.get("windows_sha256") or report.get("windows_sha256")
        source[name] += f" + {path}"
    return caches, source


def _slowdowns(reports: list[dict]) -> dict:
    """A "slowdown @N" column (decode time against DynamicCache) per context every report
    measured: one figure over different contexts would set 16K against 4K."""
    measured = [set(r["tasks"].get("latency", {}).get("slowdown", {})) for r in reports]
    common = sorted(set.intersection(*measured), key=int)
    return {f"slowdown @{c}": lambda t, c=c: t["latency"]["slowdown"][c] for c in common}


def table(reports: list[dict]) -> tuple[list[str], list[list]]:
    """(column names, rows): the cache's name, then each column the reports have."""
    readers = COLUMNS | _slowdowns(reports)
    columns = [c for c, read in readers.items() if _read(read, reports[0]["tasks"]) is not None]
    rows = []
    for r in reports:
        rows.append([cache_name(r), *(_read(readers[c], r["tasks"]) for c in columns)])
    return ["cache", *columns], rows


def _read(read, tasks: dict):
    try:
        return float(read(tasks))
    except (KeyError, TypeError, ValueError, IndexError):
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
        points.append((x, y, cache_name(r)))
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
