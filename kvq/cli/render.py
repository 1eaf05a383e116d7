"""Rich tables for the CLI. Presentation only.

Every string that comes from an artifact, a model or the user goes through `_t`: shown
as plain text (`rich.text.Text`, never parsed as markup) with control characters escaped
(`kvq.textsafe.printable`), so a manifest cannot drive the terminal or break the table.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvq.artifacts.store import Artifact
from kvq.eval.tasks import WINDOW_TASKS, get_task
from kvq.manifests.ledger import CATEGORIES, ByteLedger
from kvq.manifests.schema import manifest_to_json
from kvq.textsafe import printable

# rich assumes 80 columns when stdout is not a terminal (make demo | tee): use 120 there
OUT = Console(width=shutil.get_terminal_size((120, 40)).columns)


def _t(value: object, style: str = "") -> Text:
    """Untrusted text as a renderable: escaped, never markup."""
    return Text(printable(str(value)), style=style)


def _policy_rows(artifact: Artifact) -> Table:
    m = artifact.manifest
    table = Table(title="cache policy", show_lines=False)
    for col in ("layers", "type", "K", "V", "key stage", "sink"):
        table.add_column(col)
    groups: dict[tuple, list[int]] = {}
    for i, lp in enumerate(m.policy.layers):
        key = (
            m.architecture.layer_types[i],
            lp.key.describe(),
            lp.value.describe(),
            lp.key_stage,
            lp.sink_tokens,
        )
        groups.setdefault(key, []).append(i)
    for key, layers in groups.items():
        table.add_row(_ranges(layers), *(_t(k) for k in key))
    return table


def _code_bits_line(policy) -> str:
    """Each layer's key and value code widths (16: full precision) and their mean: what a
    mixed-precision policy (`vq --mixed`, `auto`) chose, layer by layer."""
    keys = [lp.key.bits for lp in policy.layers]
    values = [lp.value.bits for lp in policy.layers]
    mean = (sum(keys) + sum(values)) / (2 * len(keys))
    return (
        f"code bits per layer: K {' '.join(map(str, keys))} | V {' '.join(map(str, values))} "
        f"(mean {mean:.2f})"
    )


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 4, 6, 7] -> "0-2,4,6-7"."""
    runs: list[list[int]] = []
    for i in idx:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def ledger_table(ledger: ByteLedger, title: str = "byte ledger (measured)") -> Table:
    table = Table(title=title)
    table.add_column("category")
    table.add_column("bytes", justify="right")
    table.add_column("bytes/token", justify="right")
    for cat in CATEGORIES:
        n = getattr(ledger, cat)
        if n:
            table.add_row(cat, f"{n:,}", f"{n / ledger.tokens:,.1f}")
    table.add_row("total", f"{ledger.total:,}", f"{ledger.bytes_per_token:,.1f}", style="bold")
    table.add_row("fp16 K/V", f"{ledger.fp16_bytes:,}", f"{ledger.fp16_bytes_per_token:,.1f}")
    table.add_row("ratio to fp16", "", f"{ledger.ratio:.4f}", style="bold")
    return table


def print_calibration_summary(artifact: Artifact, out: Path) -> None:
    m = artifact.manifest
    OUT.print(Text.assemble(("policy: ", "bold"), _t(m.policy.name)))
    OUT.print(_policy_rows(artifact))
    timing = Table(title="calibration stages")
    timing.add_column("stage")
    timing.add_column("seconds", justify="right")
    for stage, s in m.passes[-1].stage_seconds.items():
        timing.add_row(_t(stage), f"{s:.1f}")
    OUT.print(timing)
    if m.ledger is not None:
        OUT.print(ledger_table(m.ledger, f"byte ledger measured on {m.ledger.tokens} tokens"))
    OUT.print(
        Text.assemble(
            ("artifact written: ", "green"), _t(out), f" ({len(artifact.tensors)} tensors)"
        )
    )


def print_manifest(artifact: Artifact) -> None:
    # ensure_ascii: control and bidi characters of manifest strings stay \u escapes
    OUT.print_json(json.dumps(manifest_to_json(artifact.manifest)), ensure_ascii=True)
    OUT.print("[green]valid[/green]: schema, tensor hashes and policy check out", highlight=False)


# layers.{i}.KIND.* other than the cache policy's key/value state (`calibrators.base`)
_TRANSFORM = re.compile(r"^layers\.\d+\.(?!key\.|value\.)([^.]+)\.")


def print_inspect(artifact: Artifact, path: Path) -> None:
    m = artifact.manifest
    head = Table(title=_t(f"kvq artifact {path}"), show_header=False)
    head.add_column("field")
    head.add_column("value")
    arch = m.architecture
    head.add_row("schema / kvq", _t(f"{m.schema_version} / {m.kvq_version}"))
    head.add_row("model", _t(f"{m.model_spec} ({m.identity.model_type})"))
    head.add_row("weights sha256", m.identity.weights_sha256[:16] + "…")
    head.add_row(
        "layers",
        f"{arch.num_layers} ({arch.layer_types.count('sliding_attention')} sliding, "
        f"window {arch.sliding_window})",
    )
    head.add_row("heads", f"{arch.num_q_heads} q / {arch.num_kv_heads} kv × {arch.head_dim}")
    for i, cal in enumerate(m.passes):
        options = ", ".join(f"{k}={v}" for k, v in cal.options.items())
        head.add_row(
            f"pass {i + 1}" if len(m.passes) > 1 else "method", _t(f"{cal.method} ({options})")
        )
        if cal.dataset is not None:
            d = cal.dataset
            data = f"{d.spec} ({d.samples} × {d.seqlen}, seed {d.seed})"
            head.add_row("  calibration data", _t(data))
        for key, value in cal.report.items():
            head.add_row(f"  {key}", _t(_report_value(value)))
    head.add_row(
        "tensors",
        f"{len(artifact.tensors)} ({sum(t.nbytes for t in artifact.tensors.values()):,} bytes)",
    )
    from kvq.calibrators.base import tensor_kind

    prefix = m.policy.prefix
    if prefix is not None:  # served before every sequence; its rows are exact
        head.add_row(
            "prefix",
            _t(
                f"{prefix.length} tokens {list(prefix.token_ids)} ({prefix.source}; tokenizer "
                f"{prefix.tokenizer_sha256[:16]}…), K/V kept exact before each sequence"
            ),
        )
    kinds = sorted({n.split(".")[2] for n in artifact.tensors if tensor_kind(n) == "transform"})
    if kinds:  # folded into the model's weights whenever the artifact is loaded
        head.add_row(
            "model transforms", _t(", ".join(kinds) + " (folded into the weights at load)")
        )
    OUT.print(head)
    OUT.print(_policy_rows(artifact))
    OUT.print(_code_bits_line(m.policy))
    if m.ledger is not None:
        led = m.ledger
        OUT.print(ledger_table(led, f"byte ledger measured on {led.tokens} tokens"))
        elems = 2 * arch.num_kv_heads * arch.head_dim * arch.num_layers
        OUT.print(
            f"bits per K/V element, all overheads included: {8 * led.bytes_per_token / elems:.3f}"
        )
    OUT.print(
        "[green]validation: OK[/green] (schema version, tensor names, dtypes, shapes, sha256)"
    )
    _print_last_eval(path)


def _print_last_eval(artifact_dir) -> None:
    """The summary `kvq run-eval` keeps beside the artifact (`last_eval_path`), if any."""
    from kvq.eval.run import last_eval_path

    try:
        summary = json.loads(last_eval_path(Path(artifact_dir)).read_text(encoding="utf-8"))
        judged = summary["verdict"]
        rows = judged["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    OUT.print(_t(f"last run-eval ({', '.join(map(str, summary.get('tasks', [])))}): "
                 f"{judged.get('overall')} against {judged.get('source')}"))  # fmt: skip
    for r in rows:
        OUT.print(_t(f"  {r['verdict']}  {r['figure']} {r['value']:.4g} "
                     f"({'≤' if r['bound'] == 'max' else '≥'} {r['limit']:g})"))  # fmt: skip


def print_verdict(report: dict) -> None:
    judged = report.get("verdict") or {}
    if not judged.get("rows"):
        return
    table = Table(title=_t(f"verdict: {judged['overall']} ({judged['source']})"))
    for col in ("figure", "value", "limit", "95% interval", "verdict"):
        table.add_column(col)
    for r in judged["rows"]:
        interval = r["interval95"]
        shown = "" if not interval else f"{interval[0]:.4g} – {interval[1]:.4g}"
        if r["within_noise"]:
            shown += " (limit inside: within noise)"
        style = "green" if r["verdict"] == "PASS" else "red"
        sign = "≤" if r["bound"] == "max" else "≥"
        table.add_row(_t(r["figure"]), f"{r['value']:.4g}", f"{sign} {r['limit']:g}",
                      _t(shown), _t(r["verdict"], style))  # fmt: skip
    OUT.print(table)


def _report_value(value) -> str:
    """A pass report's value as one line: floats to 4 significant digits, tuples joined
    (a long curve summarised by its first, middle and last points)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, tuple):
        items = [f"{v:.4g}" if isinstance(v, float) else str(v) for v in value]
        if len(items) > 24:
            items = [*items[:8], f"… ({len(items)} values) …", *items[-8:]]
        return ", ".join(items)
    return str(value)


def print_eval(report: dict) -> None:
    t = report["tasks"]
    only = "" if report.get("quantize", "both") == "both" else f" ({report['quantize']} only)"
    act = report.get("activations") or {"mode": "none"}
    if act["mode"] != "none":
        only += f" · activations {act['mode']} ({act['linears']} linears, {act['path']})"
    table = Table(
        title=_t(
            f"{report['model']} · {report['policy']}{only} · {report['dataset']}"
            + (
                f" · {report['windows']}×{report['seqlen']} · {report['protocol']}"
                if t.keys() & set(WINDOW_TASKS)
                else ""
            )
            + (
                f" · prefix {','.join(map(str, report['prefix']))} ({report.get('prefix_source')})"
                if report.get("prefix")
                else ""
            )
        )
    )
    table.add_column("metric")
    table.add_column("baseline (unquantized)", justify="right")
    table.add_column("quantized", justify="right")
    table.add_column("ratio", justify="right")
    if "ppl" in t:
        p = t["ppl"]
        table.add_row(
            "perplexity", f"{p['baseline']:.4f}", f"{p['quantized']:.4f}", f"{p['ratio']:.4f}"
        )
    if "kld" in t:
        k = t["kld"]
        table.add_row("KL divergence (mean)", "0", f"{k['mean']:.5f}", "")
        table.add_row("top-1 agreement", "1", f"{k['top1_agreement']:.4f}", "")
    if "bytes" in t:
        b = t["bytes"]
        table.add_row(
            "K/V bytes per token",
            f"{b['fp16_bytes_per_token']:,.1f}",
            f"{b['kv_bytes_per_token']:,.1f}",
            f"{b['ratio']:.4f}",
        )
    for name, section in t.items():
        if name in WINDOW_TASKS:
            continue
        for metric, base, quant in get_task(name).summary(section):
            table.add_row(_t(metric), _t(base), _t(quant), "")
    OUT.print(table)
    print_verdict(report)
    for path in report.get("plots", []):
        OUT.print(_t(f"plot: {path}"))


def print_compare(columns: list[str], rows: list[list]) -> None:
    table = Table(title="run-eval reports compared")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        cells = [_t(row[0])] + ["—" if v is None else f"{v:.4g}" for v in row[1:]]
        table.add_row(*cells)
    OUT.print(table)


def print_advise(report: dict) -> None:
    b = report["budget"]
    table = Table(title=f"{report['engine']} K/V formats on {report['model']} "
                        f"({report['windows']} x {report['seqlen']}, {report['dataset']})")  # fmt: skip
    for col in ("format", "kind", "ppl ratio", "KLD", "top-1", "bytes/token", "vs fp16", "budget"):
        table.add_column(col, justify="left" if col in ("format", "kind") else "right")
    for r in sorted(report["rows"], key=lambda r: (-r["bytes_per_token"], r["kld"])):
        table.add_row(
            # a lossless row's KLD sums to a rounding-level negative: it is 0
            _t(r["name"]), r["kind"], f"{r['ppl_ratio']:.4f}", f"{max(r['kld'], 0.0):.5f}",
            f"{r['top1']:.4f}", f"{r['bytes_per_token']:.0f}",
            "—" if r["ratio_to_fp16"] is None else f"{r['ratio_to_fp16']:.3f}",
            "within" if r["within_budget"] else "over",
        )  # fmt: skip
    OUT.print(table)
    for name in report.get("need_calibration", []):
        OUT.print(f"not scored: {_t(name)} has no default scale; add --calibration TEXT")
    limits = f"KLD <= {b['max_kld']:g}, ppl ratio <= {b['max_ppl_ratio']:g}"
    if report["recommendation"] is None:
        OUT.print(f"verdict: no {report['engine']} format is within the budget ({limits})")
    else:
        OUT.print(f"verdict: {_t(report['recommendation'])}, the fewest bytes within the budget "
                  f"({limits}); pass the engine: {_t(report['recommended_flags'])}")  # fmt: skip
