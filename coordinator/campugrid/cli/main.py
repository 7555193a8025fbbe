"""campugrid: submit and watch jobs, run the coordinator or an agent, or bring it all up."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from campugrid.cli import specfile
from campugrid.cli.follow import follow as follow_job
from campugrid.cli.follow import log_text
from campugrid.cli.metrics import metrics_app
from campugrid.cli.output import (
    Json,
    LogFormat,
    Transfers,
    emit,
    emit_array,
    emit_line,
    fail,
    interactive,
    log_as,
)
from campugrid.cli.show import job_text, machine_line
from campugrid.cli.users import users_app
from campugrid.protocol.errors import CampugridError, InvalidInput
from campugrid.protocol.spec import JobSpec

# Completion: `campugrid --install-completion` (bash, zsh, fish, PowerShell).
app = typer.Typer(no_args_is_help=True, add_completion=True, help=__doc__)
coordinator_app = typer.Typer(no_args_is_help=True, help="Run the coordinator.")
apps_app = typer.Typer(invoke_without_command=True,
                       help="The apps that may submit jobs (admins only); lists them.")
machines_app = typer.Typer(invoke_without_command=True,
                           help="The provider machines (admins only); lists them.")
app.add_typer(coordinator_app, name="coordinator")
app.add_typer(apps_app, name="apps")
app.add_typer(machines_app, name="machines")
app.add_typer(users_app, name="users")
app.add_typer(metrics_app, name="metrics")
# The agent's own commands (`agent run | join`, `provider ...`) live with the agent
# (provider-agent/campugrid/agent/commands) and are mounted by name, from the entry points the
# package declares: nothing of the agent is imported here.
for _command in importlib.metadata.entry_points(group="campugrid.commands"):
    app.add_typer(_command.load(), name=_command.name)
if not importlib.metadata.entry_points(group="campugrid.commands", name="agent"):
    @app.command("agent", hidden=True, context_settings={"allow_extra_args": True,
                                                          "ignore_unknown_options": True})
    def _no_agent() -> None:
        """The agent's commands are not installed here."""
        fail("the agent's commands (`campugrid agent`, `campugrid provider`) come with the "
             "package's metadata: install it (`pip install 'campugrid[agent]'`, or `pip "
             "install -e .` in a checkout) rather than run it from a source folder")

Server = Annotated[str | None, typer.Option(
    "--server", envvar="CAMPUGRID_SERVER",
    help="The coordinator's REST address (default: the one your identity is for).")]
DEFAULT_SERVER = None



def _api(server: str | None) -> Any:
    """The REST API as this user's app (its identity: ~/.config/campugrid/identity.json or
    $CAMPUGRID_IDENTITY), signing every request."""
    from campugrid.client import Api

    return Api.from_identity(server=server)


def _print_job(job: dict[str, Any]) -> None:
    typer.echo(job_text(job))


def _finish(job: dict[str, Any], as_json: bool) -> NoReturn:
    """After following a job: print it, and exit 0 if it succeeded, else 1."""
    emit_line(as_json, {"event": "final", "job": job}, job_text(job))
    raise typer.Exit(0 if job["state"] == "succeeded" else 1)


@app.command()
def submit(
    folder: Annotated[Path, typer.Argument(help="Folder with a Dockerfile (the build context).")],
    spec_file: Annotated[Path | None, typer.Option(
        "--spec", help="Job spec file: YAML (.yaml, .yml) or JSON.")] = None,
    command: Annotated[str | None, typer.Option(help="Command to run instead of the image's CMD.")] = None,
    client_id: Annotated[str | None, typer.Option(help="Your own id: resubmitting it is safe.")] = None,
    name: Annotated[str | None, typer.Option(help="The job's name (default: the folder's).")] = None,
    cpus: Annotated[float | None, typer.Option(help="CPUs (resources.cpus).")] = None,
    memory: Annotated[str | None, typer.Option(
        help="Memory: MB, or with a unit (512M, 4G) (resources.memory_mb).")] = None,
    gpus: Annotated[int | None, typer.Option(help="GPUs (resources.gpus).")] = None,
    gpu_memory: Annotated[str | None, typer.Option(
        help="Memory per GPU: MB, or with a unit (24G) (resources.gpu_memory_mb).")] = None,
    env: Annotated[list[str] | None, typer.Option(
        "--env", "-e", help="NAME=VALUE in the job's environment. Repeatable.")] = None,
    dockerfile: Annotated[Path | None, typer.Option(
        "--file", "-f", help="A Dockerfile of another name or place (default: FOLDER/Dockerfile).")] = None,
    upload: Annotated[list[str] | None, typer.Option(
        "--upload", help="[NAME=]FILE: send a file that exists nowhere else (mounted at "
                         "/data/NAME/; NAME defaults to the file's name). Repeatable.")] = None,
    wait: Annotated[bool, typer.Option("--wait", "--follow", help="Follow logs until done.")] = False,
    server: Server = DEFAULT_SERVER,
    as_json: Json = False,
) -> None:
    """Submit a job: build FOLDER's Dockerfile on a provider and run it in gVisor.

    Prints the job's id (--json: the job; with --wait, JSON Lines of states and logs, then the job)."""
    from campugrid.client import pack_folder

    try:
        if spec_file is None:  # the folder's own spec, if it has one
            spec_file = next((folder / n for n in specfile.SPEC_NAMES if (folder / n).is_file()), None)
            if spec_file is not None and not as_json:
                typer.echo(f"spec: {spec_file}", err=True)
        raw = specfile.load(spec_file) if spec_file else {}
        raw.update(specfile.given(command=command, client_job_id=client_id, name=name))
        if not raw.get("name"):
            raw["name"] = folder.resolve().name[:200]
        sizes = specfile.given(
            cpus=cpus, gpus=gpus,
            memory_mb=specfile.megabytes(memory, "--memory") if memory else None,
            gpu_memory_mb=specfile.megabytes(gpu_memory, "--gpu-memory") if gpu_memory else None)
        if sizes:
            raw["resources"] = {**(raw.get("resources") or {}), **sizes}
        for item in env or []:
            key, sep, value = item.partition("=")
            if not sep:
                raise InvalidInput(f"--env {item}: give NAME=VALUE")
            raw["env"] = {**(raw.get("env") or {}), key: value}
        JobSpec.from_dict(raw)  # refused here, before any upload, if it is wrong
        api = _api(server)
        with Transfers(interactive(as_json)) as bars:
            for item in upload or []:
                name, sep, path = item.partition("=")
                file = Path(path if sep else item)
                if not sep:
                    name = "".join(c if c.isalnum() or c in "._-" else "-"
                                   for c in file.name.lower())[:64]
                ticket = api.upload(file, progress=bars.bar(f"file {name}"))
                raw.setdefault("datasets", []).append({"name": name, "ticket": ticket})
            spec = JobSpec.from_dict(raw)
            # The context goes through a temporary file, never memory, however big it is.
            with tempfile.TemporaryFile(prefix="campugrid-context-") as context:
                pack_folder(folder, context, bars.bar("packing"), limit=api.max_context_bytes(),
                            dockerfile=dockerfile)
                context.seek(0)
                job = api.submit(context, spec, progress=bars.bar("uploading"))
        if not wait:
            emit(as_json, job, job["id"])
            return
        emit_line(as_json, {"event": "submitted", "job": job}, job["id"])
        try:
            job = follow_job(api, job["id"], as_json)
        except KeyboardInterrupt:
            short = job["id"][:8]
            typer.echo(f"\nstopped following job {short}; it goes on. Follow it again with "
                       f"`campugrid logs {short} --follow`, or stop it with "
                       f"`campugrid cancel {short}`", err=True)
            raise typer.Exit(130) from None
    except (CampugridError, OSError, ValueError) as e:  # ValueError: UTF-8
        fail(str(e))
    _finish(job, as_json)


@app.command()
def status(job_id: str, server: Server = DEFAULT_SERVER, as_json: Json = False) -> None:
    """Show a job's state, reason, result and history."""
    try:
        job = _api(server).job(job_id)
    except CampugridError as e:
        fail(str(e))
    emit(as_json, job, job_text(job))


@app.command()
def logs(job_id: str, follow: Annotated[bool, typer.Option(
             "--follow", "-f", help="Until the job ends (--json: JSON Lines, then the job).")] = False,
         server: Server = DEFAULT_SERVER, as_json: Json = False) -> None:
    """Print a job's build and run logs.

    --json: {"chunks": [...], "state": ...}; with --follow, JSON Lines."""
    try:
        api = _api(server)
        if follow:
            job = follow_job(api, job_id, as_json)
            if as_json:
                emit_line(True, {"event": "final", "job": job}, "")
            return
        page = api.logs(job_id)
    except CampugridError as e:
        fail(str(e))
    emit(as_json, {"job_id": job_id, **page},
         "\n".join(filter(None, (log_text(c) for c in page["chunks"]))))


@app.command()
def shards(job_id: str,
           state: Annotated[str | None, typer.Option(help="Only shards in this state.")] = None,
           server: Server = DEFAULT_SERVER, as_json: Json = False) -> None:
    """Print a sharded job's shards, one JSON object per line: index, state, result, reason.

    --json: one JSON array of the shards, with every field."""
    try:
        found = _api(server).shards(job_id, state)
        if as_json:
            emit_array(found)
            return
        for sh in found:
            line = {k: sh[k] for k in ("index", "state", "result", "reason", "exit_code", "cost",
                                       "machine_id")}
            if sh.get("copies"):  # a verified job's: [machine, result, agreed]
                line["copies"] = sh["copies"]
            typer.echo(json.dumps(line))
    except CampugridError as e:
        fail(str(e))


@app.command()
def cancel(job_id: str, server: Server = DEFAULT_SERVER, as_json: Json = False) -> None:
    """Cancel a job; a running sandbox is stopped within a lease renewal."""
    try:
        job = _api(server).cancel(job_id)
    except CampugridError as e:
        fail(str(e))
    emit(as_json, job, job_text(job))


@app.command()
def rerun(job_id: str, server: Server = DEFAULT_SERVER, as_json: Json = False) -> None:
    """Run a job again as a new job: the same spec, context and bases (for a result marked
    tainted, or simply again)."""
    try:
        job = _api(server).rerun(job_id)
    except CampugridError as e:
        fail(str(e))
    emit(as_json, job, job_text(job))


@app.command()
def jobs(state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
         limit: int = 50, server: Server = DEFAULT_SERVER, as_json: Json = False) -> None:
    """List recent jobs."""
    try:
        found = _api(server).jobs(state, limit)
    except CampugridError as e:
        fail(str(e))
    emit(as_json, found, "\n".join(
        f"{j['id']}  {j['state']:<10} {j['created_at'][:19]}  {j.get('name') or ''}"
        + (f"  ({j['waiting_reason']})" if j.get("waiting_reason") else "") for j in found))


@app.command()
def output(job_id: str, to: Annotated[Path, typer.Option("-o", help="Where to save the tar.gz.")],
           server: Server = DEFAULT_SERVER, as_json: Json = False) -> None:
    """Download a job's /output folder as a tar.gz, streamed to the file.

    Prints its path (--json: path, size and sha256)."""
    if not to.parent.is_dir():
        fail(f"-o {to}: the folder {to.parent} does not exist; create it or save elsewhere")
    if to.is_dir():
        fail(f"-o {to}: that is a folder; name the file to save, e.g. -o {to / (job_id + '.tar.gz')}")
    try:
        with Transfers(interactive(as_json)) as bars:
            got = _api(server).download_output(job_id, to, progress=bars.bar("downloading"))
    except (CampugridError, OSError) as e:
        fail(str(e))
    emit(as_json, {"job_id": job_id, "path": str(got.path), "size": got.size,
                   "sha256": got.sha256}, str(to))


@coordinator_app.command("serve")
def coordinator_serve(
    state_dir: Annotated[Path, typer.Option(help="Database and local state.")] = Path("./coordinator-state"),
    host: str = "127.0.0.1", http_port: int = 8750, grpc_port: int = 8751,
    lease_seconds: Annotated[float, typer.Option(help="How long a silent agent keeps a task.")] = 12.0,
    admin_identity: Annotated[Path | None, typer.Option(
        envvar="CAMPUGRID_ADMIN_IDENTITY",
        help="Where the first start writes the local admin's identity (default: "
             "~/.config/campugrid/identity.json).")] = None,
    log_format: LogFormat = "text",
) -> None:
    """Serve the REST API and the agents' gRPC service (S3 from CAMPUGRID_S3_* variables)."""
    from campugrid.coordinator import server as srv
    from campugrid.coordinator.config import Settings

    log_as(log_format)
    settings = Settings.from_env(state_dir, http_host=host, grpc_host=host,
                                 http_port=http_port, grpc_port=grpc_port,
                                 lease_seconds=lease_seconds, admin_identity=admin_identity)
    if not settings.s3_endpoint:
        fail("set CAMPUGRID_S3_ENDPOINT, CAMPUGRID_S3_ACCESS_KEY and CAMPUGRID_S3_SECRET_KEY "
              "(or use `campugrid up`, which starts an embedded S3 server)")
    try:
        srv.serve(settings)
    except CampugridError as e:
        fail(str(e))


# --- identities: login, apps, machines ----------------------------------------------------------


@app.command()
def login(
    server: Annotated[str, typer.Argument(help="The coordinator's REST address.")],
    invite: Annotated[str, typer.Option(help="The one-time code from `campugrid apps invite`.")],
    pin: Annotated[str, typer.Option(help="For https: the certificate fingerprint the invite "
                                          "names.")] = "",
    as_json: Json = False,
) -> None:
    """Turn an invite into this computer's app key: the key is made here and never leaves."""
    from campugrid.client.login import login as do_login

    try:
        identity, path = do_login(server, invite, pin)
    except CampugridError as e:
        fail(str(e))
    emit(as_json, {"server": identity.server, "app_id": identity.app_id, "name": identity.name,
                   "admin": identity.admin, "identity": str(path)},
         f"logged in to {identity.server} as app {identity.name!r}"
         f"{' (admin)' if identity.admin else ''}; identity in {path}")


@apps_app.callback()
def apps_list(ctx: typer.Context, server: Server = DEFAULT_SERVER, as_json: Json = False) -> None:
    if ctx.invoked_subcommand is not None:
        return
    try:
        found = _api(server).apps()
    except CampugridError as e:
        fail(str(e))
    emit(as_json, found, "\n".join(
        f"{a['name']:<24} {a['fingerprint']}  {'admin' if a['admin'] else 'app':<5}  "
        + (f"revoked {a['revoked_at'][:19]}" if a["revoked_at"] else "active") for a in found))


@apps_app.command("invite")
def apps_invite(name: str, admin: Annotated[bool, typer.Option(help="An admin app.")] = False,
                server: Server = DEFAULT_SERVER, as_json: Json = False) -> None:
    """Print a one-time invite (valid for a day) for a new app called NAME."""
    try:
        inv = _api(server).invite(name, admin)
    except CampugridError as e:
        fail(str(e))
    emit(as_json, inv, f"invite for {inv['name']!r}, single use, until {inv['expires_at'][:19]} "
                       f"UTC:\n  {inv['command']}")


@apps_app.command("revoke")
def apps_revoke(name: str, server: Server = DEFAULT_SERVER, as_json: Json = False) -> None:
    """Revoke app NAME: every request it signs from now on is refused."""
    try:
        a = _api(server).revoke_app(name)
    except CampugridError as e:
        fail(str(e))
    emit(as_json, a, f"revoked {a['name']} ({a['fingerprint']})")


@machines_app.callback()
def machines_list(ctx: typer.Context, server: Server = DEFAULT_SERVER,
                  as_json: Json = False) -> None:
    if ctx.invoked_subcommand is not None:
        return
    try:
        found = _api(server).machines()
    except CampugridError as e:
        fail(str(e))
    emit(as_json, found, "\n".join(machine_line(m) for m in found))


@machines_app.command("invite")
def machines_invite(server: Server = DEFAULT_SERVER, as_json: Json = False) -> None:
    """Print the one command a new provider machine runs to join."""
    try:
        join = _api(server).join_command()
    except CampugridError as e:
        fail(str(e))
    emit(as_json, join, join["command"])


@machines_app.command("approve")
def machines_approve(machine: str, owner: Annotated[str | None, typer.Option(
                         help="Whose machine it is: a verified job never takes two answers "
                              "from machines of one owner.")] = None,
                     server: Server = DEFAULT_SERVER, as_json: Json = False) -> None:
    """Approve a pending MACHINE (id, id prefix, name or fingerprint) once its fingerprint
    matches the one its agent printed; or reinstate a quarantined one."""
    try:
        m = _api(server).approve_machine(machine, owner)
    except CampugridError as e:
        fail(str(e))
    emit(as_json, m, f"approved {m['id']} ({m['name']}, {m['fingerprint']})")


@machines_app.command("revoke")
def machines_revoke(machine: str, server: Server = DEFAULT_SERVER, as_json: Json = False) -> None:
    """Revoke MACHINE: its leases end now, its jobs are queued again, and whatever it still
    sends is refused."""
    try:
        m = _api(server).revoke_machine(machine)
    except CampugridError as e:
        fail(str(e))
    emit(as_json, m, f"revoked {m['id']} ({m['name']})")


@app.command()
def up(
    sample: Annotated[bool, typer.Option(help="Submit examples/hello and print its result.")] = False,
    exit_after_sample: Annotated[bool, typer.Option(help="Shut down once the sample is done.")] = False,
    state_dir: Annotated[Path | None, typer.Option(help="Where everything is kept.")] = None,
    http_port: int = 8750,
    log_format: LogFormat = "text",
) -> None:
    """Bring up S3, the coordinator and a local agent on embedded defaults."""
    from campugrid.cli.platform import Platform, default_state_dir, find_example, have
    from campugrid.cli.seaweed import free_port
    from campugrid.client import tar_folder

    log_as(log_format)
    missing = have("podman", "buildah", "runsc")
    if missing:
        fail(f"missing {', '.join(missing)}; run infra/setup.sh first")
    stopping = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if not stopping.is_set():
            stopping.set()
            raise KeyboardInterrupt  # out of whatever we are doing, into platform.stop()
        typer.echo("stopping at once", err=True)
        os._exit(128 + signum)  # the guards still stop SeaweedFS and the agent

    # From the start: a signal during start-up or the sample must still stop what runs.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # The agents' port stays the same from one start to the next where it can, so that the
    # join command machines were given keeps working.
    platform = Platform(state_dir or default_state_dir(), http_port=http_port,
                        grpc_port=free_port(http_port + 1))
    code = 0
    try:
        platform.start()
        assert platform.running is not None
        if platform.running.admin_identity is not None:
            typer.echo(f"made an admin identity for you: {platform.running.admin_identity} "
                       "(the CLI uses it; invite others with `campugrid apps invite NAME`)")
        agent = platform.start_agent(restart=True)
        typer.echo(f"campugrid is up: REST {platform.url}/v1 (docs at {platform.url}/docs), "
                   f"web console {platform.url}/console (add people with `campugrid users "
                   f"add NAME`), agents at {platform.grpc_address} (TLS, certificate "
                   f"{platform.pin}), state in {platform.state_dir}")
        typer.echo(f"approved the local agent {agent.name} as machine {agent.machine_id()}: "
                   "same host, same owner. Another machine joins with:\n"
                   f"  campugrid agent join {platform.grpc_address} --pin {platform.pin}")
        if sample:
            api = platform.api()
            folder = find_example("hello")
            job = api.submit(tar_folder(folder), JobSpec(name="hello sample"))
            typer.echo(f"submitted {folder} as job {job['id']}")
            job = follow_job(api, job["id"])
            _print_job(job)
            code = 0 if job["state"] == "succeeded" else 1
        if not exit_after_sample:
            typer.echo("press Ctrl-C to stop")
            while True:
                time.sleep(3600)
    except CampugridError as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        code = 2
    except KeyboardInterrupt:
        pass
    finally:
        if stopping.is_set():
            typer.echo("stopping (a second Ctrl-C stops at once)", err=True)
        stopping.set()
        platform.stop()
    raise typer.Exit(code)


def main() -> None:  # pragma: no cover - console entry
    sys.exit(app())
