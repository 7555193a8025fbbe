"""Signing in (password and TOTP, with the account's lockout and a limit per address),
enrolling from a one-time link, and signing out."""

from __future__ import annotations

from typing import Annotated

import segno
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from limits import RateLimitItemPerMinute
from starlette.concurrency import run_in_threadpool

from campugrid.console.gate import FORM_COOKIE, SESSION_COOKIE, set_cookie
from campugrid.console.pages import csrf, pages
from campugrid.protocol.errors import InvalidInput, RateLimited, Unauthenticated

SIGN_INS_PER_ADDRESS = RateLimitItemPerMinute(30)
public = APIRouter(dependencies=[Depends(csrf)])  # no session needed
private = APIRouter(dependencies=[Depends(csrf)])


@public.get("/login", response_class=HTMLResponse)
def login_page(request: Request, next: str = "", enrolled: bool = False) -> HTMLResponse:
    site = pages(request)
    return site.page(request, "login.html", next=_safe_next(next, request), error="",
                     name="", notice="You are enrolled: sign in." if enrolled else "")


@public.post("/login", response_class=HTMLResponse)
async def login(request: Request) -> Response:
    site = pages(request)
    form = await request.form()
    name, password, code = (str(form.get(k) or "") for k in ("name", "password", "code"))
    target = _safe_next(str(form.get("next") or ""), request)
    address = request.client.host if request.client else "?"
    try:
        await run_in_threadpool(site.guard.limit, "sign-in address", address, SIGN_INS_PER_ADDRESS)
        user = await run_in_threadpool(site.users.login, name.strip(), password, code)
    except (Unauthenticated, RateLimited) as e:
        status = 429 if isinstance(e, RateLimited) else 401
        return site.page(request, "login.html", status, next=target, error=str(e),
                         name=name.strip()[:100], notice="")
    token, _ = await run_in_threadpool(site.users.open_session, user)
    response = RedirectResponse(target, 303)
    set_cookie(response, request, SESSION_COOKIE, token)
    response.delete_cookie(FORM_COOKIE, path="/console")
    return response


@public.get("/enrol", response_class=HTMLResponse)
def enrol_page(request: Request, token: Annotated[str, Query(max_length=100)] = "") -> HTMLResponse:
    site = pages(request)
    name, secret, uri = site.users.enrolment(token)
    qr = segno.make(uri, error="m").svg_data_uri(scale=5, border=2)
    return site.page(request, "enrol.html", token=token, name=name, secret=secret, qr=qr,
                     errors={})


@public.post("/enrol", response_class=HTMLResponse)
async def enrol(request: Request) -> Response:
    site = pages(request)
    form = await request.form()
    token, password, again, code = (str(form.get(k) or "")
                                    for k in ("token", "password", "again", "code"))
    name, secret, uri = await run_in_threadpool(site.users.enrolment, token)
    errors: dict[str, str] = {}
    if password != again:
        errors["again"] = "the two passwords differ"
    else:
        try:
            await run_in_threadpool(site.users.enrol, token, password, code)
        except InvalidInput as e:
            errors["code" if str(e).startswith("code") else "password"] = str(e)
    if errors:
        qr = segno.make(uri, error="m").svg_data_uri(scale=5, border=2)
        return site.page(request, "enrol.html", 422, token=token, name=name, secret=secret,
                         qr=qr, errors=errors)
    return RedirectResponse(f"{request.scope.get('root_path', '')}/login?enrolled=1", 303)


@private.post("/logout")
def logout(request: Request) -> Response:
    site = pages(request)
    site.users.close_session(request.state.session)
    response = RedirectResponse(f"{request.scope.get('root_path', '')}/login", 303)
    response.delete_cookie(SESSION_COOKIE, path="/console")
    return response


def _safe_next(target: str, request: Request) -> str:
    """Only a page of this console (no open redirect to elsewhere)."""
    root = str(request.scope.get("root_path", ""))
    if target.startswith(root + "/") and not target.startswith("//") and "\\" not in target \
            and "://" not in target:
        return target
    return root + "/"
