"""Who is using the console: the session cookie, checked on every path but sign-in,
enrolment and the static files; and CSRF, checked on every state-changing request.

The REST API's signatures do not apply under /console (auth.CONSOLE): this gate does, for
every route there, including any added later. Unsafe methods need a same-origin request (the
browser's Origin and Sec-Fetch-Site) and the form's `csrf` field, which is a MAC of the
session cookie (or, before sign-in, of a cookie set with the form).
"""

from __future__ import annotations

import hmac
import secrets
from typing import Any
from urllib.parse import quote

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import cookie_parser
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from campugrid.coordinator.users import SESSION_S, Users, UserView
from campugrid.protocol.errors import Forbidden, InvalidInput

SESSION_COOKIE = "cg_session"
FORM_COOKIE = "cg_form"  # the pre-sign-in CSRF secret (double submit)
# Served without a session (relative to /console).
PUBLIC = frozenset({"/login", "/enrol"})
PUBLIC_PREFIXES = ("/static/",)
SAFE = frozenset({"GET", "HEAD"})
HEADERS = {
    # Nothing is fetched from elsewhere and no inline script runs.
    "content-security-policy": ("default-src 'self'; script-src 'self'; style-src 'self'; "
                                "img-src 'self' data:; connect-src 'self'; form-action 'self'; "
                                "frame-ancestors 'none'; base-uri 'none'"),
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
    "cache-control": "no-store",
}


def cookies(scope: Scope) -> dict[str, str]:
    """The request's cookies, parsed as Starlette's Request does."""
    found: dict[str, str] = {}
    for k, v in scope.get("headers", []):
        if k == b"cookie":
            found.update(cookie_parser(v.decode("latin-1")))
    return found


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k == name:
            return str(v.decode("latin-1"))
    return None


def same_origin(scope: Scope) -> bool:
    """Whether an unsafe request comes from our own pages: a cross-site form or script
    carries another Origin, or Sec-Fetch-Site other than same-origin."""
    site = _header(scope, b"sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = _header(scope, b"origin")
    if origin is None:  # not a browser's cross-site request (browsers send it on those);
        return True  # the CSRF token is still needed
    host = _header(scope, b"host") or ""
    return origin.split("://", 1)[-1] == host


PUBLIC_BODY_BYTES = 64 * 1024  # a sign-in or enrolment form: a few short fields


def body_refusal(scope: Scope, limit: int, *, files: bool) -> tuple[int, str] | None:
    """Why an unsafe request's body is refused before a byte of it is read, if it is: its
    declared length (the server holds the client to it) past `limit`, none declared, or
    files where only short fields belong (before sign-in)."""
    length = _header(scope, b"content-length")
    if length is None or not length.isdigit():
        return 411, "send the form with its length (Content-Length)"
    if int(length) > limit:
        return 413, f"the form is larger than {limit // 1024:,} KiB"
    kind = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
    allowed = {"application/x-www-form-urlencoded"} | ({"multipart/form-data"} if files else set())
    if kind not in allowed:
        return 415, f"send the form as {' or '.join(sorted(allowed))}"
    return None


class ConsoleGate:
    """ASGI middleware of the console app: puts the signed-in person in
    `scope["state"]["user"]` or refuses (a sign-in redirect for pages, 401 otherwise)."""

    def __init__(self, app: ASGIApp, *, users: Users, max_body: int) -> None:
        self.app = app
        self.users = users
        self.max_body = max_body  # a signed-in request's body (the submit form's upload)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"][len(scope.get("root_path", "")):] or "/"
        if scope["method"] not in SAFE and not same_origin(scope):
            await PlainTextResponse("refused: this request does not come from the console's "
                                    "own pages (cross-site)", 403, headers=HEADERS)(
                scope, receive, send)
            return
        token = cookies(scope).get(SESSION_COOKIE, "")
        user = await run_in_threadpool(self.users.session, token) if token else None
        state = scope.setdefault("state", {})
        state["user"], state["session"] = user, token if user else ""
        public = path in PUBLIC or path.startswith(PUBLIC_PREFIXES)
        if scope["method"] not in SAFE:
            refusal = body_refusal(scope, self.max_body if user else PUBLIC_BODY_BYTES,
                                   files=user is not None)
            if refusal:
                await PlainTextResponse(refusal[1], refusal[0], headers=HEADERS)(
                    scope, receive, send)
                return
        if user is None and not public:
            root = scope.get("root_path", "")
            if scope["method"] in SAFE and not path.endswith("/stream"):
                target = quote(root + path + ("?" + scope["query_string"].decode("latin-1")
                                              if scope.get("query_string") else ""), safe="")
                response: Response = RedirectResponse(f"{root}/login?next={target}", 303,
                                                      headers=HEADERS)
            else:
                response = PlainTextResponse("sign in first: your session has ended", 401,
                                             headers=HEADERS)
            await response(scope, receive, send)
            return

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", [])}
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [
                    (k.encode(), v.encode()) for k, v in HEADERS.items()
                    if k.encode() not in have]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def user_of(request: Request) -> UserView:
    user = request.state.user
    assert isinstance(user, UserView)  # the gate let only signed-in requests through
    return user


def csrf_token(request: Request, users: Users, form_secret: str | None = None) -> str:
    """The token this page's forms carry: a MAC of the session cookie, or before sign-in of
    the form cookie's secret (this page's, unless `form_secret` names the one sent)."""
    if request.state.session:
        return users.box.mac("session\0" + request.state.session)
    secret = request.state.form_secret if form_secret is None else form_secret
    return users.box.mac("form\0" + secret) if secret else ""


def form_secret(request: Request) -> str:
    """The pre-sign-in CSRF secret: the cookie's, or a new one that the page sets."""
    secret = request.cookies.get(FORM_COOKIE, "")
    if not (20 <= len(secret) <= 64):
        secret = secrets.token_urlsafe(24)
        request.state.new_form_secret = secret
    request.state.form_secret = secret
    return secret


MAX_FORM_FILES = 1_002  # a folder upload's files (forms.MAX_FILES) and the tarball
MAX_FORM_FIELDS = 100


async def check_csrf(request: Request, users: Users) -> None:
    """Every unsafe request must carry the form's token. The form parsed here is the one the
    route reads (Starlette keeps it), so its limits are set here."""
    if request.method in SAFE:
        return
    try:
        form = await request.form(max_files=MAX_FORM_FILES, max_fields=MAX_FORM_FIELDS)
    except HTTPException as e:  # Starlette's refusal of a form past the limits
        raise InvalidInput(f"the form could not be read ({e.detail}): a folder of more than "
                           f"{MAX_FORM_FILES - 2} files goes as a tarball") from e
    sent = form.get("csrf")
    expected = csrf_token(request, users, request.cookies.get(FORM_COOKIE, ""))
    if not expected or not isinstance(sent, str) or not hmac.compare_digest(sent, expected):
        raise Forbidden("the form has expired or was not sent by this console: reload the page "
                        "and send it again")


def set_cookie(response: Response, request: Request, name: str, value: str,
               max_age: int = SESSION_S) -> None:
    response.set_cookie(name, value, max_age=max_age, path="/console", httponly=True,
                        samesite="strict", secure=request.url.scheme == "https")
