"""A Builder that builds nothing: what the build does comes from comment lines in the
Dockerfile, which real builders ignore, so one context serves the fake and the real ones.

    # fake: log=text       a build log line (repeatable)
    # fake: run_for=s      the build takes s seconds (stopped at the timeout or on cancel)
    # fake: fail=reason    the build fails: BuildFailed(reason, the log's tail)

Every other line is logged as a step, as Buildah does ("STEP 2/3: RUN ..."). The contract
test (tests/integration/test_builder_contract.py) holds it to the real builders' cases.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from campugrid.builders.base import Builder, BuilderCapabilities
from campugrid.buildpolicy.dockerfiles import BaseUse
from campugrid.protocol.errors import BuildFailed
from campugrid.sandbox.process import LogFn

DIRECTIVE = "# fake:"
TICK_S = 0.01


class FakeBuilder:
    """`images` is the image store it shares with a fake runtime: a built tag is added."""

    name = "fake"
    online = True

    def __init__(self, images: set[str] | None = None, scope: str = "") -> None:
        self.images: set[str] = images if images is not None else set()
        self.scope = scope
        self.builds: list[tuple[Path, str]] = []  # (context, tag), every build asked for
        self.limits: list[dict[str, float]] = []  # each build's memory_mb, cpus and disk_mb

    def capabilities(self) -> BuilderCapabilities:
        return BuilderCapabilities(bounded_store=False)  # it writes nothing

    def pins(self, bases: Sequence[BaseUse]) -> dict[BaseUse, str]:
        return {}

    def inputs(self, bases: Sequence[BaseUse]) -> dict[str, str]:
        return {"builder": "fake", **{f"base {u.allowed.name}": "fake" for u in bases}}

    def build(self, context_dir: Path, tag: str, *, log: LogFn, timeout_s: float,
              cancel: threading.Event | None = None, memory_mb: int = 4096,
              cpus: float = 2.0, disk_mb: int = 512,
              bases: Sequence[BaseUse] | None = None, dockerfile: Path | None = None,
              volumes: Sequence[tuple[Path, str]] = (), egress: Path | None = None,
              store_on: Path | None = None) -> str:
        self.builds.append((context_dir, tag))
        self.limits.append({"memory_mb": memory_mb, "cpus": cpus, "disk_mb": disk_mb})
        tail: collections.deque[str] = collections.deque(maxlen=40)

        def say(line: str) -> None:
            tail.append(line)
            log(line)

        try:
            lines = (dockerfile or context_dir / "Dockerfile").read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise BuildFailed(f"cannot read the Dockerfile: {e}", "") from e
        directives = [line[len(DIRECTIVE):].strip().partition("=") for line in lines
                      if line.startswith(DIRECTIVE)]
        steps = [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
        for i, step in enumerate(steps, 1):
            say(f"STEP {i}/{len(steps)}: {step}")
        run_for, fail = 0.0, ""
        for key, _, value in directives:
            if key == "log":
                say(value)
            elif key == "run_for":
                run_for = float(value)
            elif key == "fail":
                fail = value
        start = time.monotonic()
        while time.monotonic() - start < run_for:
            if cancel is not None and cancel.is_set():
                raise BuildFailed("build cancelled", "\n".join(tail))
            if time.monotonic() - start >= timeout_s:
                raise BuildFailed(f"build took longer than {timeout_s:.0f} s", "\n".join(tail))
            time.sleep(TICK_S)
        if cancel is not None and cancel.is_set():
            raise BuildFailed("build cancelled", "\n".join(tail))
        if fail:
            raise BuildFailed(fail, "\n".join(tail))
        self.images.add(tag)
        return tag


if TYPE_CHECKING:  # mypy holds the fake to the protocol
    _conforms: Builder = FakeBuilder()
