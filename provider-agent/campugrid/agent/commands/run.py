"""`campugrid agent run | join`: a provider agent, as its (unprivileged) user runs it."""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import Annotated

import typer

from campugrid.agent.install import AGENT_DIR
from campugrid.cli.output import Json, LogFormat, emit, fail, log_as
from campugrid.protocol.errors import CampugridError
from campugrid.protocol.spec import LIMITS

agent_app = typer.Typer(no_args_is_help=True, help="Run a provider agent.")


@agent_app.command("run")
def agent_run(
    coordinator: Annotated[str | None, typer.Option(
        help="The coordinator's gRPC address (default: the one this agent joined).")] = None,
    pin: Annotated[str | None, typer.Option(
        help="The coordinator certificate's fingerprint: join it now (see `agent join`).")] = None,
    config: Annotated[Path | None, typer.Option(
        help="The agent's configuration file (`provider install` writes one); options given "
             "here win over it.")] = None,
    state_dir: Annotated[Path | None, typer.Option(
        help=f"Key, membership and work folders (default: {AGENT_DIR}).")] = None,
    name: Annotated[str | None, typer.Option(help="This machine's name (default: its host "
                                                  "name).")] = None,
    builder: Annotated[str, typer.Option(help="The image builder: buildah or kaniko.")] = "buildah",
    runtime: Annotated[str, typer.Option(help="The sandbox runtime.")] = "podman-runsc",
    runsc: Annotated[str, typer.Option(
        help="gVisor's runsc for jobs and RUN steps, a path (default: the first on PATH).")
    ] = "runsc",
    kaniko_image: Annotated[str, typer.Option(
        envvar="CAMPUGRID_KANIKO_IMAGE",
        help="Kaniko's executor image, a local one (default: the one infra/kaniko.sh makes).")
    ] = "",
    once: Annotated[bool, typer.Option(help="Exit after one task.")] = False,
    gpus: Annotated[str | None, typer.Option(help="GPUs to offer: indexes or UUIDs, comma-separated "
                                                  "(default: all).")] = None,
    gpu_reserve_mb: Annotated[int | None, typer.Option(
        help="GPU memory to always leave free, per GPU.")] = None,
    protect: Annotated[list[str] | None, typer.Option(
        help="A program that takes the machine back (a game, a renderer: steam, blender): "
             "while it runs the job here is handed back after a final checkpoint and no work "
             "is taken. Repeatable.")] = None,
    hours: Annotated[str | None, typer.Option(
        help="When this machine takes new work, local time: HH:MM-HH:MM, comma-separated "
             "(e.g. 22:00-07:00). Default: any time.")] = None,
    share: Annotated[list[str] | None, typer.Option(
        "--share", help="NAME=/folder: let jobs read the files in this folder (read-only, by "
                        "path inside it and sha256; the folder's place is never reported). "
                        "Repeatable.")] = None,
    require_limits: Annotated[str, typer.Option(
        envvar="CAMPUGRID_REQUIRE_LIMITS",
        help="Limits this machine must enforce or the agent does not start, comma-separated "
             f"({', '.join(LIMITS)}).")] = "",
    metrics_port: Annotated[int | None, typer.Option(
        min=0, max=65535,
        help="Serve /metrics on 127.0.0.1 (only) at this port, to the token `campugrid provider "
             "metrics-token` prints; 0: not at all. Default: 8752.")] = None,
    image_cache_mb: Annotated[int, typer.Option(
        min=0, help="Keep images built or pulled through the coordinator's registry, up to "
                    "this many MB, for later tasks of the same build; 0: never pull another "
                    "machine's build, always build here.")] = 20480,
    build_network: Annotated[str, typer.Option(
        envvar="CAMPUGRID_BUILD_NETWORK",
        help="Where builds' RUN steps may connect: 'platform' (package registries, through the "
             "coordinator's egress proxy), 'local' (package registries, from this machine, by "
             "the same rules) or 'none' (every build offline).")] = "platform",
    poll_seconds: Annotated[float, typer.Option(
        envvar="CAMPUGRID_AGENT_POLL_SECONDS",
        help="How often an idle agent asks the coordinator for work, in seconds.")] = 1.0,
    log_format: LogFormat = "text",
) -> None:
    """Run a provider agent as this (unprivileged) user."""
    from campugrid.agent import backends, shares
    from campugrid.agent.buildnet import MODES
    from campugrid.agent.gpus import GpuPolicy
    from campugrid.agent.install import AgentConfig
    from campugrid.agent.metrics import METRICS_PORT
    from campugrid.agent.owner import Hours, OwnerPolicy
    from campugrid.agent.worker import Agent, AgentSettings, check_poll_seconds
    from campugrid.egress.policy import Policy

    log_as(log_format)
    try:
        check_poll_seconds(poll_seconds)  # before anything is made
        if build_network not in MODES:
            raise CampugridError(f"--build-network {build_network}: one of {', '.join(MODES)}")
        try:  # the builds' egress settings, checked now rather than at the first build
            Policy.from_env()
        except ValueError as e:
            raise CampugridError(str(e)) from e
        cfg = AgentConfig.load(config) if config else AgentConfig(state_dir=AGENT_DIR)
        state_dir = state_dir or (cfg.state_dir if cfg.state_dir != Path() else AGENT_DIR)
        name = name or cfg.name
        gpus = gpus if gpus is not None else (",".join(cfg.gpus) if cfg.gpus else None)
        gpu_reserve_mb = cfg.keep_free_mb if gpu_reserve_mb is None else gpu_reserve_mb
        protect = protect if protect else list(cfg.protect)
        hours = hours if hours is not None else (cfg.hours or None)
        share = share if share else [f"{k}={v}" for k, v in cfg.shares.items()]
        sandbox, chosen = backends.choose(runtime, builder,
                                          backends.BackendOptions(kaniko_image=kaniko_image,
                                                                  runsc=runsc))
        policy = GpuPolicy(allow=tuple(x.strip() for x in gpus.split(",")) if gpus else None,
                           reserve_mb=gpu_reserve_mb, protected=tuple(protect or ()))
        required = tuple(x.strip() for x in require_limits.split(",") if x.strip())
        owner = OwnerPolicy(hours=Hours.parse(hours) if hours else None,
                            programs=tuple(protect or ()))
        agent = Agent(AgentSettings(coordinator=coordinator or "", state_dir=state_dir, name=name,
                                    poll_seconds=poll_seconds, gpu_policy=policy,
                                    require_limits=required, pin=pin or "",
                                    shares=shares.parse(share or []), owner=owner,
                                    metrics_port=METRICS_PORT if metrics_port is None else metrics_port,
                                    image_cache_mb=image_cache_mb,
                                    build_network=build_network),
                      chosen, sandbox)
    except CampugridError as e:
        fail(str(e))
    signal.signal(signal.SIGTERM, lambda *_: agent.shutdown())
    signal.signal(signal.SIGINT, lambda *_: agent.shutdown())
    agent.run(once=once)
    if agent.revoked:
        raise typer.Exit(3)


@agent_app.command("join")
def agent_join(
    server: Annotated[str, typer.Argument(help="The coordinator's gRPC address (HOST:PORT; several "
                                               "coordinator processes: HOST:PORT,HOST:PORT).")],
    pin: Annotated[str, typer.Option(help="The coordinator certificate's fingerprint, as its "
                                          "operator printed it (SHA256:...).")],
    state_dir: Annotated[Path, typer.Option(help="Key, membership and work folders.")] = AGENT_DIR,
    name: Annotated[str, typer.Option(help="This machine's name.")] = socket.gethostname(),
    as_json: Json = False,
) -> None:
    """Join a coordinator: pin its certificate, make this machine's key, register it, and
    print the fingerprint its owner compares before approving it."""
    import grpc

    from campugrid.agent.client import CoordinatorClient, Membership

    try:
        membership = Membership.join(state_dir, server, pin)
        client = CoordinatorClient(membership)
        reply = client.register(name)
        client.close()
    except CampugridError as e:
        fail(str(e))
    except grpc.RpcError as e:
        fail(f"the coordinator refused the registration: {e.details()} ({e.code().name})")
    text = (f"machine      {reply.machine_id}\nfingerprint  {reply.fingerprint}\n"
            f"status       {reply.status}")
    if reply.status == "pending":
        text += ("\nThe coordinator's operator compares this fingerprint and runs:\n"
                 f"  campugrid machines approve {reply.machine_id}\n"
                 f"Then start the agent: campugrid agent run --state-dir {state_dir}")
    emit(as_json, {"machine_id": reply.machine_id, "fingerprint": reply.fingerprint,
                   "status": reply.status, "state_dir": str(state_dir)}, text)
