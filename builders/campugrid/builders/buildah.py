"""Rootless Buildah with every RUN step inside gVisor (runsc) and no network.

`--isolation chroot` would run RUN steps on the host kernel with the host network, so it is
never used. runsc goes through a small wrapper (runsc-build-runtime) because plain
`runsc delete` blocks and fails after each step, which aborts the build. Buildah's own
process (which fetches ADD's URLs itself) runs in a network namespace of its own with only a
loopback that is down: whatever a Dockerfile check missed, the build reaches no network.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

from campugrid.builders.policy import BaseUse
from campugrid.protocol.errors import BuildFailed
from campugrid.sandbox import limits as host_limits
from campugrid.sandbox.process import LogFn, run_streaming

WRAPPER = Path(__file__).with_name("runsc-build-runtime")


class BuildahBuilder:
    name = "buildah"

    def __init__(self, buildah: str = "buildah", scope: str = "") -> None:
        self.buildah = shutil.which(buildah) or buildah
        self.unshare = shutil.which("unshare") or "/usr/bin/unshare"
        # RUN steps run in a job cgroup too, where this host can enforce one.
        self.limits = host_limits.detect()
        self.scope = scope  # this agent's folder of job cgroups (see limits.job_cgroup)

    def argv(self, context_dir: Path, tag: str) -> list[str]:
        return [
            # In Buildah's user namespace (rootless), a network namespace of its own.
            self.buildah, "unshare", self.unshare, "--net", "--",
            self.buildah, "bud",
            "--isolation", "oci",
            "--runtime", str(WRAPPER),
            "--runtime-flag", "network=none",
            "--runtime-flag", "ignore-cgroups",
            "--network", "none",
            "--pull-never",  # no registry: FROM must name an image the provider has
            "--layers=false", "--rm", "--force-rm",
            "-f", str(context_dir / "Dockerfile"),
            "-t", tag,
            str(context_dir),
        ]

    def build(self, context_dir: Path, tag: str, *, log: LogFn, timeout_s: float,
              cancel: threading.Event | None = None, memory_mb: int = 4096,
              cpus: float = 2.0, bases: Sequence[BaseUse] = ()) -> str:
        for use in bases:
            self._check_base(use)
        name = "build-" + "".join(c if c.isalnum() else "-" for c in tag)[-60:]
        with host_limits.job_cgroup(self.limits, name, memory_mb=memory_mb, cpus=cpus,
                                    pids=4096, scope=self.scope) as cg:
            done = run_streaming(host_limits.launcher(cg, self.argv(context_dir, tag)), log=log,
                                 timeout_s=timeout_s, cancel=cancel,
                                 on_stop=self._remove_working_containers,
                                 on_orphan=[self.buildah, "rm", "--all"],
                                 cgroups=cg.paths if cg is not None else ())
            oom = done.returncode != 0 and cg is not None and cg.oom_killed()
        if done.cancelled:
            raise BuildFailed("build cancelled", done.tail)
        if done.timed_out:
            self._remove_working_containers()
            raise BuildFailed(f"build took longer than {timeout_s:.0f} s", done.tail)
        if done.returncode != 0:
            why = f"; a RUN step used more than {memory_mb} MB" if oom else ""
            raise BuildFailed(f"build failed (buildah exit {done.returncode}{why})", done.tail)
        return tag

    def _check_base(self, use: BaseUse) -> None:
        """The base must be here, with the digest its pin (the provider's or the FROM line's)
        names: a FROM never starts from an image that merely took an allowed name."""
        want = use.allowed.digest or use.digest
        found = subprocess.run([self.buildah, "images", "--json", use.allowed.name],
                               capture_output=True, text=True, timeout=60, check=False)
        try:
            images = json.loads(found.stdout) if found.returncode == 0 else []
        except ValueError:
            images = []
        if not images:
            raise BuildFailed(f"Dockerfile line {use.line}: base image {use.allowed.name} is not "
                              "on this provider", found.stderr.strip()[-500:])
        digest = str(images[0].get("digest", ""))
        if want and digest != want:
            raise BuildFailed(f"Dockerfile line {use.line}: base image {use.allowed.name} here is "
                              f"{digest or 'unknown'}, not the pinned {want}", "")

    def _remove_working_containers(self) -> None:
        # The provider user is dedicated to campugrid: its working containers are ours.
        subprocess.run([self.buildah, "rm", "--all"], capture_output=True, timeout=60,
                       check=False)
