"""The sandbox runtimes and image builders an agent can be configured with, by name.

One registry each, name (the backend's own `name`) -> factory: the command line looks the
configured name up here and lists the known names when it is not one of them. Test doubles (sandbox.fake,
builders.fake) are not registered: a real agent never runs a job in a fake.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TypeVar

from campugrid.builders.base import Builder
from campugrid.builders.buildah import BuildahBuilder
from campugrid.builders.kaniko import EXECUTOR_IMAGE, KanikoBuilder
from campugrid.protocol.errors import CampugridError
from campugrid.sandbox.podman_runsc import PodmanRunsc
from campugrid.sandbox.runtime import Runtime

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class BackendOptions:
    """What the factories may need from the agent's configuration."""

    kaniko_image: str = ""  # Kaniko's executor image, a local one ("": infra/kaniko.sh's)
    runsc: str = "runsc"  # gVisor's runsc, for jobs and RUN steps alike (a path, or on PATH)


def _kaniko(options: BackendOptions) -> Builder:
    return KanikoBuilder(options.kaniko_image or EXECUTOR_IMAGE, runsc=options.runsc)


RUNTIMES: Mapping[str, Callable[[BackendOptions], Runtime]] = {
    "podman-runsc": lambda options: PodmanRunsc(runsc=options.runsc),
}
BUILDERS: Mapping[str, Callable[[BackendOptions], Builder]] = {
    "buildah": lambda options: BuildahBuilder(runsc=options.runsc),
    "kaniko": _kaniko,
}


def choose(runtime: str, builder: str,
           options: BackendOptions = BackendOptions()) -> tuple[Runtime, Builder]:
    """Both backends by name; an unknown name is refused before either is made."""
    make_runtime = _factory("--runtime", "sandbox runtime", RUNTIMES, runtime)
    made = _factory("--builder", "image builder", BUILDERS, builder)(options)
    return make_runtime(options), made


def _factory(flag: str, what: str, registry: Mapping[str, Callable[[BackendOptions], T]],
             name: str) -> Callable[[BackendOptions], T]:
    factory = registry.get(name)
    if factory is None:
        raise CampugridError(f"{flag} {name!r}: no such {what} (known: "
                             f"{', '.join(sorted(registry))})")
    return factory
