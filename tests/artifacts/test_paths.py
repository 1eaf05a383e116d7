"""Destinations checked before any work, and artifact replacement that survives a kill."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch

from kvq.artifacts import paths
from kvq.artifacts.paths import check_artifact_out, check_output_file
from kvq.artifacts.store import Artifact, read_artifact, write_artifact
from kvq.errors import KvqError
from tests.artifacts.test_store import make_manifest, make_tensors

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def art(tmp_path):
    return write_artifact(
        Artifact(make_manifest(calibrated=True), make_tensors()), tmp_path / "ART"
    )


def listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_artifact_out_accepts_new_empty_and_artifact_folders(tmp_path, art):
    assert check_artifact_out(tmp_path / "new" / "deeper", overwrite=False).is_absolute()
    (tmp_path / "empty").mkdir()
    check_artifact_out(tmp_path / "empty", overwrite=True)
    check_artifact_out(art, overwrite=True)
    assert listing(tmp_path) == ["ART", "empty"]  # checking wrote nothing


@pytest.mark.parametrize(
    "case, needle",
    [
        ("exists", "exists; pass --overwrite"),
        ("file", "not a directory"),
        ("user-folder", "not a kvq artifact"),
        ("extension", "not a kvq artifact"),
        ("artifact-plus-report", "holds 'eval.json'"),
        ("inside-artifact", "lies inside the artifact"),
        ("under-a-file", "is not a directory"),
        ("proc", "cannot write"),
    ],
)
def test_artifact_out_refusals(tmp_path, art, case, needle):
    overwrite = case != "exists"
    target = {
        "exists": art,
        "file": tmp_path / "notes.txt",
        "user-folder": tmp_path / "home",
        "extension": tmp_path / "ext",
        "artifact-plus-report": art,
        "inside-artifact": art / "sub",
        "under-a-file": tmp_path / "notes.txt" / "out",
        "proc": Path("/proc/kvq-out"),
    }[case]
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("mine")
    (tmp_path / "ext").mkdir()
    (tmp_path / "ext" / "manifest.json").write_text('{"manifest_version": 3}')
    if case == "artifact-plus-report":
        (art / "eval.json").write_text("{}")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(KvqError, match=needle):
        check_artifact_out(target, overwrite=overwrite)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("where", [".", ".."])
def test_working_directory_and_its_parents_are_never_replaced(tmp_path, monkeypatch, where):
    work = tmp_path / "work"
    work.mkdir()
    (work / "mine.txt").write_text("mine")
    monkeypatch.chdir(work)
    with pytest.raises(KvqError, match="working directory"):
        check_artifact_out(Path(where), overwrite=True)
    assert (work / "mine.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "target, needle",
    [
        ("ART/manifest.json", "would overwrite a file of the artifact"),
        ("ART/tensors.safetensors", "would overwrite a file of the artifact"),
        ("ART", "is a directory"),
        ("notes.txt/x.json", "is not a directory"),
        ("/proc/kvq.json", "cannot write"),
        ("notes.txt", "is an input of this command"),
    ],
)
def test_output_file_refusals(tmp_path, art, target, needle):
    (tmp_path / "notes.txt").write_text("mine")
    path = Path(target) if target.startswith("/") else tmp_path / target
    with pytest.raises(KvqError, match=needle):
        check_output_file(path, "--json", inputs=(tmp_path / "notes.txt",))
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert read_artifact(art).tensors.keys() == make_tensors().keys()


def test_output_file_beside_or_inside_an_artifact_is_fine(tmp_path, art):
    check_output_file(art / "eval.json", "--json")
    check_output_file(tmp_path / "reports" / "manifest.json", "--json")  # not an artifact


# --- a kill at any point of a replacement ------------------------------------------------

# The child writes ART once, then replaces it and is SIGKILLed at the named point.
_CHILD = """
import os, signal, sys
sys.path.insert(0, {repo!r})
import torch
from kvq.artifacts import paths, store as artifact
from tests.artifacts.test_store import make_manifest
out, point = sys.argv[1], sys.argv[2]
def die(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
real_exchange, real_rename = paths._exchange, os.rename
if point == "before-swap":
    paths._exchange = lambda a, b: die()
elif point == "after-swap":
    def exchange(a, b):
        assert real_exchange(a, b)
        die()
    paths._exchange = exchange
elif point == "between-renames":  # a filesystem that cannot exchange names
    paths._exchange = lambda a, b: False
    def rename(src, dst):
        real_rename(src, dst)
        if ".old-" in str(dst):
            die()
    os.rename = rename
elif point == "writing-tensors":
    artifact.safetensors.torch.save_file = die
new = artifact.Artifact(make_manifest(), {{"new": torch.ones(3)}})
artifact.write_artifact(new, out, overwrite=True)
"""


@pytest.mark.parametrize(
    "point", ["writing-tensors", "before-swap", "after-swap", "between-renames"]
)
def test_a_kill_leaves_the_old_or_the_new_artifact(tmp_path, art, point):
    child = textwrap.dedent(_CHILD.format(repo=str(REPO)))
    run = subprocess.run([sys.executable, "-c", child, str(art), point], capture_output=True)
    assert run.returncode == -signal.SIGKILL, run.stderr.decode()[-2000:]
    # right after the kill: something hidden may remain, but the next read finds an artifact
    names = set(read_artifact(art).tensors)
    expected_new = point == "after-swap"
    assert names == ({"new"} if expected_new else set(make_tensors())), point
    # and the read (like the next write) cleaned what the dead writer left behind
    assert listing(tmp_path) == ["ART"]
    write_artifact(Artifact(make_manifest(), {}), art, overwrite=True)
    assert listing(tmp_path) == ["ART"]


def test_a_live_writers_temporary_folder_is_left_alone(tmp_path, art):
    live = tmp_path / f".ART.tmp-{os.getpid()}-abcd"
    live.mkdir()
    dead = tmp_path / ".ART.tmp-999999999-abcd"  # no such pid
    dead.mkdir()
    paths.recover(art)
    assert live.is_dir() and not dead.exists()


def test_output_file_checks_remove_a_dead_writers_temporary_file(tmp_path):
    dead = tmp_path / ".eval.json.tmp-999999999-abcd"
    dead.write_text("{")
    check_output_file(tmp_path / "eval.json", "--json")
    assert listing(tmp_path) == []


def test_leftovers_without_a_pid_come_from_an_older_kvq(tmp_path, art):
    legacy = tmp_path / ".ART.tmp-1f2e3d4c"  # the name format before pids were recorded
    legacy.mkdir()
    paths.recover(art)
    assert not legacy.exists()


# --- an interrupt during a replacement -------------------------------------------------


@pytest.fixture
def python_ctrl_c():
    """Python's own Ctrl-C handling with SIGINT unblocked, whatever an earlier test in this
    worker left (in the full suite the signal was never handled here; alone, it was)."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    yield
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    signal.signal(signal.SIGINT, handler)


@pytest.mark.usefixtures("python_ctrl_c")
@pytest.mark.parametrize("where", ["between-renames", "exchange", "new-path"])
def test_an_interrupt_during_the_swap_puts_the_old_entry_back(tmp_path, art, monkeypatch, where):
    real_rename, real_exchange = os.rename, paths._exchange

    def ctrl_c():  # a real signal, as the terminal sends it, at the worst moment
        signal.raise_signal(signal.SIGINT)

    def rename(src, dst):
        real_rename(src, dst)
        if ".old-" in str(dst) or where == "new-path":
            ctrl_c()  # the old artifact moved aside, the new one not yet in place

    def exchange(a, b):
        assert real_exchange(a, b)
        ctrl_c()
        return True

    if where == "exchange":
        monkeypatch.setattr(paths, "_exchange", exchange)
    else:  # a filesystem without renameat2: two renames
        monkeypatch.setattr(paths, "_exchange", lambda a, b: False)
    monkeypatch.setattr(os, "rename", rename)
    out = tmp_path / "NEW" if where == "new-path" else art
    written = paths.published()
    with pytest.raises(KeyboardInterrupt):
        write_artifact(Artifact(make_manifest(), {"new": torch.ones(3)}), out, overwrite=True)
    monkeypatch.undo()
    assert listing(tmp_path) == ["ART"]  # no new entry, no temporary or moved-aside one
    assert read_artifact(art).tensors.keys() == make_tensors().keys()  # the old one, intact
    assert paths.published() == written  # so the command line says "nothing written"


def test_a_replacement_between_the_two_reads_is_named(tmp_path, art, monkeypatch):
    # a concurrent --overwrite swaps another artifact in after the manifest was read
    other = write_artifact(Artifact(make_manifest(), {"new": torch.ones(3)}), tmp_path / "B")
    real_load = safetensors.torch.load_file

    def load_file(name, *a, **k):
        shutil.rmtree(art)
        os.rename(other, art)
        return real_load(name, *a, **k)

    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    with pytest.raises(KvqError, match="another run replaced the artifact while this one read it"):
        read_artifact(art)


def test_replaced_meanwhile_tells_this_process_write_from_another(tmp_path, art):
    assert not paths.replaced_meanwhile(art)
    assert not paths.replaced_meanwhile(tmp_path / "never-written")
    other = write_artifact(Artifact(make_manifest(), {}), tmp_path / "B")
    shutil.rmtree(art)
    os.rename(other, art)  # as another process would: not through this one's swap
    assert paths.replaced_meanwhile(art)
