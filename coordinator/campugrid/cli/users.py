"""`campugrid users`: the people who sign in to the web console (admins only)."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from campugrid.cli.output import Json, emit
from campugrid.protocol.errors import CampugridError

users_app = typer.Typer(invoke_without_command=True,
                        help="The people who sign in to the web console (admins only); lists "
                             "them.")

Server = Annotated[str | None, typer.Option(
    "--server", envvar="CAMPUGRID_SERVER",
    help="The coordinator's REST address (default: the one your identity is for).")]


def _fail(message: str) -> None:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(2)


def _api(server: str | None) -> Any:
    from campugrid.client import Api

    return Api.from_identity(server=server)


def _link(as_json: bool, made: dict[str, Any], who: str) -> None:
    emit(as_json, made, f"{who}; send them this link, once, good until "
                        f"{made['expires_at'][:16]} UTC:\n{made['link']}")


@users_app.callback()
def users_list(ctx: typer.Context, server: Server = None, as_json: Json = False) -> None:
    if ctx.invoked_subcommand is not None:
        return
    try:
        with _api(server) as api:
            found = api.users()
    except CampugridError as e:
        _fail(str(e))
    lines = [f"{u['name']:<24} app {u['app']:<24} "
             f"{'admin' if u['admin'] else 'user':<6} "
             f"{'enrolled' if u['enrolled'] else 'not enrolled yet'}"
             + (f"  locked until {u['locked_until'][:19]}" if u.get("locked_until") else "")
             for u in found]
    emit(as_json, found, "\n".join(lines) or "no users yet: `campugrid users add NAME`")


@users_app.command("add")
def users_add(
    name: str,
    app: Annotated[str | None, typer.Option(
        "--app", help="Act as this existing app (its jobs, its role); default: a new app "
                      "named NAME.")] = None,
    admin: Annotated[bool, typer.Option(help="The new app is an admin.")] = False,
    server: Server = None, as_json: Json = False,
) -> None:
    """Add a person and print their one-time enrolment link (good for 24 hours): they choose
    a password there and set up their authenticator app."""
    try:
        with _api(server) as api:
            made = api.add_user(name, app=app, admin=admin)
    except CampugridError as e:
        _fail(str(e))
    _link(as_json, made, f"user {made['name']} (app {made['app']}"
                         f"{', admin' if made['admin'] else ''})")


@users_app.command("reset")
def users_reset(name: str, server: Server = None, as_json: Json = False) -> None:
    """A new enrolment link for NAME (a lost password or phone): their old password, code and
    sessions stop working now."""
    try:
        with _api(server) as api:
            made = api.reset_user(name)
    except CampugridError as e:
        _fail(str(e))
    _link(as_json, made, f"user {made['name']}: their old sign-in no longer works")


@users_app.command("remove")
def users_remove(name: str, server: Server = None, as_json: Json = False) -> None:
    """NAME can no longer sign in to the console (their app and its jobs stay)."""
    try:
        with _api(server) as api:
            done = api.remove_user(name)
    except CampugridError as e:
        _fail(str(e))
    emit(as_json, {"name": name, **done}, f"removed user {name}" if done["removed"]
         else f"no user named {name}; nothing changed")
