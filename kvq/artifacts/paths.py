"""Where kvq may write, checked before any work starts, and crash-safe directory swaps.

No torch here: the command line checks every destination before it imports anything
heavy or loads a model, so a bad `--out` or `--json` fails in well under a second.

Rules (a user's files are never at risk):
  * `--overwrite` replaces only a kvq artifact (a directory holding just `manifest.json`,
    recognised by its fields, and `tensors.safetensors`) or an empty directory; never a
    folder with other content, never the working directory or one of its parents.
  * output files (`--json`, `--schema-out`) are never a directory, never an artifact's own
    `manifest.json` / `tensors.safetensors`, never an input of the same command.
  * a replaced artifact is swapped in atomically; a kill at any point leaves the old or the
    new artifact at its path, and the next write or read of that path restores or cleans
    whatever a killed process left behind (hidden siblings named after its pid).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from kvq.errors import KvqError

MANIFEST_FILE = "manifest.json"
TENSORS_FILE = "tensors.safetensors"
RESERVED = (MANIFEST_FILE, TENSORS_FILE)
# a serving checkpoint kvq wrote (`kvq export vllm|modelopt`) carries this file: its
# provenance, and what lets --overwrite recognise the folder as kvq's to replace
EXPORT_MARKER = "kvq_export.json"
# the fields every kvq manifest has had, whatever its schema version
_MANIFEST_KEYS = {"schema_version", "kvq_version", "identity", "architecture", "policy"}
_MAX_MANIFEST_BYTES = 64 << 20


# --- what a path is ------------------------------------------------------------------


def _json_object(file: Path) -> dict | None:
    """The JSON object in `file`, or None: missing, not a regular file, too large to be
    kvq's (a path is only being recognised here), unreadable or not an object."""
    try:
        if not file.is_file() or file.stat().st_size > _MAX_MANIFEST_BYTES:
            return None
        data = json.loads(file.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def is_artifact_dir(path: Path) -> bool:
    """True for a directory whose manifest.json is a kvq manifest (any schema version)."""
    data = _json_object(path / MANIFEST_FILE)
    return data is not None and data.keys() >= _MANIFEST_KEYS


def is_export_dir(path: Path) -> bool:
    """True for a directory holding a kvq serving export's marker (`EXPORT_MARKER`)."""
    data = _json_object(path / EXPORT_MARKER)
    return data is not None and "kvq_export" in data and "artifact" in data


def _inside(path: Path, folder: Path) -> bool:
    """path is folder or lies under it (both absolute, symlinks resolved)."""
    return path == folder or folder in path.parents


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if os.path.lexists(candidate):
            return candidate
    return Path(path.anchor)


def _check_creatable(path: Path, what: str) -> None:
    """`path` can be created: its nearest existing ancestor is a writable directory.

    Tried for real (a hidden directory made and removed), so /proc, read-only mounts and
    permissions are caught here rather than after the job has run.
    """
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise KvqError(f"{what} {path}: {base} is not a directory")
    probe = base / f".kvq-probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise KvqError(f"{what} {path}: cannot write in {base} ({e.strerror})") from None


# --- destinations ------------------------------------------------------------------------


def check_artifact_out(out: Path, overwrite: bool, export: bool = False) -> Path:
    """The absolute artifact directory to write, or a one-line KvqError; changes nothing
    except restoring what a killed write left at `out` (see `recover`). export=True: a
    serving checkpoint's folder (`kvq export vllm|modelopt`), which may replace only a
    previous kvq export or an empty folder."""
    out = Path(os.path.abspath(out))
    recover(out)
    real = Path(os.path.realpath(out))
    if _inside(Path(os.path.realpath(os.getcwd())), real):
        raise KvqError(
            f"--out {out} is the working directory or one of its parents; choose a new folder"
        )
    for parent in out.parents:
        if is_artifact_dir(parent):
            raise KvqError(f"--out {out} lies inside the artifact {parent}; choose another folder")
    if os.path.lexists(out):
        if not overwrite:
            raise KvqError(f"output {out} exists; pass --overwrite to replace it")
        check_export_replaceable(out) if export else check_replaceable(out)
    _check_creatable(out, "--out")
    return out


def check_export_replaceable(path: Path) -> None:
    """Only a folder kvq exported (it holds `EXPORT_MARKER`) or an empty one may be replaced."""
    if not path.is_dir():
        raise KvqError(f"{path} exists and is not a directory; refusing to overwrite it")
    if any(path.iterdir()) and not is_export_dir(path):
        raise KvqError(f"{path} is a non-empty directory that is not a kvq export; not replacing")


def check_replaceable(path: Path) -> None:
    """Only a kvq artifact or an empty directory may be replaced.

    A mistyped `--out ~` must not delete a home directory, nor a web extension's folder
    because it happens to hold a file called manifest.json.
    """
    if not path.is_dir():
        raise KvqError(f"{path} exists and is not a directory; refusing to overwrite it")
    entries = sorted(p.name for p in path.iterdir())
    if not entries:
        return
    if not is_artifact_dir(path):
        raise KvqError(f"{path} is a non-empty directory that is not a kvq artifact; not replacing")
    others = [e for e in entries if e not in RESERVED]
    if others:
        raise KvqError(
            f"{path} holds {others[0]!r}, which is not part of a kvq artifact; move it away "
            "before replacing the artifact"
        )


def check_output_file(path: Path, what: str, inputs: tuple[Path, ...] = ()) -> Path:
    """The absolute path of an output file (`--json`, `--schema-out`), or a KvqError;
    temporary siblings a killed writer left next to it are removed."""
    path = Path(os.path.abspath(path))
    if path.is_dir():
        raise KvqError(f"{what} {path} is a directory; give a file name")
    if path.name in RESERVED and is_artifact_dir(path.parent):
        raise KvqError(f"{what} {path} would overwrite a file of the artifact {path.parent}")
    for source in inputs:
        if os.path.lexists(path) and os.path.exists(source) and os.path.samefile(path, source):
            raise KvqError(f"{what} {path} is an input of this command; choose another file")
    _check_creatable(path, what)
    recover(path)
    return path


def write_text_atomic(path: Path, text: str) -> None:
    """Write a small text file through a hidden temporary sibling, renamed into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = sibling(path, "tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            tmp.unlink()


# --- crash-safe replacement ------------------------------------------------------------------


def sibling(path: Path, kind: str) -> Path:
    """A fresh hidden name next to `path` carrying this process's pid, e.g.
    ".ART.tmp-4242-1f2e3d4c": a later run can tell a dead writer's leftovers from a live one's."""
    for _ in range(100):
        candidate = path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")
        if not os.path.lexists(candidate):
            return candidate
    raise KvqError(f"cannot find a free temporary name next to {path}")


def _leftovers(path: Path, kind: str) -> list[Path]:
    """Hidden siblings of `path` of this kind whose writing process is gone."""
    out = []
    prefix = f".{path.name}.{kind}-"
    try:
        names = os.listdir(path.parent)
    except OSError:
        return out
    for name in names:
        if name.startswith(prefix):
            pid = name[len(prefix) :].split("-", 1)[0]
            # no pid in the name: left by a kvq from before pids were recorded
            if not pid.isdigit() or "-" not in name[len(prefix) :] or not _alive(int(pid)):
                out.append(path.parent / name)
    return out


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def recover(path: Path) -> None:
    """Undo what a killed write left next to `path`: put a moved-aside artifact back if
    nothing took its place, then remove dead writers' temporary and moved-aside copies."""
    path = Path(os.path.abspath(path))
    old = sorted(_leftovers(path, "old"), key=lambda p: p.stat().st_mtime)
    if old and not os.path.lexists(path):
        os.rename(old.pop(), path)
    for leftover in old + _leftovers(path, "tmp"):
        remove_tree(leftover)


def claim(path: Path, overwrite: bool, check_replaceable: Callable[[Path], None]) -> Path:
    """The absolute `path`, ready for `swap_into_place`: what a killed writer left beside
    it recovered, an existing entry refused unless `overwrite` and `check_replaceable`
    accepts it, its parent created."""
    path = Path(os.path.abspath(path))  # so "." and "ART/" have a name to rename
    recover(path)
    if os.path.lexists(path):
        if not overwrite:
            raise KvqError(f"{path} exists; pass --overwrite")
        check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def remove_tree(path: Path) -> None:
    # a symlinked artifact is replaced by a real directory: drop the link, not its target
    if path.is_symlink() or path.is_file():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)


def swap_into_place(new: Path, path: Path) -> Path | None:
    """Move the finished directory `new` to `path`; return where the old entry went (to be
    removed by the caller), or None. Atomic where the OS can exchange two names
    (Linux renameat2): `path` always holds the old or the new directory. Elsewhere the old
    one is moved aside first and a kill between the renames is undone by `recover`.

    Ctrl-C and SIGTERM are held back during the swap; one that came meanwhile undoes it
    (the old entry back at `path`, `new` at its name) before it is raised: an interrupted
    write writes nothing, on every path."""
    old: Path | None = None
    swapped = False
    ours = identity(new)  # renames keep it
    try:
        with _signals_held():
            old = _swap(new, path)
            swapped = True
            _published.append((path, ours))
    except BaseException:
        if swapped:  # the held signal raised as the swap ended: put the old entry back
            with _signals_held():
                _published.pop()
                if old == new:
                    _exchange(new, path)
                else:
                    os.rename(path, new)
                    if old is not None:
                        os.rename(old, path)
        raise
    return old


def _swap(new: Path, path: Path) -> Path | None:
    if not os.path.lexists(path):
        os.rename(new, path)
        return None
    if _exchange(new, path):
        return new  # the old artifact now sits at the temporary name
    aside = sibling(path, "old")
    os.rename(path, aside)
    try:
        os.rename(new, path)
    except BaseException:
        os.rename(aside, path)
        raise
    return aside


# what this process swapped into place, and the directory it put there: an interrupt after
# one is no "nothing written", and a concurrent --overwrite may have replaced it since
_published: list[tuple[Path, tuple[int, int] | None]] = []


def published() -> list[Path]:
    return [path for path, _ in _published]


def replaced_meanwhile(path: Path) -> bool:
    """Whether `path`, which this process swapped into place, now holds another entry."""
    ours = [ident for p, ident in _published if p == Path(os.path.abspath(path))]
    return bool(ours) and identity(path) != ours[-1]


def identity(path: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the entry at `path`, None if there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM recorded instead of handled, then handled as they would have been.
    Only the main thread runs signal handlers (and may install them): elsewhere, nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    sigs = (signal.SIGINT, signal.SIGTERM)
    saved = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in sigs}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        for signum in held[:1]:
            handler = saved[signum]
            if callable(handler):
                handler(signum, None)  # the CLI's handler, or Python's KeyboardInterrupt
            elif handler != signal.SIG_IGN:
                signal.raise_signal(signum)  # the default action: terminate


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two directory entries; False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p]
    renameat2.argtypes += [ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: this filesystem cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))
