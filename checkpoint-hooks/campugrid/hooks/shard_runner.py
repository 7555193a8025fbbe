"""The shard runner: what the agent starts in a sharded job's warm sandbox, as

    python3 -m campugrid.hooks.shard_runner process|serve -- COMMAND...

It reads one shard per line on stdin ({"index", "payload_json", "timeout_s"}), runs it (see
campugrid.hooks.shards for the two modes) and answers on stdout, one JSON object per line:
{"ready": true} once, {"log": text} for each line the job prints, {"done": index, "ok",
"exit", "result", "error"} per shard. The job's own output never reaches stdout unwrapped.
Standard library only: it runs with the image's own python3.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

from campugrid.hooks.shards import FDS_ENV, MAX_RESULT

MAX_LINE = 64 * 1024


class _Out:
    """The runner's channel to the agent: one JSON object per line on stdout."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.stream = sys.stdout.buffer

    def send(self, **obj: Any) -> None:
        data = json.dumps(obj).encode() + b"\n"
        with self.lock:
            self.stream.write(data)
            self.stream.flush()

    def relay(self, stream: IO[bytes], prefix: str, last: list[str] | None = None) -> threading.Thread:
        def pump() -> None:
            for raw in iter(lambda: stream.readline(MAX_LINE), b""):
                text = raw.decode("utf-8", "replace").rstrip("\n")
                if last is not None and text.strip():
                    last[:] = [text]
                self.send(log=prefix + text)
        t = threading.Thread(target=pump, daemon=True)
        t.start()
        return t


def _as_result(text: str) -> str:
    """A result as JSON text: the text itself if it is JSON, else the text as a string."""
    try:
        json.loads(text)
        return text
    except (ValueError, RecursionError):
        return json.dumps(text)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _run_process(out: _Out, command: list[str], index: int, payload: str,
                 timeout_s: float) -> dict[str, Any]:
    folder = Path(tempfile.gettempdir()) / "campugrid-shards" / str(index)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    env = dict(os.environ, CAMPUGRID_SHARD_INDEX=str(index), CAMPUGRID_SHARD_PAYLOAD=payload,
               CAMPUGRID_SHARD_OUTPUT=str(folder))
    try:
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, start_new_session=True)
    except OSError as e:
        return {"ok": False, "exit": 127, "error": f"cannot start {command[0]}: {e}"}
    last: list[str] = []
    assert proc.stdin and proc.stdout and proc.stderr
    pumps = [out.relay(proc.stdout, f"[shard {index}] ", last),
             out.relay(proc.stderr, f"[shard {index}] ")]

    def feed() -> None:
        with contextlib.suppress(OSError):
            assert proc.stdin
            proc.stdin.write(payload.encode())
            proc.stdin.close()
    threading.Thread(target=feed, daemon=True).start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill(proc)
        return {"ok": False, "exit": -1, "error": f"wall time of {timeout_s:.0f} s exceeded"}
    for p in pumps:
        p.join(timeout=5)
    result_file = folder / "result.json"
    result = None
    if result_file.is_file() and not result_file.is_symlink():
        if result_file.stat().st_size > MAX_RESULT:
            return {"ok": False, "exit": code, "error": f"result.json is over {MAX_RESULT} bytes"}
        text = result_file.read_text(errors="replace")
        try:
            json.loads(text)
        except (ValueError, RecursionError):
            return {"ok": False, "exit": code, "error": "result.json is not valid JSON"}
        result = text
    elif last:
        result = _as_result(last[0][-MAX_RESULT // 2:])
    shutil.rmtree(folder, ignore_errors=True)
    if code != 0:
        return {"ok": False, "exit": code, "result": result,
                "error": f"the command exited with status {code}"}
    return {"ok": True, "exit": 0, "result": result}


class _Server:
    """shard_mode "serve": the job's command, started once, answering over two pipes."""

    def __init__(self, out: _Out, command: list[str]) -> None:
        self.out, self.command = out, command
        self.proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        env = {"PYTHONUNBUFFERED": "1", **os.environ, FDS_ENV: f"{req_r},{rep_w}"}
        try:
            proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, pass_fds=(req_r, rep_w),
                                    start_new_session=True)
        finally:
            os.close(req_r)
            os.close(rep_w)
        assert proc.stdout and proc.stderr
        self.out.relay(proc.stdout, "")
        self.out.relay(proc.stderr, "")
        self.requests = os.fdopen(req_w, "wb", buffering=0)
        self.replies = os.fdopen(rep_r, "rb")
        self.proc = proc
        return proc

    def run(self, index: int, payload: str, timeout_s: float) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            try:
                self._start()
            except OSError as e:
                return {"ok": False, "exit": 127, "error": f"cannot start {self.command[0]}: {e}"}
        proc = self.proc
        assert proc is not None
        with contextlib.suppress(OSError):  # it exited: reported below
            self.requests.write(json.dumps({"index": index, "payload_json": payload}).encode()
                                + b"\n")
        deadline = time.monotonic() + timeout_s
        while True:
            ready, _, _ = select.select([self.replies], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                self.stop()
                return {"ok": False, "exit": -1, "error": f"wall time of {timeout_s:.0f} s exceeded"}
            line = self.replies.readline(MAX_RESULT * 2)
            if not line:  # the command exited without answering
                code = proc.wait()
                self.stop()
                return {"ok": False, "exit": code,
                        "error": f"the command exited with status {code} during the shard"
                                 if code else "the command returned without serving the shard "
                                              "(does it call hooks.serve_shards?)"}
            try:
                reply = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if reply.get("index") != index:
                continue
            if not reply.get("ok"):
                return {"ok": False, "exit": 1, "error": str(reply.get("error"))[:2000]}
            result = reply.get("result")
            if not isinstance(result, str) or len(result) > MAX_RESULT:
                return {"ok": False, "exit": 1, "error": f"the result is over {MAX_RESULT} bytes"}
            return {"ok": True, "exit": 0, "result": result}

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.requests.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill(self.proc)
            _kill(self.proc)
            self.proc = None


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[0] not in ("process", "serve") or argv[1] != "--":
        print("usage: python3 -m campugrid.hooks.shard_runner process|serve -- COMMAND...",
              file=sys.stderr)
        return 2
    mode, command = argv[0], argv[2:]
    out = _Out()
    server = _Server(out, command) if mode == "serve" else None
    out.send(ready=True)
    for line in sys.stdin.buffer:
        req = json.loads(line)
        index, payload, timeout_s = int(req["index"]), str(req["payload_json"]), float(req["timeout_s"])
        if server is not None:
            done = server.run(index, payload, timeout_s)
        else:
            done = _run_process(out, command, index, payload, timeout_s)
        out.send(done=index, **done)
    if server is not None:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
