"""What building a researcher's own Dockerfile through campugrid costs, against a plain build.

    .venv/bin/python bench/builds.py [--rounds 3] [--only NAME ...] [--runsc PATH ...]
                                                            (as root, after infra/setup.sh)

The corpus (tests/corpus, but the entries that fetch from the stand-ins for GitHub, conda and the
PyTorch index, which a plain build cannot reach) built two ways on this machine, in the same
run, caches warm (one round first, not counted: the base pulled, the caches filled):
  - baseline: a plain rootless `buildah bud` as the provider user, RUN steps with the host's
    network installing from PyPI directly, FROM the same python:3.11-slim stand-in. (Plain
    `podman build` would be the same Buildah with crun, which cannot start containers on
    these hosts' hybrid cgroups; chroot isolation is the fastest plain build there is.)
  - campugrid: submit -> the job running, through the platform as `campugrid up` starts it,
    its Docker Hub mirror caching a stand-in Hub (no public registry is reachable here):
    lease, base by digest (cached), the build with every RUN step under gVisor, reaching PyPI
    and Debian through the agent's and the platform's egress proxies and the platform's
    package caches, up to the job's "running", which
    the agent reports as it starts the sandbox: like the baseline, this counts no container's
    start.
The goal (issue 14): campugrid at most 1.5x the plain build on a warm cache. With --runsc
given more than once (by default: runsc-from-go.sh's and Debian's, where present), campugrid's
builds run once with each, one agent after the other (`campugrid agent run --runsc PATH`),
side by side in the tables; the plain build runs beside the first.

The first table also gives campugrid's build alone (its build and commit phases: the builder
with every RUN step in gVisor) against the plain build: the part of the ratio that is the
sandbox's (bench/run_steps.py measures that per kind of step), apart from what the platform
adds around it (the lease, the context, the bases).

A second table splits campugrid's time by the lines its build log ends with ("ready to run
... after the lease: ...", "built in ..., committed into this machine's store in ..."): where
the gap to the plain build goes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from recovery import until  # bench/, beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/support: the stand-in python image and open registry

from campugrid.buildpolicy.dockerfiles import check_dockerfile, pin_bases  # noqa: E402
from campugrid.cli.platform import Platform, ProviderUser  # noqa: E402
from campugrid.cli.seaweed import free_port  # noqa: E402
from campugrid.client import Api, tar_folder  # noqa: E402
from campugrid.protocol.spec import JobSpec  # noqa: E402
from tests.support.oci import PYTHON_SLIM_HUB, UV, OpenRegistry, python_slim, uv_image  # noqa: E402
from tests.support.standins import NAMES, this_network  # noqa: E402
from tests.support.timing import BUILT, READY  # noqa: E402


def entries() -> dict[str, tuple[Path, dict[str, Any]]]:
    """The corpus entries that build, but those that need the stand-ins."""
    corpus = REPO / "tests" / "corpus"
    out = {p.name: (p, json.loads((p / "expect.json").read_text()))
           for p in corpus.iterdir() if p.is_dir()}
    for named in corpus.glob("*.json"):
        expect = json.loads(named.read_text())
        out[named.stem] = (REPO / expect.pop("context"), expect)
    return {k: v for k, v in sorted(out.items()) if v[1]["state"] == "succeeded"
            and not any(n in line for line in v[1].get("egress", ()) for n in NAMES)}


def context_copy(source: Path, root: Path, user: ProviderUser) -> Path:
    folder = Path(tempfile.mkdtemp(dir=root))
    shutil.copytree(source, folder / "ctx", ignore=shutil.ignore_patterns("expect.json"))
    for path in [folder, *folder.rglob("*")]:
        os.chown(path, user.uid, user.gid)
    return folder / "ctx"


def plain_build(user: ProviderUser, context: Path, tag: str) -> float:
    # uv and Poetry (requests) trust their own roots unless told to use the system's, which
    # hold this network's TLS proxy (pip in the image already does): build arguments after
    # each FROM, as the agent adds its own, not kept in the image.
    text = (context / "Dockerfile").read_text()
    (context / "Dockerfile.plain").write_text(
        pin_bases(text, {}, check_dockerfile(text).froms,
                  (("UV_SYSTEM_CERTS", "1"),
                   ("REQUESTS_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt"))))
    t = time.monotonic()
    done = subprocess.run(user.command(["buildah", "bud", "--isolation", "chroot",
                                        "--pull-never", "--layers=false", "-q", "-t", tag,
                                        "-f", str(context / "Dockerfile.plain"), str(context)]),
                          capture_output=True, text=True, timeout=900, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"plain build of {context} failed:\n{done.stderr[-2000:]}")
    took = time.monotonic() - t
    subprocess.run(user.command(["podman", "rmi", "-f", tag]), capture_output=True, timeout=120)
    return took


PHASES = ("lease wait + start", "context", "bases", "build", "commit")


def campugrid_build(api: Api, context: Path, expect: dict[str, Any]) -> tuple[float, dict[str, float]]:
    """Submit -> running, and that time split into PHASES (from the job's build log)."""
    t = time.monotonic()
    job = api.submit(tar_folder(context), JobSpec.from_dict(expect.get("spec", {})))["id"]
    until(lambda: api.job(job)["state"] in ("running", "succeeded", "failed"), timeout=900)
    took = time.monotonic() - t
    final = api.wait(job, timeout_s=900, check=False)
    if final["state"] != "succeeded":
        raise RuntimeError(f"job {job} {final['state']}: {final.get('reason')}")
    text = "".join(c["text"] for c in api.logs(job)["chunks"])  # a build log fits one page
    ready, built = READY.search(text), BUILT.search(text)
    if ready is None or built is None:
        raise RuntimeError(f"job {job}: its build log has no timing lines")
    total, inputs, bases, image = map(float, ready.groups())
    commit = float(built.group(2))
    return took, dict(zip(PHASES, (took - total, inputs, bases, image - commit, commit),
                          strict=True))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", nargs="*", metavar="NAME", help="these corpus entries only")
    ap.add_argument("--runsc", action="append", help="a runsc for the agent (repeatable)")
    args = ap.parse_args()
    runscs = args.runsc or [p for p in ("/usr/local/bin/runsc", "/usr/bin/runsc")
                            if Path(p).exists()]
    dated = {r: "runsc " + _release(subprocess.run([r, "--version"], capture_output=True,
                                                   text=True, check=True).stdout)
             for r in runscs}
    root = Path(tempfile.mkdtemp(prefix="campugrid-bench-builds-"))
    os.chmod(root, 0o711)
    user = ProviderUser.resolve()
    slim = python_slim(user.command([]))
    # The plain build finds the base under the name the Dockerfiles use.
    subprocess.run(user.command(["podman", "tag", slim, PYTHON_SLIM_HUB]), check=True, timeout=60)
    hub = OpenRegistry(root / "hub")
    hub.push(f"containers-storage:{slim}", "library/python:3.11-slim", as_user=user.command([]))
    # uv's image (uv-project copies uv out of it): on the stand-in hub as ghcr.io's mirror, and
    # under its ghcr.io name for the plain build
    hub.push(uv_image(root / "uv-image"), UV, as_user=user.command([]))
    subprocess.run(user.command(["skopeo", "copy", "--quiet", f"docker://{hub.address}/{UV}",
                                 f"containers-storage:ghcr.io/{UV}", "--src-tls-verify=false"]),
                   check=True, timeout=300)
    os.environ["CAMPUGRID_REGISTRY_MIRRORS"] = f"ghcr.io=http://{hub.address}"
    for name, value in this_network().items():
        os.environ.setdefault(name, value)
    platform = Platform(root / "state", http_port=free_port(),
                        admin_identity=root / "admin.json", hub_upstream=f"http://{hub.address}")
    corpus = {k: v for k, v in entries().items() if not args.only or k in args.only}
    plain: dict[str, list[float]] = {name: [] for name in corpus}
    ours = {(g, name): list[float]() for g in dated.values() for name in corpus}
    phases = {(g, name): list[dict[str, float]]() for g in dated.values() for name in corpus}
    try:
        platform.start()
        with platform.api() as api:
            for i, (runsc, gvisor) in enumerate(dated.items()):
                agent = platform.start_agent(f"bench-builds-{i}", args=("--runsc", runsc))
                for r in range(args.rounds + 1):  # round 0 warms the caches, not counted
                    for name, (source, expect) in corpus.items():
                        took_plain = float("nan")
                        if i == 0:
                            took_plain = plain_build(user, context_copy(source, root, user),
                                                     f"localhost/campugrid-bench/{name}:{r}")
                        took_ours, split = campugrid_build(api, context_copy(source, root, user),
                                                           expect)
                        if r:
                            if i == 0:
                                plain[name].append(took_plain)
                            ours[gvisor, name].append(took_ours)
                            phases[gvisor, name].append(split)
                        print(f"round {r} {name}: plain {took_plain:.1f} s, campugrid "
                              f"({gvisor}) {took_ours:.1f} s", flush=True)
                platform.stop_agent(agent)  # the next runsc's agent takes the next jobs
    finally:
        platform.stop()
        hub.stop()
        subprocess.run(user.command(["podman", "rmi", PYTHON_SLIM_HUB, f"ghcr.io/{UV}"]),
                       capture_output=True)
        shutil.rmtree(root, ignore_errors=True)

    print(f"\nthe corpus built on a warm cache, median of {args.rounds} rounds (campugrid: "
          "submit -> running)\n")
    w = max(17, *map(len, corpus))  # the first column fits the longest name
    for gvisor in dated.values():
        print(f"\ncampugrid with {gvisor}\n")
        print(f"| {'Dockerfile':<{w}} | plain buildah, network | campugrid, RUN in gVisor, "
              "proxied | vs base | its build alone | vs base |")
        print(f"|{'-' * (w + 2)}|------------------------|-----------------------------------"
              "|---------|-----------------|---------|")
        ratios, alone_ratios = [], []
        for name in corpus:
            base, got = statistics.median(plain[name]), statistics.median(ours[gvisor, name])
            alone = statistics.median(s["build"] + s["commit"] for s in phases[gvisor, name])
            ratios.append(got / base)
            alone_ratios.append(alone / base)
            print(f"| {name:<{w}} | {base:20.1f} s | {got:31.1f} s | {got / base:6.2f}x "
                  f"| {alone:13.1f} s | {alone / base:6.2f}x |")
        geo = statistics.geometric_mean(ratios)
        print(f"| {'geometric mean':<{w}} |                        |                          "
              f"         | {geo:6.2f}x |                 "
              f"| {statistics.geometric_mean(alone_ratios):6.2f}x |")
    print("\nits build alone: the build and commit phases below, the builder's own time with every "
          "RUN step in gVisor\n(bench/run_steps.py measures that sandbox's cost per step); the "
          "rest is the lease, the context and the bases")
    print("\ncampugrid's time by phase, seconds (median of the rounds; build: the base check, "
          "RUN steps under gVisor; commit: the image into the machine's own store)\n")
    print(f"| {'Dockerfile':<{w}} | {'runsc':<16} | " + " | ".join(f"{p:>7}" for p in PHASES) + " |")
    print(f"|{'-' * (w + 2)}|------------------|"
          + "|".join("-" * (max(7, len(p)) + 2) for p in PHASES) + "|")
    for name in corpus:
        for gvisor in dated.values():
            cells = [statistics.median(s[p] for s in phases[gvisor, name]) for p in PHASES]
            print(f"| {name:<{w}} | {gvisor[6:]:<16} | " + " | ".join(
                f"{c:>{max(7, len(p))}.1f}" for c, p in zip(cells, PHASES, strict=True)) + " |")


def _release(version: str) -> str:
    """runsc's release date from its --version ("go-20260905-…", "0.0~20240729.0")."""
    found = re.search(r"(20\d\d)(\d\d)(\d\d)", version)
    return "-".join(found.groups()) if found else version.split("\n")[0][-20:]


if __name__ == "__main__":
    main()
