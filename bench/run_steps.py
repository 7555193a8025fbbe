"""What gVisor alone costs a build's RUN steps on this machine: the floor under bench/builds.py.

    .venv/bin/python bench/run_steps.py [--rounds 3] [--runsc PATH ...]
                                                        (as root, after infra/setup.sh)

The same one-step Dockerfiles, with the same offline inputs (the wheels fetched once, before,
mounted read-only, pip pointed at them), built as the provider user by campugrid's own builder
(builders/buildah.py: its tmpfs store, no network, the commit into the provider's store) two
ways in the same run, alternating:
  - gVisor: as campugrid always builds, every RUN step inside runsc, once with each runsc
    given (default: both that infra/setup.sh leaves, the one built from gVisor's Go module
    by runsc-from-go.sh and Debian's, where present);
  - chroot: the same builder with Buildah's `--isolation chroot`, RUN steps on the host kernel
    (a twin made here, for this measurement only: campugrid never builds that way).
Nothing else differs, so the ratio is the sandbox's own cost for that kind of step, which no
change outside gVisor can remove: such a step costs a build through campugrid at least its
gVisor row. The "no RUN step" row is the builder's fixed cost (the store, the base check, the
commit), the same for both. The "new memory" row is page faults alone: what every process
that grows its heap pays (`pip --version` peaks at 40 MB resident, Python alone at 13 MB).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests/support: the stand-in python image

from campugrid.cli.platform import ProviderUser  # noqa: E402

WHEELS = ("setuptools>=68", "six==1.16.0", "idna==3.7")
PIP = "ENV PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheels PIP_DISABLE_PIP_VERSION_CHECK=1\n"
STEPS = {  # name: what follows FROM
    "no RUN step": "ENV STEP=none\n",
    "RUN true": "RUN true\n",
    "pure CPU (Python loop)": "RUN python3 -c 'sum(i * i for i in range(20_000_000))'\n",
    # 20,000 pages touched for the first time: one page fault each
    "new memory (80 MB)": "RUN python3 -c 'x = [bytearray(4096) for _ in range(20_000)]'\n",
    "python3 -c pass": "RUN python3 -c pass\n",
    "pip --version": "RUN pip --version\n",
    "pip install a wheel": PIP + "RUN pip install --no-cache-dir --target /deps idna==3.7\n",
    "pip install a project": PIP + "COPY . /src\nRUN pip install --no-cache-dir /src\n",
}
PROJECT = REPO / "tests" / "corpus" / "pyproject"  # setuptools backend: build isolation


def child(args: dict[str, str]) -> None:
    """As the provider user: one build by the builder, or by its chroot twin; prints seconds."""
    from campugrid.builders.buildah import BuildahBuilder
    from campugrid.buildpolicy.dockerfiles import check_dockerfile

    class ChrootTwin(BuildahBuilder):
        def bud_args(self, context_dir: Path, tag: str, dockerfile: Path | None = None,
                     volumes: Sequence[tuple[Path, str]] = (), online: bool = False) -> list[str]:
            argv = super().bud_args(context_dir, tag, dockerfile, volumes, online)
            argv[argv.index("--isolation") + 1] = "chroot"
            at = argv.index("--network")  # chroot refuses it; Buildah has no network anyway
            return argv[:at] + argv[at + 2:]

    if args["mode"] != "chroot":
        os.environ["CAMPUGRID_RUNSC"] = args["mode"]  # the build runtime's runsc
    builder = (ChrootTwin if args["mode"] == "chroot" else BuildahBuilder)(scope="a-bench")
    context = Path(args["context"])
    # The base is in the provider's store already, under its Hub name, as if the agent had
    # pulled it (agent/bases.py): the builder copies it into its bases store from there.
    bases = [dataclasses.replace(use, remote=False)
             for use in check_dockerfile((context / "Dockerfile").read_text()).bases]
    lines: list[str] = []
    t = time.monotonic()
    try:
        builder.build(context, args["tag"], log=lines.append, timeout_s=600, bases=bases,
                      volumes=[(Path(args["wheels"]), "/wheels")])
    except Exception as e:
        print(json.dumps({"error": f"{e}: {' / '.join(lines[-5:])}"}))
        return
    took = time.monotonic() - t
    subprocess.run([builder.buildah, "rmi", "-f", args["tag"]], capture_output=True, timeout=120)
    print(json.dumps({"seconds": took}))


def build(user: ProviderUser, mode: str, context: Path, wheels: Path, tag: str) -> float:
    args = json.dumps({"mode": mode, "context": str(context), "wheels": str(wheels), "tag": tag})
    done = subprocess.run(user.command([sys.executable, __file__, "--child", args]),
                          capture_output=True, text=True, timeout=900, cwd="/", check=False)
    out = json.loads(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else {}
    if "seconds" not in out:
        raise RuntimeError(f"{mode} build of {context.name} failed: "
                           f"{out.get('error') or done.stderr[-2000:]}")
    return float(out["seconds"])


def contexts(root: Path, base: str, user: ProviderUser) -> dict[str, Path]:
    out = {}
    for i, (name, rest) in enumerate(STEPS.items()):
        ctx = root / f"step-{i}"
        shutil.copytree(PROJECT, ctx, ignore=shutil.ignore_patterns("expect.json"))
        (ctx / "Dockerfile").write_text(f"FROM {base}\n{rest}")
        out[name] = ctx
    for path in [root, *root.rglob("*")]:
        os.chown(path, user.uid, user.gid)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runsc", action="append", help="a runsc to build with (repeatable)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    from tests.support.oci import PYTHON_SLIM_HUB, python_slim

    user = ProviderUser.resolve()
    runscs = args.runsc or [p for p in ("/usr/local/bin/runsc", "/usr/bin/runsc")
                            if os.path.exists(p)]
    versions = {r: subprocess.run([r, "--version"], capture_output=True, text=True,
                                  check=True).stdout.split("\n")[0].replace("runsc version ", "")
                for r in runscs}
    modes = ["chroot", *runscs]
    root = Path(tempfile.mkdtemp(prefix="campugrid-bench-steps-"))
    os.chmod(root, 0o711)
    wheels = root / "wheels"
    times: dict[tuple[str, str], list[float]] = {}
    try:
        subprocess.run(user.command(["podman", "tag", python_slim(user.command([])),
                                     PYTHON_SLIM_HUB]), check=True, timeout=60)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--only-binary=:all:",
                        "--no-deps", "-d", str(wheels), *WHEELS], check=True, timeout=600)
        ctxs = contexts(root, PYTHON_SLIM_HUB, user)
        for r in range(args.rounds + 1):  # round 0 warms up (the base copied into the store)
            for name, ctx in ctxs.items():
                for i, mode in enumerate(modes[r % len(modes):] + modes[:r % len(modes)]):
                    took = build(user, mode, ctx, wheels, f"localhost/campugrid-bench/steps:{i}")
                    if r:
                        times.setdefault((name, mode), []).append(took)
                    print(f"round {r} {name}: {mode} {took:.2f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(user.command(["podman", "rmi", PYTHON_SLIM_HUB]), capture_output=True,
                       timeout=120)
    print(f"\none-step builds by campugrid's builder, RUN in gVisor against the same in a chroot, "
          f"same offline inputs, median of {args.rounds} rounds (each runsc on its default "
          f"platform)\n")
    names = [versions[r] for r in runscs]
    print("| build | chroot | " + " | ".join(f"gVisor {n}" for n in names) + " | "
          + " | ".join(f"{n} / chroot" for n in names) + " | the step alone, chroot -> "
          + " / ".join(names) + " |")
    print("|---" * (3 + 2 * len(runscs)) + "|")
    fixed = {m: statistics.median(times[("no RUN step", m)]) for m in modes}
    for name in STEPS:
        c, *gs = (statistics.median(times[(name, m)]) for m in modes)
        alone = "" if name == "no RUN step" else f"{c - fixed['chroot']:.2f} -> " + " / ".join(
            f"{g - fixed[m]:.2f}" for g, m in zip(gs, runscs, strict=True)) + " s"
        print(f"| {name} | {c:.2f} s | " + " | ".join(f"{g:.2f} s" for g in gs) + " | "
              + " | ".join(f"{g / c:.2f}x" for g in gs) + f" | {alone} |")
    print("\nthe step alone: the build's time less the no-RUN-step build's, same isolation")

if __name__ == "__main__":
    main()
