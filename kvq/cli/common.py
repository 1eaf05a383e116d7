"""What every `kvq` command shares: one-line errors, common options, small helpers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from typer.core import TyperGroup

from kvq.errors import KvqError
from kvq.progress import interrupt_received, interrupted
from kvq.textsafe import printable

try:  # typer >= 0.20 vendors click; its exceptions are not click's
    from typer._click import exceptions as cx
except ImportError:  # pragma: no cover - older typer on real click
    from click import exceptions as cx


class OneLineErrors(TyperGroup):
    """Every user error is one line on stderr and exit code 2, never a traceback."""

    def main(self, *args, **kwargs):
        from kvq.artifacts.paths import published

        self._published = len(published())  # earlier commands of this process are not ours
        try:
            self._main(*args, **kwargs)
        except SystemExit as e:
            # 130: _aborted() has said so already
            if e.code not in (0, None, 130) and interrupted():
                self._aborted()  # whatever failed after Ctrl-C, the user asked to stop
            raise
        except BaseException:
            if interrupted():  # a failure that an interrupt caused (a half-done import)
                self._aborted()
            raise

    def _aborted(self) -> None:
        from kvq.artifacts.paths import published

        aborted(published()[self._published :])

    def _main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except cx.NoArgsIsHelpError as e:
            typer.echo(e.ctx.get_help() if e.ctx else str(e))
            sys.exit(2)
        except cx.ClickException as e:
            fail(e.format_message())
        except typer.Exit as e:
            sys.exit(e.exit_code)
        except (typer.Abort, KeyboardInterrupt):
            self._aborted()
        except KvqError as e:
            fail(str(e))
        except OSError as e:  # the environment, not kvq: a full disk, a permission
            where = f"{e.filename}: " if e.filename else ""
            fail(f"{where}{e.strerror or e}")
        except MemoryError:
            fail("out of memory; try fewer or shorter windows")
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx):
        # typer would turn Ctrl-C into a silent exit code 130; say it, once
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            raise typer.Abort() from None


def fail(message: str) -> None:
    first = printable(" ".join(message.split()))  # one line, no terminal control
    typer.echo(f"kvq: error: {first}", err=True)
    sys.exit(2)


def aborted(written: list[Path]) -> None:
    # every writer cleans up on the way out (temporary folders go, old artifacts stay, a
    # swap cut by the interrupt is undone): only what was swapped into place is written
    said = f" after writing {printable(str(written[-1]))}" if written else ", nothing written"
    typer.echo(f"kvq: aborted{said}", err=True)
    sys.exit(130)


MODEL = typer.Option(
    "gemma3-270m", "--model", help="gemma3-270m, a local HF dir, a .gguf file or a hub id"
)
DATA_DIR = typer.Option(
    None, "--data-dir", help="folder holding wikitext-2-raw/ (else $KVQ_DATA_DIR)"
)
DEVICE_MAP = typer.Option(
    None,
    "--device-map",
    help="spread the model over devices (accelerate): auto, balanced, balanced_low_0, "
    "sequential, or a JSON file of module name -> GPU number, cpu or disk",
)
MAX_MEMORY = typer.Option(
    None, "--max-memory", help="with --device-map: per-device limits, e.g. 0=70GiB,cpu=200GiB"
)
BACKEND = typer.Option(
    None,
    "--backend",
    help="attention backend: auto (Triton on CUDA, else torch), triton or reference "
    "(else $KVQ_BACKEND)",
)


def positive(**values: int) -> None:
    for name, v in values.items():
        if v <= 0:
            raise KvqError(f"--{name.replace('_', '-')} must be positive, got {v}")


def artifact_files(artifact: Path) -> tuple[Path, ...]:
    from kvq.artifacts.paths import RESERVED

    return tuple(Path(artifact) / name for name in RESERVED)


def write_json(path: Path, obj) -> None:
    from kvq.artifacts.paths import write_text_atomic

    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def quiet_transformers() -> None:
    """kvq draws its own progress: keep transformers' bars and deprecation chatter out.
    Called by the commands that load a model, not at startup: importing transformers
    takes a second, which --help and input errors should not wait for."""
    import warnings

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)


def on_interrupt(signum, frame) -> None:
    """SIGINT and SIGTERM: remembered (see `kvq.progress`), then raised as Ctrl-C."""
    interrupt_received()
    raise KeyboardInterrupt
