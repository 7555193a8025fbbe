"""What every console page shares: the coordinator behind it, its people and the sign-in
guard, the templates, and the checks a page makes (CSRF on every form, who sees what)."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import HTMLResponse

from campugrid.console.gate import (
    FORM_COOKIE,
    SAFE,
    check_csrf,
    csrf_token,
    form_secret,
    set_cookie,
    user_of,
)
from campugrid.coordinator.auth import Guard
from campugrid.coordinator.service import Coordinator
from campugrid.coordinator.users import Users, UserView
from campugrid.protocol.errors import Forbidden

# What a page says after an action redirected to it (?done=…): fixed words, never the query's.
NOTICES = {
    "cancelled": "Job cancelled: its sandbox is stopped, and it will not run again.",
    "rerun": "This is a new run of the job, with the same spec and files.",
    "approved": "Machine approved: it takes work from now on.",
    "revoked": "Machine revoked: its leases have ended, its jobs are queued again, and "
               "whatever it still sends is refused.",
}


@dataclasses.dataclass(frozen=True)
class Pages:
    coord: Coordinator
    users: Users
    guard: Guard  # sign-in attempts per address, beside each account's lockout
    env: jinja2.Environment

    def page(self, request: Request, template: str, status: int = 200,
             **values: Any) -> HTMLResponse:
        user = request.state.user
        if not request.state.session:
            form_secret(request)
        for key in ("errors", "values"):  # a form's fields without an error or a value
            if key in values:
                values[key] = collections.defaultdict(str, values[key])
        values.setdefault("notice", NOTICES.get(request.query_params.get("done", "")))
        body = self.env.get_template(template).render(
            user=user, csrf=csrf_token(request, self.users),
            root=request.scope.get("root_path", ""), **values)
        response = HTMLResponse(body, status)
        new = getattr(request.state, "new_form_secret", None)
        if new:
            set_cookie(response, request, FORM_COOKIE, new, max_age=3600)
        return response

    def job_id(self, request: Request, ref: str) -> str:
        """The id of the job `ref` names (an id, or a start of one), among the caller's."""
        return self.coord.jobs.job_id(ref, owner_of(user_of(request)))


def pages(request: Request) -> Pages:
    found = request.app.state.pages
    assert isinstance(found, Pages)
    return found


def owner_of(user: UserView) -> str | None:
    """Whose jobs a person sees: their app's, or (admins) everyone's."""
    return None if user.admin else user.app_id


def admin_of(request: Request) -> UserView:
    user = user_of(request)
    if not user.admin:
        raise Forbidden("only admins see and approve machines")
    return user


async def csrf(request: Request) -> AsyncIterator[None]:
    """Every form a page posts carries the session's token (gate.py)."""
    await check_csrf(request, pages(request).users)
    try:
        yield
    finally:
        if request.method not in SAFE:  # the uploaded files' spool files
            await (await request.form()).close()
