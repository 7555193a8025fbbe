"""The web console in a real browser for tests: Debian's Chromium driven by Playwright, and a
person enrolled (password and TOTP) and signed in."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyotp
import pytest

CHROMIUM = "/usr/bin/chromium"
SHOTS = Path(os.environ.get("CAMPUGRID_SCREENSHOTS", "/tmp/campugrid-screenshots"))
PASSWORD = "correct horse battery staple"
CLI = [sys.executable, "-m", "campugrid.cli"]


@contextlib.contextmanager
def browser_page(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A Chromium page; a screenshot of every open page is saved if the test fails."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (infra/test does)")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM)
        context = browser.new_context()
        context.set_default_timeout(30_000)
        first = context.new_page()
        yield first
        if getattr(request.node, "failed", False):
            SHOTS.mkdir(parents=True, exist_ok=True)
            for i, open_page in enumerate(context.pages):
                shot = SHOTS / f"{request.node.name}-{i}.png"
                open_page.screenshot(path=str(shot), full_page=True)
                print(f"screenshot: {shot} ({open_page.url})")
        browser.close()


def run(env: dict[str, str], *args: str) -> str:
    """A `campugrid` command; its output (it must succeed)."""
    out = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out.stdout


def enrol(page: Any, link: str) -> pyotp.TOTP:
    """Enrol through the one-time link: a password and the first code of the authenticator."""
    from playwright.sync_api import expect

    page.goto(link)
    totp = pyotp.TOTP(page.locator("#totp-secret").inner_text().strip())
    expect(page.locator("img[alt^='QR code']")).to_be_visible()
    page.fill("#password", PASSWORD)
    page.fill("#again", PASSWORD)
    page.fill("#code", totp.now())
    page.click("button:has-text('Activate my account')")
    expect(page.locator(".notice")).to_contain_text("You are enrolled")
    return totp


def sign_in(page: Any, name: str, totp: pyotp.TOTP) -> None:
    """Sign in with the next step's code (enrolment used this one)."""
    from playwright.sync_api import expect

    page.fill("#name", name)
    page.fill("#password", PASSWORD)
    page.fill("#code", totp.at(time.time() + 30))
    page.click("button:has-text('Sign in')")
    expect(page.locator("h1")).to_have_text("Jobs")


def signed_in_admin(page: Any, env: dict[str, str], name: str = "ada") -> None:
    """A new admin, enrolled and signed in on this page."""
    link = run(env, "users", "add", name, "--admin").strip().splitlines()[-1]
    sign_in(page, name, enrol(page, link))
