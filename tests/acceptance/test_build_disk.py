"""A build's disk, through the platform: on the agent's output slot (a bounded filesystem on
disk), not in memory; as large as the job asks, or what the machine offers; and a machine
that cannot give what a job asks hands it back, saying so."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from campugrid.client import tar_folder
from campugrid.protocol.spec import JobSpec

pytestmark = pytest.mark.acceptance
BASE = "localhost/campugrid/python:bookworm"


def context(tmp_path: Path, dockerfile: str) -> bytes:
    (tmp_path / "Dockerfile").write_text(dockerfile)
    return tar_folder(tmp_path)


def build_log(api, job: str) -> str:
    return "".join(c["text"] for c in api.logs(job)["chunks"] if c["stream"] == "build")


def shmem_mb() -> int:
    """The machine's tmpfs and shared memory in use (what a tmpfs build store would take)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("Shmem:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no Shmem in /proc/meminfo")


def test_a_build_writes_to_disk_not_memory_up_to_what_it_asks(api, tmp_path):
    # 600 MB written by a build (held for a few seconds): on the slot it is disk, and the
    # machine's memory does not grow by it, as it would with a tmpfs store.
    before = shmem_mb()
    job = api.submit(context(tmp_path, f"FROM {BASE}\nRUN dd if=/dev/zero of=/big bs=1M "
                                       "count=600 status=none && sleep 4 && rm /big && "
                                       "echo wrote-600\n"),
                     JobSpec.from_dict({"command": ["true"], "resources": {
                         "memory_mb": 256, "build_mb": 1024}}))
    most = before
    while api.job(job["id"])["state"] in ("queued", "building"):
        most = max(most, shmem_mb())
        time.sleep(0.2)
    final = api.wait(job["id"], timeout_s=300)
    log = build_log(api, job["id"])
    assert most - before < 300, f"shared memory grew by {most - before} MB during the build"
    assert final["state"] == "succeeded", (final["reason"], log[-2000:])
    assert "wrote-600" in log and "1024 MB of disk (on disk)" in log, log[-2000:]
    # and the same past what it asked fails, saying so, in the job's words
    job = api.submit(context(tmp_path, f"FROM {BASE}\nRUN dd if=/dev/zero of=/big bs=1M "
                                       "count=600 status=none\n"),
                     JobSpec.from_dict({"command": ["true"], "resources": {"build_mb": 128}}))
    final = api.wait(job["id"], timeout_s=300, check=False)
    assert final["state"] == "failed" and "more than 128 MB of disk" in final["reason"], final
    assert "resources.build_mb" in final["reason"]


def test_without_a_size_a_build_gets_what_the_machine_offers(api, tmp_path):
    job = api.submit(context(tmp_path, f"FROM {BASE}\nRUN true\n"),
                     JobSpec.from_dict({"command": ["true"]}))
    final = api.wait(job["id"], timeout_s=300)
    assert final["state"] == "succeeded", final
    line = next(x for x in build_log(api, job["id"]).splitlines() if "MB of disk" in x)
    offered = int(line.split(" MB of disk")[0].rsplit(" ", 1)[1])
    assert offered > 1024, line  # the slot's room (CAMPUGRID_SLOT_GB), not disk_mb's 256


def test_a_build_disk_no_machine_has_is_never_leased_and_the_job_says_why(api, tmp_path):
    job = api.submit(context(tmp_path, f"FROM {BASE}\nRUN true\n"),
                     JobSpec.from_dict({"command": ["true"], "max_attempts": 1,
                                        "resources": {"build_mb": 16 * 1024 * 1024}}))
    try:
        # The agent reports its disk (the output slot's room) with every ask for work: the
        # job is not offered to it, and waits saying which resource and the most on offer.
        time.sleep(3)  # a few asks
        seen = api.job(job["id"])
        assert seen["state"] == "queued" and seen["attempt"] == 0, seen
        why = seen["waiting_reason"]
        assert why.startswith("needs 16384 GB of disk; the one online machine has "), why
        assert why.endswith(" of disk") and "16384 GB of disk" not in why.split(" has ")[1], why
    finally:
        api.cancel(job["id"])
