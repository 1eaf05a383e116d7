"""`kvq calibrate NAME`: one subcommand per registered pass, built from its options class,
and `kvq calibrate recipe FILE.yaml` for a chain of passes in one command.

Every subcommand shares the options below (model, data, destination, `--base`); a pass's
own options come from the fields of its options dataclass (`kvq.calibrators.options`).
"""

from __future__ import annotations

import inspect
import typing
from pathlib import Path
from typing import Any

import typer

from kvq.calibrators.options import PassOptions
from kvq.calibrators.registry import PASSES, PassEntry, get_pass
from kvq.cli.common import (
    DATA_DIR,
    DEVICE_MAP,
    MAX_MEMORY,
    MODEL,
    OneLineErrors,
    positive,
    quiet_transformers,
)
from kvq.errors import KvqError

calibrate_app = typer.Typer(
    cls=OneLineErrors, no_args_is_help=True, rich_markup_mode=None, help="Run a calibration pass."
)

# (name, type, typer option) shared by every pass
COMMON = [
    (
        "dataset",
        str,
        typer.Option(..., "--dataset", help="wikitext2 or a .txt/.jsonl/.parquet path"),
    ),
    ("out", Path, typer.Option(..., "--out", help="artifact directory to write")),
    ("model", str, MODEL),
    ("samples", int, typer.Option(16, "--samples", help="calibration windows")),
    ("seqlen", int, typer.Option(512, "--seqlen", help="tokens per window")),
    ("seed", int, typer.Option(0, "--seed", help="window sampling (and k-means) seed")),
    (
        "base",
        Path | None,
        typer.Option(None, "--base", help="start from this artifact: its transforms apply first"),
    ),
    ("overwrite", bool, typer.Option(False, "--overwrite", help="replace an existing artifact")),
    ("data_dir", str | None, DATA_DIR),
    ("device_map", str | None, DEVICE_MAP),
    ("max_memory", str | None, MAX_MEMORY),
]


def _cli_type(tp: Any) -> type:
    """The command-line type of an options field's type hint (Literal -> str, X | None -> X)."""
    if typing.get_origin(tp) is typing.Literal:
        return str
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def _pass_parameters(options: type[PassOptions]) -> list[inspect.Parameter]:
    hints = typing.get_type_hints(options)
    params = []
    for f in options.cli_fields():
        flag = f.metadata["flag"] or "--" + f.name.replace("_", "-")
        default = typer.Option(f.default, flag, help=f.metadata["help"])
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=_cli_type(hints[f.name])))  # fmt: skip
    return params


def _register(entry: PassEntry) -> None:
    options_cls = entry.options
    own = [f.name for f in options_cls.cli_fields()]
    takes_seed = "seed" in {f for f in options_cls.__dataclass_fields__}

    def command(**values) -> None:
        common = {name: values.pop(name) for name, _, _ in COMMON}
        if takes_seed:
            values["seed"] = common["seed"]  # one seed for the windows and the pass
        options = options_cls.from_cli({n: v for n, v in values.items() if n in own + ["seed"]})
        calibrate(passes=(options,), **common)

    common_params = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=tp)
        for name, tp, opt in COMMON
    ]
    command.__signature__ = inspect.Signature(common_params + _pass_parameters(options_cls))
    command.__doc__ = options_cls.SUMMARY
    calibrate_app.command(entry.name)(command)


for _entry in PASSES.values():
    _register(_entry)


@calibrate_app.command("recipe")
def calibrate_recipe(
    recipe: Path = typer.Argument(
        ..., metavar="RECIPE", help="YAML file: passes (and defaults for the options)"
    ),
    out: Path = typer.Option(..., "--out", help="artifact directory to write"),
    model: str | None = typer.Option(None, "--model", help="overrides the recipe's model"),
    dataset: str | None = typer.Option(None, "--dataset", help="overrides the recipe's dataset"),
    samples: int | None = typer.Option(None, "--samples", help="overrides the recipe's samples"),
    seqlen: int | None = typer.Option(None, "--seqlen", help="overrides the recipe's seqlen"),
    seed: int | None = typer.Option(None, "--seed", help="overrides the recipe's seed"),
    base: Path | None = typer.Option(None, "--base", help="start from this artifact"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace an existing artifact"),
    data_dir: str | None = DATA_DIR,
    device_map: str | None = DEVICE_MAP,
    max_memory: str | None = MAX_MEMORY,
) -> None:
    """Run a chain of passes from a recipe file, each on the model the ones before left.

    \b
    model: gemma3-270m
    dataset: ../shared/data/calibration/groups_merged.txt
    samples: 16
    passes:
      - smoothattention: {alpha: 0.5}
      - channel-scales: {bits: 4, key_stage: post-rope}
    """
    from kvq.calibrators.recipe import read_recipe

    r = read_recipe(recipe)
    given = dict(model=model, dataset=dataset, samples=samples, seqlen=seqlen, seed=seed)
    settings = r.settings | {k: v for k, v in given.items() if v is not None}
    if "dataset" not in settings:
        raise KvqError(f"{recipe}: no dataset; give one in the recipe or with --dataset")
    defaults = {"model": "gemma3-270m", "samples": 16, "seqlen": 512, "seed": 0}
    settings = defaults | settings
    passes = tuple(
        get_pass(name).options.from_recipe(values, settings["seed"]) for name, values in r.passes
    )
    calibrate(
        passes=passes, out=out, base=base, overwrite=overwrite, data_dir=data_dir,
        device_map=device_map, max_memory=max_memory, **settings,
    )  # fmt: skip


def calibrate(
    *,
    passes: tuple[PassOptions, ...],
    dataset: str,
    out: Path,
    model: str,
    samples: int,
    seqlen: int,
    seed: int,
    base: Path | None,
    overwrite: bool,
    data_dir: str | None,
    device_map: str | None = None,
    max_memory: str | None = None,
) -> None:
    """Check everything a calibration needs before torch loads (the model spec, the seed,
    the destination, the base artifact, the dataset, read once here), then run the chain."""
    from kvq.artifacts.paths import check_artifact_out, replaced_meanwhile
    from kvq.data.text import check_seed, read_corpus
    from kvq.models.placement import parse_placement
    from kvq.models.spec import check_fits_context, check_model_spec

    positive(samples=samples, seqlen=seqlen)
    placement = parse_placement(device_map, max_memory)
    check_seed(seed)
    check_model_spec(model)
    check_fits_context(model, seqlen, "--seqlen")
    if base is not None and not Path(base).is_dir():
        raise KvqError(f"--base {base}: no such artifact directory")
    out = check_artifact_out(out, overwrite)
    corpus = read_corpus(dataset, samples, seqlen, data_dir)

    from kvq.cli.progress import cli_progress  # torch and transformers: after the checks
    from kvq.cli.render import print_calibration_summary
    from kvq.pipeline import CalibrationRequest, calibrate_job

    quiet_transformers()
    request = CalibrationRequest(
        passes=passes,
        model_spec=model,
        dataset=dataset,
        out=out,
        samples=samples,
        seqlen=seqlen,
        seed=seed,
        overwrite=overwrite,
        data_dir=data_dir,
        base=base,
        placement=placement,
    )
    with cli_progress() as progress:
        artifact = calibrate_job(request, progress, corpus)
    if replaced_meanwhile(out):  # a concurrent --overwrite of the same --out, swapped in later
        raise KvqError(f"--out {out}: another run replaced the artifact this one wrote")
    print_calibration_summary(artifact, out)
