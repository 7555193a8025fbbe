"""Rootless Buildah with every RUN step inside gVisor (runsc), bounded disk, and a network
whose only way out is the egress proxy (or none at all).

`--isolation chroot` would run RUN steps on the host kernel with the host network, so it is
never used. runsc goes through a small wrapper (runsc-build-runtime) because plain
`runsc delete` blocks and fails after each step, which aborts the build.

Each build runs in Buildah's user namespace (`buildah unshare`) with, in it:
- a network namespace of its own with nothing in it but its loopback. With `egress` (a unix
  socket: the agent's egress proxy, agent/buildnet.py), the loopback is up and relay.py
  listens on it at PROXY_PORT, carrying each connection to that socket; Buildah (which fetches
  ADD's URLs itself) and the RUN steps get it as their HTTP(S) proxy, and RUN steps use the
  namespace's own sockets (runsc `network=host`: gVisor's netstack would have a loopback of
  its own, without the relay). Nothing else is there to reach: a tool that ignores the proxy
  finds no route, no DNS server, no host. Without `egress` the loopback stays down and RUN
  steps run with runsc `network=none`: the build is offline;
- its own image store in `store_on` (a folder on a filesystem the agent bounds to `disk_mb`:
  its output slot, sandbox/slots.py), else on a tmpfs of `disk_mb` (which counts as memory),
  so everything the RUN steps write (the working layer, any earlier stage's image) stops at
  that size; the store goes with the build;
- as the only other images, a store of this provider's allowed base images (read-only), so
  no other job's image can be named as a base, a `--from` or a mount.
The finished image is committed straight into the provider's own store, to run. That commit
writes the layer at its full size (a sparse file of a few bytes on the tmpfs is written out in
full: 3 GB from a 64 MB build, tried), so Buildah runs with a file size limit (RLIMIT_FSIZE,
`layer_limit_mb`): Buildah writes each layer whole to a file before storing it, and a layer
over the limit fails the build there. The runtime wrapper lifts the limit again for gVisor
(whose memory file is a file too). Committing into the tmpfs and copying the image across
afterwards bounded it too, but cost a second copy of every layer (4 s for NumPy + SciPy).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from campugrid.builders.base import BuilderCapabilities
from campugrid.buildpolicy.dockerfiles import BaseUse, check_dockerfile
from campugrid.egress.policy import CA_ENV
from campugrid.protocol.errors import BuildFailed, CannotRunHere, InvalidInput
from campugrid.sandbox import limits as host_limits
from campugrid.sandbox import profile, slots, store_lock
from campugrid.sandbox.podman_runsc import RUNSC_FLAGS, runtime_dir
from campugrid.sandbox.process import LogFn, run_streaming

RELAY = Path(__file__).with_name("relay.py")
# RUN steps with the egress proxy: the build namespace's own sockets (see the docstring).
NETWORK_FLAGS = tuple("network=host" if f == "network=none" else f for f in RUNSC_FLAGS)
WRAPPER = Path(__file__).with_name("runsc-build-runtime")
PULLED_PREFIX = "localhost/campugrid-cache/"  # agent/images.py's cache names
# What Buildah says of every layer it copies and every image it writes: nothing a researcher
# acts on, and dozens of lines in front of the steps (the build log keeps the steps).
_NOISE = re.compile(r"(Copying (blob|config) |Writing manifest to image destination|"
                    r"Storing signatures|Getting image source signatures)")
COMMIT = "COMMIT "  # Buildah's line as it begins to commit an image (the final one: the last)


def layer_limit_mb(disk_mb: int) -> int:
    """The largest file (so the largest layer) a build's Buildah may write: its disk limit,
    and room for the layer's tar headers (512 bytes a file or folder, which the tmpfs does not
    count) and for whatever the tmpfs rounds down."""
    return disk_mb * 5 // 4 + 64


PROXY_PORT = 3128  # where the relay listens, on the build's own loopback
# $1 store folder, $2 its tmpfs's size in MB (0: none, it is on a bounded disk), $3 the layer
# limit in MB, $4 the allowed-bases store, $5 the egress proxy's socket (empty: offline), $6 a
# Python for the relay, $7 its file; the rest is `buildah bud`'s arguments, its `-t` the
# provider's store.
_SCRIPT = """
set -e
w=$1 size=$2 layer=$3 bases=$4
[ "$size" = 0 ] || mount -t tmpfs -o "size=${size}m,mode=0700" campugrid-build "$w"
ulimit -S -f $((layer * 2048))
exec unshare --net -- /bin/sh -c "$NETNS" campugrid-netns "$@"
"""
_NETNS = """
set -e
w=$1 bases=$4 egress=$5 python=$6 relay=$7
shift 7
set -- buildah --root "$w/root" --runroot "$w/run" --storage-driver overlay \\
  --storage-opt "overlay.imagestore=$bases" "$@"
[ -n "$egress" ] || exec "$@"
"$python" "$relay" PORT "$egress" >"$w/relay.out" 2>&1 &
relay=$!
i=0
until grep -q ready "$w/relay.out" 2>/dev/null; do
  i=$((i + 1)); [ $i -lt 200 ] && kill -0 $relay 2>/dev/null || { cat "$w/relay.out"; exit 1; }
  sleep 0.05
done
export http_proxy=http://127.0.0.1:PORT https_proxy=http://127.0.0.1:PORT
export HTTP_PROXY=$http_proxy HTTPS_PROXY=$https_proxy no_proxy= NO_PROXY=
"$@" && rc=0 || rc=$?
kill $relay 2>/dev/null || true
exit $rc
""".replace("PORT", str(PROXY_PORT))


class BuildahBuilder:
    name = "buildah"
    online = True  # RUN steps may reach the egress proxy

    def __init__(self, buildah: str = "buildah", scope: str = "", runsc: str = "runsc") -> None:
        self.buildah = shutil.which(buildah) or buildah
        self.runsc = shutil.which(runsc) or runsc  # what runsc-build-runtime runs
        # RUN steps run in a job cgroup too, where this host can enforce one.
        self.limits = host_limits.detect()
        self.scope = scope  # this agent's folder of job cgroups (see limits.job_cgroup)
        runtime = runtime_dir()
        self.bases_store = (store_lock.data_dir() / "bases", runtime / "campugrid-bases")
        # RUN steps get the same seccomp profile inside gVisor as jobs do.
        self.seccomp = profile.write_profile(runtime / "campugrid" / "seccomp.json")
        self._main: tuple[str, str] | None = None
        self._version: str | None = None

    def main_store(self) -> tuple[str, str]:
        """The provider's own image store (graphroot, runroot), where jobs run from."""
        if self._main is None:
            out = subprocess.run([self.buildah, "info", "--format",
                                  "{{.store.GraphRoot}} {{.store.RunRoot}}"],
                                 capture_output=True, text=True, timeout=60, check=False)
            words = out.stdout.split()
            if out.returncode != 0 or len(words) != 2:
                raise BuildFailed("cannot find Buildah's image store", out.stderr[-1000:])
            self._main = (words[0], words[1])
        return self._main

    def destination(self, tag: str) -> str:
        """`tag` in the provider's own store, as a build's `-t` names it."""
        graph, run = self.main_store()
        return f"containers-storage:[overlay@{graph}+{run}]{tag}"

    def bud_args(self, context_dir: Path, tag: str, dockerfile: Path | None = None,
                 volumes: Sequence[tuple[Path, str]] = (), online: bool = False) -> list[str]:
        return [
            "bud",
            "--isolation", "oci",
            "--runtime", str(WRAPPER),
            *(NETWORK_FLAGS if online else RUNSC_FLAGS),
            *([*profile.RUNTIME_FLAGS, "--security-opt", f"seccomp={self.seccomp}"]
              if self.seccomp else []),
            # "host": the build's own namespace (only its loopback and the relay), not the host's
            "--network", "host" if online else "none",
            "--pull-never",  # no registry: FROM names an allowed base this provider has
            "--layers=false", "--rm", "--force-rm",
            # Reproducible: every timestamp (image, history, files) is the epoch, so machines
            # with the same inputs build the same digest ("verified" reuse compares them).
            "--timestamp", "0",
            *[a for host, inside in volumes for a in ("--volume", f"{host}:{inside}:ro")],
            "-f", str(dockerfile or context_dir / "Dockerfile"),
            "-t", tag,
            str(context_dir),
        ]

    def argv(self, store: Path, disk_mb: int, context_dir: Path, tag: str,
             dockerfile: Path | None = None, volumes: Sequence[tuple[Path, str]] = (),
             egress: Path | None = None, tmpfs: bool = True) -> list[str]:
        trust = os.environ.get(CA_ENV, "") if egress is not None else ""
        return [self.buildah, "unshare", "/usr/bin/env", f"NETNS={_NETNS}",
                f"CAMPUGRID_RUNSC={self.runsc}",
                *([f"SSL_CERT_FILE={trust}"] if trust else []),
                "/bin/sh", "-c", _SCRIPT, "campugrid-build",
                str(store), str(disk_mb if tmpfs else 0), str(layer_limit_mb(disk_mb)),
                str(self.bases_store[0] / "root"), str(egress or ""), sys.executable, str(RELAY),
                *self.bud_args(context_dir, self.destination(tag), dockerfile, volumes,
                               online=egress is not None)]

    def build(self, context_dir: Path, tag: str, *, log: LogFn, timeout_s: float,
              cancel: threading.Event | None = None, memory_mb: int = 4096,
              cpus: float = 2.0, disk_mb: int = 512,
              bases: Sequence[BaseUse] | None = None, dockerfile: Path | None = None,
              volumes: Sequence[tuple[Path, str]] = (), egress: Path | None = None,
              store_on: Path | None = None) -> str:
        if bases is None:  # not checked by the caller: check here, with this host's policy
            try:
                bases = check_dockerfile((context_dir / "Dockerfile").read_text()).bases
            except (InvalidInput, OSError, UnicodeDecodeError) as e:
                raise BuildFailed(str(e), "") from e
        began = time.monotonic()
        # One listing of each store for all the checks below (a `buildah images` costs
        # 60 ms; a call per check was 0.5 s of a two-stage build).
        main, copied = _listing(self._buildah("images", "--json")), \
            _listing(self._buildah_bases("images", "--json"))
        self._drop_evicted(main, copied)
        for use in bases:
            self._ensure_base(use, main, copied)
        committing: list[float] = []
        dest = self.destination(tag)
        final = COMMIT + dest

        def logged(line: str) -> None:
            if _NOISE.match(line):
                return
            if line.endswith(final):  # "[2/2] COMMIT ..." in a multi-stage build
                committing.append(time.monotonic())
                # without the store's path, which names the provider's user
                line = line[:-len(final)] + COMMIT + tag
            log(line)
        name = "build-" + "".join(c if c.isalnum() else "-" for c in tag)[-60:]
        # On the bounded disk, else a tmpfs next to the context (in the task's work folder,
        # which the agent sweeps) if it can.
        near = store_on or (context_dir.parent if os.access(context_dir.parent, os.W_OK)
                            else None)
        store = Path(tempfile.mkdtemp(prefix="build-store-", dir=near))
        try:
            # A tmpfs store is memory: the build may then use its memory and its disk.
            # Not waited for at the end: the build runtime's last `runsc delete` goes on in
            # the background for seconds (runsc-build-runtime); the reaper removes the cgroup.
            # The store lock for the whole build: where its commit begins is Buildah's to know.
            with host_limits.job_cgroup(self.limits, name,
                                        memory_mb=memory_mb + (0 if store_on else disk_mb),
                                        cpus=cpus, pids=4096, scope=self.scope,
                                        wait_s=0.0) as cg, store_lock.writing():
                done = run_streaming(
                    host_limits.launcher(cg, self.argv(store, disk_mb, context_dir, tag,
                                                       dockerfile, volumes, egress,
                                                       tmpfs=store_on is None)),
                    log=logged, timeout_s=timeout_s, cancel=cancel, on_orphan=(),
                    cgroups=cg.paths if cg is not None else ())
                oom = done.returncode != 0 and cg is not None and cg.oom_killed()
        finally:
            # A tmpfs's mount point is empty by now; a store on disk holds files of the build's
            # user namespace's ids, removed from inside it
            slots.remove_tree(store)
        if done.cancelled or done.timed_out or done.returncode != 0:
            # A build can fail after its image is committed (Buildah cleaning up on a full
            # tmpfs): a failed build leaves no image (or, if the store is busy, one for the
            # agent's sweep, which removes its job images by name).
            with store_lock.removing() as held:
                if held:
                    self._buildah("rmi", "-f", tag)
        tail = done.tail.replace(dest, tag)
        if done.cancelled:
            raise BuildFailed("build cancelled", tail)
        if done.timed_out:
            raise BuildFailed(f"build took longer than {timeout_s:.0f} s", tail)
        if done.returncode != 0:
            # Past the file size limit Buildah says "file too large", or Go's "closed pipe"
            # when the file it stopped writing was the other end of its own tar stream.
            said = tail.lower()
            if any(s in said for s in ("no space left on device", "file too large",
                                       "io: read/write on closed pipe")):
                raise BuildFailed(f"the build used more than {disk_mb} MB of disk "
                                  "(resources.build_mb bounds what its steps write, and the "
                                  "layer it commits, sparse files at their full size)", tail)
            why = f"; a RUN step used more than {memory_mb} MB" if oom else ""
            raise BuildFailed(f"build failed (buildah exit {done.returncode}{why})", tail)
        if committing:
            log(f"[campugrid] built in {committing[-1] - began:.1f} s, committed into this "
                f"machine's store in {time.monotonic() - committing[-1]:.1f} s")
        return tag

    def capabilities(self) -> BuilderCapabilities:
        # its store sits on the output slot's bounded disk, or on a tmpfs of disk_mb
        return BuilderCapabilities(bounded_store=True)

    def pins(self, bases: Sequence[BaseUse]) -> dict[BaseUse, str]:
        return {}  # its store of allowed bases has them under their own names

    def inputs(self, bases: Sequence[BaseUse]) -> dict[str, str]:
        out = {"builder": f"buildah {self.version()}"}
        main = _listing(self._buildah("images", "--json")) if bases else None
        for use in bases:
            here = self._find(main, use.allowed.name, self._buildah)
            out[f"base {use.allowed.name}"] = str((here or {}).get("digest", "missing"))
        return out

    def version(self) -> str:
        if self._version is None:
            out = subprocess.run([self.buildah, "--version"], capture_output=True, text=True,
                                 timeout=60, check=False)
            self._version = out.stdout.split()[2] if out.returncode == 0 and \
                len(out.stdout.split()) > 2 else "unknown"
        return self._version

    def _buildah(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Buildah on the provider's own store."""
        return subprocess.run([self.buildah, *args], capture_output=True, text=True,
                              timeout=60, check=False)

    def _buildah_bases(self, *args: str) -> subprocess.CompletedProcess[str]:
        root, run = self.bases_store
        return subprocess.run([self.buildah, "--root", str(root / "root"), "--runroot", str(run),
                               "--storage-driver", "overlay", *args],
                              capture_output=True, text=True, timeout=600, check=False)

    @staticmethod
    def _find(listing: dict[str, dict[str, object]] | None, name: str,
              call: Callable[..., subprocess.CompletedProcess[str]]) -> dict[str, object] | None:
        """The image a store holds under `name`: from the store's listing when it has that
        exact name, else from Buildah (which also resolves a short name, as a build would)."""
        if listing is not None and name in listing:
            return listing[name]
        return _image(call("images", "--json", name))

    def _ensure_base(self, use: BaseUse, main: dict[str, dict[str, object]] | None = None,
                     copied: dict[str, dict[str, object]] | None = None) -> None:
        """The allowed base must be in the bases store, as the provider's own store has it
        (copied across when it changed), with the digest a pin names. `main`, `copied`: the
        two stores' listings, if already read."""
        if use.remote:
            raise BuildFailed(f"Dockerfile line {use.line}: {use.said} is an image "
                              "on a registry, which the agent pulls first (agent/bases.py)", "")
        here = self._find(main, use.allowed.name, self._buildah)
        if here is None:  # an allowed base the provider has not made or loaded
            raise CannotRunHere(f"Dockerfile line {use.line}: base image {use.allowed.name} is "
                                "not on this machine (`campugrid provider check` says how to "
                                "add it)")
        known = self._find(copied, use.allowed.name, self._buildah_bases)
        if known is None or known.get("id") != here.get("id"):
            graph, run = self.main_store()
            pulled = self._buildah_bases("pull", "-q",
                                         f"containers-storage:[overlay@{graph}+{run}]"
                                         f"{use.allowed.name}")
            if pulled.returncode != 0:
                raise BuildFailed(f"cannot make {use.allowed.name} available to builds",
                                  pulled.stderr[-1000:])
            if copied is not None:  # a second use of the same base finds it there
                copied[use.allowed.name] = here
        digest, want = str(here.get("digest", "")), use.allowed.digest or use.digest
        if want and digest != want:
            raise CannotRunHere(f"Dockerfile line {use.line}: base image {use.allowed.name} "
                                f"here is {digest or 'unknown'}, not the pinned {want}")

    def _drop_evicted(self, main: dict[str, dict[str, object]] | None = None,
                      copied: dict[str, dict[str, object]] | None = None) -> None:
        """Pulled bases (agent/images.py's cache names) copied into the bases store stay
        there only while the provider's own store still has them: the cache bounds both.
        From one listing of each store (`main`, `copied`: read here if not given; a
        `buildah images` per name cost 50 ms each, seconds in all before every build once
        the cache held a few dozen names)."""
        main = main if main is not None else _listing(self._buildah("images", "--json"))
        copied = copied if copied is not None else \
            _listing(self._buildah_bases("images", "--json"))
        if copied is None or main is None:  # unsure what either store holds: drop nothing
            return
        for name in sorted(n for n in copied.keys() - main.keys() if n.startswith(PULLED_PREFIX)):
            self._buildah_bases("rmi", "-f", name)
            del copied[name]


def _listing(found: subprocess.CompletedProcess[str]) -> dict[str, dict[str, object]] | None:
    """Each name in a `buildah images --json` listing, with its image; None if it failed."""
    if found.returncode != 0:
        return None
    try:
        return {str(n): i for i in json.loads(found.stdout or "[]") for n in i.get("names") or ()}
    except (ValueError, AttributeError, TypeError):
        return None


def _image(found: subprocess.CompletedProcess[str]) -> dict[str, object] | None:
    if found.returncode != 0:
        return None
    try:
        images = json.loads(found.stdout)
    except ValueError:
        return None
    return images[0] if isinstance(images, list) and images and isinstance(images[0], dict) else None
