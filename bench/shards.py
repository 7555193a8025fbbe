"""Sharded throughput end to end: trivial shards per second, gVisor sandbox included.

    .venv/bin/python bench/shards.py [--count 300] [--no-peer] [--runsc PATH ...]
                                                               (as root, like ./infra/up)

The platform as `campugrid up` starts it (embedded S3, coordinator on SQLite, ONE agent as the
unprivileged provider user). A sharded job of N trivial shards (each returns i * 2) is
submitted through the REST API and timed from submit to its final state, build and sandbox
start included, then from its first shard's end to its last (steady state). Two modes:
"serve" (the job's process stays up and serves shards through hooks.serve_shards) and
"process" (python3 starts once per shard, inside the one warm sandbox). The peer, gpumesh
3.2.0 from PyPI with one worker (no isolation at all), runs the same count in the same run
(bench/peers/gpumesh_driver.py) and the ratio is printed. With --runsc given more than once
(by default: runsc-from-go.sh's and Debian's, where present), the agent runs once with each
(`campugrid agent run --runsc PATH`), rows side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from campugrid.cli.platform import Platform
from campugrid.cli.seaweed import free_port
from campugrid.client import Api
from campugrid.protocol.spec import JobSpec

BENCH = Path(__file__).resolve().parent

SERVE = "from campugrid import hooks\nhooks.serve_shards(lambda p: p['i'] * 2)\n"
PROCESS = ("import json, os\n"
           "print(json.loads(os.environ['CAMPUGRID_SHARD_PAYLOAD'])['i'] * 2)\n")


def context(root: Path, script: str) -> Path:
    ctx = root / f"ctx-{abs(hash(script))}"
    ctx.mkdir()
    (ctx / "Dockerfile").write_text("FROM localhost/campugrid/python:bookworm\n"
                                    "COPY shard.py /shard.py\n")
    (ctx / "shard.py").write_text(script)
    return ctx


def run_ours(api: Api, root: Path, mode: str, count: int) -> dict[str, float]:
    from campugrid.client import tar_folder

    spec = JobSpec.from_dict({
        "command": ["python3", "/shard.py"], "shard_mode": mode,
        "resources": {"cpus": 1, "memory_mb": 512, "wall_time_s": 60},
        "shards": [{"payload": {"i": i}} for i in range(count)]})
    tarball = tar_folder(context(root, SERVE if mode == "serve" else PROCESS))
    t0 = time.perf_counter()
    job = api.submit(tarball, spec)
    final = api.wait(job["id"], timeout_s=1800, poll_s=0.05, check=False)
    wall = time.perf_counter() - t0
    if final["state"] != "succeeded":
        raise SystemExit(f"{mode}: the job ended {final['state']}: {final.get('reason')}")
    shards = list(api.shards(job["id"]))
    wrong = [s["index"] for s in shards if s["result"] != s["index"] * 2]
    if wrong:
        raise SystemExit(f"{mode}: wrong results for shards {wrong[:10]}")
    ends = sorted(s["finished_at"] for s in shards)
    import datetime as dt
    first, last = (dt.datetime.fromisoformat(x) for x in (ends[0], ends[-1]))
    steady = (last - first).total_seconds()
    return {"count": count, "wall_s": wall, "per_s": count / wall,
            "steady_per_s": (count - 1) / steady if steady > 0 else float("nan")}


def run_peer(count: int) -> dict[str, float] | None:
    driver = BENCH / "peers" / "gpumesh_driver.py"
    out = subprocess.run([sys.executable, str(driver), "--venv", str(BENCH / ".peers" / "gpumesh"),
                          "--mode", "shards", "--count", str(count)],
                         capture_output=True, text=True, timeout=1200)
    try:
        result = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        print(f"gpumesh driver failed: {out.stderr[-800:]}", file=sys.stderr)
        return None
    if "error" in result:
        print(f"gpumesh driver: {result['error']}", file=sys.stderr)
        return None
    return result


def _release(version: str) -> str:
    """runsc's release date from its --version ("go-20260905-…", "0.0~20240729.0")."""
    found = re.search(r"(20\d\d)(\d\d)(\d\d)", version)
    return "-".join(found.groups()) if found else version.split("\n")[0][-20:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=300, help="shards per job (and for gpumesh)")
    ap.add_argument("--no-peer", action="store_true", help="skip gpumesh")
    ap.add_argument("--runsc", action="append", help="a runsc for the agent (repeatable)")
    args = ap.parse_args()
    runscs = args.runsc or [p for p in ("/usr/local/bin/runsc", "/usr/bin/runsc")
                            if Path(p).exists()]
    dated = {r: _release(subprocess.run([r, "--version"], capture_output=True, text=True,
                                        check=True).stdout) for r in runscs}
    rows: dict[str, dict[str, float]] = {}
    for runsc in runscs:
        root = Path(tempfile.mkdtemp(prefix="campugrid-shards-bench-"))
        os.chmod(root, 0o711)
        platform = Platform(root / "state", http_port=free_port(),
                            admin_identity=root / "admin.json").start()
        try:
            platform.start_agent("bench-agent", args=("--runsc", runsc))
            with platform.api() as api:
                for mode in ("serve", "process"):
                    row = f"{mode}, runsc {dated[runsc]}"
                    rows[row] = run_ours(api, root, mode, args.count)
                    print(f"  campugrid {row}: {rows[row]['per_s']:.1f} shards/s", file=sys.stderr)
        finally:
            platform.stop()
            shutil.rmtree(root, ignore_errors=True)
    peer = None if args.no_peer else run_peer(args.count)
    print(f"\n{args.count} trivial shards, one worker/agent on this machine, timed from submit "
          "to the last result\n")
    print("| system                                              | isolation        | shards/s "
          "| wall s | steady shards/s | ratio to gpumesh |")
    print("|-----------------------------------------------------|------------------|----------"
          "|--------|-----------------|------------------|")
    for mode, r in rows.items():
        ratio = f"{r['per_s'] / peer['per_s']:.2f}x" if peer and peer.get("per_s") else "n/a"
        print(f"| campugrid, shard_mode {mode:<29} | gVisor, offline  | {r['per_s']:8.1f} "
              f"| {r['wall_s']:6.1f} | {r['steady_per_s']:15.1f} | {ratio:>16} |")
    if peer:
        print(f"| gpumesh 3.2.0 (baseline)                            | none             | "
              f"{peer['per_s']:8.1f} | {peer['wall_s']:6.1f} | {'n/a':>15} | {'1.00x':>16} |")
    else:
        print("| gpumesh 3.2.0 (baseline)                            | none             | not run |")
    print("\nratio: our shards/s over gpumesh's, same machine, same run (higher is better for "
          "campugrid). Wall includes our image build and sandbox start; steady is first to last "
          "shard end.")


if __name__ == "__main__":
    main()
