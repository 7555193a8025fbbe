"""The frameworks image the checkpoint tests run (tests/frameworks), built the way a
researcher's image is: a job whose Dockerfile pip-installs tests/frameworks/requirements.txt,
submitted to the platform as `campugrid up` starts it, built by its agent (rootless Buildah,
RUN steps under gVisor, wheels through the coordinator's PyPI cache and nothing else), FROM
the stand-in for `python:3.11-slim` (tests/support/oci.py). The job checks what it imports;
its image is then named as set-up asks in the provider's store, and its site-packages are copied to a
folder for the tests that run the same frameworks on the host.

    .venv/bin/python -m tests.support.frameworks_image USER IMAGE SITE

(as root, from the checkout; infra/test runs it through infra/frameworks-image.sh)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from campugrid.cli.platform import BASE_IMAGE, PROVIDER_USER_ENV, Platform, ProviderUser
from campugrid.cli.seaweed import free_port
from campugrid.client import Api, tar_folder
from campugrid.protocol.spec import JobSpec
from tests.support.oci import python_slim

REQUIREMENTS = Path(__file__).resolve().parents[1] / "frameworks" / "requirements.txt"
# The job's check: the versions it imports and where they are; then it keeps its image a
# while (HOLD_S), so that set-up names it before the agent removes it at the task's end.
CHECK = ("import json, os, keras, lightning, torch, transformers; "
         "print(json.dumps({'site': os.path.dirname(os.path.dirname(torch.__file__)), "
         "**{m.__name__: m.__version__ for m in (torch, transformers, lightning, keras)}}))")
HOLD_S = 15
BUILD_TIMEOUT_S = 3600


def pinned() -> dict[str, str]:
    """name -> version, as tests/frameworks/requirements.txt pins them."""
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name] = version
    return pins


def context(folder: Path, base: str) -> bytes:
    folder.mkdir()
    shutil.copy(REQUIREMENTS, folder / "requirements.txt")
    (folder / "Dockerfile").write_text(
        f"FROM {base}\n"
        "COPY requirements.txt /tmp/requirements.txt\n"
        "RUN pip install --no-cache-dir -r /tmp/requirements.txt && rm /tmp/requirements.txt\n"
        "ENV KERAS_BACKEND=torch\n")
    return tar_folder(folder)


def build(provider: ProviderUser, image: str, root: Path) -> dict[str, Any]:
    """Runs the job on a platform of its own and names its image `image`; returns its
    result."""
    base = python_slim(provider.command([]))
    os.environ["CAMPUGRID_ALLOWED_BASES"] = f"{BASE_IMAGE},{base}"
    platform = Platform(root / "state", http_port=free_port(), admin_identity=root / "admin.json")
    try:
        platform.start()
        platform.start_agent("frameworks")
        api = platform.api()
        spec = JobSpec.from_dict({
            "name": "frameworks image",
            "command": ["sh", "-c", f'python3 -c "{CHECK}" && sleep {HOLD_S}'],
            "resources": {"memory_mb": 4096}})
        job = api.submit(context(root / "context", base), spec)["id"]
        said = wait_naming_its_image(api, job, provider, image)
    finally:
        platform.stop()
    result: dict[str, Any] = json.loads(said["result"])
    wrong = {name: result.get(name) for name, version in pinned().items()
             if name in result and result[name].split("+")[0] != version}
    if wrong:
        raise SystemExit(f"frameworks: the image has {wrong}, not {pinned()}")
    return result


def wait_naming_its_image(api: Api, job: str, provider: ProviderUser,
                          image: str) -> dict[str, Any]:
    """Waits for the job's end, naming its image `image` as soon as it is there."""
    named = False
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    while time.monotonic() < deadline:
        said = api.job(job)
        if not named:
            images = podman(provider, "images", "--format", "{{.Repository}}:{{.Tag}}").split()
            mine = [ref for ref in images if f"/{job}:" in ref]
            if mine:
                podman(provider, "tag", mine[0], image)
                named = True
        if said["state"] in ("succeeded", "failed", "cancelled"):
            if said["state"] != "succeeded" or not named:
                logs = "".join(c["text"] for c in api.logs(job)["chunks"])
                raise SystemExit(f"frameworks: the job {said['state']} ({said.get('reason')}),"
                                 f" its image {'named' if named else 'never seen'}\n{logs[-6000:]}")
            return said
        time.sleep(1)
    raise SystemExit(f"frameworks: the job took over {BUILD_TIMEOUT_S} s")


def podman(provider: ProviderUser, *args: str) -> str:
    return subprocess.run(provider.command(["podman", *args]), capture_output=True, text=True,
                          check=True, timeout=600).stdout


def copy_site(provider: ProviderUser, image: str, site_in_image: str, site: Path) -> None:
    """The image's site-packages into `site` (made anew), readable by all."""
    ctr = podman(provider, "create", "--pull=never", image, "true").strip()
    partial = site.with_name(site.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        out = subprocess.Popen(provider.command(["podman", "cp", f"{ctr}:{site_in_image}/.", "-"]),
                               stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "--no-same-owner", "-C", str(partial)], stdin=out.stdout,
                       check=True)
        if out.wait(timeout=600) != 0:
            raise SystemExit(f"frameworks: podman cp of {site_in_image} failed")
    finally:
        podman(provider, "rm", ctr)
    subprocess.run(["chmod", "-R", "a+rX,go-w", str(partial)], check=True)
    shutil.rmtree(site, ignore_errors=True)
    partial.rename(site)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("user", help="the provider user whose store gets the image")
    parser.add_argument("image", help="what to name the image in that store")
    parser.add_argument("site", type=Path, help="where the image's site-packages go")
    args = parser.parse_args()
    os.environ[PROVIDER_USER_ENV] = args.user
    provider = ProviderUser.resolve()
    root = Path(tempfile.mkdtemp(prefix="campugrid-frameworks-", dir="/var/tmp"))
    os.chmod(root, 0o711)  # the agent user must traverse it
    began = time.monotonic()
    try:
        result = build(provider, args.image, root)
    except BaseException:
        print(f"frameworks: the platform's state is kept in {root}")
        raise
    shutil.rmtree(root, ignore_errors=True)
    copy_site(provider, args.image, result["site"], args.site)
    print(f"frameworks: {args.image} built through the platform in {time.monotonic() - began:.0f} s "
          f"({', '.join(f'{k} {v}' for k, v in result.items() if k != 'site')}); "
          f"its {result['site']} copied to {args.site}")


if __name__ == "__main__":
    main()
