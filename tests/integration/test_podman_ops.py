"""The agent's questions to its Podman (sandbox/podman_ops.py), the same cases through both
paths, as the provider user: podman-py on the agent's own API service, and the command line.
Sandboxes are started the way the runtime starts them (the CLI, under runsc)."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys

import pytest

from campugrid.cli.platform import ProviderUser
from tests.support.provider import DEFAULT_IMAGE
from tests.support.runtimes import REPO

pytestmark = pytest.mark.integration

SCRIPT = r"""
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from campugrid.sandbox import podman_ops
from campugrid.sandbox.podman_runsc import RUNSC_FLAGS, runtime_dir
kind, image, mark = sys.argv[1], sys.argv[3], sys.argv[4]
ops = (podman_ops.ApiOps(runtime_dir() / "campugrid" / f"ops-test-{mark}.sock") if kind == "api"
       else podman_ops.CliOps())
out = {"kind": type(ops).__name__}
runsc = ["podman", "--runtime", "runsc", *RUNSC_FLAGS]
label = ["--label", f"campugrid.agent=ops-{mark}"]
try:
    # a job that ran and exited
    done = f"ops-done-{mark}"
    t0 = time.time()
    subprocess.run([*runsc, "run", "--name", done, "--network", "none", *label, image,
                    "sh", "-c", "exit 3"], capture_output=True, check=False)
    state = ops.state(done)
    started = podman_ops.started_at(state)
    out["exit_code"] = state["ExitCode"]
    out["started_within_run"] = isinstance(started, float) and t0 - 1 <= started <= time.time() + 1
    # one that was made but never started
    never = f"ops-never-{mark}"
    subprocess.run(["podman", "create", "--name", never, *label, image, "true"],
                   capture_output=True, check=True)
    out["never_started"] = podman_ops.started_at(ops.state(never))
    # one that runs
    up = f"ops-up-{mark}"
    subprocess.run([*runsc, "run", "-d", "--name", up, "--network", "none", *label, image,
                    "sleep", "60"], capture_output=True, check=True)
    running = ops.state(up)
    out["running"] = running["Running"]
    out["conmon"] = int(running["ConmonPid"] or 0) > 0
    out["labelled"] = sorted(ops.labelled("campugrid.agent", f"ops-{mark}")) == sorted(
        [done, never, up])
    out["labelled_other"] = ops.labelled("campugrid.agent", f"nobody-{mark}")
    ops.kill(up, "TERM")
    deadline = time.monotonic() + 20
    while (ops.state(up) or {}).get("Running") and time.monotonic() < deadline:
        time.sleep(0.1)
    out["running_after_term"] = (ops.state(up) or {}).get("Running")
    for name in (done, never, up):
        ops.remove(name)
    out["gone"] = [ops.state(n) for n in (done, never, up)]
    out["labelled_after"] = ops.labelled("campugrid.agent", f"ops-{mark}")
    # what is not there: no error, no answer
    ops.remove("ops-no-such"); ops.kill("ops-no-such", "TERM"); ops.remove_image("localhost/no/such:x")
    out["absent"] = [ops.state("ops-no-such"), ops.image_size("localhost/no/such:x"),
                     ops.image_layers("localhost/no/such:x")]
    want = json.loads(subprocess.run(["podman", "image", "inspect", image], capture_output=True,
                                     text=True, check=True).stdout)[0]["RootFS"]["Layers"]
    out["layers"] = ops.image_layers(image) == want and len(want) > 0
    env = json.loads(subprocess.run(["podman", "image", "inspect", image], capture_output=True,
                                    text=True, check=True).stdout)[0]["Config"].get("Env") or []
    out["env"] = [ops.image_env(image) == env, ops.image_env("localhost/no/such:x")]
    ident = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", image],
                           capture_output=True, text=True, check=True).stdout.strip()
    out["id"] = [ops.image_id(image) == ident, ops.image_id("localhost/no/such:x")]
    # a file of the image, through a symlink inside it (/etc/os-release -> ../usr/lib/...)
    want_release = subprocess.run(["podman", "run", "--rm", "--runtime", "runsc", *RUNSC_FLAGS,
                                   "--network", "none", image, "cat", "/etc/os-release"],
                                  capture_output=True, check=True).stdout
    try:
        ops.image_file(image, "/etc/os-release", 10)
        too_big = "read"
    except ValueError:
        too_big = "refused"
    out["file"] = [ops.image_file(image, "/etc/os-release", 1 << 20) == want_release,
                   ops.image_file(ident, "/etc/os-release", 1 << 20) == want_release,  # by ID
                   ops.image_file(image, "/etc/no-such-file", 1 << 20),
                   ops.image_file(image, "/etc", 1 << 20),
                   ops.image_file("localhost/no/such:x", "/etc/os-release", 1 << 20), too_big,
                   [n for n in subprocess.run(["podman", "ps", "-a", "--format", "{{.Names}}"],
                                              capture_output=True, text=True).stdout.split()
                    if n.startswith("campugrid-read-")]]
    index = ops.layer_index()
    store = json.loads(index[0].read_text())
    out["layer_index"] = [str(p.parent) for p in index] == [
        os.path.expanduser("~/.local/share/containers/storage/overlay-layers")] * 2 \
        and want[0] in {layer.get("diff-digest") for layer in store}
    # images: names, sizes, tags, and removing one name of two
    a, b = f"localhost/ops-{mark}/img:a", f"localhost/ops-{mark}/img:b"
    ops.tag(image, a)
    ops.tag(a, b)
    out["sizes_equal"] = ops.image_size(a) == ops.image_size(b) == ops.image_size(image) > 0
    out["listed"] = a in ops.images() and b in ops.images()
    out["removed"] = ops.remove_image(a)
    out["after_one_name"] = [ops.image_size(a), ops.image_size(b) is not None,
                             ops.image_size(image) is not None]
    # while another agent of this user writes to the store, a removal waits, then leaves it
    from campugrid.sandbox import store_lock
    with store_lock.writing():
        t0 = time.monotonic()
        left = ops.remove_image(b)
        waited = time.monotonic() - t0
    out["left_while_writing"] = [left, ops.image_size(b) is not None,
                                 store_lock.REMOVE_WAIT_S <= waited < store_lock.REMOVE_WAIT_S + 5]
    ops.remove_image(b)
    out["after_both"] = [ref for ref in ops.images() if ref.startswith(f"localhost/ops-{mark}/")]
    out["base_kept"] = ops.image_size(image) is not None
finally:
    for n in ("done", "never", "up"):
        subprocess.run(["podman", "rm", "-f", f"ops-{n}-{mark}"], capture_output=True)
    if kind == "api":
        ops.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("kind", ["api", "cli"])
def test_both_paths_answer_alike(kind: str):
    user = ProviderUser.resolve()
    mark = secrets.token_hex(4)
    proc = subprocess.run(user.command([sys.executable, "-c", SCRIPT, kind, str(REPO),
                                        DEFAULT_IMAGE, mark]),
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got.pop("kind") == {"api": "ApiOps", "cli": "CliOps"}[kind]
    assert got == {
        "exit_code": 3, "started_within_run": True, "never_started": False,
        "running": True, "conmon": True, "labelled": True, "labelled_other": [],
        "running_after_term": False, "gone": [None, None, None], "labelled_after": [],
        "absent": [None, None, None], "layers": True, "layer_index": True,
        "env": [True, None], "id": [True, None],
        "file": [True, True, None, None, None, "refused", []],
        "sizes_equal": True, "listed": True,
        "removed": True, "after_one_name": [None, True, True],
        "left_while_writing": [False, True, True], "after_both": [], "base_kept": True,
    }


IMAGE_CASES = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
from campugrid.sandbox.podman_ops import CliOps
from tests.support.ops_cases import image_cases
print(json.dumps(image_cases(CliOps(), sys.argv[2], sys.argv[3])))
"""


def test_the_fake_runtime_answers_image_questions_as_podman_does():
    """FakeOps, which the fake runtime offers as its `ops`, holds to the same image cases as
    the provider's Podman (the same body: tests/support/ops_cases.py)."""
    from campugrid.sandbox.fake import FakeRuntime
    from tests.support.ops_cases import image_cases

    user = ProviderUser.resolve()
    mark = secrets.token_hex(4)
    proc = subprocess.run(user.command([sys.executable, "-c", IMAGE_CASES, str(REPO),
                                        DEFAULT_IMAGE, mark]),
                          capture_output=True, text=True, timeout=300, cwd="/")
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    fake = image_cases(FakeRuntime(images={DEFAULT_IMAGE}).ops, DEFAULT_IMAGE, mark)
    assert real == fake == {
        "present": [True, True, True, True, True], "missing": [None, None, None, None],
        "tagged": [True, True, True], "one_name_left": [None, True, True], "gone": []}
