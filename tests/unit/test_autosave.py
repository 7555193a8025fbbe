"""Checkpoints taken from a folder the job's own code writes (hooks/autosave.py): when an entry
counts as complete, what is taken, and how it goes back where it came from. The frameworks'
hooks run against the real frameworks in tests/integration/test_framework_hooks.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from campugrid import hooks
from campugrid.hooks import autosave


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A job's checkpoint folder (as the agent mounts it) and nothing taken yet."""
    monkeypatch.setenv(hooks.ENV_DIR, str(tmp_path / "checkpoints"))
    monkeypatch.delenv(autosave.ENV_RESUMED, raising=False)
    monkeypatch.delenv(autosave.ENV_PUT_BACK, raising=False)
    return tmp_path


def taken(job: Path) -> list[int]:
    return [int(p.name[len(hooks.PREFIX):]) for p in hooks.complete(job / "checkpoints")]


@pytest.mark.parametrize(("name", "step"), [
    ("checkpoint-500", 500), ("epoch=2-step=300.ckpt", 300), ("model_0012.pt", 12),
    ("step_00040.pt", 40), ("last.ckpt", None), ("weights.pt", None)])
def test_the_step_is_the_one_the_name_says(name, step):
    assert autosave.step_of(name) == step


def test_an_entry_is_taken_once_it_stops_changing(job: Path):
    folder = job / "app" / "outputs"
    (folder / "checkpoint-10").mkdir(parents=True)
    (folder / "checkpoint-10" / "model.bin").write_bytes(b"w" * 100)
    watch = autosave.Watch(folder, "checkpoint-*", settle_s=0.2)
    watch.scan()
    assert taken(job) == []  # first seen: it may still be being written
    (folder / "checkpoint-10" / "optimizer.bin").write_bytes(b"o" * 50)  # it was
    time.sleep(0.25)
    watch.scan()
    assert taken(job) == []  # changed since: the wait starts again
    watch.scan()
    assert taken(job) == []  # unchanged, but not for long enough
    time.sleep(0.25)
    watch.scan()
    assert taken(job) == [10]
    manifest = hooks.verify(job / "checkpoints" / hooks.folder_name(10))
    assert sorted(manifest["files"]) == ["checkpoint-10/model.bin", "checkpoint-10/optimizer.bin"]
    assert manifest["meta"] == {"folder": str(folder), "entries": ["checkpoint-10"],
                                "framework": "folder"}


def test_a_newer_entry_means_the_one_before_is_complete(job: Path):
    folder = job / "ckpt"
    folder.mkdir()
    for step in (10, 20, 30):
        (folder / f"step_{step:05d}.pt").write_bytes(str(step).encode())
    watch = autosave.Watch(folder, "step_*.pt", settle_s=60)
    watch.scan()
    assert taken(job) == []  # nothing seen before: any of them may be being written
    watch.scan()
    assert taken(job) == [10, 20]  # unchanged, and a newer step began; 30 may be in writing
    watch.scan(ending=True)  # the process ends: unchanged since the last look, 30 is complete
    assert taken(job) == [10, 20, 30]
    (folder / "step_00025.pt").write_bytes(b"late")
    watch.scan()
    watch.scan(ending=True)
    assert taken(job) == [10, 20, 30]  # never an older step after a newer one


def test_files_of_one_step_are_one_checkpoint_and_what_changes_at_the_end_is_not_taken(
        job: Path):
    folder = job / "ckpt"
    folder.mkdir()
    (folder / "model_00100.pt").write_bytes(b"m")
    (folder / "optim_00100.pt").write_bytes(b"o")
    (folder / "empty-200").mkdir()  # nothing in it yet (but a newer step: 100 is complete)
    watch = autosave.Watch(folder, settle_s=60)
    watch.scan()
    watch.scan()
    manifest = hooks.verify(job / "checkpoints" / hooks.folder_name(100))
    assert sorted(manifest["files"]) == ["model_00100.pt", "optim_00100.pt"]
    assert manifest["meta"]["entries"] == ["model_00100.pt", "optim_00100.pt"]
    assert taken(job) == [100]  # an empty entry is never complete
    (folder / "model_00300.pt").write_bytes(b"half")
    watch.scan()
    (folder / "model_00300.pt").write_bytes(b"half, then more")
    watch.scan(ending=True)  # changed since the last look: perhaps cut short
    assert taken(job) == [100]
    watch.scan(ending=True, clean=False)  # unchanged now, but an exception ends the job
    assert taken(job) == [100]
    watch.scan(ending=True)  # a clean end: nothing writes it any more
    assert taken(job) == [100, 300]


def test_once_a_framework_saves_its_own_the_folder_watch_takes_nothing(job: Path):
    """The watch can only guess when an entry is complete (a pause in a long save looks
    settled); a framework's hook knows, and takes each as it is saved."""
    folder = job / "outputs"
    (folder / "checkpoint-10").mkdir(parents=True)
    (folder / "checkpoint-10" / "model.bin").write_bytes(b"half of it")
    watch = autosave.Watch(folder, settle_s=0)
    watch.scan()
    autosave.framework_takes_over("transformers")  # in this Python or another of the job
    watch.scan(ending=True)
    assert taken(job) == []


def test_what_is_not_a_checkpoint_is_left_alone(job: Path, capsys: pytest.CaptureFixture[str]):
    folder = job / "ckpt"
    (folder / "checkpoint-7").mkdir(parents=True)
    (folder / "checkpoint-7" / "w.bin").write_bytes(b"w")
    os.symlink("/etc/passwd", folder / "checkpoint-7" / "stolen")
    os.symlink("/etc", folder / "checkpoint-9")  # an entry that is a link
    (folder / "last.ckpt").write_bytes(b"no number")
    (folder / "notes-99.txt").write_bytes(b"does not match")
    watch = autosave.Watch(folder, "[cl]*", settle_s=0)
    watch.scan()
    watch.scan()
    assert taken(job) == [7]
    manifest = hooks.verify(job / "checkpoints" / hooks.folder_name(7))
    assert list(manifest["files"]) == ["checkpoint-7/w.bin"]  # links are never followed
    assert "last.ckpt: no step number in its name; not taken" in capsys.readouterr().err


def test_the_checkpoint_resumed_from_goes_back_where_it_was_written(job: Path,
                                                                     monkeypatch: pytest.MonkeyPatch):
    folder = job / "app" / "outputs"
    (folder / "checkpoint-40").mkdir(parents=True)
    (folder / "checkpoint-40" / "model.bin").write_bytes(b"trained")
    assert autosave.take(40, [folder / "checkpoint-40"], "transformers")
    assert not autosave.take(40, [folder / "checkpoint-40"], "transformers")  # never replaced
    # Another machine: the agent unpacked the checkpoint; the framework's folder is empty.
    (folder / "checkpoint-40" / "model.bin").unlink()
    (folder / "checkpoint-40").rmdir()
    monkeypatch.setenv(autosave.ENV_RESUMED, "40")
    assert autosave.put_back() == [folder / "checkpoint-40"]
    assert (folder / "checkpoint-40" / "model.bin").read_bytes() == b"trained"
    assert not list(folder.glob(".campugrid-*"))  # copied aside, then renamed into place
    assert autosave.resumed_entry("transformers") == folder / "checkpoint-40"
    assert autosave.resumed_entry("lightning") is None  # another framework's: not handed to it
    # Put back, it counts as taken: the same step is not taken again from the folder.
    assert not autosave.take(40, [folder / "checkpoint-40"], "transformers")
    # The job's later Pythons are told it is done; one that looks anyway leaves what is there.
    assert os.environ[autosave.ENV_PUT_BACK] == "40" and autosave.put_back() == []
    monkeypatch.delenv(autosave.ENV_PUT_BACK)
    (folder / "checkpoint-40" / "model.bin").write_bytes(b"trained further")
    assert autosave.put_back() == [folder / "checkpoint-40"]
    assert (folder / "checkpoint-40" / "model.bin").read_bytes() == b"trained further"


def test_a_checkpoint_saved_with_the_hooks_api_is_not_put_anywhere(job: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    with hooks.save(3) as into:
        (into / "weights.bin").write_bytes(b"w")
    monkeypatch.setenv(autosave.ENV_RESUMED, "3")
    assert autosave.put_back() == []
    assert autosave.resumed_entry("folder") is None
    manifest = job / "checkpoints" / hooks.folder_name(3) / hooks.MANIFEST
    for meta in (None, [], {"folder": "/app", "entries": ["../x"]}, {"folder": 1, "entries": ["x"]}):
        manifest.write_text(json.dumps({"epoch": 3, "files": {}, "meta": meta}))
        assert autosave.put_back() == [] and autosave.resumed_entry("folder") is None


def test_nothing_starts_outside_a_job(monkeypatch: pytest.MonkeyPatch):
    import sys
    import threading

    monkeypatch.delenv(hooks.ENV_DIR, raising=False)
    monkeypatch.setattr(autosave, "_started", False)
    before = list(sys.meta_path)

    assert autosave.start() is False and not autosave._started
    assert sys.meta_path == before  # the frameworks are hooked by sitecustomize, in a job only
    assert "campugrid-watch" not in {t.name for t in threading.enumerate()}


def test_a_framework_version_the_hooks_do_not_know_is_left_alone_with_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """A module that the import hook patches (here a stand-in named like Keras's) whose class
    lacks what the patch needs: it loads and works as it is, and the job's log says so."""
    import importlib
    import sys

    from campugrid.hooks import frameworks

    package = tmp_path / "keras" / "src" / "callbacks"
    package.mkdir(parents=True)
    for folder in (tmp_path / "keras", tmp_path / "keras" / "src", package):
        (folder / "__init__.py").write_text("")
    (package / "backup_and_restore.py").write_text(
        "class BackupAndRestore:\n    def save(self):\n        return 'saved'\n")
    (tmp_path / "keras" / "__init__.py").write_text("__version__ = '9.9'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "keras" or n.startswith("keras.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    frameworks.install()
    module = importlib.import_module("keras.src.callbacks.backup_and_restore")
    assert module.BackupAndRestore().save() == "saved"
    assert not hasattr(module.BackupAndRestore, "_load_model")  # untouched
    err = capsys.readouterr().err
    assert "keras 9.9 is not a version the checkpoint hooks know" in err
    assert '("checkpoints": {"dir": ...})' in err
