"""The checkpoint hooks that run inside jobs: atomic saves, verified restores."""

from __future__ import annotations

import json

import pytest

from campugrid import hooks


def test_first_run_has_nothing_to_restore(tmp_path):
    assert hooks.restore(tmp_path) is None


def test_save_then_restore_the_latest(tmp_path):
    for epoch in range(3):
        with hooks.save(epoch, {"loss": 1.0 / (epoch + 1)}, root=tmp_path) as folder:
            (folder / "weights.bin").write_bytes(bytes([epoch]) * 100)
            (folder / "sub").mkdir()
            (folder / "sub" / "opt.json").write_text(json.dumps({"lr": 0.1}))
    found = hooks.restore(tmp_path)
    assert found is not None and found.epoch == 2 and found.meta == {"loss": 1 / 3}
    assert found.file("weights.bin").read_bytes() == b"\x02" * 100
    manifest = json.loads((found.path / hooks.MANIFEST).read_text())
    assert manifest["files"]["weights.bin"]["size"] == 100
    assert set(manifest["files"]) == {"weights.bin", "sub/opt.json"}


def test_a_failed_save_leaves_nothing_behind(tmp_path):
    with hooks.save(0, root=tmp_path) as folder:
        (folder / "w").write_text("good")
    with pytest.raises(RuntimeError), hooks.save(1, root=tmp_path) as folder:
        (folder / "w").write_text("half")
        raise RuntimeError("killed mid-save")
    assert [p.name for p in tmp_path.iterdir()] == ["epoch-00000000"]
    assert hooks.restore(tmp_path).epoch == 0


def test_damaged_and_partial_checkpoints_are_skipped(tmp_path):
    for epoch in range(3):
        with hooks.save(epoch, root=tmp_path) as folder:
            (folder / "w").write_text(f"epoch {epoch}")
    (tmp_path / "epoch-00000002" / "w").write_text("flipped bits")  # corrupt the newest
    (tmp_path / "epoch-00000003").mkdir()  # a folder with no manifest: incomplete
    (tmp_path / "epoch-00000003" / "w").write_text("partial")
    found = hooks.restore(tmp_path)
    assert found is not None and found.epoch == 1
    with pytest.raises(hooks.CheckpointError, match="does not match"):
        hooks.verify(tmp_path / "epoch-00000002")
    (tmp_path / "epoch-00000001" / "extra").write_text("x")
    with pytest.raises(hooks.CheckpointError, match="extra"):
        hooks.verify(tmp_path / "epoch-00000001")


def test_folder_mode_copies_a_folder(tmp_path):
    src = tmp_path / "state"
    src.mkdir()
    (src / "a.txt").write_text("A")
    hooks.save_folder(5, src, root=tmp_path / "ck")
    assert hooks.restore(tmp_path / "ck").file("a.txt").read_text() == "A"


def test_bad_epochs_are_refused(tmp_path):
    with pytest.raises(hooks.CheckpointError), hooks.save(-1, root=tmp_path):
        pass


def test_pytorch_adapter_round_trip(tmp_path):
    import torch

    from campugrid.hooks import torch as th

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    th.save(3, model, opt, root=tmp_path)
    clone = torch.nn.Linear(4, 2)
    assert th.restore(clone, torch.optim.SGD(clone.parameters(), lr=0.1), root=tmp_path) == 3
    assert torch.equal(clone.weight, model.weight)


@pytest.mark.parametrize("manifest", ["[]", '{"epoch": 1, "files": []}', '{"files": {}}',
                                      '{"epoch": 1, "files": {"w": {"size": "1"}}}'])
def test_manifests_not_written_by_the_hooks_are_refused(tmp_path, manifest):
    folder = tmp_path / "epoch-00000001"
    folder.mkdir()
    (folder / hooks.MANIFEST).write_text(manifest)
    with pytest.raises(hooks.CheckpointError):
        hooks.verify(folder)
    assert hooks.restore(tmp_path) is None


def test_odd_folder_names_are_not_checkpoints(tmp_path):
    (tmp_path / "epoch-²").mkdir()
    (tmp_path / "epoch-²" / hooks.MANIFEST).write_text("{}")
    assert hooks.complete(tmp_path) == []
