"""A dead-man switch for the process groups we start (the sandbox's Podman and its jobs, the
platform's own servers under `campugrid up`): a small shell process that waits on a pipe only
its parent holds, and cleans up when the parent dies without saying it finished. Shared by
the sandbox and the command line, so it depends on nothing of ours."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

_GUARD = """
read line
[ "$line" = done ] && exit 0
# First the clean stop of what lives outside the group (podman rm, while conmon and runsc
# can still answer), then the group, then everything left in the job's cgroups, which also
# holds what left the group (setsid).
[ $# -gt 0 ] && "$@"
kill -s KILL -- "-$0" 2>/dev/null
i=0
while [ $i -lt 100 ]; do
  left=
  for d in $CAMPUGRID_GUARD_CGROUPS; do
    for p in $(cat "$d/cgroup.procs" 2>/dev/null); do kill -s KILL "$p" 2>/dev/null; left=1; done
  done
  [ -z "$left" ] && break
  i=$((i + 1))
  sleep 0.1
done
# The job's cgroups, then their agent's scope folder if nothing else is in it.
for d in $CAMPUGRID_GUARD_CGROUPS; do rmdir "$d" "${d%/*}" 2>/dev/null; done
exit 0
"""


def guard(pgid: int, cleanup: Sequence[str],
           cgroups: Sequence[Path] = ()) -> subprocess.Popen[bytes]:
    """A process in its own session that waits on a pipe only we hold. EOF (we died) means:
    run `cleanup`, kill the child's group and everything in `cgroups`, remove the cgroups;
    a "done" line means we finished normally."""
    env = {**os.environ, "CAMPUGRID_GUARD_CGROUPS": " ".join(str(c) for c in cgroups)}
    return subprocess.Popen(["/bin/sh", "-c", _GUARD, str(pgid), *cleanup],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, env=env)


def release_guard(watcher: subprocess.Popen[bytes]) -> None:
    """We finished normally: the guard exits without killing anything."""
    assert watcher.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        watcher.stdin.write(b"done\n")
        watcher.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        watcher.wait(timeout=5)
