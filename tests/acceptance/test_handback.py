"""A machine that cannot run a job, through no fault of the job's (here: a base image it does
not have), hands it back without using an attempt, is never offered it again, and the job
says so while it waits; a machine that has the base then runs it."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest

from campugrid.cli.platform import BASE_IMAGE, Platform, ProviderUser
from campugrid.client import tar_folder
from campugrid.protocol.spec import JobSpec
from tests.acceptance.conftest import a_platform

pytestmark = pytest.mark.acceptance
ABSENT = "localhost/campugrid/handback-test:1"


@pytest.fixture(scope="module")
def platform() -> Iterator[Platform]:
    """The platform and one agent, both allowing a base that the provider does not have."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CAMPUGRID_ALLOWED_BASES", f"{BASE_IMAGE},{ABSENT}")
        with a_platform("no-base") as p:
            yield p


def test_a_machine_without_the_base_hands_the_job_back_and_one_with_it_runs_it(platform,
                                                                                 tmp_path):
    user = ProviderUser.resolve()
    subprocess.run(user.command(["podman", "rmi", "--ignore", ABSENT]), capture_output=True,
                   timeout=60, check=False)
    (tmp_path / "Dockerfile").write_text(f"FROM {ABSENT}\nCMD [\"echo\", \"built on it\"]\n")
    with platform.api() as api:
        job = api.submit(tar_folder(tmp_path), JobSpec.from_dict({"max_attempts": 1}))
        deadline = time.monotonic() + 120
        while "handed_back" not in [e["kind"] for e in api.job(job["id"])["events"]]:
            assert time.monotonic() < deadline, api.job(job["id"])
            time.sleep(0.3)
        seen = api.job(job["id"])
        assert seen["state"] == "queued", seen  # not failed: its only attempt was not used
        assert seen["waiting_reason"].startswith(
            "every online machine said it cannot run this job (no-base: Dockerfile line 1: "
            f"base image {ABSENT} is not on this machine"), seen["waiting_reason"]
        time.sleep(2)  # the machine keeps asking for work, and is not offered it again
        assert [e["kind"] for e in api.job(job["id"])["events"]].count("leased") == 1
        subprocess.run(user.command(["podman", "tag", BASE_IMAGE, ABSENT]), check=True,
                       capture_output=True, timeout=60)
        try:
            platform.start_agent("has-base")
            final = api.wait(job["id"], timeout_s=180, poll_s=0.3)
        finally:
            subprocess.run(user.command(["podman", "rmi", "--ignore", ABSENT]),
                           capture_output=True, timeout=60, check=False)
        assert (final["state"], final["result"]) == ("succeeded", "built on it"), final
