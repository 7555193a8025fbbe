"""Peer baseline: gpumesh 3.2.0 from PyPI, in its own venv, on loopback, on this machine.

lease: `gpumesh serve` runs as its own process with N trivial tasks queued (GPUMesh.submit_job);
the driver registers as a worker and times POST /api/lease round trips through gpumesh's MeshClient.
shards: `gpumesh serve` plus ONE `gpumesh join` worker; M trivial functions go through
GPUMesh.distribute, timed from submit to the last result recorded. Prints one JSON line on stdout."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

PEER = "gpumesh 3.2.0"
PIN = "gpumesh==3.2.0"
INNER_ENV = "GPUMESH_DRIVER_INNER"
MAX_QUEUED = 50_000
BODY_LIMIT = 9 * 1024 * 1024  # gpumesh refuses request bodies over 10 MB


def log(*parts) -> None:
    print("[gpumesh-driver]", *parts, file=sys.stderr, flush=True)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", required=True, help="virtual environment holding gpumesh==3.2.0")
    ap.add_argument("--mode", required=True, choices=["lease", "shards", "idle"])
    ap.add_argument("--queued", type=int, default=10_000, help="lease: tasks queued (1000..50000)")
    ap.add_argument("--repeats", type=int, default=200, help="lease: timed claims")
    ap.add_argument("--warmup", type=int, default=5, help="lease: untimed claims first")
    ap.add_argument("--count", type=int, default=200, help="shards: tasks submitted")
    ap.add_argument("--seconds", type=float, default=300.0,
                    help="idle: how long to watch the registered, idle worker")
    ap.add_argument("--budget-s", type=float, default=170.0,
                    help="wall-clock budget for the measurement (venv setup not included)")
    ap.add_argument("--keep", action="store_true", help="keep the run folder (logs, database)")
    return ap.parse_args(argv)


# --------------------------------------------------------------------------------------------
# Outer part: plain /usr/bin/python3, standard library only.


def _venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def _installed_version(py: str):
    probe = "import importlib.metadata as m; print(m.version('gpumesh'))"
    try:
        out = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def ensure_venv(venv: str) -> str:
    py = _venv_python(venv)
    if not os.path.exists(py):
        base = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
        log(f"creating venv {venv} with {base}")
        subprocess.run([base, "-m", "venv", venv], check=True, stdout=sys.stderr, timeout=300)
    if _installed_version(py) != "3.2.0":
        log(f"installing {PIN} into {venv}")
        subprocess.run([py, "-m", "pip", "install", "--quiet", PIN], check=True,
                       stdout=sys.stderr, timeout=900)
    version = _installed_version(py)
    if version != "3.2.0":
        raise RuntimeError(f"{venv} holds gpumesh {version!r}, not 3.2.0")
    return py


def emit(result: dict) -> None:
    sys.__stdout__.write(json.dumps(result) + "\n")
    sys.__stdout__.flush()


def main() -> int:
    args = parse_args()
    venv = os.path.abspath(args.venv)
    inside = os.path.realpath(sys.prefix) == os.path.realpath(venv)
    if not inside:
        if os.environ.get(INNER_ENV):
            emit({"peer": PEER, "mode": args.mode, "error": f"re-exec did not land in {venv}"})
            return 1
        try:
            py = ensure_venv(venv)
        except Exception as exc:
            emit({"peer": PEER, "mode": args.mode, "error": f"venv setup failed: {exc}"})
            return 1
        os.environ[INNER_ENV] = "1"
        sys.stdout.flush()
        sys.stderr.flush()
        os.execv(py, [py, os.path.abspath(__file__), *sys.argv[1:]])
    return inner_main(args)


# --------------------------------------------------------------------------------------------
# Inner part: runs with the venv's python, where gpumesh is importable.

TRIVIAL_SCRIPT = (
    "import json, sys\n"
    "payload = json.load(sys.stdin)\n"
    "print(json.dumps(payload.get('i', 0) * 2))\n"
)


def _shard(i):
    """The trivial shard for --mode shards: returns a small number."""
    return i * 2


class Run:
    """Owns the run folder and every process started in it; stop() ends them all."""

    def __init__(self, keep: bool):
        self.dir = tempfile.mkdtemp(prefix="gpumesh-bench-")
        self.keep = keep
        for sub in ("home", "tmp", "logs"):
            os.makedirs(os.path.join(self.dir, sub))
        self.procs = []  # (name, Popen, stop signal)
        self.token = __import__("secrets").token_urlsafe(18)
        self.port = self._free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db = os.path.join(self.dir, "gpumesh.db")
        self.env = dict(os.environ)
        self.env.pop(INNER_ENV, None)
        self.env.update({
            "HOME": os.path.join(self.dir, "home"),   # gpumesh writes ~/.gpumesh/config.json
            "TMPDIR": os.path.join(self.dir, "tmp"),  # task sandboxes land here
            "GPUMESH_TOKEN": self.token,
            "GPUMESH_HOST": "127.0.0.1",
            "GPUMESH_HOST_IP": "127.0.0.1",  # no LAN-address detection
            "GPUMESH_BENCH_RUN": self.dir,    # marks descendants for the final sweep
            "PYTHONUNBUFFERED": "1",
            "NO_COLOR": "1",
        })
        self.gpumesh = os.path.join(os.path.dirname(sys.executable), "gpumesh")

    @staticmethod
    def _free_port() -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    def start(self, name: str, argv: list, stop_signal: int):
        out = open(os.path.join(self.dir, "logs", name + ".log"), "wb")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=self.env, cwd=self.dir, start_new_session=True)
        out.close()
        self.procs.append((name, proc, stop_signal))
        log(f"started {name} (pid {proc.pid})")
        return proc

    def tail(self, name: str, lines: int = 15) -> str:
        try:
            with open(os.path.join(self.dir, "logs", name + ".log"), "rb") as f:
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def start_coordinator(self):
        return self.start("coordinator", [self.gpumesh, "serve", "--host", "127.0.0.1",
                                          "--port", str(self.port), "--db", self.db,
                                          "--no-discovery", "--no-self-worker"], signal.SIGTERM)

    def start_worker(self):
        # Ctrl+C is how `gpumesh join` is meant to be stopped: it lets the task in hand finish.
        return self.start("worker", [self.gpumesh, "join", self.url, "--timeout", "60"], signal.SIGINT)

    def stop_one(self, which: str) -> None:
        for name, proc, sig in self.procs:
            if name == which:
                self._end(name, proc, sig)

    def stop(self) -> None:
        # Worker first (it would otherwise go on polling a closing coordinator), then coordinator.
        for name, proc, sig in reversed(self.procs):
            self._end(name, proc, sig)
        self._sweep()
        if not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            log(f"kept {self.dir}")

    @staticmethod
    def _end(name: str, proc, sig: int) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                log(f"{name} did not stop in 20 s; killing its process group")
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        # Anything left in its process group (same session) goes too.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _sweep(self) -> None:
        """Kill stray descendants: gpumesh runs every task in a new session of its own."""
        marker = ("GPUMESH_BENCH_RUN=" + self.dir).encode()
        me = os.getpid()
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == me:
                continue
            pid = int(entry)
            ours = False
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    ours = marker in f.read().split(b"\0")
            except OSError:
                pass
            if not ours:
                try:
                    cwd = os.readlink(f"/proc/{pid}/cwd")
                    ours = cwd == self.dir or cwd.startswith(self.dir + os.sep)
                except OSError:
                    pass
            if ours:
                log(f"sweeping leftover process {pid}")
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass


def _wait(check, what: str, timeout: float, procs=(), every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited (rc {proc.returncode}) while waiting for {what}")
        try:
            value = check()
        except Exception:
            value = None
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def _pct(sorted_ms: list, q: float) -> float:
    if not sorted_ms:
        return float("nan")
    k = max(0, min(len(sorted_ms) - 1, int(round(q * len(sorted_ms) + 0.5)) - 1))
    return sorted_ms[k]


def measure_lease(run: Run, args, deadline: float, notes: list) -> dict:
    from gpumesh import PROTOCOL_VERSION, GPUMesh, capability
    from gpumesh.worker import MeshClient

    queued = args.queued
    if queued > MAX_QUEUED:
        notes.append(f"queued capped from {queued} to {MAX_QUEUED}")
        queued = MAX_QUEUED
    if queued < 1:
        raise ValueError("--queued must be at least 1")
    repeats = max(1, min(args.repeats, queued - args.warmup))
    if repeats != args.repeats:
        notes.append(f"repeats capped to {repeats} (queue of {queued})")

    coord = run.start_coordinator()
    client = MeshClient(run.url, run.token)
    _wait(lambda: client.call("GET", "/api/health", timeout=2), "the coordinator", 30,
          [("coordinator", coord)])

    # Queue N trivial script tasks through the public API, as one job (one HTTP request).
    mesh = GPUMesh(run.url, run.token)
    t0 = time.perf_counter()
    mesh.submit_job(TRIVIAL_SCRIPT, [{"i": i} for i in range(queued)], name="bench-queue")
    seed_s = time.perf_counter() - t0
    log(f"queued {queued} tasks via POST /api/jobs in {seed_s:.2f}s")

    # Register exactly as `gpumesh join` does (capability probe + protocol version), minus the
    # GFLOP/s benchmark, whose score only matters for ranking several workers against each other.
    body = capability.probe_device()
    body.update({"score": 1.0, "protocol_version": PROTOCOL_VERSION})
    worker_id = client.call("POST", "/api/register", body)["worker_id"]

    def lease():
        task = client.call("POST", "/api/lease", {"worker_id": worker_id})
        if task is None:
            raise RuntimeError("coordinator had no task to lease")
        return task

    for _ in range(args.warmup):
        lease()
    samples = []
    last_beat = time.monotonic()
    for _ in range(repeats):
        if time.monotonic() > deadline:
            notes.append(f"stopped after {len(samples)} of {repeats} claims: time budget")
            break
        if time.monotonic() - last_beat > 5.0:  # a real worker heartbeats every 10 s
            client.call("POST", "/api/heartbeat", {"worker_id": worker_id})
            last_beat = time.monotonic()
        t = time.perf_counter()
        lease()
        samples.append((time.perf_counter() - t) * 1000.0)

    health = client.call("GET", "/api/health")
    in_flight = health["jobs_pending"] + health["jobs_running"]

    # Stop the coordinator, then time Database.lease_task() itself on the same database:
    # the server-side share of a claim, without HTTP, threads or the reaper.
    run.stop_one("coordinator")
    from gpumesh.db import Database
    server_ms = []
    db = Database(run.db)
    try:
        for _ in range(min(50, len(samples))):
            if time.monotonic() > deadline:
                break
            t = time.perf_counter()
            if db.lease_task(worker_id) is None:
                break
            server_ms.append((time.perf_counter() - t) * 1000.0)
    finally:
        db.close()

    s = sorted(samples)
    result = {
        "queued": queued,
        "median_ms": round(statistics.median(s), 3),
        "p95_ms": round(_pct(s, 0.95), 3),
        "per_s": round(len(s) / (sum(s) / 1000.0), 1),
        "claims": len(s),
        "in_flight_during": in_flight,
        "seed_s": round(seed_s, 2),
    }
    if server_ms:
        result["server_median_ms"] = round(statistics.median(server_ms), 3)
    return result


def start_mesh(run: Run):
    """`gpumesh serve` and one `gpumesh join` worker, once it has registered."""
    from gpumesh.worker import MeshClient

    coord = run.start_coordinator()
    client = MeshClient(run.url, run.token)
    _wait(lambda: client.call("GET", "/api/health", timeout=2), "the coordinator", 30,
          [("coordinator", coord)])
    worker = run.start_worker()
    _wait(lambda: client.call("GET", "/api/health", timeout=2)["workers_alive"] >= 1,
          "the worker to register", 90, [("coordinator", coord), ("worker", worker)], every=0.2)
    return coord, worker, client


def measure_shards(run: Run, args, deadline: float, notes: list) -> dict:
    from gpumesh import GPUMesh, GPUMeshError, serializer
    from gpumesh.worker import MeshClient

    count = args.count
    if count < 1:
        raise ValueError("--count must be at least 1")
    # distribute() puts the pickled function into every task payload, and the coordinator
    # refuses bodies over 10 MB, so one job can only hold so many.
    per_task = len(serializer.serialize_function(_shard)) + 120
    fit = BODY_LIMIT // per_task
    if count > fit:
        notes.append(f"count capped from {count} to {fit} (gpumesh's 10 MB job-body limit)")
        count = fit

    _, _, client = start_mesh(run)
    log("worker registered; submitting")

    mesh = GPUMesh(run.url, run.token)
    params = [{"i": i} for i in range(count)]
    budget = max(5.0, deadline - time.monotonic())

    # The coordinator's own counts, sampled every 50 ms, date the last result more precisely
    # than distribute()'s backing-off status poll (up to 1 s between looks).
    import threading
    finished_at = {}
    stop_watch = threading.Event()
    watcher_client = MeshClient(run.url, run.token)

    def watch():
        while not stop_watch.is_set():
            try:
                h = watcher_client.call("GET", "/api/health", timeout=5)
                if h["jobs_done"] + h["jobs_failed"] >= count and "t" not in finished_at:
                    finished_at["t"] = time.perf_counter()
                    return
            except Exception:
                pass
            stop_watch.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    t0 = time.perf_counter()
    watcher.start()
    timed_out = False
    results = []
    try:
        results = mesh.distribute(_shard, params, name="bench-shards", timeout=budget)
    except (TimeoutError, GPUMeshError) as exc:
        timed_out = True
        notes.append(f"distribute() did not finish: {exc}")
    t_user = time.perf_counter()
    stop_watch.set()
    watcher.join(timeout=10)

    health = client.call("GET", "/api/health")
    done, failed = health["jobs_done"], health["jobs_failed"]
    if timed_out:
        wall = t_user - t0
        notes.append(f"partial: {done} of {count} done when the {budget:.0f}s budget ran out")
    else:
        wall = finished_at.get("t", t_user) - t0
        wrong = sum(1 for i, r in enumerate(results) if r != i * 2)
        if wrong:
            notes.append(f"{wrong} of {count} results were wrong or failed")
    return {
        "count": count,
        "per_s": round(done / wall, 2) if wall > 0 else None,
        "wall_s": round(wall, 3),
        "user_wall_s": round(t_user - t0, 3),
        "done": done,
        "failed": failed,
    }


def tree_usage(root: int) -> tuple[float, float, int]:
    """(CPU seconds, resident MB, processes) of `root` and all its descendants, from /proc."""
    children: dict = {}
    stats: dict = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry)
        stats[pid] = fields
        children.setdefault(int(fields[1]), []).append(pid)
    todo, seen = [root], []
    while todo:
        pid = todo.pop()
        if pid in stats:
            seen.append(pid)
            todo += children.get(pid, [])
    tick, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
    cpu = sum(int(stats[p][11]) + int(stats[p][12]) for p in seen) / tick
    rss = sum(int(stats[p][21]) for p in seen) * page / 1024**2
    return cpu, rss, len(seen)


def watch_idle(pid: int, seconds: float) -> dict:
    """CPU and memory of a process tree over `seconds`, sampled once a second."""
    cpu0, _, _ = tree_usage(pid)
    t0 = time.monotonic()
    rss, procs = [], 0
    while time.monotonic() - t0 < seconds:
        time.sleep(1.0)
        _, mb, n = tree_usage(pid)
        rss.append(mb)
        procs = max(procs, n)
    cpu1, _, _ = tree_usage(pid)
    wall = time.monotonic() - t0
    return {"seconds": round(wall, 1), "cpu_s": round(cpu1 - cpu0, 2),
            "cpu_pct": round(100 * (cpu1 - cpu0) / wall, 3),
            "rss_mb_median": round(statistics.median(rss), 1), "rss_mb_max": round(max(rss), 1),
            "processes": procs}


def measure_idle(run: Run, args) -> dict:
    _, worker, _ = start_mesh(run)
    time.sleep(5)  # past its start-up (benchmark, registration)
    return watch_idle(worker.pid, args.seconds)


def inner_main(args) -> int:
    import contextlib

    started = time.monotonic()
    deadline = started + args.budget_s
    notes = []
    out = {"peer": PEER, "mode": args.mode}
    rc = 0
    run = None

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    # Started in the background by a shell, this process may have SIGINT ignored, and children
    # would inherit that; `gpumesh join` is stopped with SIGINT, so give it a real handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # gpumesh prints; stdout is for the JSON
            run = Run(args.keep)
            log(f"run folder {run.dir}, coordinator {run.url}")
            if args.mode == "lease":
                out.update(measure_lease(run, args, deadline, notes))
            elif args.mode == "idle":
                out.update(measure_idle(run, args))
            else:
                out.update(measure_shards(run, args, deadline, notes))
    except BaseException as exc:
        rc = 1
        out["error"] = f"{type(exc).__name__}: {exc}"
        if run is not None:
            for name, _, _ in run.procs:
                log(f"--- last lines of {name} log ---\n{run.tail(name)}")
    finally:
        # Cleanup must not itself be cut short by a second Ctrl+C / SIGTERM.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if run is not None:
            with contextlib.redirect_stdout(sys.stderr):
                run.stop()
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    if notes:
        out["note"] = "; ".join(notes)
    emit(out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
