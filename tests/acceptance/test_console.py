"""Issue 12's console, in a real browser (Debian's Chromium, driven by Playwright) against a
running platform: enrolment with TOTP, a wrong code refused, a submit through the form, the
waiting job's reason, approving the pending machine, the job's logs streaming to the end, and
the GPU memory chart."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from campugrid.agent.client import CoordinatorClient, Membership
from campugrid.cli.platform import Platform
from campugrid.cli.seaweed import free_port
from campugrid.protocol import agent_pb2 as pb
from tests.support.console import PASSWORD, browser_page, enrol, run, sign_in

pytestmark = pytest.mark.acceptance
TICKS = "for i in 1 2 3 4 5 6 7 8; do echo tick $i; sleep 1; done"


@pytest.fixture
def page(request: pytest.FixtureRequest) -> Iterator[object]:
    with browser_page(request) as first:
        yield first


def test_from_nothing_to_a_finished_job_in_the_console(page):
    from playwright.sync_api import expect

    root = Path(tempfile.mkdtemp(prefix="campugrid-console-"))
    os.chmod(root, 0o711)
    p = Platform(root / "state", http_port=free_port(), lease_seconds=4.0,
                 admin_identity=root / "admin.json").start()
    try:
        link = run(p.cli_env(), "users", "add", "ada", "--admin").strip().splitlines()[-1]
        assert link.startswith(f"{p.url}/console/enrol?token=")
        agent = p.start_agent("home-pc", approve=False)  # pending until approved below

        # Enrolment: a password and the first code from the authenticator.
        totp = enrol(page, link)

        # A wrong code is refused; the right one (the next step: enrolment used this one) works.
        page.fill("#name", "ada")
        page.fill("#password", PASSWORD)
        page.fill("#code", str((int(totp.now()) + 1) % 10**6).zfill(6))
        page.click("button:has-text('Sign in')")
        expect(page.locator("#login-error")).to_contain_text("wrong user name, password or code")
        sign_in(page, "ada", totp)

        # Submit through the form: the first one must acknowledge that providers read it all.
        page.click("nav >> text=Submit")
        page.fill("#f-name", "console-ticks")
        page.fill("#f-dockerfile", "FROM localhost/campugrid/python:bookworm\n")
        page.fill("#f-command", TICKS)
        page.fill("#f-memory_mb", "lots")
        page.select_option("#f-image_reuse", "verified")
        page.click("#submit-form button[type=submit]")
        expect(page.locator("#memory_mb-error")).to_contain_text("a whole number")
        expect(page.locator("#acknowledge-error")).to_contain_text("providers can read")
        expect(page.locator("#f-command")).to_have_value(TICKS)  # nothing typed is lost
        expect(page.locator("#f-image_reuse")).to_have_value("verified")
        page.fill("#f-memory_mb", "512")
        page.check("#f-acknowledge")
        page.click("#submit-form button[type=submit]")
        expect(page).to_have_url(re.compile(r"/console/jobs/[0-9a-f-]{36}$"))
        job_id = page.url.rsplit("/", 1)[1]
        with p.api() as api:
            assert api.job(job_id)["spec"]["image"] == {"reuse": "verified"}

        # It waits, and says why: the only machine is pending.
        expect(page.locator("#job-state")).to_have_text("queued")
        expect(page.locator("#job-waiting")).to_contain_text("owner's approval")

        # The admin approves the pending machine in another tab, by its fingerprint.
        machines = page.context.new_page()
        machines.goto(f"{p.url}/console/machines")
        machine_id = agent.machine_id()
        assert machine_id
        row = machines.locator("tr.machine", has_text="home-pc")
        expect(row).to_have_class(re.compile("pending"))
        fingerprint = row.locator("code.fingerprint").inner_text()
        with p.api() as api:
            assert fingerprint == next(m["fingerprint"] for m in api.machines()
                                       if m["id"] == machine_id)
        # Approving asks once, naming the fingerprint; saying no changes nothing.
        asked: list[str] = []
        machines.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
        row.locator("button:has-text('Approve')").click()
        assert asked and fingerprint in asked[0], asked
        expect(row).to_have_class(re.compile("pending"))
        machines.once("dialog", lambda d: d.accept())
        row.locator("button:has-text('Approve')").click()
        expect(machines.locator("tr.machine", has_text="home-pc")).to_have_class(
            re.compile("approved"))
        expect(machines.locator("#notice")).to_have_text(
            "Machine approved: it takes work from now on.")

        # The job page follows the run live: lines arrive while the job is still running,
        # before the page reloads itself at the end.
        reloads: list[str] = []
        page.on("framenavigated", lambda frame: reloads.append(frame.url))
        expect(page.locator("#run-log")).to_contain_text("tick 2", timeout=240_000)
        assert page.locator("#job-state").inner_text() == "running"
        assert reloads == [], "the log arrived by a reload, not by the stream"
        # The attempts table and the machine follow too: the lease, by the machine's name.
        expect(page.locator("#events")).to_contain_text("leased")
        expect(page.locator("#job-machine")).to_have_text("home-pc")
        assert reloads == []
        expect(page.locator("#job-state")).to_have_text("succeeded", timeout=120_000)
        # The state event comes just before the stream's end, which reloads the page: wait
        # for that event, not only for the state (a full run once read `reloads` in between).
        until = time.monotonic() + 30
        while not reloads and time.monotonic() < until:
            page.wait_for_timeout(100)
        assert reloads, "the page reloads itself once the job has ended"
        expect(page.locator("#run-log")).to_contain_text("tick 8")
        expect(page.locator("#events")).to_contain_text("succeeded")
        # The list names the machine, not an id's start.
        listed = page.context.new_page()
        listed.goto(f"{p.url}/console/")
        expect(listed.locator("tr.job", has=listed.locator(f"a[href$='{job_id}']"))).to_contain_text(
            "home-pc")
        listed.close()

        # The memory chart: the real agent has no GPU; a machine that reports two GPUs and
        # Apple unified memory over real signed gRPC is drawn to one scale.
        machines.reload()
        expect(machines.locator("#no-gpus")).to_be_visible()
        # Which gVisor the real agent runs, dated (Debian's 0.0~20240729.0, or runsc-from-go.sh's).
        expect(machines.locator("tr.machine[data-name='home-pc'] small.runtime")).to_have_text(
            re.compile(r"^runsc \S*20\d{6}"))
        rig = CoordinatorClient(Membership.join(root / "rig", p.grpc_address, p.pin))
        rig.register("rig", pb.Capabilities(runtime="runsc", builder="buildah"))
        p.running.coord.machines.approve(rig.machine_id)
        rig.heartbeat(pb.Capabilities(runtime="runsc", builder="buildah", gpus=[
            pb.Gpu(uuid="GPU-a", name="RTX 4090", kind="nvidia", memory_total_mb=24_000,
                   memory_free_mb=18_000, compute_capability="8.9"),
            pb.Gpu(uuid="GPU-b", name="RTX 3060", kind="nvidia", memory_total_mb=12_000,
                   memory_free_mb=12_000, compute_capability="8.6"),
            pb.Gpu(uuid="apple", name="M2 Max", kind="apple", memory_total_mb=32_000,
                   memory_free_mb=20_000, shared_memory=True)]))
        rig.close()
        machines.reload()
        charts = machines.locator("section.gpus[data-machine='rig'] svg.mem")
        expect(charts).to_have_count(3)
        heights = [charts.nth(i).bounding_box()["height"] for i in range(3)]
        assert heights[0] == pytest.approx(2 * heights[1], rel=0.02), heights  # one scale
        expect(machines.locator("section.gpus[data-machine='rig'] svg.mem.shared")).to_have_count(1)
        expect(machines.locator("section.gpus[data-machine='rig']")).to_contain_text(
            "6,000 MB outside, 0 MB reserved, 18,000 MB free of 24,000 MB")

        # Every field of every form has a label, and a phone's width needs no sideways scroll.
        for path in ("/console/submit", "/console/machines", "/console/"):
            page.goto(f"{p.url}{path}")
            unlabelled = page.evaluate(
                "() => [...document.querySelectorAll('input:not([type=hidden]), select, textarea')]"
                ".filter(e => e.labels.length === 0 && !e.getAttribute('aria-label'))"
                ".map(e => e.name || e.id)")
            assert unlabelled == [], (path, unlabelled)
        page.set_viewport_size({"width": 390, "height": 844})
        for path in ("/console/", f"/console/jobs/{job_id}", "/console/submit", "/console/machines"):
            page.goto(f"{p.url}{path}")
            assert page.evaluate("() => document.documentElement.scrollWidth <= window.innerWidth"), path
        page.set_viewport_size({"width": 1280, "height": 800})

        # The jobs list shows it, filtered by state and name.
        page.goto(f"{p.url}/console/?state=succeeded&name=ticks")
        expect(page.locator(f"a[href$='/jobs/{job_id}']")).to_have_text("console-ticks")
        page.goto(f"{p.url}/console/?state=queued")
        expect(page.locator(f"a[href$='/jobs/{job_id}']")).to_have_count(0)
    finally:
        p.stop()
        shutil.rmtree(root, ignore_errors=True)
