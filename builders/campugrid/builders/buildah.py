"""Rootless Buildah with every RUN step inside gVisor (runsc) and no network.

`--isolation chroot` would run RUN steps on the host kernel with the host network, so it is
never used. runsc goes through a small wrapper (runsc-build-runtime) because plain
`runsc delete` blocks and fails after each step, which aborts the build.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from pathlib import Path

from campugrid.protocol.errors import BuildFailed
from campugrid.sandbox.process import LogFn, run_streaming

WRAPPER = Path(__file__).with_name("runsc-build-runtime")


class BuildahBuilder:
    name = "buildah"

    def __init__(self, buildah: str = "buildah") -> None:
        self.buildah = shutil.which(buildah) or buildah

    def argv(self, context_dir: Path, tag: str) -> list[str]:
        return [
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
              cancel: threading.Event | None = None) -> str:
        done = run_streaming(self.argv(context_dir, tag), log=log, timeout_s=timeout_s,
                             cancel=cancel, on_stop=self._remove_working_containers)
        if done.cancelled:
            raise BuildFailed("build cancelled", done.tail)
        if done.timed_out:
            self._remove_working_containers()
            raise BuildFailed(f"build took longer than {timeout_s:.0f} s", done.tail)
        if done.returncode != 0:
            raise BuildFailed(f"build failed (buildah exit {done.returncode})", done.tail)
        return tag

    def _remove_working_containers(self) -> None:
        # The provider user is dedicated to campugrid: its working containers are ours.
        subprocess.run([self.buildah, "rm", "--all"], capture_output=True, timeout=60,
                       check=False)
