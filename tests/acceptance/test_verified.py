"""Results checked by agreement, for real: three agents (the provider user's, real Podman,
runsc and Buildah), one of them dishonest (tests/support/liar.py: it changes a byte of every
/output it uploads and every shard result it reports, and the image it pushes for the others
says 43 where its build says 42). Its word is taken for an unverified job, and an honest
machine runs its forged image for another. A verified job ends with the honest answer, the
liar is quarantined with the evidence, gets no more work, and both earlier jobs are marked
tainted; `rerun` runs one again, from an honest build. Reinstated, it lies about shards: an
adaptive sweep ends with every shard's honest result, and it is quarantined again. A liar that
poisons checkpoints is caught by their checks, and the training job it ran resumes elsewhere
from the last checked one."""

from __future__ import annotations

import io
import json
import re
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from campugrid.cli.platform import Platform
from campugrid.client import Api, tar_folder
from campugrid.protocol.spec import JobSpec
from tests.acceptance.test_resilience import platform_with, wait_for
from tests.support.console import CLI, browser_page, signed_in_admin

pytestmark = pytest.mark.acceptance
LIAR = Path(__file__).resolve().parents[1] / "support" / "liar.py"
TRAIN = Path(__file__).resolve().parents[2] / "examples" / "train"
# The answer is in the image (/answer.txt) and in the output file: a liar that changes /output
# but reports the honest result line is caught only by the coordinator's own reading of the
# archives; one that pushes a forged image changes what other machines answer.
COMMAND = ["sh", "-c", "mkdir -p /output/model && cp /answer.txt /output/model/answer.txt && "
                       "cat /answer.txt"]


@pytest.fixture
def grid(tmp_path: Path) -> Iterator[tuple[Platform, Api, Path]]:
    """A platform of its own, with no agent yet (each test starts its own), and a job's
    context (the base image alone)."""
    context = tmp_path / "job"
    context.mkdir()
    (context / "answer.txt").write_text("42\n")
    (context / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\n"
                                        "COPY answer.txt /answer.txt\n")
    # Leases of 10 s, not the other platforms' 4 s (whose renewals time out after 1 s): none
    # of these tests waits for a lease to run out (a caught liar's leases are ended), and a
    # liar that loses its one task (--once) to a slow renewal while the other test worker
    # loads the host left its job queued with no machine to run it (a red full run).
    with platform_with({}, lease_seconds=10.0) as (p, api):
        yield p, api, context


def answer_in(api: Api, job_id: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(api.output(job_id)), mode="r:gz") as tar:
        f = tar.extractfile("model/answer.txt")
        assert f is not None
        return f.read()


def log_of(api: Api, job_id: str) -> str:
    """The platform's lines of a job's log (where its image came from, what was pushed)."""
    text = "".join(c["text"] for c in api.logs(job_id)["chunks"])
    events = "\n".join(f"{e['kind']}: {e['detail']}" for e in api.job(job_id)["events"])
    return "\n".join([*(line for line in text.splitlines() if "[campugrid]" in line), events])


def ended(p: Platform, api: Api, job_id: str, timeout_s: float = 240) -> dict[str, Any]:
    """The job once it has ended; if it has not within `timeout_s` (less than the test's own
    limit, so that this is what fails), what happened to it so far, and the agents' last
    lines (their logs go with the platform's folder)."""
    try:
        return api.wait(job_id, timeout_s=timeout_s, poll_s=0.3)
    except TimeoutError as e:
        tails = [f"--- {log.name} ---\n" + "\n".join(log.read_text().splitlines()[-25:])
                 for log in sorted((p.state_dir / "agents").glob("*.log"))]
        raise AssertionError("\n".join([str(e), log_of(api, job_id), *tails])) from None


def test_a_liar_is_outvoted_quarantined_and_its_earlier_result_tainted(grid, request):
    p, api, context = grid
    # Before anyone checks it, the liar runs an unverified job: its word is taken. A second
    # job of the same image, queued already, makes it push its build for the others ("first"
    # reuse); as it takes one task (--once), an honest machine runs that one, from the image
    # the liar pushed.
    packed = tar_folder(context)  # the same bytes: the same context, whose image is shared
    plain = api.submit(packed, JobSpec(command=COMMAND))["id"]
    twin = api.submit(packed, JobSpec(command=COMMAND))["id"]
    lies = (str(LIAR), "--lie", "output,shards,image")
    liar = p.start_agent("liar", program=lies, args=("--once",))
    plain_final = ended(p, api, plain)
    assert plain_final["machine_id"] == liar.machine_id() and plain_final["result"] == "42"
    assert answer_in(api, plain) != b"42\n" and not plain_final.get("tainted")
    assert liar.proc.wait(timeout=60) == 0
    honest_a = p.start_agent("honest-a")
    twin_final = ended(p, api, twin)
    shown = f"\nthe liar's log:\n{log_of(api, plain)}\nhonest-a's log:\n{log_of(api, twin)}"
    assert twin_final["machine_id"] == honest_a.machine_id(), shown
    assert twin_final["result"] == "43" and not twin_final.get("tainted"), shown  # the forgery
    assert any(e["kind"] == "image" and f"built by machine {liar.machine_id()}" in e["detail"]
               for e in twin_final["events"]), twin_final["events"]

    liar = p.start_agent("liar", program=lies)
    spec = JobSpec.from_dict({"command": COMMAND, "verify": {"replicas": 2}})
    job = api.submit(tar_folder(context), spec)["id"]
    # The liar and honest-a take the two replicas; they disagree, and honest-b breaks the tie.
    wait_for("the liar to hold a replica", lambda: any(
        r["machine_id"] == liar.machine_id() for r in api.job(job)["replicas"]))
    p.start_agent("honest-b")
    final = ended(p, api, job)
    assert final["state"] == "succeeded" and final["result"] == "42"
    assert answer_in(api, job) == b"42\n"  # the output served is the quorum's
    by_machine = {r["machine_id"]: r for r in final["replicas"]}
    assert len(by_machine) == 3 and by_machine[liar.machine_id()]["agreed"] is False
    assert by_machine[liar.machine_id()]["result"] == "42"  # same line, other bytes
    assert sorted(r["agreed"] for r in final["replicas"]) == [False, True, True]
    # A verified job's image is one two machines built alike: never the liar's forgery.
    assert not any(e["kind"] == "image" and "pulls" in e["detail"]
                   and liar.machine_id() in e["detail"] for e in final["events"])

    record = next(m for m in api.machines() if m["id"] == liar.machine_id())
    assert record["status"] == "quarantined" and job in record["quarantine"]
    assert record["disagreed"] == 1
    tainted = api.job(plain)
    assert tainted["tainted"] and "quarantined" in tainted["tainted"]
    ran_forged = api.job(twin)["tainted"]
    assert ran_forged and "it ran an image built by" in ran_forged, ran_forged

    # Its remedy: run it again; the quarantined liar gets none of it.
    # Its build is withdrawn: the rerun pulls an honest machine's (or builds), never the forgery.
    again = ended(p, api, api.rerun(twin)["id"])
    assert again["machine_id"] != liar.machine_id() and again["result"] == "42"
    assert answer_in(api, again["id"]) == b"42\n"
    assert liar.proc.poll() is None  # still running, asking in vain

    # What the people see: the replicas and who disagreed, the taint, the quarantine.
    shown = subprocess.run([*CLI, "status", job], capture_output=True, text=True, timeout=60,
                           env=p.cli_env(), check=True).stdout
    assert "verified: 3 replicas" in shown, shown
    assert sorted(line.split()[-1] for line in shown.splitlines()
                  if line.startswith("replica ")) == ["DISAGREED", "agreed", "agreed"], shown
    with browser_page(request) as page:
        from playwright.sync_api import expect

        signed_in_admin(page, p.cli_env())
        page.goto(f"{p.url}/console/jobs/{job}")
        expect(page.locator("#replicas tr.replica")).to_have_count(3)
        expect(page.locator("#replicas tr.replica.disagreed")).to_contain_text("liar")
        page.goto(f"{p.url}/console/jobs/{plain}")
        expect(page.locator("#job-tainted")).to_contain_text("quarantined")
        page.goto(f"{p.url}/console/machines")
        row = page.locator("tr.machine", has_text="liar")
        expect(row).to_have_class(re.compile("quarantined"))
        expect(row.locator(".quarantine")).to_contain_text(job)
        expect(row.locator("button:has-text('Reinstate')")).to_be_visible()

    # Reinstated (as new: no trust), it lies about shards: an adaptive sweep checks every
    # answer of an untrusted machine, and ends with every shard's honest result.
    api.approve_machine(liar.machine_id())
    sweep = api.submit(tar_folder(context), JobSpec.from_dict({
        "command": ["sh", "-c", 'echo $(( $(echo "$CAMPUGRID_SHARD_PAYLOAD" | tr -dc 0-9) * 2 ))'],
        "verify": "adaptive", "shards": [{"payload": i} for i in range(6)]}))["id"]
    done = ended(p, api, sweep)
    shards = list(api.shards(sweep))
    assert [s["result"] for s in shards] == [i * 2 for i in range(6)], shards
    assert all(len(s["copies"]) >= 2 for s in shards)  # no machine had earned trust
    assert any(agreed is False for s in shards for _, _, agreed in s["copies"])
    again = next(m for m in api.machines() if m["id"] == liar.machine_id())
    assert again["status"] == "quarantined" and f"of job {sweep}" in again["quarantine"], again
    assert done["state"] == "succeeded"


def test_a_poisoned_checkpoint_is_caught_and_the_job_resumes_from_a_checked_one(grid, request):
    p, api, _ = grid
    liar = p.start_agent("liar", program=(str(LIAR), "--lie", "checkpoints"))
    # Every checkpoint is recomputed on another machine from the one before. Long enough that
    # the liar is caught before it could finish (it lies from epoch 1 on): with 20 epochs, a
    # loaded host once started the honest machines' checks so late that it finished first.
    job = api.submit(tar_folder(TRAIN), JobSpec.from_dict({
        "env": {"EPOCHS": "30", "EPOCH_SECONDS": "1.5"}, "verify": {"checkpoints": 1}}))["id"]
    wait_for("the liar to take the job", lambda: api.job(job)["machine_id"] == liar.machine_id())
    for name in ("honest-a", "honest-b"):
        p.start_agent(name)
    final = ended(p, api, job)
    assert final["state"] == "succeeded", final
    assert json.loads(final["result"])["epochs"] == 30
    assert final["machine_id"] != liar.machine_id()

    record = next(m for m in api.machines() if m["id"] == liar.machine_id())
    # Caught on whichever of its lies a check finished first (the checks of epochs 1 and 2
    # may run at once on the two honest machines).
    assert record["status"] == "quarantined", record
    assert re.search(rf"epoch [1-9][0-9]* of job {job}", record["quarantine"]), record
    kinds = [e["kind"] for e in final["events"]]
    assert "rejected" in kinds and "checked" in kinds
    # It went back to epoch 0, the checkpoint a check agreed with, and never past a lie.
    said = [(e["kind"], e["detail"]) for e in final["events"]]
    assert any(k == "checked" and d.startswith("checkpoint of epoch 0 ") for k, d in said), said
    assert any(k == "rejected" and re.match(r"checkpoint of epoch [1-9][0-9]* ", d)
               and liar.machine_id()[:8] in d for k, d in said), said
    resumed = [c for c in final["checkpoints"] if c["machine_id"] != liar.machine_id()]
    assert resumed and all(c["resumed_from"] == 0 for c in resumed), resumed
    assert all(c["verdict"] in ("rejected", "untrusted") for c in final["checkpoints"]
               if c["machine_id"] == liar.machine_id() and c["epoch"] >= 1)
    logs = "".join(chunk["text"] for chunk in api.logs(job)["chunks"])
    assert "resumed from the checkpoint of epoch 0" in logs

    shown = subprocess.run([*CLI, "status", job], capture_output=True, text=True, timeout=60,
                           env=p.cli_env(), check=True).stdout
    assert "checked: agreed" in shown and "lost its check" in shown, shown
    with browser_page(request) as page:
        from playwright.sync_api import expect

        signed_in_admin(page, p.cli_env())
        page.goto(f"{p.url}/console/jobs/{job}")
        expect(page.locator("#checkpoints tr.ckpt.agreed").first).to_contain_text("agreed")


COMPARE = '''import sys, tarfile
def answer(path):
    with tarfile.open(path) as tar:
        return tar.extractfile("answer.txt").read()
sys.exit(0 if answer("/data/a/output.tar.gz") == answer("/data/b/output.tar.gz") else 1)
'''


def test_a_jobs_own_compare_command_accepts_outputs_that_differ_only_where_it_allows(grid):
    """Honest runs that differ bit for bit (a timestamp in /output): equality would fail them;
    the job's compare command, run in a sandbox on two other machines, says they agree."""
    p, api, context = grid
    (context / "cmp.py").write_text(COMPARE)
    (context / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\n"
                                        "COPY cmp.py /cmp.py\n")
    for name in ("a", "b", "judge-1", "judge-2"):  # "alike" takes two judges' word
        p.start_agent(name)
    job = api.submit(tar_folder(context), JobSpec.from_dict({
        "command": ["sh", "-c", "mkdir -p /output && echo 42 > /output/answer.txt && "
                                "date +%s%N > /output/when.txt && echo 42"],
        "verify": {"replicas": 2, "compare": ["python3", "/cmp.py"]}}))["id"]
    final = ended(p, api, job)
    assert final["state"] == "succeeded" and final["result"] == "42", final
    with tarfile.open(fileobj=io.BytesIO(api.output(job)), mode="r:gz") as tar:
        assert (tar.extractfile("answer.txt") or io.BytesIO()).read() == b"42\n"
    replicas = final["replicas"]
    assert len(replicas) == 2 and all(r["agreed"] for r in replicas), replicas
    assert replicas[0]["output_digest"] != replicas[1]["output_digest"]
    compared = [e for e in final["events"] if e["kind"] == "compare"]
    assert len(compared) == 2, final["events"]  # one pair, two judges
