"""The shard runner and hooks.serve_shards, run for real as processes (outside a sandbox:
the same code runs inside gVisor in tests/acceptance/test_shards.py), and the agent's checks
of what the runner says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import campugrid.hooks
from campugrid.agent import runner_lines
from campugrid.agent.shards import READER_LIMITS, _result
from campugrid.protocol import agent_pb2 as pb
from campugrid.sandbox import confine

HOOKS_ROOT = str(Path(campugrid.hooks.__file__).parents[2])

SERVER = """
from campugrid import hooks
calls = []
def work(p):
    calls.append(p)
    if p == "boom":
        raise ValueError("no good")
    if p == "exit":
        raise SystemExit(4)
    if p == "sleep":
        import time; time.sleep(30)
    return {"twice": p * 2 if isinstance(p, int) else None, "calls": len(calls)}
hooks.serve_shards(work)
"""


def run_runner(mode: str, command: list[str], shards: list[object],
               timeout_s: float = 10) -> list[dict[str, object]]:
    lines = "".join(json.dumps({"index": i, "payload_json": json.dumps(p), "timeout_s": timeout_s})
                    + "\n" for i, p in enumerate(shards))
    out = subprocess.run([sys.executable, "-m", "campugrid.hooks.shard_runner", mode, "--",
                          *command], input=lines, capture_output=True, text=True, timeout=60,
                         env={"PYTHONPATH": HOOKS_ROOT, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_serve_mode_keeps_one_process_and_reports_each_shard(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    msgs = run_runner("serve", [sys.executable, str(script)], [1, "boom", 3, "exit", 5])
    assert msgs[0] == {"ready": True}
    done = {m["done"]: m for m in msgs if "done" in m}
    assert json.loads(done[0]["result"]) == {"twice": 2, "calls": 1}
    assert done[1]["ok"] is False and done[1]["error"] == "ValueError: no good"
    assert json.loads(done[2]["result"]) == {"twice": 6, "calls": 3}  # same process: state kept
    assert done[3]["ok"] is False and "exited with status 4" in done[3]["error"]
    assert json.loads(done[4]["result"]) == {"twice": 10, "calls": 1}  # started again
    assert any("ValueError: no good" in str(m.get("log")) for m in msgs)


def test_serve_mode_stops_a_shard_at_its_wall_time(tmp_path):
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    msgs = run_runner("serve", [sys.executable, str(script)], ["sleep", 2], timeout_s=1)
    done = {m["done"]: m for m in msgs if "done" in m}
    assert done[0]["ok"] is False and "wall time of 1 s exceeded" in done[0]["error"]
    assert json.loads(done[1]["result"])["twice"] == 4


def test_process_mode_result_is_the_last_line_or_result_json():
    script = ('p=$(cat); echo "log line"; '
              'if [ "$p" = "\\"file\\"" ]; then echo "{\\"f\\": 1}" > "$CAMPUGRID_SHARD_OUTPUT/result.json"; fi; '
              'if [ "$p" = 3 ]; then exit 3; fi; '
              'echo "plain text $CAMPUGRID_SHARD_INDEX"')
    msgs = run_runner("process", ["sh", "-c", script], [1, "file", 3])
    done = {m["done"]: m for m in msgs if "done" in m}
    assert json.loads(done[0]["result"]) == "plain text 0"
    assert json.loads(done[1]["result"]) == {"f": 1}
    assert done[2]["ok"] is False and done[2]["exit"] == 3
    assert {"log": "[shard 0] log line"} in msgs


def test_process_mode_refuses_an_oversized_result_json():
    script = 'head -c 70000 /dev/zero | tr "\\0" 1 > "$CAMPUGRID_SHARD_OUTPUT/result.json"'
    [done] = [m for m in run_runner("process", ["sh", "-c", script], [1]) if "done" in m]
    assert done["ok"] is False and done["error"] == "result.json is over 65536 bytes"


def test_serve_shards_outside_a_sharded_job_says_so():
    out = subprocess.run([sys.executable, "-c", "from campugrid import hooks; "
                          "hooks.serve_shards(print)"], capture_output=True, text=True,
                         env={"PYTHONPATH": HOOKS_ROOT}, timeout=30)
    assert out.returncode != 0 and 'shard_mode": "serve"' in out.stderr


def test_the_agent_trusts_nothing_the_runner_says():
    with confine.Worker(READER_LIMITS) as reader:  # as the agent reads them: confined

        def said(msg: object) -> pb.ShardResult:
            return _result(3, reader.call(runner_lines.parse, json.dumps(msg).encode()))

        assert said({"done": 3, "ok": True, "exit": 0, "result": '{"a": 1}'}).succeeded
        bad_json = said({"done": 3, "ok": True, "exit": 0, "result": "{oops"})
        assert not bad_json.succeeded and bad_json.reason.startswith("the shard's result is not JSON")
        deep = said({"done": 3, "ok": True, "exit": 0, "result": "[" * 60_000 + "]" * 60_000})
        assert not deep.succeeded and deep.result_json == ""
        huge = said({"done": 3, "ok": True, "exit": 0, "result": json.dumps("x" * 70_000)})
        assert not huge.succeeded and huge.result_json == ""
        odd = said({"done": 3, "ok": "yes", "exit": 2**40, "result": 5})
        assert not odd.succeeded and odd.exit_code == -1 and odd.result_json == ""
        assert reader.call(runner_lines.parse, b"[1, 2]") == {}  # not an object
        assert reader.call(runner_lines.parse, b"\xff not json") == {}
        assert reader.call(runner_lines.parse, b"[" * 200_000) == {}  # too deep for json
