"""The `kvq` command line: parse, call the library, render with rich. No logic here."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import typer
from typer.core import TyperGroup

from kvq.errors import KvqError
from kvq.textsafe import printable

try:  # typer >= 0.20 vendors click; its exceptions are not click's
    from typer._click import exceptions as cx
except ImportError:  # pragma: no cover - older typer on real click
    from click import exceptions as cx


class OneLineErrors(TyperGroup):
    """Every user error is one line on stderr and exit code 2, never a traceback."""

    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except cx.NoArgsIsHelpError as e:
            typer.echo(e.ctx.get_help() if e.ctx else str(e))
            sys.exit(2)
        except cx.ClickException as e:
            _fail(e.format_message())
        except typer.Exit as e:
            sys.exit(e.exit_code)
        except (typer.Abort, KeyboardInterrupt):
            _aborted()
        except KvqError as e:
            _fail(str(e))
        except OSError as e:  # the environment, not kvq: a full disk, a permission
            where = f"{e.filename}: " if e.filename else ""
            _fail(f"{where}{e.strerror or e}")
        except MemoryError:
            _fail("out of memory; try fewer or shorter windows")
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx):
        # typer would turn Ctrl-C into a silent exit code 130; say it, once
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise typer.Abort() from None


def _fail(message: str) -> None:
    first = printable(" ".join(message.split()))  # one line, no terminal control
    typer.echo(f"kvq: error: {first}", err=True)
    sys.exit(2)


def _aborted() -> None:
    # every writer cleans up on the way out (temporary folders go, old artifacts stay)
    typer.echo("kvq: aborted, nothing written", err=True)
    sys.exit(130)


app = typer.Typer(
    cls=OneLineErrors,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    help="Calibrate, export and evaluate live-data (K/V cache) quantization.",
)
calibrate_app = typer.Typer(cls=OneLineErrors, no_args_is_help=True, help="Run a calibration pass.")
export_app = typer.Typer(cls=OneLineErrors, no_args_is_help=True, help="Export an artifact.")
app.add_typer(calibrate_app, name="calibrate")
app.add_typer(export_app, name="export")

MODEL = typer.Option(
    "gemma3-270m", "--model", help="gemma3-270m, a local HF dir, a .gguf file or a hub id"
)
DATA_DIR = typer.Option(
    None, "--data-dir", help="folder holding wikitext-2-raw/ (else $KVQ_DATA_DIR)"
)
BACKEND = typer.Option(
    None,
    "--backend",
    help="attention backend: auto (Triton on CUDA, else torch), triton or reference "
    "(else $KVQ_BACKEND)",
)

# options every calibration pass shares
CAL_DATASET = typer.Option(..., "--dataset", help="wikitext2 or a .txt/.jsonl/.parquet path")
OUT = typer.Option(..., "--out", help="artifact directory to write")
SAMPLES = typer.Option(16, "--samples", help="calibration windows")
SEQLEN = typer.Option(512, "--seqlen", help="tokens per window")
SINK = typer.Option(1, "--sink", help="first N positions kept in full precision")
OVERWRITE = typer.Option(False, "--overwrite", help="replace an existing artifact")


@calibrate_app.command("channel-scales")
def calibrate_channel_scales(
    dataset: str = CAL_DATASET,
    out: Path = OUT,
    model: str = MODEL,
    samples: int = SAMPLES,
    seqlen: int = SEQLEN,
    bits: int = typer.Option(4, "--bits", help="2, 3, 4 or 8"),
    key_stage: str = typer.Option("pre-rope", "--key-stage", help="pre-rope or post-rope"),
    clip_percentile: float = typer.Option(
        99.9, "--clip-percentile", help="per-tail key percentile"
    ),
    sink: int = SINK,
    v_group: int = typer.Option(
        32, "--v-group", help="V channels per qparam group (0: whole head)"
    ),
    seed: int = typer.Option(0, "--seed"),
    overwrite: bool = OVERWRITE,
    data_dir: str | None = DATA_DIR,
) -> None:
    """Static per-channel K scales (pre-RoPE by default); V per token at append."""
    from kvq.calibrators.options import ChannelScalesOptions

    _positive(samples=samples, seqlen=seqlen)
    options = ChannelScalesOptions(
        bits=bits,
        key_stage=key_stage,
        clip_percentile=clip_percentile,
        sink=sink,
        value_group=v_group or None,
    )
    out, corpus = _calibrate_inputs(model, out, overwrite, dataset, samples, seqlen, seed, data_dir)
    from kvq.pipeline import channel_scales_fit  # torch and transformers: after the checks

    _calibrate(
        "channel-scales",
        channel_scales_fit(options),
        options.as_dict(),
        model,
        dataset,
        samples,
        seqlen,
        seed,
        out,
        overwrite,
        data_dir,
        corpus,
    )


@calibrate_app.command("kvquant")
def calibrate_kvquant(
    dataset: str = CAL_DATASET,
    out: Path = OUT,
    model: str = MODEL,
    samples: int = SAMPLES,
    seqlen: int = SEQLEN,
    bits: int = typer.Option(4, "--bits", help="2, 3 or 4"),
    outliers: float = typer.Option(0.01, "--outliers", help="fraction kept exactly (sparse)"),
    sink: int = SINK,
    fisher: bool = typer.Option(True, "--fisher/--no-fisher", help="Fisher-weighted k-means"),
    qnorm: bool = typer.Option(
        True, "--qnorm/--no-qnorm", help="Q-Norm level correction (mean/std of decoded values)"
    ),
    seed: int = typer.Option(0, "--seed"),
    overwrite: bool = OVERWRITE,
    data_dir: str | None = DATA_DIR,
) -> None:
    """KVQuant: pre-RoPE per-channel K, per-token V, Fisher-weighted NUQ, sparse outliers, sinks."""
    from kvq.calibrators.options import KVQuantOptions

    _positive(samples=samples, seqlen=seqlen)
    options = KVQuantOptions(
        bits=bits, outliers=outliers, sink=sink, fisher=fisher, qnorm=qnorm, seed=seed
    )
    out, corpus = _calibrate_inputs(model, out, overwrite, dataset, samples, seqlen, seed, data_dir)
    from kvq.pipeline import kvquant_fit  # torch and transformers: after the checks

    _calibrate(
        "kvquant",
        kvquant_fit(options),
        options.as_dict(),
        model,
        dataset,
        samples,
        seqlen,
        seed,
        out,
        overwrite,
        data_dir,
        corpus,
    )


def _calibrate_inputs(model, out, overwrite, dataset, samples, seqlen, seed, data_dir):
    """Everything a calibration needs checked before torch loads: the model spec, the seed,
    the destination (never a user's folder) and the dataset, read once here.
    Returns (absolute --out, the corpus)."""
    from kvq.data.text import check_seed, read_corpus
    from kvq.exporters.paths import check_artifact_out
    from kvq.models.spec import check_model_spec

    check_seed(seed)
    check_model_spec(model)
    out = check_artifact_out(out, overwrite)
    return out, read_corpus(dataset, samples, seqlen, data_dir)


def _calibrate(
    method, fit, options, model, dataset, samples, seqlen, seed, out, overwrite, data_dir, corpus
) -> None:
    from kvq.cli.progress import RichProgress
    from kvq.cli.render import print_calibration_summary
    from kvq.pipeline import calibrate_job

    _quiet_transformers()

    with RichProgress() as progress:
        artifact = calibrate_job(
            method,
            fit,
            options,
            model,
            dataset,
            samples,
            seqlen,
            seed,
            out,
            overwrite,
            data_dir,
            progress,
            corpus,
        )
    print_calibration_summary(artifact, out)


@export_app.command("manifest")
def export_manifest(
    artifact: Path = typer.Argument(..., help="artifact directory"),
    schema_out: Path | None = typer.Option(None, "--schema-out", help="write the JSON Schema here"),
) -> None:
    """Validate an artifact, print its manifest, optionally write the JSON Schema."""
    from kvq.exporters.paths import check_output_file

    if schema_out is not None:
        schema_out = check_output_file(schema_out, "--schema-out", _artifact_files(artifact))

    from kvq.cli.render import print_manifest
    from kvq.exporters.artifact import read_artifact
    from kvq.manifests.jsonschema import json_schema

    art = read_artifact(artifact)
    print_manifest(art)
    if schema_out is not None:
        _write_json(schema_out, json_schema())
        typer.echo(f"JSON Schema written to {printable(str(schema_out))}", err=True)


@app.command("inspect")
def inspect(artifact: Path = typer.Argument(..., help="artifact directory")) -> None:
    """Summary, byte ledger and validation result of an artifact."""
    from kvq.cli.render import print_inspect
    from kvq.exporters.artifact import read_artifact

    print_inspect(read_artifact(artifact), artifact)


@app.command("run-eval")
def run_eval(
    model: str = MODEL,
    artifact: Path | None = typer.Option(None, "--artifact", help="artifact directory"),
    policy: str | None = typer.Option(None, "--policy", help="calibration-free policy name"),
    dataset: str = typer.Option("wikitext2", "--dataset"),
    tasks: str = typer.Option("ppl,kld,bytes", "--tasks", help="comma list of ppl, kld, bytes"),
    windows: int = typer.Option(16, "--windows"),
    seqlen: int = typer.Option(512, "--seqlen"),
    protocol: str = typer.Option("prefill", "--protocol", help="prefill or decode"),
    quantize: str = typer.Option(
        "both",
        "--quantize",
        help="both, or keys / values alone (the other side at full precision): what each "
        "side costs in quality",
    ),
    seed: int = typer.Option(0, "--seed"),
    json_out: Path | None = typer.Option(None, "--json", help="write the report here"),
    data_dir: str | None = DATA_DIR,
    backend: str | None = BACKEND,
) -> None:
    """Perplexity, KL divergence and bytes of the quantized cache vs the unquantized model."""
    from kvq.data.text import check_seed, read_corpus
    from kvq.eval.inputs import check_cache_source, check_protocol, check_quantize, parse_tasks
    from kvq.exporters.paths import check_output_file
    from kvq.models.spec import check_model_spec

    _positive(windows=windows, seqlen=seqlen)
    parse_tasks(tasks)
    check_protocol(protocol)
    check_quantize(quantize)
    check_seed(seed)
    check_cache_source(artifact, policy, backend)
    check_model_spec(model)
    if json_out is not None:
        inputs = (Path(dataset), *(_artifact_files(artifact) if artifact else ()))
        json_out = check_output_file(json_out, "--json", inputs)
    corpus = read_corpus(dataset, windows, seqlen, data_dir)

    from kvq.cli.progress import RichProgress
    from kvq.cli.render import print_eval
    from kvq.eval.run import run_eval_job

    _quiet_transformers()
    with RichProgress() as progress:
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
        )
    if json_out is not None:  # first: the report is kept whatever happens on the terminal
        _write_json(json_out, report)
    print_eval(report)


@app.command("generate")
def generate(
    prompt: str = typer.Option(..., "--prompt"),
    model: str = MODEL,
    artifact: Path | None = typer.Option(None, "--artifact"),
    policy: str | None = typer.Option(None, "--policy"),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens"),
    backend: str | None = BACKEND,
) -> None:
    """Greedy generation through the quantized cache."""
    from kvq.eval.inputs import check_cache_source, check_prompt
    from kvq.models.spec import check_model_spec

    _positive(max_new_tokens=max_new_tokens)
    check_prompt(prompt, max_new_tokens)
    check_cache_source(artifact, policy, backend)
    check_model_spec(model)

    from kvq.eval.run import generate_text

    _quiet_transformers()
    gen = generate_text(model, artifact, policy, prompt, max_new_tokens, backend)
    typer.echo(printable(gen.text, keep_newlines=True))  # the model's text, not commands
    ledger = gen.ledger
    typer.echo(
        f"[{gen.new_tokens} new tokens in {gen.seconds:.1f} s "
        f"({gen.new_tokens / max(gen.seconds, 1e-9):.1f} tokens/s, prefill included); "
        f"cache: {ledger.total} bytes for {ledger.tokens} tokens, {ledger.ratio:.3f} x fp16]",
        err=True,
    )


def _positive(**values: int) -> None:
    for name, v in values.items():
        if v <= 0:
            raise KvqError(f"--{name.replace('_', '-')} must be positive, got {v}")


def _artifact_files(artifact: Path) -> tuple[Path, ...]:
    from kvq.exporters.paths import RESERVED

    return tuple(Path(artifact) / name for name in RESERVED)


def _write_json(path: Path, obj) -> None:
    from kvq.exporters.paths import write_text_atomic

    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _quiet_transformers() -> None:
    """kvq draws its own progress: keep transformers' bars and deprecation chatter out.
    Called by the commands that load a model, not at startup: importing transformers
    takes a second, which --help and input errors should not wait for."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)


def main() -> None:
    # a polite kill (SIGTERM) cleans up as Ctrl-C does: temporary folders go, old artifacts stay
    signal.signal(signal.SIGTERM, _interrupt)
    app()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
