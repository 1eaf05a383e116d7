"""`kvq advise`: what each of a serving engine's K/V cache formats does to this model, and
which one to pick.

Every format of the engine's menu (`formats.menu`) runs through kvq's cache with the
engine's numerics, on the same WikiText-2 windows, against one shared unquantized baseline
(`evaluate_many`; formats with the same numerics in two engines are scored once); formats whose engine loads scales from a checkpoint also run with
scales kvq calibrates (`kv-scales`, per tensor), the scales `kvq export vllm|modelopt`
writes. kvq's own layouts (calibration-free ones, and any `--artifact`) run beside them at
their own bytes. The recommendation is the engine format with the fewest bytes per token
within the budget (`--max-kld`, `--max-ppl-ratio`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from kvq.engines.formats import EngineFormat, engine_policy, menu
from kvq.errors import KvqError
from kvq.progress import Progress

DEFAULT_MAX_KLD = 0.02  # nats/token: about run-eval's default budget for 4-bit caches
DEFAULT_MAX_PPL_RATIO = 1.02
KVQ_LAYOUTS = ("int8", "int4", "kivi4", "kivi2")  # calibration-free kvq rows beside them
# llama.cpp's common split: keys keep 8 bits (their errors pass through the softmax)
# the `kvq export` target whose checkpoint carries scales each engine loads
EXPORTS = {"vllm": "vllm", "sglang": "modelopt", "trtllm": "modelopt"}
LLAMACPP_SPLITS = ("llamacpp:q8_0/q4_0", "llamacpp:q8_0/q5_0")


@dataclass(frozen=True)
class Candidate:
    name: str
    kind: str  # "engine" (its uncalibrated default), "engine + kvq scales" or "kvq"
    flags: str | None
    engine_bits: float | None  # the engine's own storage per element (None: kvq's ledger)


def candidates(engine: str, calibrated: bool) -> list[tuple[Candidate, EngineFormat | None]]:
    from kvq.engines.formats import parse

    formats = menu(engine)
    if engine in ("llamacpp", "all"):
        formats += [parse(n) for n in LLAMACPP_SPLITS]
    out = []
    for fmt in formats:
        if not fmt.needs_scales:  # a format without a default scale: calibrated only
            out.append((Candidate(fmt.name, "engine", fmt.flags(), fmt.bits_per_element), fmt))
        if calibrated and fmt.loads_scales:
            name = f"{fmt.name} + kvq scales"
            flags = f"{fmt.flags()} with the scales of `kvq export {EXPORTS[fmt.engine]}`"
            out.append((Candidate(name, "engine + kvq scales", flags, fmt.bits_per_element), fmt))
    return out


def advise_job(
    model_spec: str,
    engine: str,
    progress: Progress,
    *,
    dataset: str = "wikitext2",
    windows: int = 16,
    seqlen: int = 512,
    seed: int = 0,
    data_dir: str | None = None,
    calibration: str | None = None,
    samples: int = 16,
    artifacts: tuple[Path, ...] = (),
    max_kld: float = DEFAULT_MAX_KLD,
    max_ppl_ratio: float = DEFAULT_MAX_PPL_RATIO,
    kvq_layouts: tuple[str, ...] = KVQ_LAYOUTS,
) -> dict:
    """The advise report: one row per candidate and the recommendation (plain data)."""
    from kvq.artifacts.compat import load_artifact
    from kvq.calibrators.options import KVScalesOptions
    from kvq.data.text import read_corpus
    from kvq.engines.scaled import scaled_cache
    from kvq.eval.quality import evaluate_many
    from kvq.models.loading import load_model
    from kvq.pipeline import cache_for, load_windows, run_pass

    if max_kld <= 0 or max_ppl_ratio < 1:
        raise KvqError("--max-kld must be > 0 and --max-ppl-ratio >= 1")
    chosen = candidates(engine, calibration is not None)  # refuses an unknown engine first
    corpus = read_corpus(dataset, windows, seqlen, data_dir)
    start = time.perf_counter()
    with progress.stage("load model"):
        loaded = load_model(model_spec)
    with progress.stage("sample windows"):
        ev = load_windows(loaded, dataset, windows, seqlen, seed, data_dir, corpus)
    factories, rows = {}, {}
    scales: dict[str, object] = {}  # kv-scales --format -> its calibrated state
    same: dict[tuple, str] = {}  # (layers, kind) -> the first candidate storing rows so
    alias: dict[str, str] = {}  # a candidate -> the one whose figures it shares
    info = loaded.adapter.info
    for cand, fmt in chosen:
        policy = fmt.name
        if fmt.needs_scales:  # no cache before its scales; the policy still refuses
            layers = engine_policy(policy, info.num_layers, info.head_dim, True).layers
        else:
            layers = cache_for(loaded, policy=policy).policy.layers  # refuse what cannot run
        rows[cand.name] = cand
        # engines with the same numerics (vLLM's and SGLang's FP8) are scored once
        if (layers, cand.kind) in same:
            alias[cand.name] = same[layers, cand.kind]
            continue
        same[layers, cand.kind] = cand.name
        if cand.kind == "engine":
            factories[cand.name] = lambda p=policy: cache_for(loaded, policy=p)
        else:
            fmt_name = fmt.key.calibrated
            if fmt_name not in scales:
                cal = load_windows(loaded, calibration, samples, seqlen, seed, data_dir)
                opts = KVScalesOptions(kv_format=fmt_name)
                scales[fmt_name] = run_pass(loaded, cal, opts, progress)
            tensors = scales[fmt_name].tensors
            static = {n: t for n, t in tensors.items() if ".key." in n or ".value." in n}
            # the engine's own numerics, with the scales as it loads them
            factories[cand.name] = lambda p=policy, s=static: scaled_cache(loaded, p, s)
    for name in kvq_layouts:
        factories[f"kvq {name}"] = lambda n=name: cache_for(loaded, policy=n)
        rows[f"kvq {name}"] = Candidate(f"kvq {name}", "kvq", f"--policy {name}", None)
    for path in artifacts:
        art = load_artifact(path, loaded)
        factories[f"kvq {path.name}"] = lambda a=art: cache_for(loaded, artifact=a)
        rows[f"kvq {path.name}"] = Candidate(f"kvq {path.name}", "kvq", f"--artifact {path}", None)
    results = evaluate_many(loaded.model, ev.ids, factories, progress,
                            title=f"eval {len(factories)} caches (shared baseline)")  # fmt: skip
    results |= {name: results[first] for name, first in alias.items()}
    table = []
    dtype_bytes = loaded.model.dtype.itemsize  # kvq keeps unquantized rows in this dtype
    for name, result in results.items():
        # bytes as measured on the cache at --seqlen (sliding layers hold their window):
        # kvq stores each engine format's codes and scales at the engine's own size
        cand, t, ledger = rows[name], result.totals, result.ledger
        ratio, kld = t.ppl_quant() / t.ppl_base(), t.kl / t.tokens
        stored = ledger.total
        if cand.engine_bits == 16:  # the engine keeps 16-bit K/V (kvq: the model's dtype)
            stored = ledger.fp16_bytes
        elif cand.kind != "kvq":  # layers it leaves unquantized (TurboQuant's boundary) too
            stored += ledger.full_precision * 2 // dtype_bytes - ledger.full_precision
        table.append({
            "name": name, "kind": cand.kind, "flags": cand.flags,
            "engine_bits_per_element": cand.engine_bits,
            "ppl_ratio": ratio, "kld": kld, "top1": t.top1_agree / t.tokens,
            "kld_interval95": t.interval().get("kld"),
            "bytes_per_token": stored / ledger.tokens,
            "ratio_to_fp16": stored / ledger.fp16_bytes if ledger.fp16_bytes else None,
            "within_budget": kld <= max_kld and ratio <= max_ppl_ratio,
            "same_numerics_as": alias.get(name),
        })  # fmt: skip
    engine_rows = [r for r in table if r["kind"] != "kvq"]
    fits = sorted((r for r in engine_rows if r["within_budget"]),
                  key=lambda r: (r["bytes_per_token"], r["kld"]))  # fmt: skip
    return {
        "model": model_spec,
        "engine": engine,
        "dataset": corpus[1].spec,
        "windows": windows,
        "seqlen": seqlen,
        "seed": seed,
        "calibration": calibration,
        "budget": {"max_kld": max_kld, "max_ppl_ratio": max_ppl_ratio},
        "baseline_ppl": next(iter(results.values())).totals.ppl_base(),
        "fp16_bytes_per_token": next(iter(results.values())).ledger.fp16_bytes_per_token,
        "rows": table,
        # formats with no default scale, left out without --calibration
        "need_calibration": []
        if calibration is not None
        else [f.name for f in menu(engine) if f.needs_scales],
        "recommendation": fits[0]["name"] if fits else None,
        "recommended_flags": fits[0]["flags"] if fits else None,
        "identity": {
            "model_type": loaded.identity.model_type,
            "weights_sha256": loaded.identity.weights_sha256,
            "dataset_sha256": corpus[1].sha256,
        },  # fmt: skip
        "seconds": {**progress.seconds, "total": round(time.perf_counter() - start, 3)},
    }


def advise_plot(report: dict, path: Path) -> Path:
    """KLD against bytes per token, one point per distinct result (formats with the same
    numerics share a point and a label), labels moved apart where points crowd, the
    budget as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 6))
    colors = {"engine": "tab:blue", "engine + kvq scales": "tab:green", "kvq": "tab:orange"}
    points: dict[str, tuple[float, float, str, list[str]]] = {}  # first name -> point
    for r in report["rows"]:
        first = r["same_numerics_as"] or r["name"]
        if first in points:
            points[first][3].append(r["name"])
        else:
            points[first] = (r["bytes_per_token"], max(r["kld"], 1e-6), r["kind"], [r["name"]])
    lossless = [_joined(names) for _, y, _, names in points.values() if y <= 1e-6]
    points = {k: p for k, p in points.items() if p[1] > 1e-6}  # KLD 0: off a log axis
    for x, y, kind, _ in points.values():
        ax.scatter(x, y, color=colors[kind], s=18)
    if lossless:
        ax.text(0.01, 0.01, f"KLD 0 (16-bit): {', '.join(lossless)}", fontsize=7,
                transform=ax.transAxes)  # fmt: skip
    ax.axhline(report["budget"]["max_kld"], color="gray", linestyle="--", label="--max-kld")
    for kind, c in colors.items():
        ax.scatter([], [], color=c, label=kind)
    ax.set_yscale("log")
    ax.set_xlabel(f"K/V bytes per token at {report['seqlen']} tokens")
    ax.set_ylabel("KLD vs unquantized (nats/token)")
    ax.set_title(f"{report['model']}: {report['engine']} K/V formats "
                 f"({report['windows']} x {report['seqlen']} {report['dataset']})")  # fmt: skip
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    _label_apart(ax, [(x, y, _joined(names)) for x, y, _, names in points.values()])
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _label_apart(ax, labels: list[tuple[float, float, str]], size: int = 7) -> None:
    """Annotate each (x, y, text) to the right of its point, moving a label up or down a
    line at a time (with a leader line) until it overlaps no label placed before it."""
    line = size * 1.4  # label height in points
    placed: list[tuple[float, float, float, float]] = []  # boxes in display points
    to_points = 72 / ax.figure.dpi
    right_edge = ax.transAxes.transform((0.7, 0))[0] * to_points
    for x, y, text in sorted(labels, key=lambda t: (t[0], -t[1])):
        px, py = (v * to_points for v in ax.transData.transform((x, y)))
        width = 0.55 * size * len(text)
        dx = 4 if px < right_edge else -4 - width  # labels of the right-most points: left
        for k in range(40):  # offsets 0, +1, -1, +2, -2 ... lines
            dy = line * ((k + 1) // 2) * (1 if k % 2 else -1)
            box = (px + dx, py + dy - line / 2, px + dx + width, py + dy + line / 2)
            if not any(_overlap(box, b) for b in placed):
                break
        placed.append(box)
        ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=size,
                    va="center", arrowprops=None if dy == 0 else
                    {"arrowstyle": "-", "color": "0.6", "lw": 0.5})  # fmt: skip


def _joined(names: list[str]) -> str:
    """Formats sharing a point: "a = b = c", a common " + kvq scales" said once."""
    tail = " + kvq scales"
    if len(names) > 1 and all(n.endswith(tail) for n in names):
        return " = ".join(n[: -len(tail)] for n in names) + tail
    return " = ".join(names)


def _overlap(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]
