"""The checkpoint hooks in a Python of their own: the standard library only, and SIGTERM as a
flag the training loop checks (tests/unit/test_hooks.py has the rest)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from campugrid import hooks


def test_the_hooks_use_the_standard_library_only():
    root = Path(hooks.__file__).parent
    code = (f"import sys; sys.path.insert(0, {str(root.parent.parent)!r}); "
            "import campugrid.hooks, campugrid.hooks.torch; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy')))")
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_sigterm_becomes_a_flag_the_loop_can_check(tmp_path):
    root = Path(hooks.__file__).parent.parent.parent
    script = f"""
import os, signal, sys, time
sys.path.insert(0, {str(root)!r})
from campugrid import hooks
assert not hooks.stop_requested()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.1)
with hooks.save(7, root={str(tmp_path)!r}) as f:
    (f / "final").write_text("saved after SIGTERM")
print("stopping" if hooks.stop_requested() else "ignored")
"""
    out = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "stopping", out.stderr
    assert hooks.restore(tmp_path).epoch == 7
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL or os.name != "posix"
