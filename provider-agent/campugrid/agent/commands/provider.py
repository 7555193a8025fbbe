"""`campugrid provider`: the machine's owner keeps control of the agent that runs on it.

These talk to the agent through its state folder only (a pause file it watches, a status file
it writes, the digest of its metrics token): no port, no root, and each is harmless to run
twice.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from campugrid.agent import owner, status
from campugrid.agent.commands.install import install, prepare, uninstall
from campugrid.agent.install import AGENT_DIR, AgentConfig, default_config
from campugrid.protocol.errors import CampugridError

PAUSE_WAIT_S = 15.0  # the agent hands its job back within 10 s of a pause

provider_app = typer.Typer(no_args_is_help=True,
                           help="Lend this machine and control its agent (as its owner).")
provider_app.command("install")(install)
provider_app.command("uninstall")(uninstall)
provider_app.command("prepare")(prepare)

StateDir = Annotated[Path | None, typer.Option(
    help="The agent's state folder (default: the one `provider install` configured).")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON, for scripts.")]


def _state_dir(given: Path | None) -> Path:
    """The folder given, else the one in the configuration `provider install` wrote, else
    the default one."""
    if given is not None:
        return given
    config = default_config()
    if config.is_file():
        try:
            return AgentConfig.load(config).state_dir
        except CampugridError as e:
            typer.secho(f"error: {e}; say which agent with --state-dir", fg="red", err=True)
            raise typer.Exit(2) from e
    return AGENT_DIR


def _emit(as_json: bool, data: dict[str, Any], text: str) -> None:
    typer.echo(json.dumps(data, indent=1) if as_json else text)


@provider_app.command("status")
def provider_status(state_dir: StateDir = None, as_json: Json = False) -> None:
    """What the agent runs now, what this machine enforces, and the last jobs."""
    state_dir = _state_dir(state_dir)
    state = status.read(state_dir)
    paused = owner.paused_since(state_dir)
    if state is None:
        _emit(as_json, {"running": False, "paused_since": paused, "agent": None},
              f"no agent has run from {state_dir} (start one: campugrid agent run)"
              + (f"\npaused since {paused}" if paused else ""))
        return
    data = {"running": state["running"], "paused_since": paused, "agent": state}
    lines = [f"agent     {state.get('name', '?')} ({state.get('machine_id') or 'not registered'}), "
             + (f"running (pid {state['pid']})" if state["running"] else
                f"not running (last seen {state.get('updated_at', '?')})"),
             f"joined    {state.get('coordinator', '?')}  key {state.get('fingerprint', '?')}"]
    if paused:
        lines.append(f"paused    since {paused} (campugrid provider resume)")
    elif state.get("held") and state["running"]:
        lines.append(f"held      {state['held']}")
    task = state.get("task") if state["running"] else None
    lines.append(f"running   job {task['job_id']} attempt {task['attempt']} since {task['since']}"
                 if task else "running   no job")
    if state.get("hours"):
        lines.append(f"hours     {state['hours']} (local time)")
    if state.get("programs"):
        lines.append(f"programs  {', '.join(state['programs'])} take the machine back")
    limits = state.get("limits") or {}
    lines.append("limits    " + "\n          ".join(f"{k}: {v}" for k, v in sorted(limits.items())))
    for job in state.get("last_jobs") or []:
        lines.append(f"ended     job {job.get('job_id')} attempt {job.get('attempt')} at "
                     f"{job.get('ended_at')}: {job.get('how')}")
    _emit(as_json, data, "\n".join(lines))


@provider_app.command("pause")
def provider_pause(state_dir: StateDir = None, as_json: Json = False,
                   wait: Annotated[float, typer.Option(
                       help="Seconds to wait for the running job to be handed back.")] = PAUSE_WAIT_S,
                   ) -> None:
    """Take the machine back now: the running job is handed back after a final checkpoint
    (it resumes elsewhere, without losing an attempt) and no work is taken until `resume`."""
    state_dir = _state_dir(state_dir)
    newly = owner.pause(state_dir, by="campugrid provider pause")
    since = owner.paused_since(state_dir)
    state = status.read(state_dir)
    task = state.get("task") if state and state["running"] else None
    handed_back: dict[str, Any] | None = None
    if task:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            now = status.read(state_dir)
            if now is None or not now["running"] or not now.get("task"):
                ended = [j for j in (now or {}).get("last_jobs") or []
                         if j.get("job_id") == task["job_id"]]
                handed_back = ended[0] if ended else {**task, "how": "ended"}
                break
            time.sleep(0.2)
    text = [f"paused since {since}" if newly else f"already paused since {since}; nothing changed",
            "The agent takes no work until: campugrid provider resume"]
    if state is None or not state["running"]:
        text.append("(no agent runs from this folder now; it will start paused)")
    elif task and handed_back:
        text.append(f"job {task['job_id']} attempt {task['attempt']}: {handed_back.get('how')}")
    elif task:
        text.append(f"job {task['job_id']} is still being handed back after {wait:.0f} s "
                    "(campugrid provider status shows when it is)")
    _emit(as_json, {"paused": True, "changed": newly, "since": since, "task": task,
                    "handed_back": handed_back}, "\n".join(text))


@provider_app.command("resume")
def provider_resume(state_dir: StateDir = None, as_json: Json = False) -> None:
    """Let the agent take work again."""
    state_dir = _state_dir(state_dir)
    changed = owner.resume(state_dir)
    _emit(as_json, {"paused": False, "changed": changed},
          "resumed: the agent takes work again (within its hours)" if changed
          else "not paused; nothing changed")


@provider_app.command("metrics-token")
def provider_metrics_token(state_dir: StateDir = None, as_json: Json = False) -> None:
    """Print a new token for the agent's /metrics (on 127.0.0.1 only), once: the one before
    stops working now. Only its SHA-256 is kept, in the state folder."""
    state_dir = _state_dir(state_dir)
    from campugrid.agent import metrics

    token = metrics.mint_token(state_dir)
    _emit(as_json, {"token": token, "digest_file": str(state_dir / metrics.TOKEN_FILE)}, token)
