"""Output slots (campugrid.sandbox.slots) on the real filesystems infra/setup.sh mounts: a
task gets exactly output_mb, however it writes, and each agent a slot of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from campugrid.sandbox import slots
from tests.support.provider import run_as_provider

pytestmark = pytest.mark.integration
MiB = 2**20

HOLD = """
import sys, time
from campugrid.sandbox import slots
slot, how = slots.acquire()
print(slot.path if slot else how, flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module", autouse=True)
def _slots_exist() -> None:
    mounted = [p for p in slots.SLOTS_ROOT.glob("*") if p.is_dir() and os.path.ismount(p)]
    assert len(mounted) >= 2, f"infra/setup.sh mounts output slots under {slots.SLOTS_ROOT}"


def test_a_task_gets_exactly_its_output_mb_however_it_writes(provider):
    out = run_as_provider(provider, """
        import json, os, threading
        from campugrid.sandbox import slots
        from campugrid.protocol.errors import SandboxError
        slot, how = slots.acquire()
        results = {"how": how}
        try:
            slot.prepare(2**50)
        except SandboxError as e:
            results["too_big"] = str(e)
        for mode in ("one-file", "parallel"):
            folder = slot.prepare(8 * 2**20)
            written = [0]
            def write(name, chunk):
                try:
                    with open(folder / name, "wb") as f:
                        while True:
                            f.write(os.urandom(chunk)); f.flush()
                            written[0] += chunk
                except OSError as e:
                    return e.strerror
            if mode == "one-file":
                errors = [write("big", 2**20)]
            else:  # 16 writers at once, in 4 MiB strokes: a poll would see this too late
                errors = []
                threads = [threading.Thread(target=lambda i=i: errors.append(write(f"p{i}", 4 * 2**20)))
                           for i in range(16)]
                [t.start() for t in threads]
                [t.join() for t in threads]
            results[mode] = {"used": slot.used(), "errors": sorted(set(errors))}
            for path in slot.leftovers():
                for f in path.iterdir():
                    f.unlink()
                path.rmdir()
        print(json.dumps(results))
    """)
    assert out["how"] == "enforced"
    assert "1073741824 MB is more than output slot" in out["too_big"], out
    for mode in ("one-file", "parallel"):
        assert out[mode]["errors"] == ["No space left on device"], out
        used = out[mode]["used"]
        assert 8 * MiB * 0.9 <= used <= 8 * MiB + slots.SLACK, f"{mode}: {used / MiB:.2f} MiB"


def test_a_slot_is_one_agents_until_it_exits(provider):
    first = subprocess.Popen(provider.command([sys.executable, "-c", textwrap.dedent(HOLD)]),
                             stdout=subprocess.PIPE, text=True, cwd="/", start_new_session=True)
    try:
        held = first.stdout.readline().strip()
        assert held.startswith(str(slots.SLOTS_ROOT)), held
        other = run_as_provider(provider, """
            import json
            from campugrid.sandbox import slots
            slot, how = slots.acquire()
            print(json.dumps(str(slot.path) if slot else how))
        """)
        assert other != held and other.startswith(str(slots.SLOTS_ROOT))
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # runuser and the Python under it
        first.wait()
        first.stdout.close()
    time.sleep(0.1)
    again = run_as_provider(provider, """
        import json
        from campugrid.sandbox import slots
        slot, how = slots.acquire()
        print(json.dumps(str(slot.path)))
    """)
    assert again == held  # the lock went with the process (the first free slot again)


def test_without_slots_the_agent_says_how_output_is_bounded(tmp_path):
    slot, how = slots.acquire(tmp_path / "none")
    assert slot is None and how.startswith("not enforced exactly: no output slots")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "0").mkdir()  # a folder, not a mounted filesystem
    slot, how = slots.acquire(tmp_path / "plain")
    assert slot is None and "no output slot under" in how and "0.25 s" in how
