"""What the shared registry saves a second machine, and what the registry path costs.

    .venv/bin/python bench/images.py [--rounds 3] [--layer-mb 64]     (as root, after infra/setup.sh)

Table 1, submit -> running of the same job on a machine that does not have its image:
  - baseline: built from scratch there (`image.reuse: never`);
  - pulled by digest from the registry, after another machine built and pushed it. Before
    each pull the image is removed from the provider's store (its base stays, as it would on
    any provider), so the job's own layers cross the registry as they would to a new machine.
Table 2, throughput of one image (the base plus a layer of `--layer-mb` random bytes):
  - baseline: plain `skopeo copy` between the provider's store and an OCI folder on disk;
  - through the registry the way agents move images: the agent's own push and pull code
    (campugrid.agent.images.ImageCache) with a token the coordinator minted for the one
    repository.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recovery import until  # bench/, beside this script

from campugrid.cli.platform import Platform, ProviderUser
from campugrid.cli.seaweed import free_port
from campugrid.client import Api, tar_folder
from campugrid.coordinator.images import repository
from campugrid.protocol.spec import JobSpec

BASE = "localhost/campugrid/python:bookworm"


def context(folder: Path, layer_mb: int) -> bytes:
    """A job whose build makes a layer of `layer_mb` random MB (a new one every round)."""
    folder.mkdir(parents=True)
    (folder / "Dockerfile").write_text(
        f"FROM {BASE}\n"
        f"RUN head -c {layer_mb}M /dev/urandom > /weights.bin && echo {secrets.token_hex(8)} > /id\n"
        'CMD ["sleep", "30"]\n')
    return tar_folder(folder)


def to_running(api: Api, ctx: bytes, reuse: str) -> tuple[str, float]:
    t0 = time.monotonic()
    job = api.submit(ctx, JobSpec.from_dict({"image": {"reuse": reuse}}))["id"]
    until(lambda: api.job(job)["state"] in ("running", "succeeded", "failed"), timeout=600)
    took = time.monotonic() - t0
    state = api.job(job)["state"]
    if state != "running":
        raise RuntimeError(f"job {job} is {state}: {api.job(job).get('reason')}")
    return job, took


def as_provider(user: ProviderUser, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(user.command(list(argv)), capture_output=True, text=True, timeout=900,
                          check=True)


def forget_image(user: ProviderUser, digest: str) -> None:
    """Remove every name of the pushed image from the provider's store (the image goes with
    its last name; the base it was built on stays)."""
    hexd = digest.removeprefix("sha256:")
    names = as_provider(user, "podman", "images", "--format", "{{.Repository}}:{{.Tag}}").stdout
    for ref in names.split():
        if ref.endswith(":" + hexd):
            as_provider(user, "podman", "rmi", "--force", ref)


def pushed_digest(api: Api, job_id: str) -> str:
    for e in api.job(job_id)["events"]:
        if e["kind"] == "image" and "built and pushed image" in e["detail"]:
            return str(e["detail"].split("image ")[1].split()[0])
    raise RuntimeError(f"job {job_id} pushed no image: {api.job(job_id)['events']}")


def throughput(platform: Platform, user: ProviderUser, root: Path, layer_mb: int,
               rounds: int) -> dict[str, list[float]]:
    """MB/s of one image, out of the provider's store and back in: plain skopeo to and from
    a gzip-compressed OCI folder, against the agent's push and pull through the registry (which
    compresses the same way). Before each copy in, only the base is in the store."""
    ctx = root / "tp"
    ctx.mkdir()
    os.chmod(ctx, 0o755)
    (ctx / "Dockerfile").write_text(f"FROM {BASE}\nRUN head -c {layer_mb}M /dev/urandom > /w\n")
    assert platform.running is not None
    registry = platform.running.coord.images.registry
    assert registry is not None
    work = root / "tp-work"
    work.mkdir()
    os.chmod(work, 0o777)  # the provider user writes its digest file here
    out: dict[str, list[float]] = {k: [] for k in ("skopeo out", "skopeo in", "push", "pull")}
    size_mb = 0.0
    for r in range(rounds):
        image = f"localhost/campugrid-bench/layer:{r}"
        as_provider(user, "buildah", "bud", "--isolation", "chroot", "--pull-never", "-q",
                    "--timestamp", "0", "-t", image, str(ctx))
        size_mb = int(as_provider(user, "podman", "image", "inspect", "--format", "{{.Size}}",
                                  image).stdout.strip()) / 1024**2
        oci = work / f"oci-{r}"
        t = time.monotonic()
        as_provider(user, "skopeo", "copy", "--quiet", "--dest-compress",
                    f"containers-storage:{image}", f"oci:{oci}:x")
        out["skopeo out"].append(size_mb / (time.monotonic() - t))
        repo = repository(secrets.token_hex(32))
        token = registry.mint("machine:bench", repo, ("push", "pull"))
        digest, took = as_provider(user, sys.executable, "-c", AGENT_COPY, str(work), "push",
                                   image, registry.address, repo, token).stdout.split()
        out["push"].append(size_mb / float(took))
        as_provider(user, "podman", "rmi", "--force", image)
        forget_image(user, digest)  # only the base is left
        back = f"localhost/campugrid-bench/back:{r}"
        t = time.monotonic()
        as_provider(user, "skopeo", "copy", "--quiet", f"oci:{oci}:x", f"containers-storage:{back}")
        out["skopeo in"].append(size_mb / (time.monotonic() - t))
        as_provider(user, "podman", "rmi", "--force", back)
        shutil.rmtree(oci, ignore_errors=True)
        _, took = as_provider(user, sys.executable, "-c", AGENT_COPY, str(work), "pull", digest,
                              registry.address, repo, token).stdout.split()
        out["pull"].append(size_mb / float(took))
        forget_image(user, digest)
    out["size"] = [size_mb]
    return out


# The agent's own code, run as the provider user: ImageCache.push or .pull, timed.
AGENT_COPY = """
import pathlib, sys, time
from campugrid.agent.images import ImageCache
from campugrid.sandbox.podman_ops import CliOps
cache = ImageCache(pathlib.Path(sys.argv[1]), "bench", CliOps())
t = time.monotonic()
if sys.argv[2] == "push":
    d = cache.push(sys.argv[3], sys.argv[4], sys.argv[5], "bench", sys.argv[6],
                   pathlib.Path(sys.argv[1]), cancel=None)
else:
    d = cache.pull(sys.argv[4], sys.argv[5], sys.argv[3], sys.argv[6], cancel=None,
                   work=pathlib.Path(sys.argv[1]), limit_bytes=1 << 40)
print(d, time.monotonic() - t)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layer-mb", type=int, default=64)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="campugrid-bench-images-"))
    os.chmod(root, 0o711)
    user = ProviderUser.resolve()
    platform = Platform(root / "state", http_port=free_port(),
                        admin_identity=root / "admin.json").start()
    built, pulled = [], []
    try:
        platform.start_agent("bench-images", args=("--metrics-port", "0"))
        with platform.api() as api:
            for r in range(args.rounds):
                ctx = context(root / f"ctx-{r}", args.layer_mb)
                job, took = to_running(api, ctx, "never")  # from scratch
                built.append(took)
                api.cancel(job)
                # A job is pushed only when another could use it now: a companion of the same
                # context waits (for a GPU no machine here has) while the next one builds.
                companion = api.submit(ctx, JobSpec.from_dict(
                    {"resources": {"gpus": 1, "gpu_memory_mb": 1000}}))["id"]
                job, _ = to_running(api, ctx, "first")  # builds and pushes
                digest = pushed_digest(api, job)
                api.cancel(job)
                api.cancel(companion)
                until(lambda j=job: api.job(j)["state"] == "cancelled")
                time.sleep(1.5)  # the agent ends the task and sweeps
                forget_image(user, digest)
                job, took = to_running(api, ctx, "first")  # pulls by digest
                pulled.append(took)
                if not any("pulls image" in e["detail"] for e in api.job(job)["events"]):
                    raise RuntimeError("the job did not pull its image")
                api.cancel(job)
                until(lambda j=job: api.job(j)["state"] == "cancelled")
        tp = throughput(platform, user, root, args.layer_mb, args.rounds)
    finally:
        platform.stop()
        shutil.rmtree(root, ignore_errors=True)

    base = statistics.median(built)
    print(f"\nsubmit -> running of a job whose build adds {args.layer_mb} MB, on a machine "
          f"without its image ({args.rounds} rounds)\n")
    print("| how the image got there                      |  median s |   min s |   max s | vs base |")
    print("|----------------------------------------------|-----------|---------|---------|---------|")
    for name, xs in (("baseline: built here from scratch", built),
                     ("pulled by digest from the registry", pulled)):
        print(f"| {name:<44} | {statistics.median(xs):9.2f} | {min(xs):7.2f} | {max(xs):7.2f} "
              f"| {statistics.median(xs) / base:6.2f}x |")
    size = tp.pop("size")[0]
    print(f"\nthroughput of one image ({size:.0f} MB: the base and a {args.layer_mb} MB layer; "
          "the base's layers are already on the pulling side)\n")
    print("| path                                                  | median MB/s | vs skopeo copy |")
    print("|-------------------------------------------------------|-------------|----------------|")
    for name, key, against in (
            ("baseline: skopeo copy, store -> gzip OCI folder", "skopeo out", "skopeo out"),
            ("agent push: store -> registry (token, gzip)", "push", "skopeo out"),
            ("baseline: skopeo copy, gzip OCI folder -> store", "skopeo in", "skopeo in"),
            ("agent pull by digest: registry -> store", "pull", "skopeo in")):
        med = statistics.median(tp[key])
        print(f"| {name:<53} | {med:11.1f} | {med / statistics.median(tp[against]):13.2f}x |")


if __name__ == "__main__":
    main()
