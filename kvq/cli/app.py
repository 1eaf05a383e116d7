"""The `kvq` command line: parse, call the library, render with rich. No logic here."""

from __future__ import annotations

import signal
from pathlib import Path

import typer

from kvq.cli.calibrate import calibrate_app
from kvq.cli.common import (
    BACKEND,
    DATA_DIR,
    DEVICE_MAP,
    MAX_MEMORY,
    MODEL,
    OneLineErrors,
    artifact_files,
    on_interrupt,
    positive,
    quiet_transformers,
    write_json,
)
from kvq.textsafe import printable

POLICY_HELP = (
    "calibration-free layout: fp16, int8, int4, int2 (per token), kivi2, kivi4 "
    "(KIVI; kivi2-g64-r256 sets the token group and the exact window), fp8-e4m3, "
    "fp8-e5m2 (scale 1.0), fp8-e4m3-dynamic, kv4-qserve (QServe KV4); or a serving "
    "engine's own format as ENGINE:FORMAT (vllm:fp8, vllm:int8_per_token_head, "
    "sglang:fp4_e2m1, llamacpp:q8_0/q4_0, ...; an unknown FORMAT lists the engine's menu); "
    "with --artifact, an engine format that loads scales served with the artifact's "
    "kv-scales (trtllm:int8 needs them)"
)

app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: readable in a log, no "<bool>" on --help
    help="Calibrate, export and evaluate live-data (K/V cache) quantization.",
)
export_app = typer.Typer(
    cls=OneLineErrors, no_args_is_help=True, rich_markup_mode=None, help="Export an artifact."
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"kvq {version('kvq-live')}")
        except PackageNotFoundError:  # a source tree, not installed
            typer.echo("kvq 0.0.0+local")
        raise typer.Exit()


@app.callback()
def _options(
    _: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print kvq's version"
    ),
) -> None:
    """Calibrate, export and evaluate live-data (K/V cache) quantization."""


app.add_typer(calibrate_app, name="calibrate")
app.add_typer(export_app, name="export")


@export_app.command("manifest")
def export_manifest(
    artifact: Path = typer.Argument(..., metavar="ARTIFACT", help="artifact directory"),
    schema_out: Path | None = typer.Option(None, "--schema-out", help="write the JSON Schema here"),
) -> None:
    """Validate an artifact, print its manifest, optionally write the JSON Schema."""
    from kvq.artifacts.paths import check_output_file

    if schema_out is not None:
        schema_out = check_output_file(schema_out, "--schema-out", artifact_files(artifact))

    from kvq.artifacts.store import read_artifact
    from kvq.cli.render import print_manifest
    from kvq.manifests.jsonschema import json_schema

    art = read_artifact(artifact)
    print_manifest(art)
    if schema_out is not None:
        write_json(schema_out, json_schema())
        typer.echo(f"JSON Schema written to {printable(str(schema_out))}", err=True)


def _export_engine(
    engine: str, artifact: Path, model: str | None, out: Path, overwrite: bool, dtype: str
) -> None:
    from kvq.calibrators.options import check_choice
    from kvq.exporters.engines import EXPORT_DTYPES, check_export
    from kvq.models.spec import check_model_spec

    if model is not None:
        check_model_spec(model)
    check_choice("--dtype", dtype, EXPORT_DTYPES)
    check_export(engine, artifact, out, overwrite)

    from kvq.cli.progress import cli_progress
    from kvq.exporters.engines import export_job

    quiet_transformers()
    with cli_progress() as progress:
        marker = export_job(engine, artifact, model, out, overwrite, progress, dtype)
    kv = marker["kv_cache"]
    typer.echo(
        f"{printable(str(out))}: {marker['target']} checkpoint, K/V {kv['format']} with "
        f"static per-{kv['granularity']} scales for {len(kv['layers'])} layers"
    )


EXPORT_OUT = typer.Option(..., "--out", help="checkpoint directory to write")
EXPORT_OVERWRITE = typer.Option(False, "--overwrite", help="replace a previous kvq export")
EXPORT_MODEL = typer.Option(
    None, "--model", help="the model (default: the one the artifact's manifest names)"
)
EXPORT_DTYPE = typer.Option(
    "auto",
    "--dtype",
    help="weights: auto (the source model's own dtype; bfloat16 for a GGUF), bfloat16, "
    "float16 or float32; the K/V scales stay float32",
)


def _export_command(engine: str, summary: str):
    """The `kvq export ENGINE` command: the same options for every engine."""

    def command(
        artifact: Path = typer.Argument(..., metavar="ARTIFACT", help="artifact directory"),
        model: str | None = EXPORT_MODEL,
        out: Path = EXPORT_OUT,
        overwrite: bool = EXPORT_OVERWRITE,
        dtype: str = EXPORT_DTYPE,
    ) -> None:
        _export_engine(engine, artifact, model, out, overwrite, dtype)

    command.__doc__ = summary
    return command


export_app.command("vllm")(
    _export_command(
        "vllm", "A compressed-tensors checkpoint vLLM loads: weights, kv_cache_scheme, k/v_scale."
    )
)
export_app.command("modelopt")(
    _export_command(
        "modelopt",
        "A ModelOpt-layout checkpoint (TensorRT-LLM, SGLang): hf_quant_config.json + scales.",
    )
)


@app.command("compare")
def compare(
    reports: list[Path] = typer.Argument(..., metavar="REPORT", help="run-eval --json reports"),
    plot: Path | None = typer.Option(
        None, "--plot", help="write the Pareto plot (quality against bytes) to this PNG"
    ),
    json_out: Path | None = typer.Option(None, "--json", help="write the table here"),
) -> None:
    """One table over run-eval reports of one model and dataset (a cache's reports merged)."""
    from kvq.artifacts.paths import check_output_file
    from kvq.cli.render import print_compare
    from kvq.eval.compare import load_reports, pareto_plot, table

    for out in (plot, json_out):
        if out is not None:
            check_output_file(out, "--plot" if out is plot else "--json", tuple(reports))
    loaded = load_reports(list(reports))
    columns, rows = table(loaded)
    if json_out is not None:
        write_json(json_out, {"columns": columns, "rows": rows})
    print_compare(columns, rows)
    if plot is not None:
        typer.echo(f"plot: {pareto_plot(loaded, plot)}")


@app.command("advise")
def advise(
    model: str = MODEL,
    engine: str = typer.Option(
        ..., "--engine", help="vllm, sglang, trtllm, llamacpp or all: whose formats to sweep"
    ),
    dataset: str = typer.Option("wikitext2", "--dataset", help="the text scored"),
    windows: int = typer.Option(16, "--windows", help="scored windows"),
    seqlen: int = typer.Option(512, "--seqlen", help="tokens per window"),
    seed: int = typer.Option(0, "--seed", help="window sampling seed"),
    data_dir: str | None = DATA_DIR,
    calibration: str | None = typer.Option(
        None,
        "--calibration",
        help="text to calibrate per-tensor scales on, for formats whose engine loads scales "
        "(e.g. groups_merged.txt); omitted: only the engines' uncalibrated defaults",
    ),  # fmt: skip
    samples: int = typer.Option(16, "--samples", help="calibration windows"),
    artifacts: list[Path] = typer.Option(
        [], "--artifact", help="a kvq artifact to score beside them (repeatable)"
    ),
    max_kld: float = typer.Option(0.02, "--max-kld", help="budget: mean KLD (nats/token)"),
    max_ppl_ratio: float = typer.Option(1.02, "--max-ppl-ratio", help="budget: ppl ratio"),
    json_out: Path | None = typer.Option(None, "--json", help="write the report here"),
    plot: Path | None = typer.Option(None, "--plot", help="write KLD vs bytes to this PNG"),
) -> None:
    """Sweep a serving engine's K/V cache formats on this model: quality, bytes, flags."""
    from kvq.artifacts.paths import check_output_file
    from kvq.data.text import read_corpus
    from kvq.engines.formats import menu
    from kvq.models.spec import check_fits_context, check_model_spec

    menu(engine)  # an unknown engine is one line, before any work
    positive(windows=windows, seqlen=seqlen, samples=samples)
    check_model_spec(model)
    check_fits_context(model, seqlen, "--seqlen")
    for out, flag in ((json_out, "--json"), (plot, "--plot")):
        if out is not None:
            check_output_file(out, flag, (Path(dataset), *artifacts))
    read_corpus(dataset, windows, seqlen, data_dir)  # a missing text fails before the model

    from kvq.cli.progress import cli_progress
    from kvq.cli.render import print_advise
    from kvq.engines.advise import advise_job, advise_plot

    quiet_transformers()
    with cli_progress() as progress:
        report = advise_job(
            model, engine, progress, dataset=dataset, windows=windows, seqlen=seqlen,
            seed=seed, data_dir=data_dir, calibration=calibration, samples=samples,
            artifacts=tuple(artifacts), max_kld=max_kld, max_ppl_ratio=max_ppl_ratio,
        )  # fmt: skip
    if plot is not None:
        report["plot"] = str(advise_plot(report, plot))
    if json_out is not None:
        write_json(json_out, report)
    print_advise(report)
    if plot is not None:
        typer.echo(f"plot: {plot}")


@app.command("inspect")
def inspect(
    artifact: Path = typer.Argument(..., metavar="ARTIFACT", help="artifact directory"),
) -> None:
    """Summary, byte ledger and validation result of an artifact."""
    from kvq.artifacts.store import read_artifact
    from kvq.cli.render import print_inspect

    print_inspect(read_artifact(artifact), artifact)


@app.command("run-eval")
def run_eval(
    model: str = MODEL,
    artifact: Path | None = typer.Option(None, "--artifact", help="artifact directory"),
    policy: str | None = typer.Option(None, "--policy", help=POLICY_HELP),
    dataset: str = typer.Option(
        "wikitext2", "--dataset", help="wikitext2 or a .txt/.jsonl/.parquet path: the text scored"
    ),
    tasks: str = typer.Option(
        "ppl,kld,bytes",
        "--tasks",
        help="comma list of: ppl, kld, bytes (windows of --dataset); passkey, needle "
        "(retrieval over --contexts x --depths); decode, speculative (--new-tokens); "
        "attention (logit/output error per layer); latency, memory (cost per --contexts)",
    ),
    windows: int = typer.Option(16, "--windows", help="windows of the dataset scored (ppl/kld)"),
    seqlen: int = typer.Option(
        512,
        "--seqlen",
        help="tokens per window (up to the model's context; 8192 = the "
        "llama.cpp convention for long-context KLD)",
    ),
    contexts: str = typer.Option(
        "1024,2048,4096,8192", "--contexts", help="prompt lengths in tokens (retrieval, latency)"
    ),
    depths: str = typer.Option(
        "0,0.25,0.5,0.75,1", "--depths", help="where the needle sits, 0 = start, 1 = end"
    ),
    trials: int = typer.Option(8, "--trials", help="retrieval trials per context x depth"),
    new_tokens: int = typer.Option(512, "--new-tokens", help="tokens generated per prompt"),
    prompts: int = typer.Option(4, "--prompts", help="prompts for decode and speculative"),
    memory_budget: str | None = typer.Option(
        None, "--memory-budget", help="e.g. 24GiB: report the concurrent tokens that fit"
    ),
    plot: Path | None = typer.Option(None, "--plot", help="write PNG plots into this folder"),
    budget: str | None = typer.Option(
        None,
        "--budget",
        help="limits for the verdict, e.g. ppl=1.02,kld=0.02,passkey=-1 (default: by the "
        "cache's code bits; README: Evaluating)",
    ),
    protocol: str = typer.Option("prefill", "--protocol", help="prefill or decode"),
    quantize: str = typer.Option(
        "both",
        "--quantize",
        help="both, or keys / values alone (the other side at full precision): what each "
        "side costs in quality",
    ),
    activations: str = typer.Option(
        "none",
        "--activations",
        help="none, a8-dynamic (INT8 per token) or a8-static (the artifact's act-scales): "
        "quantize the input of every decoder linear",
    ),
    prefix_ids: str | None = typer.Option(
        None,
        "--prefix-ids",
        help="declare a prefix of these token ids (exact K/V from the model) on a policy or "
        "artifact without one: served before every window, not scored (default none; an "
        "artifact's declared prefix is always served)",
    ),
    seed: int = typer.Option(0, "--seed", help="window sampling and retrieval prompts"),
    json_out: Path | None = typer.Option(None, "--json", help="write the report here"),
    result_cache: Path | None = typer.Option(
        None,
        "--result-cache",
        help="keep each finished cell of passkey/needle/decode/speculative in this folder "
        "and reuse it: a matrix of caches runs the baseline once, a stopped run resumes "
        "(keyed by weights, inputs, cache, versions, kvq's source)",
    ),
    data_dir: str | None = DATA_DIR,
    backend: str | None = BACKEND,
    device_map: str | None = DEVICE_MAP,
    max_memory: str | None = MAX_MEMORY,
) -> None:
    """Quality and cost of the quantized cache against the unquantized model, same run."""
    from kvq.artifacts.paths import check_output_file
    from kvq.calibrators.options import parse_prefix_ids
    from kvq.data.text import check_seed, read_corpus
    from kvq.eval.inputs import (
        check_activations,
        check_cache_source,
        check_plot_dir,
        check_protocol,
        check_quantize,
        parse_bytes,
        parse_contexts,
        parse_depths,
        parse_tasks,
    )
    from kvq.eval.result_memo import ResultMemo
    from kvq.eval.tasks import WINDOW_TASKS
    from kvq.eval.tasks.base import EvalParams
    from kvq.eval.verdict import parse_budget
    from kvq.models.placement import parse_placement
    from kvq.models.spec import check_fits_context, check_model_spec

    positive(windows=windows, seqlen=seqlen, trials=trials, new_tokens=new_tokens, prompts=prompts)
    placement = parse_placement(device_map, max_memory)
    chosen = parse_tasks(tasks)
    params = EvalParams(
        contexts=parse_contexts(contexts), depths=parse_depths(depths), trials=trials,
        new_tokens=new_tokens, prompts=prompts, seed=seed,
        memory_budget=None if memory_budget is None else parse_bytes(memory_budget),
    )  # fmt: skip
    check_plot_dir(plot)
    memo = ResultMemo(result_cache)  # a file given as the folder: refused here
    limits = None if budget is None else parse_budget(budget)
    check_protocol(protocol)
    check_quantize(quantize)
    check_activations(activations, artifact)
    if prefix_ids is not None:
        parse_prefix_ids(prefix_ids)
    check_seed(seed)
    check_cache_source(artifact, policy, backend)
    check_model_spec(model)
    if any(t in WINDOW_TASKS for t in chosen):
        check_fits_context(model, seqlen, "--seqlen")
    if any(t not in WINDOW_TASKS for t in chosen):
        check_fits_context(model, max(params.contexts), "--contexts")
    if json_out is not None:
        inputs = (Path(dataset), *(artifact_files(artifact) if artifact else ()))
        json_out = check_output_file(json_out, "--json", inputs)
    corpus = read_corpus(dataset, windows, seqlen, data_dir)

    from kvq.cli.progress import cli_progress
    from kvq.cli.render import print_eval
    from kvq.eval.run import run_eval_job

    quiet_transformers()
    with cli_progress() as progress:
        report = run_eval_job(
            model,
            artifact,
            policy,
            dataset,
            tasks,
            windows,
            seqlen,
            protocol,
            seed,
            data_dir,
            progress,
            backend,
            corpus,
            quantize,
            placement,
            activations,
            prefix_ids,
            params,
            plot,
            limits,
            memo,
        )
    if json_out is not None:  # first: the report is kept whatever happens on the terminal
        write_json(json_out, report)
    if artifact is not None:
        from kvq.eval.run import last_eval_path

        summary = {k: report[k] for k in ("model", "policy", "dataset", "verdict")}
        summary["tasks"] = sorted(report["tasks"])
        summary["report"] = None if json_out is None else str(json_out)
        try:
            write_json(last_eval_path(artifact), summary)
        except OSError as e:  # a read-only place: the report itself is what matters
            typer.echo(f"kvq: note: cannot keep the summary beside {artifact} ({e})", err=True)
    print_eval(report)


@app.command("generate")
def generate(
    prompt: str = typer.Option(..., "--prompt", help="the text to continue"),
    model: str = MODEL,
    artifact: Path | None = typer.Option(
        None, "--artifact", help="artifact directory (else --policy)"
    ),
    policy: str | None = typer.Option(None, "--policy", help=POLICY_HELP),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", help="tokens to generate"),
    backend: str | None = BACKEND,
) -> None:
    """Greedy generation through the quantized cache."""
    from kvq.eval.inputs import check_cache_source, check_prompt
    from kvq.models.spec import check_model_spec

    positive(max_new_tokens=max_new_tokens)
    check_prompt(prompt, max_new_tokens)
    check_cache_source(artifact, policy, backend)
    check_model_spec(model)

    from kvq.eval.run import generate_text

    quiet_transformers()
    gen = generate_text(model, artifact, policy, prompt, max_new_tokens, backend)
    if gen.transforms:
        typer.echo(
            f"[applied the artifact's model transforms: {', '.join(gen.transforms)}]", err=True
        )
    typer.echo(printable(gen.text, keep_newlines=True))  # the model's text, not commands
    ledger = gen.ledger
    # full-precision rows (the fp16 policy, sinks, residual windows) keep the model's dtype
    kept = f"; full-precision rows in {gen.model_dtype}" if ledger.full_precision else ""
    typer.echo(
        f"[{gen.new_tokens} new tokens in {gen.seconds:.1f} s "
        f"({gen.new_tokens / max(gen.seconds, 1e-9):.1f} tokens/s, prefill included); "
        f"cache: {ledger.total} bytes for {ledger.tokens} tokens, {ledger.ratio:.3f} x fp16"
        f"{kept}]",
        err=True,
    )


def main() -> None:
    # a polite kill (SIGTERM) cleans up as Ctrl-C does: temporary folders go, old artifacts stay
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_interrupt)
    app()


if __name__ == "__main__":  # `python -m kvq.cli.app ...` as well as the `kvq` script
    main()
