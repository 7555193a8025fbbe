"""`campugrid metrics`: the scrape tokens Prometheus sends to the coordinator's /metrics
(admins only; the coordinator keeps their SHA-256 only)."""

from __future__ import annotations

from typing import Annotated, Any, NoReturn

import typer

from campugrid.cli.output import Json, emit, interactive
from campugrid.protocol.errors import CampugridError

metrics_app = typer.Typer(invoke_without_command=True,
                          help="Scrape tokens for the coordinator's /metrics (admins only); "
                               "lists them.")

Server = Annotated[str | None, typer.Option(
    "--server", envvar="CAMPUGRID_SERVER",
    help="The coordinator's REST address (default: the one your identity is for).")]


def _fail(message: str) -> NoReturn:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2)


def _api(server: str | None) -> Any:
    from campugrid.client import Api

    return Api.from_identity(server=server)


@metrics_app.callback()
def metrics_list(ctx: typer.Context, server: Server = None, as_json: Json = False) -> None:
    if ctx.invoked_subcommand is not None:
        return
    try:
        with _api(server) as api:
            found = api.scrape_tokens()
    except CampugridError as e:
        _fail(str(e))
    lines = [f"{t['name']:<24} since {t['created_at'][:16]} UTC  by app {t['created_by']}"
             for t in found]
    emit(as_json, found, "\n".join(lines) or "no scrape tokens yet: `campugrid metrics token`")


@metrics_app.command("token")
def metrics_token(
    name: Annotated[str, typer.Option(help="What the token is for (one per Prometheus).")] = "prometheus",
    server: Server = None, as_json: Json = False,
) -> None:
    """Mint a scrape token and print it, once: only the token goes to stdout (`> FILE` for
    Prometheus's credentials_file)."""
    try:
        with _api(server) as api:
            made = api.mint_scrape_token(name)
    except CampugridError as e:
        _fail(str(e))
    emit(as_json, made, made["token"])
    if interactive(as_json):
        typer.echo(f"scrape token {made['name']!r}: shown this once; Prometheus sends it as "
                   "`authorization: {type: Bearer, credentials_file: FILE}`", err=True)


@metrics_app.command("revoke")
def metrics_revoke(name: str, server: Server = None, as_json: Json = False) -> None:
    """/metrics refuses the token NAME from now on."""
    try:
        with _api(server) as api:
            done = api.revoke_scrape_token(name)
    except CampugridError as e:
        _fail(str(e))
    emit(as_json, {"name": name, **done}, f"revoked scrape token {name}" if done["revoked"]
         else f"no scrape token named {name}; nothing changed")
