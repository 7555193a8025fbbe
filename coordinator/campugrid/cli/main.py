"""campugrid: submit and watch jobs, run the coordinator or an agent, or bring it all up."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from campugrid.protocol.errors import CampugridError
from campugrid.protocol.logs import configure as configure_logging
from campugrid.protocol.spec import LIMITS, JobSpec

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
coordinator_app = typer.Typer(no_args_is_help=True, help="Run the coordinator.")
agent_app = typer.Typer(no_args_is_help=True, help="Run a provider agent.")
app.add_typer(coordinator_app, name="coordinator")
app.add_typer(agent_app, name="agent")

Server = Annotated[str, typer.Option("--server", envvar="CAMPUGRID_SERVER",
                                     help="The coordinator's REST address.")]
DEFAULT_SERVER = "http://127.0.0.1:8750"


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2)


LogFormat = Annotated[str, typer.Option(
    "--log-format", envvar="CAMPUGRID_LOG_FORMAT",
    help="How to log: text, or json (one object per line, for a log system). Lines about a "
         "job name its id and attempt either way.")]


def _logging(fmt: str = "text") -> None:
    try:
        configure_logging(fmt)
    except ValueError as e:
        _fail(f"--log-format: {e}")
    os.environ["CAMPUGRID_LOG_FORMAT"] = fmt  # for the processes we start (up's agent)


def _api(server: str) -> Any:
    from campugrid.cli.rest import Api

    return Api(server)


def _print_job(job: dict[str, Any]) -> None:
    typer.echo(f"job      {job['id']}" + (f"  ({job['name']})" if job.get("name") else ""))
    shards = job.get("shards")
    if shards:
        typer.echo(f"state    {job['state']}  ({shards['total']} shards: {shards['queued']} "
                   f"queued, {shards['running']} running, {shards['done'] - shards['failed']} "
                   f"succeeded, {shards['failed']} failed)")
    else:
        typer.echo(f"state    {job['state']}  (attempt {job['attempt']} of {job['max_attempts']})")
    if job.get("waiting_reason"):
        typer.echo(f"waiting  {job['waiting_reason']}")
    if job.get("reason"):
        typer.echo(f"reason   {job['reason']}")
    if job.get("exit_code") is not None:
        typer.echo(f"exit     {job['exit_code']}")
    if job.get("result"):
        typer.echo(f"result   {job['result']}")
    for limit, how in (job.get("limits") or {}).items():
        if how != "enforced":
            typer.echo(f"limit    {limit}: {how}")
    for ev in job.get("events") or []:
        typer.echo(f"  {ev['at'][:19]}  #{ev['attempt']}  {ev['kind']:<14} {ev['detail']}")


def _follow(api: Any, job_id: str) -> dict[str, Any]:
    for chunk in api.follow_logs(job_id):
        prefix = "build| " if chunk["stream"] == "build" else ""
        for line in chunk["text"].splitlines():
            typer.echo(f"{prefix}{line}")
    return dict(api.wait(job_id))


@app.command()
def submit(
    folder: Annotated[Path, typer.Argument(help="Folder with a Dockerfile (the build context).")],
    spec_file: Annotated[Path | None, typer.Option("--spec", help="Job spec JSON file.")] = None,
    command: Annotated[str | None, typer.Option(help="Command to run instead of the image's CMD.")] = None,
    client_id: Annotated[str | None, typer.Option(help="Your own id: resubmitting it is safe.")] = None,
    wait: Annotated[bool, typer.Option("--wait", "--follow", help="Follow logs until done.")] = False,
    server: Server = DEFAULT_SERVER,
) -> None:
    """Submit a job: build FOLDER's Dockerfile on a provider and run it in gVisor."""
    from campugrid.cli.rest import tar_folder

    try:
        raw: Any = json.loads(spec_file.read_text()) if spec_file else {}
        if not isinstance(raw, dict):
            _fail(f"{spec_file}: the spec must be a JSON object")
        if command is not None:
            raw["command"] = command
        if client_id is not None:
            raw["client_job_id"] = client_id
        spec = JobSpec.from_dict(raw)
        api = _api(server)
        job = api.submit(tar_folder(folder), spec)
        typer.echo(job["id"])
        if wait:
            job = _follow(api, job["id"])
            _print_job(job)
            raise typer.Exit(0 if job["state"] == "succeeded" else 1)
    except (CampugridError, OSError, ValueError) as e:  # ValueError: JSON, UTF-8
        _fail(str(e))


@app.command()
def status(job_id: str, server: Server = DEFAULT_SERVER) -> None:
    """Show a job's state, reason, result and history."""
    try:
        _print_job(_api(server).job(job_id))
    except CampugridError as e:
        _fail(str(e))


@app.command()
def logs(job_id: str, follow: Annotated[bool, typer.Option("--follow", "-f")] = False,
         server: Server = DEFAULT_SERVER) -> None:
    """Print a job's build and run logs."""
    try:
        api = _api(server)
        if follow:
            _follow(api, job_id)
            return
        for chunk in api.logs(job_id)["chunks"]:
            prefix = "build| " if chunk["stream"] == "build" else ""
            for line in chunk["text"].splitlines():
                typer.echo(f"{prefix}{line}")
    except CampugridError as e:
        _fail(str(e))


@app.command()
def shards(job_id: str,
           state: Annotated[str | None, typer.Option(help="Only shards in this state.")] = None,
           server: Server = DEFAULT_SERVER) -> None:
    """Print a sharded job's shards, one JSON object per line: index, state, result, reason."""
    try:
        for sh in _api(server).shards(job_id, state):
            typer.echo(json.dumps({k: sh[k] for k in ("index", "state", "result", "reason",
                                                      "exit_code", "cost", "machine_id")}))
    except CampugridError as e:
        _fail(str(e))


@app.command()
def cancel(job_id: str, server: Server = DEFAULT_SERVER) -> None:
    """Cancel a job; a running sandbox is stopped within a lease renewal."""
    try:
        _print_job(_api(server).cancel(job_id))
    except CampugridError as e:
        _fail(str(e))


@app.command()
def jobs(state: Annotated[str | None, typer.Option(help="Only jobs in this state.")] = None,
         limit: int = 50, server: Server = DEFAULT_SERVER) -> None:
    """List recent jobs."""
    try:
        for j in _api(server).jobs(state, limit):
            why = f"  ({j['waiting_reason']})" if j.get("waiting_reason") else ""
            typer.echo(f"{j['id']}  {j['state']:<10} {j['created_at'][:19]}  {j.get('name') or ''}{why}")
    except CampugridError as e:
        _fail(str(e))


@app.command()
def output(job_id: str, to: Annotated[Path, typer.Option("-o", help="Where to save the tar.gz.")],
           server: Server = DEFAULT_SERVER) -> None:
    """Download a job's /output folder as a tar.gz."""
    try:
        to.write_bytes(_api(server).output(job_id))
        typer.echo(str(to))
    except (CampugridError, OSError) as e:
        _fail(str(e))


@coordinator_app.command("serve")
def coordinator_serve(
    state_dir: Annotated[Path, typer.Option(help="Database and local state.")] = Path("./coordinator-state"),
    host: str = "127.0.0.1", http_port: int = 8750, grpc_port: int = 8751,
    lease_seconds: Annotated[float, typer.Option(help="How long a silent agent keeps a task.")] = 12.0,
    log_format: LogFormat = "text",
) -> None:
    """Serve the REST API and the agents' gRPC service (S3 from CAMPUGRID_S3_* variables)."""
    from campugrid.coordinator import server as srv
    from campugrid.coordinator.config import Settings

    _logging(log_format)
    settings = Settings.from_env(state_dir, http_host=host, grpc_host=host,
                                 http_port=http_port, grpc_port=grpc_port,
                                 lease_seconds=lease_seconds)
    if not settings.s3_endpoint:
        _fail("set CAMPUGRID_S3_ENDPOINT, CAMPUGRID_S3_ACCESS_KEY and CAMPUGRID_S3_SECRET_KEY "
              "(or use `campugrid up`, which starts an embedded S3 server)")
    try:
        srv.serve(settings)
    except CampugridError as e:
        _fail(str(e))


@agent_app.command("run")
def agent_run(
    coordinator: Annotated[str, typer.Option(help="The coordinator's gRPC address.")] = "127.0.0.1:8751",
    state_dir: Annotated[Path, typer.Option(help="Credentials and work folders.")] = Path(
        os.path.expanduser("~/.local/share/campugrid-agent")),
    name: Annotated[str, typer.Option(help="This machine's name.")] = socket.gethostname(),
    builder: Annotated[str, typer.Option(help="The image builder: buildah or kaniko.")] = "buildah",
    runtime: Annotated[str, typer.Option(help="The sandbox runtime.")] = "podman-runsc",
    kaniko_image: Annotated[str, typer.Option(envvar="CAMPUGRID_KANIKO_IMAGE",
                                              help="Kaniko executor image (a local one).")] = "",
    once: Annotated[bool, typer.Option(help="Exit after one task.")] = False,
    gpus: Annotated[str | None, typer.Option(help="GPUs to offer: indexes or UUIDs, comma-separated "
                                                  "(default: all).")] = None,
    gpu_reserve_mb: Annotated[int, typer.Option(help="GPU memory to always leave free, per GPU.")] = 0,
    protect: Annotated[list[str] | None, typer.Option(help="A process name whose GPU is never used "
                                                           "while it runs (repeatable).")] = None,
    require_limits: Annotated[str, typer.Option(
        envvar="CAMPUGRID_REQUIRE_LIMITS",
        help="Limits this machine must enforce or the agent does not start, comma-separated "
             f"({', '.join(LIMITS)}).")] = "",
    log_format: LogFormat = "text",
) -> None:
    """Run a provider agent as this (unprivileged) user."""
    from campugrid.agent import backends
    from campugrid.agent.gpus import GpuPolicy
    from campugrid.agent.worker import Agent, AgentSettings

    _logging(log_format)
    try:
        sandbox, chosen = backends.choose(runtime, builder,
                                          backends.BackendOptions(kaniko_image=kaniko_image))
        policy = GpuPolicy(allow=tuple(x.strip() for x in gpus.split(",")) if gpus else None,
                           reserve_mb=gpu_reserve_mb, protected=tuple(protect or ()))
        required = tuple(x.strip() for x in require_limits.split(",") if x.strip())
        agent = Agent(AgentSettings(coordinator=coordinator, state_dir=state_dir, name=name,
                                    gpu_policy=policy, require_limits=required), chosen,
                      sandbox)
    except CampugridError as e:
        _fail(str(e))
    signal.signal(signal.SIGTERM, lambda *_: agent.shutdown())
    signal.signal(signal.SIGINT, lambda *_: agent.shutdown())
    agent.run(once=once)


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
    from campugrid.cli.rest import Api, tar_folder

    _logging(log_format)
    missing = have("podman", "buildah", "runsc")
    if missing:
        _fail(f"missing {', '.join(missing)}; run infra/setup.sh first")
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
    platform = Platform(state_dir or default_state_dir(), http_port=http_port)
    code = 0
    try:
        platform.start()
        platform.start_agent(restart=True)
        typer.echo(f"campugrid is up: REST {platform.url}/v1 (docs at {platform.url}/docs), "
                   f"agents at {platform.grpc_address}, state in {platform.state_dir}")
        if sample:
            api = Api(platform.url)
            folder = find_example("hello")
            job = api.submit(tar_folder(folder), JobSpec(name="hello sample"))
            typer.echo(f"submitted {folder} as job {job['id']}")
            job = _follow(api, job["id"])
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
