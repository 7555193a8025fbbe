"""The machine is its owner's first: a program the owner listed starting, or `campugrid
provider pause`, hands the running job over with a checkpoint within 10 s, without costing it
an attempt, and the job goes on elsewhere. Real agents (as the provider user), real sandboxes,
a real "game" process.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from campugrid.cli.platform import AgentHandle, Platform, ProviderUser
from campugrid.client import Api, tar_folder
from campugrid.protocol.spec import JobSpec
from tests.acceptance.test_resilience import TRAIN, epochs_by_attempt, holder, platform_with, wait_for

pytestmark = pytest.mark.acceptance
EPOCHS = 14
HANDOVER_S = 10.0  # the promise to owners
GAMES = {"agent-a": "cg-game-a", "agent-b": "cg-game-b"}  # one host: each agent its own game


@pytest.fixture
def owned_agents() -> Iterator[tuple[Platform, Api]]:
    with platform_with({name: ("--protect", game) for name, game in GAMES.items()}) as running:
        yield running


def provider(agent: AgentHandle, *args: str) -> dict:
    """`campugrid provider ... --json` as the machine's owner (the provider user)."""
    out = subprocess.run(ProviderUser.resolve().command(
        [sys.executable, "-m", "campugrid.cli", "provider", *args, "--state-dir",
         str(agent.state_dir), "--json"]), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def drained(api: Api, job: str, attempt: int) -> dict | None:
    return next((e for e in api.job(job)["events"]
                 if e["kind"] == "drained" and e["attempt"] == attempt), None)


def seconds_after(event: dict, t: float) -> float:
    return dt.datetime.fromisoformat(event["at"]).timestamp() - t


def run_log(api: Api, job: str, attempt: int) -> str:
    return "".join(c["text"] for c in api.logs(job)["chunks"]
                   if c["stream"] == "run" and c["attempt"] == attempt)


def test_the_owner_takes_the_machine_back_and_the_job_moves_on(owned_agents, tmp_path):
    p, api = owned_agents
    spec = JobSpec.from_dict({"env": {"EPOCHS": str(EPOCHS), "EPOCH_SECONDS": "1"},
                              "max_attempts": 1})  # hand-overs must not use attempts up
    job = api.submit(tar_folder(TRAIN), spec)["id"]
    wait_for("a first checkpoint", lambda: any(e["kind"] == "checkpoint"
                                               for e in api.job(job)["events"]))
    first = holder(p, api, job)

    # 1. A program the owner listed starts (a game): the job is handed over within 10 s.
    game = tmp_path / GAMES[first.name]
    shutil.copy("/bin/sleep", game)
    started = time.time()
    playing = subprocess.Popen([str(game), "600"])
    try:
        event = wait_for("the hand-over", lambda: drained(api, job, 1), timeout=60)
        assert event["detail"] == f"its owner's program {GAMES[first.name]} started"
        assert seconds_after(event, started) <= HANDOVER_S, event
        stopped_at = int(run_log(api, job, 1).split("asked to stop: checkpoint of epoch ")[1].split()[0])
        assert stopped_at in [c for a, cs in epochs_by_attempt(api, job).items() if a == 1 for c in cs]
        # it goes on elsewhere from that checkpoint; the owner's machine takes nothing meanwhile
        wait_for("the other machine", lambda: api.job(job)["attempt"] == 2
                 and api.job(job)["state"] == "running")
        second = holder(p, api, job)
        assert second.name != first.name
        wait_for("the coordinator to hear that the owner holds it", lambda: {
            m["id"]: m["held"] for m in api.machines()}[first.machine_id()]
            == f"its owner's program {GAMES[first.name]} started", timeout=15)
        wait_for("the second attempt's own checkpoint",
                 lambda: len(epochs_by_attempt(api, job).get(2, [])) >= 2)
        assert f"resuming from the checkpoint of epoch {stopped_at}" in run_log(api, job, 2)

        # 2. The other owner pauses their machine: the command returns once it is handed over.
        paused_at = time.time()
        answer = provider(second, "pause")
        assert answer["changed"] and answer["task"]["job_id"] == job
        assert answer["handed_back"]["how"] == (
            "handed back: its owner paused the machine (campugrid provider pause)")
        assert seconds_after(drained(api, job, 2), paused_at) <= HANDOVER_S
        # the coordinator heard of the hold before the hand-back, not at the agent's next beat
        assert {m["id"]: m["held"] for m in api.machines()}[second.machine_id()] == (
            "its owner paused the machine (campugrid provider pause)")
        assert not provider(second, "pause")["changed"]  # twice: harmless
        state = provider(second, "status")
        assert state["running"] and state["paused_since"] and state["agent"]["task"] is None
        assert state["agent"]["last_jobs"][0]["job_id"] == job
        # both owners hold their machines: the job waits, and says why
        why = wait_for("the waiting reason", lambda: api.job(job)["waiting_reason"])
        assert why.startswith("every approved machine online (2) is held by its owner now"), why
    finally:
        playing.kill()
        playing.wait()

    # 3. The game ends: the first machine takes the job back and finishes it.
    final = api.wait(job, timeout_s=300, poll_s=0.2)
    assert final["state"] == "succeeded", final
    assert final["attempt"] == 3 and final["machine_id"] == first.machine_id()
    by_attempt = epochs_by_attempt(api, job)
    assert sorted(e for es in by_attempt.values() for e in es) == list(range(EPOCHS)), by_attempt
    assert provider(second, "resume")["changed"] and not provider(second, "resume")["changed"]
    assert not provider(second, "status")["paused_since"]
