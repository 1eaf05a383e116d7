"""Failure lab: re-run every failure class of issue 13 (the hostile / careless-user audit).

Each case drives the real `kvq` command line in a subprocess (exit code, stderr, signals,
timing) or, where the case is about the library, `kvq.load_artifact` / `kvq.make_cache` in a
subprocess, and classifies what happened:

    ok / ok-refused / ok-aborted   the correct outcome (refused: exit 2, exactly one stderr
                                   line starting "kvq: error:", no traceback, user files
                                   intact, nothing left behind)
    destroyed-user-data            a file the user had is gone or changed
    traceback                      a Python traceback reached the terminal
    accepted-bad-input             exit 0 (or a library call returned) where it should refuse
    false-valid                    "valid" printed for an artifact that cannot be loaded
    silent-wrong-result            accepted, and the result or the record differs from the input
    late-refusal                   refused, but only after torch was imported / the model loaded /
                                   the job ran (the seconds to the error are in the table)
    leftover-files                 hidden temp / aside folders (or files) remain
    terminal-escape-leak           raw ESC bytes, or interpreted rich markup, reached the terminal
    misleading-error               refused, but the message blames the wrong thing (or a
                                   command that did its job reports a failure)
    hang                           still running at the per-case timeout (killed)
    oversized-allocation           memory out of proportion to the work
    no-aborted-line / ignored-interrupt / exit-N / messy-error
                                   Ctrl-C without "kvq: aborted", a Ctrl-C the job ran through,
                                   another exit code, an error that is not one clean line
    n/a / skipped                  the case could not be staged (e.g. no tmpfs without root)

A row passes when the labels found are exactly one of the expected outcomes. Everything runs in
a temp dir on the tiny random llama of tests/conftest.py (its q/k/v/o and lm_head weights scaled
up so a corrupted key scale shows in the numbers) with 2 windows of 32 tokens; the real Gemma is
never loaded. Artifacts are tampered with numpy and re-hashed, so the hash check passes. The kvq
measured is whatever `import kvq` finds (run with PYTHONPATH=<repo root>), so the same script
measures the code before and after a fix. About 2-5 minutes on 2 cores with --jobs 2; root is
needed only for the full-disk cases (a 64 KiB tmpfs), which are skipped otherwise.

    PYTHONPATH=$PWD .venv/bin/python bench/failure_lab.py [--only REGEX] [--json FILE]
        [--jobs N] [--timeout S] [--data-dir DIR] [--keep] [--list]

Exit code 0 whatever the outcomes: it is a measuring instrument, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MANIFEST, TENSORS = "manifest.json", "tensors.safetensors"

# --- the child processes ----------------------------------------------------------------

# The CLI as a user runs it (`kvq ...` is `kvq.cli.app:main`), plus a probe written at exit:
# whether torch was imported and a model class built before the process ended. FL_HOOK_CODE
# installs a deterministic kill / interrupt point (see the HOOK_* snippets below).
CLI_DRIVER = r"""
import atexit, json, os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
_fired = []
def _probe():
    path = os.environ.get("FL_PROBE")
    if path:
        mods = list(sys.modules)
        built = any(m.startswith("transformers.models.") and ".modeling_" in m for m in mods)
        with open(path, "w") as f:
            json.dump({"torch": "torch" in sys.modules, "model_built": built, "fired": _fired}, f)
atexit.register(_probe)
exec(os.environ.get("FL_HOOK_CODE", ""))
from kvq.cli.app import main
main()
"""

# SIGKILL itself at the first rename / replace / exchange that touches FL_TARGET, before or
# after it.
HOOK_KILL_AT_RENAME = r"""
import os as _os
_target, _when = _os.path.abspath(_os.environ["FL_TARGET"]), _os.environ["FL_WHEN"]
def _wrap(real):
    def rename(src, dst, *a, **k):
        hit = _target in (_os.path.abspath(_os.fspath(src)), _os.path.abspath(_os.fspath(dst)))
        if hit and _when == "before":
            _os.kill(_os.getpid(), signal.SIGKILL)
        r = real(src, dst, *a, **k)
        if hit and _when == "after":
            _os.kill(_os.getpid(), signal.SIGKILL)
        return r
    return rename
_os.rename, _os.replace = _wrap(_os.rename), _wrap(_os.replace)
try:  # kvq since 4538c82 swaps an artifact in with one atomic exchange of two names
    import kvq.artifacts.paths as _paths
    _paths._exchange = _wrap(_paths._exchange)
except (ImportError, AttributeError):
    pass
"""

# SIGINT itself inside FL_MODULE.FL_ATTR (before or after the real call): a Ctrl-C at that point.
HOOK_SIGINT_IN = r"""
import importlib, time
_mod = importlib.import_module(os.environ["FL_MODULE"])
_real, _when = getattr(_mod, os.environ["FL_ATTR"]), os.environ["FL_WHEN"]
def _interrupted(*a, **k):
    if _when == "after":
        _real(*a, **k)
    _fired.append(os.environ["FL_ATTR"])
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(1)
    return _real(*a, **k)
setattr(_mod, os.environ["FL_ATTR"], _interrupted)
"""

# SIGINT itself when FL_IMPORT is first imported: a Ctrl-C while torch and its numpy load.
HOOK_SIGINT_AT_IMPORT = r"""
import time
class _Interrupt:
    def find_spec(self, name, path=None, target=None):
        if name == os.environ["FL_IMPORT"]:
            sys.meta_path.remove(self)
            _fired.append(name)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        return None
sys.meta_path.insert(0, _Interrupt())
"""

# The library on a list of artifacts: one JSON line per artifact with the first stage that
# failed (read alone, read against the model, make_cache, a forward) and how.
LIB_DRIVER = r"""
import json, sys, traceback
import torch
import kvq
from kvq.errors import KvqError

model_dir, paths = sys.argv[1], json.loads(sys.argv[2])
model, tok = kvq.load_model(model_dir)
ids = tok("The cache holds keys and values for every layer.", return_tensors="pt")["input_ids"]
with torch.no_grad():
    ref = model(ids).logits
first = None  # logits through the first artifact (the untampered one)
for path in paths:
    rec, stage = {"path": path}, "read"
    try:
        art = kvq.load_artifact(path)
        stage = "read+model"
        art = kvq.load_artifact(path, model=model)
        stage = "make_cache"
        cache = kvq.make_cache(model, artifact=art)
        stage = "forward"
        with torch.no_grad():
            logits = model(ids, cache=cache, use_cache=True).logits
        rec["finite"] = bool(torch.isfinite(logits).all())
        rec["max_logit_err"] = float((logits - ref).abs().max())
        first = logits if first is None else first
        rec["max_diff_vs_base"] = float((logits - first).abs().max())
        stage = "loaded"
    except BaseException as e:
        tb = traceback.extract_tb(e.__traceback__)
        rec.update(kvq_error=isinstance(e, KvqError), type=type(e).__name__,
                   message=str(e)[:300], frames=[[f.filename, f.lineno, f.name] for f in tb])
    rec["stage"] = stage
    print(json.dumps(rec), flush=True)
"""

# A pre-RoPE artifact's cache at one token placed at position 100,000: bytes of RoPE tables held.
ROPE_DRIVER = r"""
import json, resource, sys
import torch
import kvq

model, tok = kvq.load_model(sys.argv[1])
cache = kvq.make_cache(model, artifact=sys.argv[2])
rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ids = tok("x", return_tensors="pt")["input_ids"][:, :1]
out = {}
try:
    with torch.no_grad():
        model(ids, position_ids=torch.tensor([[100_000]]), cache=cache, use_cache=True)
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"[:300]
    out["kvq_error"] = isinstance(e, kvq.KvqError)
tables, rows = 0, []
for layer in cache.layers:
    for t in getattr(layer, "_rope", None) or ():
        tables += t.nbytes
        rows.append(t.shape[0])
out.update(table_bytes=tables, table_rows=max(rows, default=0), layers=len(cache.layers),
           peak_rss_growth=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024)
print(json.dumps(out))
"""

# The tests' tiny llama, with sharper attention and logits: at random init its output is almost
# uniform whatever the keys hold, so a corrupted key scale would not show in any number.
BUILD_MODEL = r"""
import sys
import torch
sys.path.insert(0, sys.argv[1])
from tests.conftest import make_tiny_model, tiny_tokenizer
model = make_tiny_model("llama")
gain = {"q_proj.weight": 8, "k_proj.weight": 8, "v_proj.weight": 5, "o_proj.weight": 5}
with torch.no_grad():
    for name, p in model.named_parameters():
        suffix = ".".join(name.split(".")[-2:])
        p.mul_(50 if name.startswith("lm_head") else gain.get(suffix, 1))
model.save_pretrained(sys.argv[2])
tiny_tokenizer().save_pretrained(sys.argv[2])
"""


@dataclass
class Run:
    """One finished (or killed) child process."""

    rc: int | None
    out: bytes
    err: bytes
    seconds: float
    timed_out: bool = False
    probe: dict = field(default_factory=dict)

    @property
    def stderr(self) -> str:
        return self.err.decode("utf-8", "replace")

    @property
    def stdout(self) -> str:
        return self.out.decode("utf-8", "replace")

    @property
    def text(self) -> str:
        return self.stdout + self.stderr


# --- the lab: paths, environment, shared fixtures ------------------------------------------


class LabError(Exception):
    """A fixture the cases need could not be made (reported as lab-error, the run goes on)."""


class Lab:
    def __init__(self, root: Path, data_dir: Path, timeout: float, jobs: int):
        self.root, self.data_dir, self.timeout = root, data_dir, timeout
        self.calib_txt = data_dir / "calibration" / "groups_merged.txt"
        self.model = root / "tiny-llama"
        self._lock = threading.Lock()
        self._cache: dict[str, object] = {}
        self.live: set[subprocess.Popen] = set()  # killed if the lab itself is interrupted
        import kvq  # whichever kvq this interpreter finds is the one measured

        self.kvq_root = Path(kvq.__file__).resolve().parents[1]
        drop = ("KVQ_", "FL_", "FORCE_COLOR", "TTY_COMPATIBLE", "PY_COLORS", "CLICOLOR_FORCE")
        env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
        env["PYTHONPATH"] = os.pathsep.join(
            [str(self.kvq_root), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        env["KVQ_CACHE"] = str(root / "kvq-cache")
        env["TRANSFORMERS_VERBOSITY"] = "error"
        if jobs > 1:  # two jobs on two cores: one thread each
            env["OMP_NUM_THREADS"] = "1"
        self.env = env

    def once(self, key: str, make: Callable[[], object]) -> object:
        """A fixture computed once, whichever case asks first; a failure is kept and re-raised."""
        with self._lock:
            lock = self._cache.setdefault(f"lock:{key}", threading.Lock())
        with lock:
            if key not in self._cache:
                try:
                    self._cache[key] = make()
                except Exception as e:
                    self._cache[key] = e
            value = self._cache[key]
        if isinstance(value, Exception):
            raise value
        return value

    def case_dir(self, name: str) -> Path:
        d = self.root / "cases" / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    # subprocesses

    def spawn(self, argv, *, cwd=None, env=None, timeout=None, sigint_after=None) -> Run:
        probe = Path(tempfile.mkstemp(dir=self.root, prefix="probe-")[1])
        full_env = {**self.env, "FL_PROBE": str(probe), **(env or {})}
        start = time.perf_counter()
        p = subprocess.Popen(
            argv,
            cwd=cwd or self.root,  # `python -c` puts the cwd first on sys.path: not a kvq tree
            env=full_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # a hung case is killed with its children
        )
        self.live.add(p)
        timed_out = False
        if sigint_after is not None:
            try:
                p.wait(sigint_after)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGINT)
        try:
            out, err = p.communicate(timeout=timeout or self.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
        seconds = time.perf_counter() - start
        self.live.discard(p)
        try:
            info = json.loads(probe.read_text() or "{}")
        except (OSError, ValueError):
            info = {}
        probe.unlink(missing_ok=True)
        return Run(p.returncode, out, err, seconds, timed_out, info)

    def kvq(self, *args, hook: str = "", **kw) -> Run:
        env = {**kw.pop("env", {}), "FL_HOOK_CODE": hook}
        argv = [
            sys.executable,
            "-c",
            CLI_DRIVER,
            *[a if isinstance(a, bytes) else str(a) for a in args],
        ]
        return self.spawn(argv, env=env, **kw)

    def python(self, code: str, *args, **kw) -> Run:
        return self.spawn([sys.executable, "-c", code, *map(str, args)], **kw)

    # command lines

    def calibrate(self, out, *extra) -> list:
        return [
            "calibrate", "channel-scales", "--model", self.model, "--dataset", self.calib_txt,
            "--samples", "2", "--seqlen", "32", "--bits", "4", "--v-group", "8", "--out", out,
            *extra,
        ]  # fmt: skip

    def eval_args(self, *extra) -> list:
        return [
            "run-eval", "--model", self.model, "--dataset", self.eval_text(), "--windows", "2",
            "--seqlen", "32", "--tasks", "ppl", *extra,
        ]  # fmt: skip

    def eval_text(self) -> Path:
        """The first 64 KiB of WikiText-2 test: tokenizing all of it costs each run a second."""

        def cut():
            raw = (self.data_dir / "wikitext-2-raw" / "wiki.test.raw").read_bytes()[: 1 << 16]
            path = self.root / "wiki-head.txt"
            path.write_bytes(raw[: raw.rfind(b"\n") + 1])
            return path

        return self.once("eval-text", cut)

    # fixtures

    def tiny_model(self) -> Path:
        def build():
            r = self.python(BUILD_MODEL, REPO, self.model, timeout=120)
            if r.rc != 0 or not (self.model / "config.json").is_file():
                raise LabError(f"cannot build the tiny model: {_tail(r.stderr)}")
            return self.model

        return self.once("model", build)

    def base_artifact(self) -> Path:
        def build():
            self.tiny_model()
            out = self.root / "base-artifact"
            r = self.kvq(*self.calibrate(out), timeout=180)
            if r.rc != 0:
                raise LabError(f"cannot calibrate the base artifact: {_tail(r.stderr)}")
            return out

        return self.once("artifact", build)

    def artifact_copy(self, where: Path, name: str = "art") -> Path:
        dst = where / name
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(self.base_artifact(), dst)
        return dst

    def base_ratio(self) -> float | None:
        def measure():
            out = self.root / "base-eval.json"
            r = self.kvq(*self.eval_args("--artifact", self.base_artifact(), "--json", out))
            return _ppl_ratio(out) if r.rc == 0 else None

        return self.once("ratio", measure)

    def early_refusal_seconds(self) -> float:
        """Seconds of a refusal kvq already makes before any heavy import (--samples 0)."""

        def measure():
            r = self.kvq(*self.calibrate(self.root / "never", "--samples", "0"))
            return r.seconds

        return self.once("early", measure)

    def oracle(self) -> dict[str, dict]:
        """What the library does with every tampered artifact (one process, one model load)."""

        def run():
            self.tiny_model()
            paths = [str(build(self)) for build in ORACLE_ARTIFACTS.values()]
            r = self.python(LIB_DRIVER, self.model, json.dumps(paths), timeout=180)
            found = {}
            for line in r.stdout.splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                found[rec["path"]] = rec
            died = f"oracle process died (rc {r.rc}): {_tail(r.stderr)}"
            return {
                name: found.get(p, {"stage": "died", "message": died})
                for name, p in zip(ORACLE_ARTIFACTS, paths, strict=True)
            }

        return self.once("oracle", run)


def _tail(text: str, n: int = 160) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return _safe(lines[-1][-n:]) if lines else ""


def _safe(text: str) -> str:
    """Printable for our own table: control characters shown as escapes, never sent raw."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


def _ppl_ratio(path: Path) -> float | None:
    try:
        return json.loads(path.read_text())["tasks"]["ppl"]["ratio"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- what happened: files, tracebacks, labels ------------------------------------------


def snapshot(path: Path) -> dict[str, str]:
    """relpath -> sha256 (or "<dir>") for everything under `path` (or `path` itself)."""
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    snap = {}
    if path.is_dir():
        for p in sorted(path.rglob("*")):
            rel = str(p.relative_to(path))
            snap[rel] = "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return snap


def changed(path: Path, before: dict[str, str]) -> list[str]:
    after = snapshot(path)
    return [rel for rel, digest in before.items() if after.get(rel) != digest]


def new_entries(parent: Path, before: set[str], allowed: tuple[str, ...] = ()) -> list[str]:
    now = {p.name for p in parent.iterdir()} if parent.is_dir() else set()
    return sorted(n for n in now - before if n not in allowed)


def listing(parent: Path) -> set[str]:
    return {p.name for p in parent.iterdir()} if parent.is_dir() else set()


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def parse_traceback(text: str) -> dict | None:
    """The last exception of the last traceback: type, message, raising frame, deepest kvq frame."""
    if "Traceback (most recent call last):" not in text:
        return None
    blocks = text.split("Traceback (most recent call last):")
    first_exc = _exception_line(blocks[1])
    block = blocks[-1]
    frames = [m.groups() for m in map(_FRAME.match, block.splitlines()) if m]
    exc = _exception_line(block)
    kvq_frames = [f for f in frames if "/kvq/" in f[0]]
    tb = {
        "exception": exc.split(":", 1)[0].strip(),
        "message": _safe(exc.split(":", 1)[1].strip()[:200]) if ":" in exc else "",
        "raised_at": _where(frames[-1]) if frames else "?",
        "kvq_frame": _where(kvq_frames[-1]) if kvq_frames else "-",
    }
    if first_exc and first_exc != exc:
        tb["cause"] = _safe(first_exc[:120])
    return tb


def _exception_line(block: str) -> str:
    lines = [ln for ln in block.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if not ln.startswith((" ", "\t")) and not ln.startswith(("During handling", "The above")):
            return ln.strip()
    return ""


_LIB_PREFIX = re.compile(r"^.*/(site-packages|lib/python3\.\d+)/")


def _where(frame: tuple[str, str, str]) -> str:
    """A frame as "kvq/cli/app.py:329 _write_json" or "json/decoder.py:353 raw_decode"."""
    path, line, func = frame
    if _LIB_PREFIX.match(path):
        path = _LIB_PREFIX.sub("", path)
    elif "/kvq/" in path:
        path = "kvq/" + path.rsplit("/kvq/", 1)[1]
    return f"{path}:{line} {func}"


def _error_lines(run: Run) -> list[str]:
    return [ln for ln in run.stderr.splitlines() if ln.startswith("kvq: error:")]


def is_clean_refusal(run: Run) -> bool:
    lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
    errors = _error_lines(run)
    return (
        run.rc == 2
        and len(errors) == 1
        and bool(lines)
        and lines[-1] == errors[0]
        and "Traceback" not in run.text
    )


def stages(run: Run) -> list[str]:
    """The job stages the CLI's progress bars reported (rich draws them on stderr)."""
    return [ln.split("━")[0].split("╺")[0].strip() for ln in run.stderr.splitlines() if "━" in ln]


def lateness(run: Run, early: str | None) -> str:
    """Why a refusal came late, or "" when it came early enough.

    early: "torch" (before torch is imported, as --samples 0 is), "model" (before a model
    is built), "artifact" (no job stage after loading the artifact), None (any time).
    """
    ran = stages(run)
    after = f"; stages run: {', '.join(ran)}" if ran else ""
    if early == "torch" and run.probe.get("torch"):
        return "after importing torch" + after
    if early == "model" and run.probe.get("model_built"):
        return "after building the model" + after
    if early == "artifact" and set(ran) - {"load model", "load artifact"}:
        return "after the job started" + after
    return ""


ESC = re.compile(rb"[\x1b\x9b]")


@dataclass
class Verdict:
    labels: list[str]
    detail: str = ""
    traceback: dict | None = None
    seconds: float | None = None  # of the measured run (else the case's wall time)


def judge(
    run: Run,
    *,
    refuse: bool = True,
    early: str | None = None,
    intact: tuple[Path, dict] | None = None,
    leftovers: tuple[Path, set, tuple] | None = None,
    literal: str | None = None,
    extra: list[str] | None = None,
    notes: list[str] | None = None,
) -> Verdict:
    """Labels for a CLI run.

    refuse: the correct outcome is a refusal (else exit 0). intact: (path, snapshot before)
    of user data that must survive. leftovers: (parent dir, listing before, allowed new
    names). literal: text that must appear verbatim (markup not interpreted).
    """
    labels: list[str] = []
    notes = list(notes or [])
    tb = parse_traceback(run.text)
    if intact is not None:
        lost = changed(*intact)
        if lost:
            labels.append("destroyed-user-data")
            notes.append(f"lost/changed: {', '.join(lost[:4])}")
    if run.timed_out:
        labels.append("hang")
        notes.append(f"killed after {run.seconds:.0f} s")
    if tb:
        labels.append("traceback")
    if ESC.search(run.out + run.err):
        labels.append("terminal-escape-leak")
        notes.append("raw ESC in output")
    elif literal is not None and literal not in run.text and run.rc == 0:
        labels.append("terminal-escape-leak")
        notes.append(f"{literal!r} rendered as markup")
    if run.rc == 0 and refuse:
        labels.append("accepted-bad-input")
    if leftovers is not None:
        left = new_entries(*leftovers)
        if left:
            labels.append("leftover-files")
            notes.append(f"left: {', '.join(left[:3])}")
    if is_clean_refusal(run):
        late = lateness(run, early)
        if late:
            labels.append("late-refusal")
            notes.append(late)
        notes.append(_tail(_error_lines(run)[0]))
    elif not run.timed_out and not tb and run.rc not in (0, 2):
        labels.append(f"exit-{run.rc}")
        notes.append(_tail(run.stderr) or "no stderr")
    elif run.rc == 2 and not tb:
        labels.append("messy-error")
        notes.append(_tail(run.stderr))
    labels += extra or []
    if not labels:
        labels = ["ok-refused" if run.rc == 2 else "ok"]
    if tb:
        notes.append(f"{tb['exception']} at {tb['raised_at']}")
    return Verdict(labels, "; ".join(n for n in notes if n), tb, run.seconds)


# --- artifacts to tamper with ------------------------------------------------------------


def _rehash(art: Path, edit: Callable[[dict], dict]) -> Path:
    """Edit the tensors with numpy, save them and write a matching index (dtype/shape/sha256)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    tensors = edit(load_file(str(art / TENSORS)))
    save_file(tensors, str(art / TENSORS), metadata={"format": "pt"})
    m = json.loads((art / MANIFEST).read_text())
    m["tensors"] = {
        name: {
            "dtype": str(a.dtype),
            "shape": list(a.shape),
            "sha256": hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest(),
        }
        for name, a in sorted(tensors.items())
    }
    (art / MANIFEST).write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    return art


def _edit_manifest(art: Path, edit: Callable[[dict], object]) -> Path:
    m = json.loads((art / MANIFEST).read_text())
    edit(m)
    (art / MANIFEST).write_text(json.dumps(m, indent=2, sort_keys=True) + "\n")
    return art


KEY = "layers.0.key.scale"


def _set_key_scale(fn):
    def edit(t):
        t[KEY] = fn(t[KEY]).astype(t[KEY].dtype)
        return t

    return edit


def _double_heads(t):
    import numpy as np

    for name in (KEY, KEY.replace("scale", "offset")):  # [2, 16] -> [4, 16], both consistent
        t[name] = np.concatenate([t[name], t[name]], axis=0)
    return t


TENSOR_TAMPERS: dict[str, tuple[str, Callable]] = {
    "zero-key-scale": ("layers.0.key.scale = 0, re-hashed", _set_key_scale(lambda a: a * 0)),
    "negative-key-scale": ("layers.0.key.scale negated, re-hashed", _set_key_scale(lambda a: -a)),
    "nan-key-scale": (
        "layers.0.key.scale = NaN, re-hashed",
        _set_key_scale(lambda a: a * float("nan")),
    ),
    "inf-key-scale": (
        "layers.0.key.scale = inf, re-hashed",
        _set_key_scale(lambda a: a * float("inf")),
    ),
    "2x-heads-key-scale": (
        "layers.0.key scale+offset [2,16] -> [4,16], 2 KV heads",
        _double_heads,
    ),
}


def _arch(key, value):
    return lambda m: m["architecture"].__setitem__(key, value)


def _each_layer(side, key, value):
    def edit(m):
        for layer in m["policy"]["_data"]["layers"]:
            layer[side][key] = value

    return edit


def _each_rope(key, value):
    def edit(m):
        for rope in m["architecture"]["rope"]:
            rope[key] = value

    return edit


def _seq(*edits):
    def edit(m):
        for e in edits:
            e(m)

    return edit


# name -> (what is wrong with it, manifest edit): each can never be loaded by any model.
BAD_MANIFESTS: dict[str, tuple[str, Callable]] = {
    "head-dim-1e30": ("architecture.head_dim = 10**30", _arch("head_dim", 10**30)),
    "kv-heads-negative": ("architecture.num_kv_heads = -2", _arch("num_kv_heads", -2)),
    "kv-heads-zero": ("architecture.num_kv_heads = 0", _arch("num_kv_heads", 0)),
    "q-heads-3": ("num_q_heads 3 with 2 KV heads (no GQA grouping)", _arch("num_q_heads", 3)),
    "kv-heads-vs-tensors": (
        "num_kv_heads 4 (q heads 8) but key tensors [2,16]",
        _seq(_arch("num_kv_heads", 4), _arch("num_q_heads", 8)),
    ),
    "head-dim-vs-tensors": (
        "head_dim 32 (rotary 32) but key tensors [2,16]",
        _seq(_arch("head_dim", 32), _each_rope("rotary_dim", 32)),
    ),
    "v-group-7": ("value group_size 7 with head_dim 16", _each_layer("value", "group_size", 7)),
    "layer-types-short": (
        "layer_types has 1 entry for 2 layers",
        _arch("layer_types", ["full_attention"]),
    ),
    "rope-short": (
        "rope has 1 entry for 2 layers",
        lambda m: m["architecture"].__setitem__("rope", m["architecture"]["rope"][:1]),
    ),
    "rotary-dim-64": ("rope rotary_dim 64 > head_dim 16", _each_rope("rotary_dim", 64)),
    "sliding-window-0": ("sliding_window = 0", _arch("sliding_window", 0)),
    "sliding-window-negative": ("sliding_window = -5", _arch("sliding_window", -5)),
    "theta-1e999999": ("rope theta 1e999999 (JSON overflows to inf)", None),  # a text edit
    "static-key-without-tensors": (
        "static per-channel key of layer 1 with its tensors removed (re-hashed)",
        None,
    ),
}

CONTROL_MANIFESTS: dict[str, tuple[str, Callable]] = {
    "bits-5": ("key bits = 5 (control: refused today)", _each_layer("key", "bits", 5)),
    "num-layers-3": ("architecture.num_layers = 3 (control)", _arch("num_layers", 3)),
}


def make_bad_manifest(lab: Lab, name: str) -> Path:
    def build():
        where = lab.root / "manifests" / name
        where.mkdir(parents=True, exist_ok=True)
        art = lab.artifact_copy(where)
        if name == "theta-1e999999":
            text = (art / MANIFEST).read_text()
            (art / MANIFEST).write_text(text.replace('"theta": 10000.0', '"theta": 1e999999'))
        elif name == "static-key-without-tensors":
            _rehash(art, lambda t: {n: a for n, a in t.items() if not n.startswith("layers.1.key")})
        else:
            _edit_manifest(art, {**BAD_MANIFESTS, **CONTROL_MANIFESTS}[name][1])
        return art

    return lab.once(f"manifest:{name}", build)


def make_tampered(lab: Lab, name: str) -> Path:
    def build():
        where = lab.root / "tampered" / name
        where.mkdir(parents=True, exist_ok=True)
        return _rehash(lab.artifact_copy(where), TENSOR_TAMPERS[name][1])

    return lab.once(f"tampered:{name}", build)


ORACLE_ARTIFACTS: dict[str, Callable[[Lab], Path]] = {
    "base": Lab.base_artifact,
    **{f"t:{n}": (lambda lab, n=n: make_tampered(lab, n)) for n in TENSOR_TAMPERS},
    **{f"m:{n}": (lambda lab, n=n: make_bad_manifest(lab, n)) for n in BAD_MANIFESTS},
    **{f"m:{n}": (lambda lab, n=n: make_bad_manifest(lab, n)) for n in CONTROL_MANIFESTS},
}


def describe_oracle(rec: dict) -> str:
    if rec["stage"] == "loaded":
        err, diff = rec.get("max_logit_err"), rec.get("max_diff_vs_base")
        finite = "" if rec.get("finite", True) else ", logits not finite"
        return f"loads and runs (max |logit err| {err:.3g}, {diff:.3g} off the untampered{finite})"
    kind = "KvqError" if rec.get("kvq_error") else f"{rec.get('type')} (traceback)"
    frames = rec.get("frames") or []
    at = _where(tuple(map(str, frames[-1]))) if frames else "?"
    return f"fails at {rec['stage']}: {kind}: {_safe(rec.get('message', ''))[:110]} [{at}]"


def oracle_verdict(rec: dict) -> Verdict:
    """`kvq.load_artifact(path)` (no model) must refuse an artifact no model can load."""
    if rec["stage"] == "read":
        if rec.get("kvq_error"):
            return Verdict(["ok-refused"], describe_oracle(rec))
        return Verdict(["traceback"], describe_oracle(rec), _oracle_tb(rec))
    if rec["stage"] == "died":
        return Verdict(["traceback"], rec["message"])
    labels = ["accepted-bad-input"]
    if rec["stage"] != "loaded" and not rec.get("kvq_error"):
        labels.append("traceback")
    if rec["stage"] == "loaded" and rec.get("max_diff_vs_base", 0) > 1e-3:
        labels.append("silent-wrong-result")
    return Verdict(labels, describe_oracle(rec), _oracle_tb(rec))


def _oracle_tb(rec: dict) -> dict | None:
    if rec.get("kvq_error") or "type" not in rec:
        return None
    frames = [tuple(map(str, f)) for f in rec.get("frames") or []]
    kvq_frames = [f for f in frames if "/kvq/" in f[0]]
    return {
        "exception": rec["type"],
        "message": _safe(rec.get("message", ""))[:200],
        "raised_at": _where(frames[-1]) if frames else "?",
        "kvq_frame": _where(kvq_frames[-1]) if kvq_frames else "-",
    }


# --- the cases ----------------------------------------------------------------------------


@dataclass
class Case:
    name: str
    klass: str  # the failure class of issue 13
    input: str
    expected: tuple[str, ...]
    fn: Callable[[Lab, Path], Verdict]
    timeout: float | None = None


CASES: list[Case] = []


def case(name, klass, input, expected=("ok-refused",), timeout=None):
    def register(fn):
        exp = (expected,) if isinstance(expected, str) else tuple(expected)
        CASES.append(Case(name, klass, input, exp, fn, timeout))
        return fn

    return register


DELETES, TRUSTS, TRACEBACKS, LATE, LEFTOVERS = (
    "deletes user data",
    "trusts the artifact",
    "tracebacks",
    "late checks",
    "leftovers",
)


def _web_extension(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / MANIFEST).write_text('{"manifest_version": 3, "name": "my extension"}\n')
    (d / "background.js").write_text("chrome.runtime.onInstalled.addListener(() => {});\n")
    (d / "icons").mkdir(exist_ok=True)
    (d / "icons" / "icon.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)
    return d


# -- it deletes user data --


@case("overwrite-web-extension", DELETES, "--out webext/ --overwrite (holds manifest.json)")
def _(lab, d):
    ext = _web_extension(d / "webext")
    before = snapshot(ext)
    r = lab.kvq(*lab.calibrate(ext, "--overwrite"))
    return judge(r, intact=(ext, before), leftovers=(d, {"webext"}, ()), early="torch")


@case("overwrite-cwd-user-folder", DELETES, "cd project/; --out . --overwrite")
def _(lab, d):
    proj = _web_extension(d / "project")
    before = snapshot(proj)
    r = lab.kvq(*lab.calibrate(".", "--overwrite"), cwd=proj)
    return judge(r, intact=(proj, before), leftovers=(d, {"project"}, ()), early="torch")


@case(
    "overwrite-cwd-artifact",
    DELETES,
    "cd ART/; --out . --overwrite",
    expected=("ok", "ok-refused"),
)
def _(lab, d):
    art = lab.artifact_copy(d)
    before = snapshot(art)
    r = lab.kvq(*lab.calibrate(".", "--overwrite"), cwd=art)
    notes, extra = [], []
    valid = (art / MANIFEST).is_file() and (art / TENSORS).is_file()
    replaced = valid and snapshot(art) != before
    if r.rc == 0 and not valid:
        extra.append("destroyed-user-data")
    if r.rc != 0 and replaced:
        extra.append("misleading-error")
        notes.append("the artifact was replaced, yet the command failed")
    return judge(r, refuse=False, leftovers=(d, {"art"}, ()), extra=extra, notes=notes)


@case("run-eval-json-onto-manifest", DELETES, "run-eval --artifact ART --json ART/manifest.json")
def _(lab, d):
    art = lab.artifact_copy(d)
    before = snapshot(art)
    r = lab.kvq(*lab.eval_args("--artifact", art, "--json", art / MANIFEST))
    return judge(r, intact=(art, before), leftovers=(art, set(listing(art)), ()), early="model")


@case(
    "run-eval-json-onto-tensors",
    DELETES,
    "run-eval --artifact ART --json ART/tensors.safetensors",
)
def _(lab, d):
    art = lab.artifact_copy(d)
    before = snapshot(art)
    r = lab.kvq(*lab.eval_args("--artifact", art, "--json", art / TENSORS))
    return judge(r, intact=(art, before), leftovers=(art, set(listing(art)), ()), early="model")


@case("schema-out-onto-manifest", DELETES, "export manifest ART --schema-out ART/manifest.json")
def _(lab, d):
    art = lab.artifact_copy(d)
    before = snapshot(art)
    r = lab.kvq("export", "manifest", art, "--schema-out", art / MANIFEST)
    return judge(r, intact=(art, before), leftovers=(art, set(listing(art)), ()))


@case(
    "schema-out-onto-tensors",
    DELETES,
    "export manifest ART --schema-out ART/tensors.safetensors",
)
def _(lab, d):
    art = lab.artifact_copy(d)
    before = snapshot(art)
    r = lab.kvq("export", "manifest", art, "--schema-out", art / TENSORS)
    return judge(r, intact=(art, before), leftovers=(art, set(listing(art)), ()))


def _kill_at_rename(lab: Lab, d: Path, when: str) -> tuple[Run, Path]:
    art = lab.artifact_copy(d)
    env = {"FL_TARGET": str(art), "FL_WHEN": when}
    return lab.kvq(*lab.calibrate(art, "--overwrite"), hook=HOOK_KILL_AT_RENAME, env=env), art


def _killed_state(lab: Lab, d: Path) -> tuple[Run, Path]:
    """A copy of the folder left by kill-between-renames (killed once, copied per case)."""

    def kill():
        where = lab.root / "killed"
        where.mkdir(exist_ok=True)
        return _kill_at_rename(lab, where, "after")[0]

    run = lab.once("killed", kill)
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(lab.root / "killed", d, symlinks=True)
    return run, d / "art"


def _after_kill(r: Run, art: Path, d: Path) -> Verdict:
    if r.rc != -signal.SIGKILL:
        return Verdict(
            ["n/a"], f"no rename touching --out was seen (exit {r.rc}); hook not reached"
        )
    labels, notes = [], []
    ok = (art / MANIFEST).is_file() and (art / TENSORS).is_file()
    if not ok:
        labels.append("destroyed-user-data")
        notes.append("nothing (or a partial artifact) at --out")
    left = new_entries(d, {"art"})
    if left:  # a killed process cannot clean up; the next run must (next-run-after-kill)
        notes.append(f"left until the next run: {', '.join(left)}")
    return Verdict(labels or ["ok"], "; ".join(notes), None, r.seconds)


@case(
    "kill-before-first-rename",
    DELETES,
    "calibrate --overwrite ART, SIGKILL just before the first rename touching ART",
    expected="ok",
)
def _(lab, d):
    r, art = _kill_at_rename(lab, d, "before")
    return _after_kill(r, art, d)


@case(
    "kill-between-renames",
    DELETES,
    "calibrate --overwrite ART, SIGKILL just after the first rename touching ART",
    expected="ok",
)
def _(lab, d):
    return _after_kill(*_killed_state(lab, d), d)


@case(
    "next-run-after-kill",
    LEFTOVERS,
    "after the kill-between-renames state: calibrate --overwrite ART again",
    expected="ok",
)
def _(lab, d):
    _, art = _killed_state(lab, d)
    state = f"after the kill: {', '.join(sorted(listing(d))) or 'nothing'}"
    r = lab.kvq(*lab.calibrate(art, "--overwrite"))
    return judge(r, refuse=False, leftovers=(d, set(), ("art",)), notes=[state])


@case(
    "inspect-after-kill",
    LEFTOVERS,
    "after the kill-between-renames state: kvq inspect ART",
    expected=("ok", "ok-refused"),
)
def _(lab, d):
    _, art = _killed_state(lab, d)
    r = lab.kvq("inspect", art)
    v = judge(r, refuse=False)
    if r.rc == 2 and not re.search(r"\.old|restor|interrupted|aside", r.stderr):
        v.labels = ["misleading-error" if x == "ok-refused" else x for x in v.labels]
        v.detail += "; the error does not mention the hidden old artifact"
    return v


# -- it trusts what an artifact says --


@case("reference-run-eval", TRUSTS, "run-eval on the untampered artifact (reference)", "ok")
def _(lab, d):
    ratio = lab.base_ratio()
    return Verdict(
        ["ok" if ratio is not None else "error"], f"ppl ratio {ratio:.4f}" if ratio else ""
    )


def _tamper_eval(name):
    def fn(lab, d):
        art = make_tampered(lab, name)
        out = d / "eval.json"
        r = lab.kvq(*lab.eval_args("--artifact", art, "--json", out))
        extra, notes = [], []
        ratio, base = _ppl_ratio(out), lab.base_ratio()
        if r.rc == 0 and ratio is not None:
            notes.append(f"ppl ratio {ratio:.4f} vs {base:.4f} untampered" if base else "")
            if base is None or abs(ratio - base) > 1e-6:
                extra.append("silent-wrong-result")
        if is_clean_refusal(r) and "layers.0.key" not in _error_lines(r)[0]:
            extra.append("misleading-error")  # the refusal should name the tampered tensor
        return judge(r, early="artifact", extra=extra, notes=notes)

    return fn


def _tamper_inspect(name):
    def fn(lab, d):
        r = lab.kvq("inspect", make_tampered(lab, name))
        return _false_valid(judge(r), r, f"t:{name}", lab)

    return fn


def _false_valid(v: Verdict, r: Run, oracle_key: str, lab: Lab) -> Verdict:
    """An exit 0 that calls the artifact valid, for an artifact that cannot be used."""
    if r.rc == 0 and re.search(r"valid", r.stdout, re.I):
        rec = lab.oracle()[oracle_key]
        v.labels = ["false-valid" if x == "accepted-bad-input" else x for x in v.labels]
        v.detail = f"printed valid; library: {describe_oracle(rec)}"
    return v


def _oracle_case(key):
    def fn(lab, d):
        return oracle_verdict(lab.oracle()[key])

    return fn


for _name, (_what, _) in TENSOR_TAMPERS.items():
    case(f"tamper-{_name}-run-eval", TRUSTS, f"run-eval --artifact ({_what})")(_tamper_eval(_name))
    case(f"tamper-{_name}-inspect", TRUSTS, f"inspect ({_what})")(_tamper_inspect(_name))
    case(f"tamper-{_name}-library", TRUSTS, f"kvq.load_artifact ({_what})")(
        _oracle_case(f"t:{_name}")
    )


def _manifest_cli(name, command):
    def fn(lab, d):
        art = make_bad_manifest(lab, name)
        before = snapshot(art)
        args = ["inspect", art] if command == "inspect" else ["export", "manifest", art]
        r = lab.kvq(*args)
        v = _false_valid(judge(r, intact=(art, before)), r, f"m:{name}", lab)
        return v

    return fn


for _name, (_what, _) in {**BAD_MANIFESTS, **CONTROL_MANIFESTS}.items():
    for _cmd in ("inspect", "export") if _name in BAD_MANIFESTS else ("inspect",):
        case(f"manifest-{_name}-{_cmd}", TRUSTS, f"{_cmd} ({_what})")(_manifest_cli(_name, _cmd))
    case(f"manifest-{_name}-library", TRUSTS, f"kvq.load_artifact ({_what})")(
        _oracle_case(f"m:{_name}")
    )


ESCAPES = {
    "osc52-clipboard": "\x1b]52;c;SGVsbG8=\x07",
    "clear-screen": "\x1b[2J",
    "set-title": "\x1b]0;title\x07",
    "markup-close": "[/bold]",
    "markup-red": "[red]x",
}


def _escape_manifest(lab: Lab, d: Path, field_: str, text: str) -> Path:
    art = lab.artifact_copy(d)

    def edit(m):
        if field_ == "model_spec":
            m["model_spec"] = f"model{text}"
        else:
            m["policy"]["_data"]["name"] = f"policy{text}"

    return _edit_manifest(art, edit)


def _escape_cli(key, command):
    text = ESCAPES[key]

    def fn(lab, d):
        art = _escape_manifest(lab, d, "model_spec", text)
        args = ["inspect", art] if command == "inspect" else ["export", "manifest", art]
        r = lab.kvq(*args)
        literal = f"model{text}" if text.startswith("[") else None
        return judge(r, refuse=False, literal=literal)

    return fn


def _escape_eval(key):
    text = ESCAPES[key]

    def fn(lab, d):
        art = _escape_manifest(lab, d, "policy", text)
        out = d / "eval.json"
        r = lab.kvq(*lab.eval_args("--artifact", art, "--json", out))
        literal = f"policy{text}" if text.startswith("[") else None
        extra = [] if out.is_file() or r.rc != 0 else ["silent-wrong-result"]
        notes = [] if out.is_file() else ["--json report not written"]
        return judge(r, refuse=False, literal=literal, extra=extra, notes=notes)

    return fn


for _key, _text in ESCAPES.items():
    for _cmd in (
        ("inspect", "export") if _key in ("osc52-clipboard", "markup-close") else ("inspect",)
    ):
        case(
            f"escape-{_key}-{_cmd}",
            TRUSTS,
            f"{_cmd}, model_spec = {_safe(_text)!s}",
            expected=("ok", "ok-refused"),
        )(_escape_cli(_key, _cmd))
for _key in ("osc52-clipboard", "markup-close", "markup-red"):
    case(
        f"escape-{_key}-run-eval",
        TRUSTS,
        f"run-eval --json, policy name = {_safe(ESCAPES[_key])}",
        expected=("ok", "ok-refused"),
    )(_escape_eval(_key))


@case(
    "escape-in-path-argument",
    TRUSTS,
    "inspect '\\x1b]0;pwned\\x07' (a path echoed in the error)",
)
def _(lab, d):
    return judge(lab.kvq("inspect", d / "\x1b]0;pwned\x07"))


# -- tracebacks --


@case("json-out-under-proc", TRACEBACKS, "run-eval --json /proc/kvq.json")
def _(lab, d):
    return judge(
        lab.kvq(*lab.eval_args("--policy", "int8", "--json", "/proc/kvq.json")), early="model"
    )


@case("out-under-proc", TRACEBACKS, "calibrate --out /proc/x")
def _(lab, d):
    return judge(lab.kvq(*lab.calibrate("/proc/kvq-x")), early="torch")


@case("json-out-under-a-file", TRACEBACKS, "run-eval --json somefile.txt/x.json")
def _(lab, d):
    f = d / "somefile.txt"
    f.write_text("mine\n")
    r = lab.kvq(*lab.eval_args("--policy", "int8", "--json", f / "x.json"))
    return judge(r, early="model", intact=(f, snapshot(f)))


@case("out-under-a-file", TRACEBACKS, "calibrate --out somefile.txt/x")
def _(lab, d):
    f = d / "somefile.txt"
    f.write_text("mine\n")
    before = snapshot(f)
    return judge(lab.kvq(*lab.calibrate(f / "x")), early="torch", intact=(f, before))


@case("json-out-is-a-folder", TRACEBACKS, "run-eval --json existing_dir/")
def _(lab, d):
    (d / "existing_dir").mkdir(exist_ok=True)
    (d / "existing_dir" / "keep.txt").write_text("mine\n")
    before = snapshot(d / "existing_dir")
    r = lab.kvq(*lab.eval_args("--policy", "int8", "--json", d / "existing_dir"))
    return judge(
        r,
        early="model",
        intact=(d / "existing_dir", before),
        leftovers=(d, {"existing_dir"}, ()),
    )


@case("schema-out-under-proc", TRACEBACKS, "export manifest ART --schema-out /proc/kvq.json")
def _(lab, d):
    return judge(lab.kvq("export", "manifest", lab.base_artifact(), "--schema-out", "/proc/k.json"))


@case("schema-out-is-a-folder", TRACEBACKS, "export manifest ART --schema-out existing_dir/")
def _(lab, d):
    (d / "existing_dir").mkdir(exist_ok=True)
    r = lab.kvq("export", "manifest", lab.base_artifact(), "--schema-out", d / "existing_dir")
    return judge(r, leftovers=(d, {"existing_dir"}, ()))


def _dataset_case(make_file, *, command="calibrate"):
    def fn(lab, d):
        path = make_file(d)
        if command == "calibrate":
            args = lab.calibrate(d / "out")
            args[args.index("--dataset") + 1] = path
        else:  # run-eval on wikitext2 from a --data-dir
            args = lab.eval_args("--policy", "int8", "--data-dir", path)
            args[args.index("--dataset") + 1] = "wikitext2"
        return judge(lab.kvq(*args), early="torch", leftovers=(d, listing(d), ()))

    return fn


def _jsonl_deep(d: Path) -> Path:
    p = d / "deep.jsonl"
    p.write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    return p


def _jsonl_bigint(d: Path) -> Path:
    p = d / "bigint.jsonl"
    p.write_text('{"text": "hello world", "n": ' + "9" * 100_000 + "}\n")
    return p


def _jsonl_overflow(d: Path) -> Path:
    p = d / "overflow.jsonl"
    p.write_text('{"text": 1e999999}\n')
    return p


def _parquet_ints(d: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = d / "ints.parquet"
    pq.write_table(pa.table({"text": list(range(1, 200))}), p)
    return p


def _binary_wikitext(d: Path) -> Path:
    root = d / "data"
    (root / "wikitext-2-raw").mkdir(parents=True, exist_ok=True)
    (root / "wikitext-2-raw" / "wiki.test.raw").write_bytes(bytes(range(256)) * 64)
    return root


case("jsonl-nesting-100000", TRACEBACKS, '--dataset x.jsonl, "text" nested 100000 deep')(
    _dataset_case(_jsonl_deep)
)
case("jsonl-100000-digit-int", TRACEBACKS, "--dataset x.jsonl with a 100000-digit integer")(
    _dataset_case(_jsonl_bigint)
)
case("jsonl-text-1e999999", TRACEBACKS, '--dataset x.jsonl, {"text": 1e999999} (control)')(
    _dataset_case(_jsonl_overflow)
)
case("parquet-int-text-column", TRACEBACKS, "--dataset x.parquet, text column of integers")(
    _dataset_case(_parquet_ints)
)
case("binary-wiki-test-raw", TRACEBACKS, "run-eval --data-dir D, binary wiki.test.raw")(
    _dataset_case(_binary_wikitext, command="eval")
)


def _manifest_text_case(make_text, command):
    def fn(lab, d):
        art = lab.artifact_copy(d)
        (art / MANIFEST).write_text(make_text((art / MANIFEST).read_text()))
        args = ["inspect", art] if command == "inspect" else ["export", "manifest", art]
        return judge(lab.kvq(*args))

    return fn


def _deep_manifest(_text: str) -> str:
    return "[" * 100_000 + "]" * 100_000


def _bigint_manifest(text: str) -> str:
    return text.replace('"head_dim": 16', '"head_dim": ' + "1" * 100_000)


for _cmd in ("inspect", "export"):
    case(
        f"manifest-nesting-100000-{_cmd}", TRACEBACKS, f"{_cmd}, manifest.json nested 100000 deep"
    )(_manifest_text_case(_deep_manifest, _cmd))
    case(f"manifest-100000-digit-int-{_cmd}", TRACEBACKS, f"{_cmd}, head_dim of 100000 digits")(
        _manifest_text_case(_bigint_manifest, _cmd)
    )

SEED = str(2**70)


@case("seed-2pow70-calibrate", TRACEBACKS, f"calibrate --seed {SEED}")
def _(lab, d):
    return judge(lab.kvq(*lab.calibrate(d / "out", "--seed", SEED)), early="torch")


@case("seed-2pow70-run-eval", TRACEBACKS, f"run-eval --seed {SEED}")
def _(lab, d):
    return judge(lab.kvq(*lab.eval_args("--policy", "int8", "--seed", SEED)), early="torch")


@case(
    "prompt-lone-surrogate",
    TRACEBACKS,
    "generate --prompt $'\\x80' (argv byte -> lone surrogate \\udc80)",
    expected=("ok", "ok-refused"),
)
def _(lab, d):
    args = ["generate", "--model", lab.model, "--policy", "int8", "--max-new-tokens", "2"]
    return judge(lab.kvq(*args, "--prompt", b"caf\x80"), refuse=False)


class FullDisk:
    """A 64 KiB tmpfs filled to the last byte (root only); unmounted on exit."""

    def __init__(self, where: Path):
        self.where = where
        self.reason = ""

    def __enter__(self) -> FullDisk:
        self.where.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(self.where)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            self.reason = f"cannot mount a tmpfs ({_tail(r.stderr) or r.returncode}); skipped"
            return self
        try:
            with open(self.where / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 1024)
                    f.flush()
        except OSError:
            pass
        return self

    def __exit__(self, *exc) -> None:
        if not self.reason:
            subprocess.run(["umount", "-l", str(self.where)], capture_output=True)


def _full_disk(run_it):
    def fn(lab, d):
        with FullDisk(d / "disk") as disk:
            if disk.reason:
                return Verdict(["skipped"], disk.reason)
            before = listing(disk.where)
            r = run_it(lab, disk.where)
            return judge(r, leftovers=(disk.where, before, ()))

    return fn


case("full-disk-calibrate", TRACEBACKS, "calibrate --out FULL/art (a full tmpfs)")(
    _full_disk(lambda lab, disk: lab.kvq(*lab.calibrate(disk / "art")))
)
case("full-disk-run-eval-json", TRACEBACKS, "run-eval --json FULL/eval.json")(
    _full_disk(
        lambda lab, disk: lab.kvq(*lab.eval_args("--policy", "int8", "--json", disk / "e.json"))
    )
)
case("full-disk-schema-out", TRACEBACKS, "export manifest ART --schema-out FULL/s.json")(
    _full_disk(
        lambda lab, disk: lab.kvq(
            "export", "manifest", lab.base_artifact(), "--schema-out", disk / "s.json"
        )
    )
)


# -- late checks --


@case("missing-model-calibrate", LATE, "calibrate --model /no/such/model")
def _(lab, d):
    args = lab.calibrate(d / "out")
    args[args.index("--model") + 1] = "/no/such/model"
    v = judge(lab.kvq(*args), early="torch")
    v.detail += f"; an early refusal (--samples 0) takes {lab.early_refusal_seconds():.1f} s"
    return v


@case("missing-model-run-eval", LATE, "run-eval --model /no/such/model --policy int8")
def _(lab, d):
    args = lab.eval_args("--policy", "int8")
    args[args.index("--model") + 1] = "/no/such/model"
    return judge(lab.kvq(*args), early="torch")


@case("existing-out", LATE, "calibrate --out ART (exists, no --overwrite)")
def _(lab, d):
    art = lab.artifact_copy(d)
    return judge(lab.kvq(*lab.calibrate(art)), early="torch", intact=(art, snapshot(art)))


@case("overwrite-onto-a-file", LATE, "calibrate --out notes.txt --overwrite")
def _(lab, d):
    f = d / "notes.txt"
    f.write_text("my notes\n")
    r = lab.kvq(*lab.calibrate(f, "--overwrite"))
    return judge(r, early="torch", intact=(f, snapshot(f)), leftovers=(d, {"notes.txt"}, ()))


@case("overwrite-non-artifact-folder", LATE, "calibrate --out photos/ --overwrite (no manifest)")
def _(lab, d):
    photos = d / "photos"
    photos.mkdir(exist_ok=True)
    (photos / "cat.jpg").write_bytes(b"\xff\xd8\xff" + b"\0" * 100)
    before = snapshot(photos)
    r = lab.kvq(*lab.calibrate(photos, "--overwrite"))
    return judge(r, early="torch", intact=(photos, before), leftovers=(d, {"photos"}, ()))


@case("max-new-tokens-1e9", LATE, "generate --max-new-tokens 1000000000 (context 256)")
def _(lab, d):
    args = ["generate", "--model", lab.model, "--policy", "int8", "--prompt", "The"]
    return judge(lab.kvq(*args, "--max-new-tokens", "1000000000", timeout=20))


@case(
    "v-group-100000",
    LATE,
    "calibrate --v-group 100000 (head_dim 16)",
    expected=("ok-refused", "ok"),
)
def _(lab, d):
    out = d / "out"
    args = lab.calibrate(out)
    args[args.index("--v-group") + 1] = "100000"
    r = lab.kvq(*args)
    extra, notes = [], []
    if r.rc == 0:
        m = json.loads((out / MANIFEST).read_text())
        recorded = m["calibration"]["options"].get("value_group")
        used = {lay["value"]["group_size"] for lay in m["policy"]["_data"]["layers"]}
        notes.append(f"options.value_group={recorded}, policy group_size={sorted(used, key=str)}")
        if recorded not in used:
            extra.append("silent-wrong-result")
    v = judge(r, refuse=False, extra=extra, notes=notes)
    return v


@case("seqlen-over-context-calibrate", LATE, "calibrate --seqlen 512 (max_position_embeddings 256)")
def _(lab, d):
    args = lab.calibrate(d / "out")
    args[args.index("--seqlen") + 1] = "512"
    return judge(lab.kvq(*args), leftovers=(d, listing(d), ()))


@case("seqlen-over-context-run-eval", LATE, "run-eval --seqlen 512 (max_position_embeddings 256)")
def _(lab, d):
    args = lab.eval_args("--policy", "int8")
    args[args.index("--seqlen") + 1] = "512"
    return judge(lab.kvq(*args))


@case(
    "pre-rope-position-100000",
    LATE,
    "library: pre-RoPE artifact, 1 token at position 100000 (context 256)",
    expected=("ok", "ok-refused"),
)
def _(lab, d):
    r = lab.python(ROPE_DRIVER, lab.tiny_model(), lab.base_artifact())
    tb = parse_traceback(r.stderr)
    if r.rc != 0 or tb:
        return Verdict(["traceback"], _tail(r.stderr), tb)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if res.get("error"):
        label = "ok-refused" if res.get("kvq_error") else "traceback"
        return Verdict([label], res["error"])
    per_row = res["table_bytes"] / max(res["table_rows"], 1) / max(res["layers"], 1)
    gemma = res["table_rows"] * 18 * per_row * 256 / 16  # 18 layers, head_dim 256
    detail = (
        f"{res['table_bytes'] / 2**20:.1f} MiB of RoPE tables ({res['table_rows']} rows x "
        f"{res['layers']} layers) for 1 stored token, peak RSS +{res['peak_rss_growth'] / 2**20:.0f} MiB; "
        f"the same tables on Gemma 3 270M: {gemma / 2**30:.1f} GiB"
    )
    if res["table_bytes"] <= 1 << 20:  # a MiB is plenty for one token
        return Verdict(["ok"], detail)
    return Verdict(["accepted-bad-input", "oversized-allocation"], detail)


# -- leftovers --


def _stale_conversion(age_s: float):
    def fn(lab, d):
        cache = d / "kvq-cache"
        models = cache / "models"
        models.mkdir(parents=True, exist_ok=True)
        (models / "gemma3-270m").symlink_to(lab.tiny_model(), target_is_directory=True)
        stale = models / ".gemma3-270m.tmp-deadbeef"
        (stale / "model").mkdir(parents=True, exist_ok=True)
        (stale / "model" / "model.safetensors").write_bytes(b"\0" * (1 << 20))
        past = time.time() - age_s
        for p in (stale / "model" / "model.safetensors", stale / "model", stale):
            os.utime(p, (past, past))
        args = ["generate", "--model", "gemma3-270m", "--policy", "int8", "--prompt", "The"]
        r = lab.kvq(*args, "--max-new-tokens", "2", env={"KVQ_CACHE": str(cache)})
        notes = ["generate with a cached gemma3-270m (a symlink to the tiny model)"]
        extra = ["leftover-files"] if stale.exists() else []
        if stale.exists():
            notes.append(f"{stale.name} ({age_s / 60:.0f} min old, 1 MiB) still there")
        return judge(r, refuse=False, extra=extra, notes=notes)

    return fn


case(
    "stale-conversion-10min",
    LEFTOVERS,
    "$KVQ_CACHE/models/.gemma3-270m.tmp-* 10 min old, next run",
    expected="ok",
)(_stale_conversion(600))
case(
    "stale-conversion-7h",
    LEFTOVERS,
    "$KVQ_CACHE/models/.gemma3-270m.tmp-* 7 h old, next run",
    expected="ok",
)(_stale_conversion(7 * 3600))


def _sigint_verdict(r: Run, out: Path, d: Path, interrupted: bool = False) -> Verdict:
    """interrupted: the SIGINT certainly arrived while the job was still running."""
    labels, notes = [], [f"exit {r.rc}"]
    aborted = [ln for ln in r.stderr.splitlines() if "aborted" in ln.lower()]
    tb = parse_traceback(r.text)
    if tb:
        labels.append("traceback")
        notes.append(f"{tb['exception']} at {tb['raised_at']}")
    if r.rc == 0 and interrupted:
        return Verdict(["ignored-interrupt"], "exit 0: the interrupt was swallowed, the job ran on")
    if r.rc == 0:
        return Verdict(["n/a"], "finished before the interrupt arrived")
    if r.rc != 130:
        labels.append(f"exit-{r.rc}")
    if not aborted:
        labels.append("no-aborted-line")
    complete = (out / MANIFEST).is_file() and (out / TENSORS).is_file()
    if out.exists() and not complete:
        labels.append("leftover-files")
        notes.append("a partial artifact at --out")
    left = new_entries(d, set(), ("out",))
    if left:
        labels.append("leftover-files")
        notes.append(f"left: {', '.join(left)}")
    return Verdict(labels or ["ok-aborted"], "; ".join(notes), tb, r.seconds)


def _sigint_external(delay: float):
    def fn(lab, d):
        out = d / "out"
        r = lab.kvq(*lab.calibrate(out), sigint_after=delay)
        return _sigint_verdict(r, out, d)

    return fn


def _sigint_import(module: str):
    def fn(lab, d):
        out = d / "out"
        r = lab.kvq(*lab.calibrate(out), hook=HOOK_SIGINT_AT_IMPORT, env={"FL_IMPORT": module})
        v = _sigint_verdict(r, out, d, interrupted=bool(r.probe.get("fired")))
        if not r.probe.get("fired"):
            v.detail += f"; {module} was never imported"
        return v

    return fn


def _sigint_hook(module: str, attr: str, when: str):
    def fn(lab, d):
        out = d / "out"
        env = {"FL_MODULE": module, "FL_ATTR": attr, "FL_WHEN": when}
        r = lab.kvq(*lab.calibrate(out), hook=HOOK_SIGINT_IN, env=env)
        v = _sigint_verdict(r, out, d, interrupted=bool(r.probe.get("fired")))
        if not r.probe.get("fired"):
            v.detail += f"; hook {module}.{attr} not reached"
        return v

    return fn


case(
    "sigint-at-1s",
    LEFTOVERS,
    "calibrate, SIGINT 1 s after start (torch importing, on this machine)",
    expected=("ok-aborted", "n/a"),
)(_sigint_external(1.0))
for _module in ("numpy", "numpy._core.umath"):
    case(
        f"sigint-at-import-{_module}",
        LEFTOVERS,
        f"calibrate, SIGINT as {_module} is first imported (inside import torch)",
        expected="ok-aborted",
    )(_sigint_import(_module))
case(
    "sigint-in-model-load",
    LEFTOVERS,
    "calibrate, SIGINT inside kvq.models.loading.load_model",
    expected="ok-aborted",
)(_sigint_hook("kvq.models.loading", "load_model", "before"))
case(
    "sigint-in-artifact-write",
    LEFTOVERS,
    "calibrate, SIGINT right after safetensors wrote the tensors",
    expected="ok-aborted",
)(_sigint_hook("safetensors.torch", "save_file", "after"))


# --- running and reporting ----------------------------------------------------------------


def run_case(lab: Lab, c: Case) -> dict:
    start = time.perf_counter()
    try:
        lab.tiny_model()  # every case runs on it
        v = c.fn(lab, lab.case_dir(c.name))
    except Exception as e:  # a missing fixture or a bug in the lab: report it, keep going
        v = Verdict(["lab-error"], f"{type(e).__name__}: {e}")
    seconds = v.seconds if v.seconds is not None else time.perf_counter() - start
    passed = None if v.labels in (["skipped"], ["n/a"]) else v.labels in [[x] for x in c.expected]
    return {
        "case": c.name,
        "class": c.klass,
        "input": _safe(c.input),
        "expected": " or ".join(c.expected),
        "got": ", ".join(v.labels),
        "pass": passed,
        "seconds": round(seconds, 2),
        "detail": _safe(v.detail),
        "traceback": v.traceback,
    }


def print_table(rows: list[dict]) -> None:
    w_case = max(len(r["case"]) for r in rows)
    w_in = min(60, max(len(r["input"]) for r in rows))
    w_exp = max(len(r["expected"]) for r in rows)
    w_got = max(len(r["got"]) for r in rows)
    head = (
        f"{'case':<{w_case}}  {'input':<{w_in}}  {'expected':<{w_exp}}  {'got':<{w_got}}  {'s':>5}"
    )
    print(head)
    print("-" * len(head))
    klass = None
    for r in rows:
        if r["class"] != klass:
            klass = r["class"]
            print(f"## {klass}")
        mark = {True: "", False: "  FAIL", None: "  (n/a)"}[r["pass"]]
        inp = r["input"] if len(r["input"]) <= w_in else r["input"][: w_in - 1] + "…"
        print(
            f"{r['case']:<{w_case}}  {inp:<{w_in}}  {r['expected']:<{w_exp}}  "
            f"{r['got']:<{w_got}}  {r['seconds']:>5.1f}{mark}"
        )
        if r["detail"]:
            print(f"{'':<{w_case}}    {r['detail'][:220]}")


def distinct_tracebacks(rows: list[dict]) -> list[dict]:
    """One entry per (exception, last kvq frame): where the fix goes, with the cases that hit it."""
    seen: dict[tuple, dict] = {}
    for r in rows:
        tb = r["traceback"]
        if tb:
            key = (tb["exception"], tb["kvq_frame"])
            seen.setdefault(key, {**tb, "cases": []})["cases"].append(r["case"])
    return sorted(seen.values(), key=lambda t: t["kvq_frame"])


def print_tracebacks(rows: list[dict]) -> None:
    found = distinct_tracebacks(rows)
    print(f"\ndistinct tracebacks: {len(found)}")
    for tb in found:
        cause = f" (while handling {tb['cause']})" if tb.get("cause") else ""
        print(f"  {tb['exception']}: {tb['message'][:100]}{cause}")
        print(f"      raised at {tb['raised_at']}; last kvq frame {tb['kvq_frame']}")
        print(f"      cases: {', '.join(tb['cases'])}")


def _default_data_dir() -> Path | None:
    candidates = [os.environ.get("KVQ_DATA_DIR"), REPO.parent / "shared" / "data"]
    candidates.append(REPO.parents[1] / "shared" / "data")
    for c in candidates:
        if c and (Path(c) / "calibration" / "groups_merged.txt").is_file():
            return Path(c)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="regex: run the cases whose name or class matches")
    ap.add_argument("--json", type=Path, help="write the rows as JSON here")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once (default 2)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per child process")
    ap.add_argument("--data-dir", type=Path, default=_default_data_dir())
    ap.add_argument("--keep", action="store_true", help="keep the temp dir and print its path")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    args = ap.parse_args(argv)

    cases = [c for c in CASES if not args.only or re.search(args.only, f"{c.name} {c.klass}")]
    if not cases:
        print(f"failure_lab: no case matches {args.only!r} (see --list)")
        return 0
    if args.list:
        for c in cases:
            print(f"{c.name:<42} {c.klass:<20} {_safe(c.input)}")
        return 0
    if args.data_dir is None:
        print("failure_lab: no data dir with calibration/groups_merged.txt; pass --data-dir")
        return 0
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # children get a default SIGINT
        signal.signal(signal.SIGINT, signal.default_int_handler)

    root = Path(tempfile.mkdtemp(prefix="kvq-failure-lab-"))
    lab = Lab(root, args.data_dir.resolve(), args.timeout, args.jobs)
    print(f"kvq under test: {lab.kvq_root}; {len(cases)} cases, {args.jobs} at a time", flush=True)
    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            rows = list(pool.map(lambda c: run_case(lab, c), cases))
    finally:
        for p in list(lab.live):
            with contextlib.suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)
        for mount in (root / "cases").glob("*/disk"):
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    total = time.perf_counter() - start
    print()
    print_table(rows)
    print_tracebacks(rows)
    failed = sum(r["pass"] is False for r in rows)
    print(f"\n{len(rows)} cases, {failed} not as expected, {total:.0f} s")
    if args.json:
        report = {"kvq": str(lab.kvq_root), "seconds": round(total, 1), "rows": rows}
        report["tracebacks"] = distinct_tracebacks(rows)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
