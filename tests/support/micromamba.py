#!/usr/bin/env python3
"""`micromamba` as the stand-in for its image (tests/support/oci.py) runs it: micromamba's
binary cannot be had from these machines' registries, so this speaks the subset of its command
line that research Dockerfiles use, and does the work with py-rattler (the conda library that
pixi and rattler-build are made of): channels by name from conda.anaconda.org, an environment
file's channels and dependencies, a solve over linux-64 and noarch, downloads into the package
cache, and the packages linked into the prefix.

    micromamba install -y -n base -f environment.yml
    micromamba create -y -n NAME -c conda-forge PKG...
    micromamba clean --all --yes
    micromamba run -n base CMD...
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(os.environ.get("MAMBA_ROOT_PREFIX", "/opt/conda"))
CHANNEL_ALIAS = "https://conda.anaconda.org"


def prefix(name: str | None, path: str | None) -> Path:
    if path:
        return Path(path)
    return ROOT if name in (None, "base") else ROOT / "envs" / name


def channel(name: str) -> str:
    return name if "://" in name else f"{CHANNEL_ALIAS}/{name}"


def read_file(path: str) -> tuple[list[str], list[str]]:
    """An environment file's channels and conda dependencies (a `pip:` section is refused:
    the stand-in has no pip step)."""
    import yaml
    data = yaml.safe_load(Path(path).read_text()) or {}
    specs = []
    for dep in data.get("dependencies") or []:
        if not isinstance(dep, str):
            sys.exit(f"micromamba (stand-in): {path}: only conda dependencies are supported")
        specs.append(dep)
    return list(data.get("channels") or []), specs


async def install(target: Path, channels: list[str], specs: list[str]) -> None:
    import rattler
    records = await rattler.solve([rattler.Channel(channel(c)) for c in channels], specs,
                                  platforms=["linux-64", "noarch"],
                                  virtual_packages=rattler.VirtualPackage.detect())
    print("Transaction\n")
    for r in sorted(records, key=lambda r: r.name.normalized):
        print(f"  + {r.name.normalized!s:<20} {r.version!s:<10} {r.build!s:<10} {r.channel!s}")
    await rattler.install(records, target, cache_dir=ROOT / "pkgs", show_progress=False)
    print(f"\nTransaction finished: {len(records)} packages in {target}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="micromamba")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("install", "create"):
        p = sub.add_parser(name)
        p.add_argument("-y", "--yes", action="store_true")
        p.add_argument("-n", "--name")
        p.add_argument("-p", "--prefix")
        p.add_argument("-c", "--channel", action="append", default=[])
        p.add_argument("-f", "--file", action="append", default=[])
        p.add_argument("specs", nargs="*")
    clean = sub.add_parser("clean")
    clean.add_argument("-a", "--all", action="store_true")
    clean.add_argument("-y", "--yes", action="store_true")
    run = sub.add_parser("run")
    run.add_argument("-n", "--name")
    run.add_argument("-p", "--prefix")
    run.add_argument("cmd", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "clean":
        shutil.rmtree(ROOT / "pkgs", ignore_errors=True)
        return 0
    target = prefix(args.name, args.prefix)
    if args.command == "run":
        if not args.cmd:
            parser.error("run: no command")
        env = {**os.environ, "CONDA_PREFIX": str(target),
               "PATH": f"{target / 'bin'}:{os.environ.get('PATH', '')}"}
        os.execvpe(args.cmd[0], args.cmd, env)
    channels, specs = list(args.channel), list(args.specs)
    for file in args.file:
        more_channels, more_specs = read_file(file)
        channels += [c for c in more_channels if c not in channels]
        specs += more_specs
    if not specs:
        parser.error(f"{args.command}: nothing to install")
    asyncio.run(install(target, channels or ["conda-forge"], specs))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
