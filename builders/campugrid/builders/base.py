"""The builder interface. Implementations: buildah (default), kaniko, and fake (tests: its
failures come from the Dockerfile). tests/integration/test_builder_contract.py runs them
all through the same cases."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from campugrid.buildpolicy.dockerfiles import BaseUse
from campugrid.sandbox.process import LogFn


@dataclasses.dataclass(frozen=True)
class BuilderCapabilities:
    """What a builder can do on this machine, for the agent to ask rather than test names."""

    bounded_store: bool  # what a build writes is held to its disk_mb
    # ... also where the agent has no output slot to give it (`store_on` None)
    bounded_without_slot: bool = True


class Builder(Protocol):
    name: str
    online: bool  # whether its RUN steps can reach the egress proxy (else builds are offline)
    scope: str  # this agent's folder of job cgroups: what its sweeps may remove

    def build(self, context_dir: Path, tag: str, *, log: LogFn, timeout_s: float,
              cancel: threading.Event | None = None, memory_mb: int = 4096,
              cpus: float = 2.0, disk_mb: int = 512,
              bases: Sequence[BaseUse] | None = None, dockerfile: Path | None = None,
              volumes: Sequence[tuple[Path, str]] = (), egress: Path | None = None,
              store_on: Path | None = None) -> str:
        """Build context_dir/Dockerfile (or `dockerfile`: the agent's copy with remote bases
        pinned and pip pointed at the platform's cache) into the provider's image store as
        `tag`. `volumes`: host paths RUN steps see read-only, at the given paths (extra
        certificates to trust). `egress`: the unix socket of the agent's egress proxy, the
        only way out of the build (agent/buildnet.py); None: offline. `store_on`: a folder on a
        filesystem the agent bounds to `disk_mb` (its output slot), for what the build writes;
        None: the builder bounds it itself where it can (a tmpfs: memory).

        `bases` are the allowed base images the checked Dockerfile starts from (None: check
        the Dockerfile here): each must be here with its pinned digest, if any. RUN steps get
        the job's memory and CPU where the host can enforce them, and the build at most
        `disk_mb` of disk where the builder can bound it. Returns the tag; raises BuildFailed
        with the log tail on any failure.
        """
        ...

    def capabilities(self) -> BuilderCapabilities: ...

    def pins(self, bases: Sequence[BaseUse]) -> dict[BaseUse, str]:
        """What each of `bases` (allowed bases the checked Dockerfile uses) must be named in the
        Dockerfile this builder is given for it to find it ({}: as the Dockerfile names it).
        Raises BuildFailed for one it cannot build from."""
        ...

    def inputs(self, bases: Sequence[BaseUse]) -> dict[str, str]:
        """What besides the context decides this builder's result here: the builder and its
        version, and each base image's digest as this provider has it. Two machines with the
        same inputs and context build the same image (builds are reproducible), so the build
        key (coordinator/images.py) names it."""
        ...
