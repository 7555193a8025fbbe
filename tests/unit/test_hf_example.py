"""examples/hf-trainer as the README shows it: its job.yaml is a valid spec naming the folder
its unchanged script writes, and it installs the versions the checkpoint tests run
(tests/frameworks/requirements.txt), so that what the tests hold is what a researcher gets."""

from __future__ import annotations

import re
from pathlib import Path

from campugrid.cli import specfile
from campugrid.protocol.spec import JobSpec
from tests.support import frameworks_image

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf-trainer"


def test_its_spec_names_the_folder_the_trainer_writes():
    spec = JobSpec.from_dict(specfile.load(EXAMPLE / "job.yaml"))
    workdir = re.search(r"^WORKDIR (\S+)$", (EXAMPLE / "Dockerfile").read_text(), re.M)
    output_dir = re.search(r'output_dir="([^"]+)"', (EXAMPLE / "train.py").read_text())
    assert spec.checkpoints is not None and workdir and output_dir
    assert spec.checkpoints.dir == f"{workdir[1]}/{output_dir[1]}"
    code = (EXAMPLE / "train.py").read_text().split('"""')[2]  # after its docstring
    assert "campugrid" not in code  # nothing of ours in it


def test_it_installs_what_the_checkpoint_tests_run():
    pinned = frameworks_image.pinned()
    wanted = dict(re.findall(r"^([a-z]+)==([0-9.]+)$", (EXAMPLE / "requirements.txt").read_text(),
                             re.M))
    assert wanted and all(pinned.get(name) == version for name, version in wanted.items()), \
        (wanted, pinned)
