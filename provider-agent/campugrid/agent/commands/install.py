"""`campugrid provider install | uninstall | prepare`: a provider goes from `pip install` to a
machine waiting for approval with one command, and back to nothing with another.

`install` runs as the machine's owner, never as root. What only root can do (packages,
subordinate ids, cgroup delegation, lingering) is printed as one script and runs only with the
owner's consent (`--yes` or a prompt), through sudo; or an admin runs `prepare --user NAME` as
root. Every command here is harmless to run twice.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Annotated

import typer

from campugrid.agent import prereqs
from campugrid.agent.install import (
    AGENT_DIR,
    UNIT_NAME,
    AgentConfig,
    default_config,
    has_user_systemd,
    remove_state,
    scope_of,
    stop_agent,
    systemctl,
    unit_path,
    unit_text,
)
from campugrid.cli.output import Json, emit
from campugrid.protocol.errors import CampugridError

Yes = Annotated[bool, typer.Option("--yes", "-y", help="Run the root step without asking.")]


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2)


def _say(as_json: bool, text: str) -> None:
    if not as_json:
        typer.echo(text, err=True)


def _run_root_step(script: str, user: str, yes: bool, as_json: bool) -> bool:
    """Run the root step with the owner's consent; False if it was not run."""
    _say(as_json, "These need root, once (read them first):\n\n" + script)
    if not yes:
        if as_json or not sys.stdin.isatty():
            return False
        if not typer.confirm("Run them now with sudo?", default=False, err=True):
            return False
    argv = ["sh", "-c", script] if os.geteuid() == 0 else ["sudo", "sh", "-c", script]
    if argv[0] == "sudo" and shutil.which("sudo") is None:
        _fail(f"there is no sudo here: as root, run `campugrid provider prepare --user {user} "
              "--yes` (the same steps), then this command again")
    done = subprocess.run(argv, check=False)
    if done.returncode != 0:
        _fail(f"the root step failed (exit status {done.returncode}); nothing else was changed")
    return True


def install(
    join: Annotated[str, typer.Option(help="The coordinator's gRPC address (HOST:PORT), as "
                                           "its operator gave it.")],
    pin: Annotated[str, typer.Option(help="The coordinator certificate's fingerprint "
                                          "(SHA256:...), as its operator gave it.")],
    name: Annotated[str | None, typer.Option(help="This machine's name.")] = None,
    share: Annotated[list[str] | None, typer.Option(
        "--share", help="NAME=/folder jobs may read (read-only). Repeatable.")] = None,
    gpus: Annotated[str, typer.Option(help="GPUs to lend: all, or indexes/UUIDs, "
                                           "comma-separated.")] = "all",
    keep_free_mb: Annotated[int, typer.Option(help="GPU memory always left for you, per GPU.")] = 0,
    protect: Annotated[list[str] | None, typer.Option(
        help="A program that takes the machine back while it runs (steam, blender). "
             "Repeatable.")] = None,
    hours: Annotated[str, typer.Option(help="When work is taken, local time: HH:MM-HH:MM, "
                                            "comma-separated; default any time.")] = "",
    state_dir: Annotated[Path, typer.Option(help="The agent's key, membership and work.")] = AGENT_DIR,
    config: Annotated[Path | None, typer.Option(help="Where to write the configuration "
                                                     "(default ~/.config/campugrid/agent.toml).")] = None,
    start: Annotated[bool, typer.Option(help="Start the agent (systemd user unit).")] = True,
    yes: Yes = False,
    as_json: Json = False,
) -> None:
    """Check this machine, set up what is missing (root only with your consent), write the
    agent's configuration, join the coordinator and start the agent; prints the fingerprint
    the coordinator's operator compares before approving this machine."""
    import grpc

    from campugrid.agent import shares as shared
    from campugrid.agent.client import CoordinatorClient, Membership
    from campugrid.agent.owner import Hours

    if os.geteuid() == 0:
        _fail("install as the user who owns this machine, not as root: the agent never runs as "
              "root (the one root step runs through sudo, or as `campugrid provider prepare "
              "--user NAME`)")
    config = config or default_config()
    host = prereqs.Host.this_user()
    checks = prereqs.check_all(host, state_dir)
    _say(as_json, "\n".join(c.line for c in checks))
    try:
        script = prereqs.root_step(host.user, checks)
    except ValueError as e:
        _fail(f"{e}; do the root step by hand: {'; '.join(c.fix for c in checks if c.root and not c.ok)}")
    if script and _run_root_step(script, host.user, yes, as_json):
        checks = prereqs.check_all(host, state_dir)
        _say(as_json, "\nafter the root step:\n" + "\n".join(c.line for c in checks))
    missing = [c for c in checks if not c.ok and c.blocking]
    if missing:
        _fail("this machine cannot run jobs yet: " + "; ".join(
            f"{c.name}: {c.found} (fix: {c.fix})" for c in missing))
    try:
        listed = shared.parse(share or [])
        if hours:
            Hours.parse(hours)
        cfg = AgentConfig(state_dir=state_dir.expanduser().resolve(),
                          name=name or socket.gethostname(),
                          shares={k: str(v) for k, v in listed.items()},
                          gpus=None if gpus == "all" else tuple(g.strip() for g in gpus.split(",")),
                          keep_free_mb=keep_free_mb, protect=tuple(protect or ()), hours=hours)
        membership = Membership.join(cfg.state_dir, join, pin)
        client = CoordinatorClient(membership)
        reply = client.register(cfg.name)
        client.close()
        cfg.write(config)  # once the coordinator has the machine: a failed join leaves none
    except CampugridError as e:
        _fail(str(e))
    except grpc.RpcError as e:
        _fail(f"the coordinator refused the registration: {e.details()} ({e.code().name})")
    unit = unit_path()
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(unit_text(config))
    foreground = f"  {sys.executable} -m campugrid.cli agent run --config {config}"
    running = start and has_user_systemd()
    if running:
        for args in (("daemon-reload",), ("enable", "--now", UNIT_NAME)):
            code, text = systemctl(*args)
            if code != 0:
                _fail(f"systemctl --user {' '.join(args)}: {text}")
        started = f"started: systemctl --user status {UNIT_NAME.removesuffix('.service')}"
    elif start:
        started = f"no systemd user session here: run the agent in the foreground with\n{foreground}"
    else:
        started = (f"not started (--no-start): systemctl --user enable --now {UNIT_NAME}, or in "
                   f"the foreground:\n{foreground}")
    emit(as_json, {"machine_id": reply.machine_id, "fingerprint": reply.fingerprint,
                   "status": reply.status, "config": str(config), "unit": str(unit),
                   "state_dir": str(cfg.state_dir), "started": running},
         f"configuration  {config}\nunit           {unit}\n{started}\n\n"
         f"machine        {reply.machine_id}\nfingerprint    {reply.fingerprint}\n"
         f"status         {reply.status}\n"
         + ("Ask the coordinator's operator to compare this fingerprint and approve the "
            f"machine (campugrid machines approve {reply.machine_id}, or the console's "
            "Machines page)." if reply.status == "pending" else ""))


def uninstall(
    state_dir: Annotated[Path | None, typer.Option(
        help="The agent's key, membership and work (default: the configuration's).")] = None,
    config: Annotated[Path | None, typer.Option(help="Its configuration file.")] = None,
    as_json: Json = False,
) -> None:
    """Stop the agent and remove everything install added: the unit, the configuration, the
    machine's key and membership, its containers, images and cgroups. The root step's changes
    stay; `provider prepare --undo` (as root) removes them."""
    from campugrid.agent.client import Membership
    from campugrid.agent.task import job_image_prefix
    from campugrid.sandbox import limits as host_limits
    from campugrid.sandbox.podman_runsc import PodmanRunsc

    config = config or default_config()
    if state_dir is None:
        try:
            found = AgentConfig.load(config).state_dir if config.exists() else Path()
        except CampugridError as e:
            _fail(f"{e}; say which agent to remove with --state-dir")
        state_dir = found if found != Path() else AGENT_DIR
    removed: list[str] = []
    unit = unit_path()
    if has_user_systemd() and unit.exists():
        systemctl("disable", "--now", UNIT_NAME)
    if stop_agent(state_dir):
        removed.append("the running agent")
    membership = Membership.load(state_dir) if state_dir.exists() else None
    if state_dir.exists():
        scope = scope_of(state_dir)
        sandbox = PodmanRunsc(scope=scope)
        if membership is not None and membership.machine_id:
            removed += [f"container {c}" for c in sandbox.sweep(membership.machine_id)]
        removed += [f"image {i}" for i in sandbox.sweep_images(job_image_prefix(scope))]
        removed += [f"cgroup {g}" for g in host_limits.sweep(sandbox.limits, scope)]
        remove_state(state_dir)
        removed.append(str(state_dir))
    for path in (unit, config):
        if path.exists():
            path.unlink()
            removed.append(str(path))
    if has_user_systemd():
        systemctl("daemon-reload")
    for folder in (config.parent, unit.parent):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    user = prereqs.Host.this_user().user
    # The machine's key is gone, so it can never call again; the coordinator still lists it
    # until its operator revokes it (a pending or approved machine that is simply silent).
    operator = (f"\nThe coordinator at {membership.coordinator} still lists machine "
                f"{membership.machine_id} until its operator revokes it: `campugrid machines "
                f"revoke {membership.machine_id[:8]}` (its jobs are queued again at once; "
                "without that, when its lease runs out)."
                if membership is not None and membership.machine_id else "")
    emit(as_json, {"removed": removed, "machine_id": membership.machine_id if membership else None,
                   "coordinator": membership.coordinator if membership else None},
         ("removed " + "\n        ".join(removed) if removed else "nothing to remove: not "
          "installed") + operator + f"\nThe root step's changes stay; as root, `campugrid "
         f"provider prepare --user {user} --undo` removes its cgroups and lingering.")


def prepare(
    user: Annotated[str, typer.Option(help="The user who will run the agent.")],
    undo: Annotated[bool, typer.Option(help="Remove what it added (cgroups, lingering).")] = False,
    yes: Yes = False,
    as_json: Json = False,
) -> None:
    """(As root.) The one-time root step for USER: packages, subordinate ids, cgroup
    delegation, lingering; printed first, run with --yes or after a prompt."""
    if os.geteuid() != 0:
        _fail("this is the root step: run it as root (sudo campugrid provider prepare --user "
              f"{user})")
    try:
        host = prereqs.Host.of(prereqs.check_user(user))
    except ValueError as e:
        _fail(str(e))
    except KeyError:
        _fail(f"no user {user!r} on this machine (make one first: useradd --create-home {user})")
    if undo:
        script = prereqs.undo_root_step(user)
    else:
        checks = [prereqs.podman(host), prereqs.runsc(host),
                  prereqs.subids(host, host.subuid, "subuid"),
                  prereqs.subids(host, host.subgid, "subgid"), prereqs.cgroups(host),
                  prereqs.lingering(host)]
        _say(as_json, "\n".join(c.line for c in checks))
        script = prereqs.root_step(user, checks)
    if not script:
        emit(as_json, {"ran": False, "script": ""}, "nothing to do: the root step is done")
        return
    ran = _run_root_step(script, user, yes, as_json)
    emit(as_json, {"ran": ran, "script": script},
         "done" if ran else "not run: run it yourself, or again with --yes")
