"""A task's FROMs on registries: each pulled, outside any sandbox and running nothing from it,
by the digest the coordinator resolved at submit (never the tag), from the first of its
sources that has it (the operator's mirrors, then the registry), into this machine's bounded
cache of bases. The build then starts from those local copies: the agent writes the
Dockerfile again with each such FROM naming its copy (buildpolicy.dockerfiles.pin_bases), and
the builder stays offline (`--pull-never`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

from campugrid.agent.images import COPIES, ImageCache
from campugrid.agent.messages import BaseImage
from campugrid.buildpolicy.dockerfiles import AllowedBase, BaseUse, parse_image_ref
from campugrid.protocol.errors import BuildFailed, CannotRunHere, SandboxError
from campugrid.sandbox.process import LogFn


def registries(resolved: Sequence[BaseImage]) -> tuple[str, ...]:
    """The registries the coordinator resolved this task's bases on: the ones its Dockerfile
    may name here (the coordinator's policy decided; the agent needs each to be resolved)."""
    return tuple(sorted({parse_image_ref(b.ref).registry for b in resolved}))


def prepare(uses: Sequence[BaseUse], resolved: Sequence[BaseImage], cache: ImageCache | None,
            work: Path, *, user: str, log: LogFn,
            stop: threading.Event) -> tuple[dict[BaseUse, str], tuple[BaseUse, ...]]:
    """Pull this Dockerfile's remote bases, in use by `user` (a task) until it releases them
    from the cache; returns the local image of each (for pin_bases: empty when it has none)
    and the bases as the builder now finds them (local). Raises BuildFailed, naming the line,
    for a base that cannot be had."""
    if not any(u.remote for u in uses):
        return {}, tuple(uses)
    if cache is None or not cache.available:
        raise CannotRunHere("this Dockerfile starts from images on registries, and this "
                            "machine cannot pull images (skopeo is missing, or "
                            "--image-cache-mb is 0)")
    by_ref = {b.ref: b for b in resolved}
    local: dict[BaseUse, str] = {}
    out = []
    try:
        for use in uses:
            if not use.remote:
                out.append(use)
                continue
            base = by_ref.get(use.allowed.name)
            if base is None or (use.digest and use.digest != base.digest):
                raise BuildFailed(f"Dockerfile line {use.line}: {use.said} was not "
                                  "resolved by the coordinator for this job", "")
            local[use] = _obtain(base, use, cache, work, user, log, stop)
            out.append(BaseUse(use.line, AllowedBase(local[use]), None, copy=use.copy))
    except (BuildFailed, CannotRunHere):
        cache.release(user)  # the task ends here
        raise
    return local, tuple(out)


def _obtain(base: BaseImage, use: BaseUse, cache: ImageCache, work: Path, user: str,
            log: LogFn, stop: threading.Event) -> str:
    found = cache.lookup(base.digest, user, COPIES)
    if found is not None:
        log(f"[campugrid] base {base.ref} ({base.digest}) is already on this machine")
        return found
    repository = parse_image_ref(base.ref).repository
    errors = []
    for source in base.sources:
        began = time.monotonic()
        log(f"[campugrid] pulling base {base.ref} ({base.digest}) from {source.address}")
        try:
            image = cache.pull(source.address, repository, base.digest, source.token or None,
                               work=work, limit_bytes=cache.largest_bytes(COPIES), cancel=stop,
                               insecure=source.insecure, log=log, user=user, copies=COPIES)
        except SandboxError as e:
            if stop.is_set():
                raise BuildFailed("stopped while pulling a base image", "") from e
            log(f"[campugrid] {source.address} did not give it: {e}")
            errors.append(f"{source.address}: {e}")
            continue
        log(f"[campugrid] pulled base {base.ref} in {time.monotonic() - began:.1f} s")
        return image
    # The coordinator resolved this digest at submit: a machine that cannot get it lacks
    # something (a route, room), which is not the job's fault.
    raise CannotRunHere(f"Dockerfile line {use.line}: {use.said}: cannot pull "
                        f"{base.digest} ({'; '.join(errors) or 'no source'})"[:2000])
