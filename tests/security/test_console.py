"""The console's boundary, against a running coordinator: every page needs a session, every
state-changing request a same-origin CSRF token, sign-in is rate limited and locks, cookies are
HttpOnly and SameSite=Strict, and a person sees only their own app's jobs."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pyotp
import pytest
from starlette.routing import Route

from campugrid.client import Api, Identity, tar_folder
from campugrid.console.app import create_console
from campugrid.coordinator import server
from campugrid.coordinator.users import MAX_FAILURES
from campugrid.protocol.spec import JobSpec
from tests.security.test_trust import start
from tests.support.holds import attempt

HELLO = Path(__file__).resolve().parents[2] / "examples" / "hello"
PASSWORD = "a long enough password"


@pytest.fixture(scope="module")
def coord(s3_server, tmp_path_factory) -> Iterator[server.Running]:
    running, t = start(s3_server, tmp_path_factory.mktemp("console"), "console-tests")
    yield running
    running.stop()
    t.join(5)


@pytest.fixture(scope="module")
def admin(coord) -> Iterator[Api]:
    with Api(coord.url, Identity.load(Path(coord.admin_identity))) as api:
        yield api


class Person:
    """A browser-like client of the console, signed in as `name`."""

    def __init__(self, coord: server.Running, link: str) -> None:
        self.url = coord.url
        self.http = httpx.Client(base_url=coord.url, follow_redirects=False, timeout=30)
        page = self.http.get(link.removeprefix(coord.url))
        assert page.status_code == 200, page.text
        secret = re.search(r'id="totp-secret">([A-Z2-7]+)<', page.text)
        assert secret
        self.totp = pyotp.TOTP(secret[1])
        token = link.split("token=", 1)[1]
        done = self.post("/console/enrol", page.text, token=token, password=PASSWORD,
                         again=PASSWORD, code=self.totp.now())
        assert done.status_code == 303, done.text

    def __enter__(self) -> Person:
        return self

    def __exit__(self, *_: object) -> None:
        self.http.close()

    def form_token(self, html: str) -> str:
        found = re.search(r'name="csrf" value="([0-9a-f]+)"', html)
        assert found, html[:2000]
        return found[1]

    def post(self, path: str, html: str, **fields: str) -> httpx.Response:
        return self.http.post(path, data={"csrf": self.form_token(html), **fields},
                              headers={"origin": self.url})

    def sign_in(self, name: str, code: str) -> httpx.Response:
        page = self.http.get("/console/login")
        return self.post("/console/login", page.text, name=name, password=PASSWORD, code=code)


def add(api: Api, name: str, **body: object) -> str:
    made = api.http.post("/v1/users", json={"name": name, **body})
    assert made.status_code == 201, made.text
    return str(made.json()["link"])


@pytest.fixture(scope="module")
def bea(coord, admin) -> Iterator[Person]:
    with Person(coord, add(admin, "bea")) as person:
        signed_in = person.sign_in("bea", person.totp.at(time.time() + 30))
        assert signed_in.status_code == 303, signed_in.text
        yield person


def test_users_are_added_by_admins_only_through_signed_requests(coord, admin):
    assert httpx.post(f"{coord.url}/v1/users", json={"name": "eve"}).status_code == 401
    add(admin, "fay")
    again = admin.http.post("/v1/users", json={"name": "fay"})
    assert again.status_code == 409 and "exists already" in again.json()["detail"]
    bad = admin.http.post("/v1/users", json={"name": "Eve Smith"})
    assert bad.status_code == 422 and "a-z" in bad.json()["detail"]
    listed = {u["name"]: u for u in admin.http.get("/v1/users").json()}
    assert listed["fay"]["enrolled"] is False and listed["fay"]["app"] == "fay"


def test_every_console_page_needs_a_session(coord):
    with httpx.Client(base_url=coord.url, follow_redirects=False) as anon:
        for path in ("/console/", "/console/submit", "/console/machines",
                     "/console/jobs/00000000-0000-0000-0000-000000000000"):
            r = anon.get(path)
            assert r.status_code == 303 and "/console/login?next=" in r.headers["location"], path
        assert anon.get("/console/jobs/00000000-0000-0000-0000-000000000000/stream").status_code == 401
        assert anon.get("/console/%2e%2e/v1/jobs").status_code in (303, 404)
        assert anon.get("/console/../v1/jobs").status_code in (303, 404, 401)
        login = anon.get("/console/login")
        assert login.status_code == 200
        assert "script-src 'self'" in login.headers["content-security-policy"]
        assert login.headers["x-frame-options"] == "DENY"
        assert anon.get("/console/static/console.css").status_code == 200
    with httpx.Client(base_url=coord.url, follow_redirects=False,
                      cookies={"cg_session": "cgs_" + "A" * 43}) as forged:
        assert forged.get("/console/").status_code == 303


def test_every_state_changing_route_refuses_without_the_csrf_token(coord, bea):
    page = bea.http.get("/console/").text
    token = bea.form_token(page)
    routes = []
    for r in create_console(coord.coord).routes:  # included routers keep theirs inside
        routes += getattr(r, "original_router", None).routes if hasattr(r, "original_router") \
            else [r]
    posts = [r.path for r in routes if isinstance(r, Route) and "POST" in (r.methods or set())]
    assert {"/login", "/enrol", "/logout", "/submit", "/jobs/{job_id}/cancel",
            "/machines/{ref}/approve", "/machines/{ref}/revoke"} <= set(posts)
    for path in posts:
        url = "/console" + path.replace("{job_id}", "00000000-0000-0000-0000-000000000000") \
            .replace("{ref}", "nothing")
        missing = bea.http.post(url, data={"other": "1"}, headers={"origin": coord.url})
        assert missing.status_code == 403 and "reload the page" in missing.text, (path, missing.text)
        wrong = bea.http.post(url, data={"csrf": "0" * 64}, headers={"origin": coord.url})
        assert wrong.status_code == 403, path
        cross = bea.http.post(url, data={"csrf": token}, headers={"origin": "https://evil.example"})
        assert cross.status_code == 403 and "cross-site" in cross.text, path
        fetched = bea.http.post(url, data={"csrf": token},
                                headers={"sec-fetch-site": "cross-site"})
        assert fetched.status_code == 403, path
    assert bea.http.get("/console/").status_code == 200  # still signed in: nothing was done


def test_the_session_cookie_is_http_only_and_strict(coord, admin):
    with Person(coord, add(admin, "cyd")) as person:
        signed_in = person.sign_in("cyd", person.totp.at(time.time() + 30))
        cookie = signed_in.headers["set-cookie"]
        assert "cg_session=cgs_" in cookie and "HttpOnly" in cookie
        assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
        assert "Path=/console" in cookie
        page = person.http.get("/console/")
        assert page.status_code == 200 and "Sign out cyd" in page.text
        out = person.post("/console/logout", page.text)
        assert out.status_code == 303
        assert person.http.get("/console/").status_code == 303  # the session is gone server-side


def test_wrong_codes_lock_the_account_and_the_page_says_until_when(coord, admin):
    with Person(coord, add(admin, "dan")) as person:
        _lockout(person)


def _lockout(person: Person) -> None:
    wrong = str((int(person.totp.now()) + 1) % 10**6).zfill(6)
    for _ in range(MAX_FAILURES - 1):
        r = person.sign_in("dan", wrong)
        assert r.status_code == 401 and "wrong user name, password or code" in r.text
    locked = person.sign_in("dan", wrong)
    assert locked.status_code == 429 and "locked until" in locked.text
    right = person.sign_in("dan", person.totp.at(time.time() + 30))
    assert right.status_code == 429 and "locked until" in right.text
    unknown = person.sign_in("nobody-here", wrong)
    assert unknown.status_code == 401 and "wrong user name, password or code" in unknown.text


def test_forms_before_sign_in_are_short_and_carry_no_files(coord):
    with httpx.Client(base_url=coord.url, follow_redirects=False) as anon:
        files = anon.post("/console/login", files={"f": ("x.bin", b"0" * 1000)},
                          headers={"origin": coord.url})
        assert files.status_code == 415
        big = anon.post("/console/login", content=b"name=" + b"a" * 70_000,
                        headers={"origin": coord.url,
                                 "content-type": "application/x-www-form-urlencoded"})
        assert big.status_code == 413


def test_a_deep_link_returns_to_its_page_after_sign_in(coord, admin):
    job = admin.submit(tar_folder(HELLO), JobSpec.from_dict({"name": "deep"}))
    with Person(coord, add(admin, "gus", admin=True)) as gus:
        to = gus.http.get(f"/console/jobs/{job['id']}")
        assert to.status_code == 303
        login = gus.http.get(to.headers["location"])
        assert f'value="/console/jobs/{job["id"]}"' in login.text
        signed_in = gus.post("/console/login", login.text, name="gus", password=PASSWORD,
                             code=gus.totp.at(time.time() + 30), next=f"/console/jobs/{job['id']}")
        assert signed_in.headers["location"] == f"/console/jobs/{job['id']}"
        for evil in ("https://evil.example/", "//evil.example/", "/v1/jobs", "/console\\x"):
            page = gus.http.get("/console/login", params={"next": evil})
            assert 'name="next" value="/console/"' in page.text, evil


def test_a_person_sees_only_their_own_apps_jobs(coord, admin, bea):
    theirs = admin.submit(tar_folder(HELLO), JobSpec.from_dict({"name": "admins-own"}))
    assert bea.http.get(f"/console/jobs/{theirs['id']}").status_code == 404
    assert bea.http.get(f"/console/jobs/{theirs['id']}/stream").status_code == 404
    assert "admins-own" not in bea.http.get("/console/").text
    assert bea.http.get("/console/machines").status_code == 403  # not an admin
    page = bea.http.get("/console/").text
    cancel = bea.post(f"/console/jobs/{theirs['id']}/cancel", page)
    assert cancel.status_code == 404
    assert admin.job(theirs["id"])["state"] == "queued"  # untouched


def test_the_submit_form_refuses_bad_input_by_field_and_stores_nothing(coord, admin, bea):
    before = len(admin.jobs())
    page = bea.http.get("/console/submit").text
    cases = [
        ({"dockerfile": ""}, "dockerfile", "type a Dockerfile"),
        ({"dockerfile": "FROM debian:evil\n", "acknowledge": "yes"}, "context", "FROM"),
        ({"dockerfile": "FROM localhost/campugrid/python:bookworm\n", "gpus": "two",
          "acknowledge": "yes"}, "gpus", "a whole number"),
        ({"dockerfile": "FROM localhost/campugrid/python:bookworm\n", "datasets": "[{",
          "acknowledge": "yes"}, "datasets", "not valid JSON"),
        ({"dockerfile": "FROM localhost/campugrid/python:bookworm\n",
          "datasets": '[{"name": "d", "uri": "s3://open-data/x.csv"}]', "acknowledge": "yes"},
         "datasets", "sha256"),
        ({"dockerfile": "FROM localhost/campugrid/python:bookworm\n", "memory_mb": "-5",
          "acknowledge": "yes"}, "memory_mb", "memory_mb"),
        ({"dockerfile": "FROM localhost/campugrid/python:bookworm\n", "image_reuse": "always",
          "acknowledge": "yes"}, "image_reuse", "must be one of first, verified, never"),
        ({"dockerfile": "FROM localhost/campugrid/python:bookworm\nRUN --network=host true\n",
          "acknowledge": "yes"}, "context", "egress proxy"),
        ({"dockerfile": "FROM localhost/campugrid/python:bookworm\nCOPY train.py /t.py\n",
          "acknowledge": "yes"}, "context", "train.py is not in the build context"),
        ({"dockerfile": "FROM localhost/campugrid/python:bookworm\n", "acknowledge": "yes"},
         "command", "the job says nothing to run"),
    ]
    for fields, field, words in cases:
        r = bea.post("/console/submit", page, **fields)
        assert r.status_code == 422, (fields, r.status_code)
        error = re.search(rf'id="{field}-error" role="alert">([^<]*)<', r.text)
        assert error and words in error[1], (fields, field, r.text[-3000:])
    folder = bea.http.post("/console/submit", data={"csrf": bea.form_token(page),
                                                    "acknowledge": "yes"},
                           files=[("folder", ("job/../../etc/passwd", b"x"))],
                           headers={"origin": coord.url})
    assert folder.status_code == 422 and "unusable path" in folder.text
    assert len(admin.jobs()) == before


def test_the_submit_form_can_ask_for_an_offline_build(coord, admin, bea):
    page = bea.http.get("/console/submit").text
    r = bea.post("/console/submit", page, dockerfile="FROM localhost/campugrid/python:bookworm\n",
                 command="true", build_offline="1", acknowledge="yes")
    assert r.status_code == 303, r.text[-2000:]
    job = admin.job(r.headers["location"].rsplit("/", 1)[1])
    assert job["spec"]["build"] == {"network": "none"}
    admin.cancel(job["id"])


def test_an_enrolment_link_works_once_and_a_reset_gives_a_new_one(coord, admin):
    link = add(admin, "eli")
    with Person(coord, link):
        pass
    with httpx.Client(base_url=coord.url) as again:
        r = again.get(link.removeprefix(coord.url))
        assert r.status_code == 401 and "used already" in r.text
    assert httpx.post(f"{coord.url}/v1/users/eli/reset").status_code == 401  # signed only
    reset = admin.reset_user("eli")
    assert reset["link"] != link and not reset["enrolled"]
    with Person(coord, reset["link"]) as eli:
        assert eli.sign_in("eli", eli.totp.at(time.time() + 30)).status_code == 303
        assert admin.remove_user("eli") == {"removed": True}
        assert eli.http.get("/console/").status_code == 303  # signed out everywhere



def test_a_jobs_checkpoint_downloads_for_its_owner_only_and_its_machine_shows_by_name(
        coord, admin, bea):
    from tests.support.machines import add_machine

    store = coord.coord.store
    for queued in admin.jobs(state="queued", limit=1000):  # earlier tests' jobs: out of the way
        admin.cancel(queued["id"])
    page = bea.http.get("/console/submit").text
    made = bea.post("/console/submit", page, dockerfile="FROM localhost/campugrid/python:bookworm\n",
                    command="true", name="ckpt", acknowledge="yes")
    job_id = made.headers["location"].rsplit("/", 1)[1]
    m = add_machine(store, "ck", {})
    assert store.claim_next(m, 30).id == job_id
    data = b"a checkpoint's bytes"
    coord.coord.objects.put_bytes(f"checkpoints/{job_id}/1-2.tar.gz", data)
    store.checkpoints.record(attempt(job_id, 1, m), epoch=2, key=f"checkpoints/{job_id}/1-2.tar.gz",
                            size=len(data), sha256=hashlib.sha256(data).hexdigest(), keep=3)
    shown = bea.http.get(f"/console/jobs/{job_id[:8]}").text  # an id's start works here too
    assert f'href="/console/jobs/{job_id}/checkpoints/2"' in shown
    assert "ck" in re.search(r'id="job-machine">([^<]*)<', shown)[1]  # its name, not its id
    got = bea.http.get(f"/console/jobs/{job_id}/checkpoints/2")
    assert got.status_code == 200 and got.content == data
    assert f'filename="{job_id}-epoch-2.tar.gz"' in got.headers["content-disposition"]
    assert bea.http.get(f"/console/jobs/{job_id}/checkpoints/3").status_code == 404
    with Person(coord, add(admin, "hal")) as hal:  # another person's app: not found
        assert hal.sign_in("hal", hal.totp.at(time.time() + 30)).status_code == 303
        assert hal.http.get(f"/console/jobs/{job_id}/checkpoints/2").status_code == 404
    store.cancel(job_id)
