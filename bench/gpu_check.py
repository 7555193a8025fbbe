"""The GPU path on a real NVIDIA GPU, as one command with a JSON report (under 5 minutes).

Here (a machine without a GPU), once, to make what travels with the checkout:

    .venv/bin/python bench/gpu_check.py --prepare

writes bench/.carry/ (ignored by git; about 20 MB): the runsc that runsc-from-go.sh built,
xz-compressed, and NVML's Python binding (nvidia-ml-py's pynvml.py). On the GPU machine
(PyTorch installed, no Podman, no network), from the checkout's root:

    python3 bench/gpu_check.py [--out gpu-report.json]

It checks, and reports each with its figures:
1. discovery: the GPUs the agent's own NVML code finds (campugrid.agent.gpus) against
   `nvidia-smi`: the same UUIDs, names, memory, compute capability and driver;
2. speed: a bf16 CUDA matmul natively and inside gVisor (`runsc --nvproxy`, the carried
   runsc), and their ratio (goal: at least 0.95);
3. isolation: a sandbox given one reserved GPU, with the devices the agent would map for it
   (campugrid.sandbox.podman_runsc.gpu_devices), sees exactly that GPU;
4. reservation: the coordinator's placement (campugrid.coordinator.scheduler.place) grants a
   job the GPU memory the agent reports free; that much is then allocated in the sandbox.

The sandbox is an OCI bundle run by runsc directly (the GPU machine has no Podman): the
host's root read-only, /tmp in memory, no network, the reserved GPU's device nodes. Exit
status: 0 all checks passed, 1 one failed, 2 nothing to check (no NVIDIA GPU or no driver).
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CARRY = ROOT / "bench" / ".carry"
# Our PEP 420 roots and the carried pynvml: all the imports below need (no .venv there).
PATHS = [str(CARRY / "site"), *(str(ROOT / r) for r in ("provider-agent", "sandbox", "coordinator"))]
sys.path[:0] = PATHS

from campugrid.agent.gpus import GpuPolicy, discover  # noqa: E402
from campugrid.agent.messages import Gpu  # noqa: E402
from campugrid.coordinator.scheduler import GpuView, MachineView, place  # noqa: E402
from campugrid.protocol.spec import Resources  # noqa: E402
from campugrid.sandbox.podman_runsc import gpu_devices  # noqa: E402

GOAL_RATIO = 0.95
MB = 1024 * 1024
SMI_FIELDS = ("uuid", "name", "memory.total", "memory.free", "compute_cap", "driver_version")
CARRY_LIMIT = 60 * MB  # what a device call carries with the tree is 64 MiB in all


# --- here: what travels ---------------------------------------------------------------------

def prepare(runsc: Path, carry: Path = CARRY) -> list[Path]:
    """The runsc (compressed) and pynvml.py into `carry`; returns the files written."""
    carry.mkdir(parents=True, exist_ok=True)
    packed = carry / "runsc.xz"
    packed.write_bytes(lzma.compress(runsc.read_bytes(), preset=9))
    import pynvml  # the coordinator's .venv has nvidia-ml-py

    site = carry / "site"
    site.mkdir(exist_ok=True)
    shutil.copy(pynvml.__file__, site / "pynvml.py")
    written = [packed, site / "pynvml.py"]
    size = sum(p.stat().st_size for p in written)
    if size > CARRY_LIMIT:
        raise SystemExit(f"gpu_check: {size // MB} MB to carry, over {CARRY_LIMIT // MB} MB")
    return written


def unpack_runsc(carry: Path, into: Path) -> Path:
    runsc = into / "runsc"
    runsc.write_bytes(lzma.decompress((carry / "runsc.xz").read_bytes()))
    runsc.chmod(0o755)
    return runsc


# --- 1. discovery ---------------------------------------------------------------------------

def smi_gpus(run: Callable[..., Any] = subprocess.run) -> list[dict[str, str]]:
    """What nvidia-smi says of each GPU (SMI_FIELDS); [] where there is none."""
    try:
        out = run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}",
                   "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return [dict(zip(SMI_FIELDS, (v.strip() for v in line.split(",")), strict=True))
            for line in out.stdout.splitlines() if line.strip()]


def compare(found: Sequence[Gpu], smi: Sequence[dict[str, str]]) -> list[str]:
    """Where the agent's discovery and nvidia-smi disagree ([]: nowhere). Free memory moves
    between the two reads: within 2 % of the total is the same."""
    problems = []
    ours, theirs = {g.uuid: g for g in found}, {s["uuid"]: s for s in smi}
    if set(ours) != set(theirs):
        problems.append(f"GPUs: the agent found {sorted(ours)}, nvidia-smi {sorted(theirs)}")
    for uuid in sorted(set(ours) & set(theirs)):
        g, s = ours[uuid], theirs[uuid]
        total = int(float(s["memory.total"]))
        checks = [("name", g.name, s["name"]), ("compute capability", g.compute_capability,
                                                s["compute_cap"]),
                  ("driver", g.driver_version, s["driver_version"]),
                  ("memory total MB", g.memory_total_mb, total)]
        problems += [f"{uuid} {what}: agent {a!r}, nvidia-smi {b!r}" for what, a, b in checks
                     if a != b]
        if abs(g.memory_free_mb - int(float(s["memory.free"]))) > 0.02 * total:
            problems.append(f"{uuid} free MB: agent {g.memory_free_mb}, nvidia-smi "
                            f"{s['memory.free']}")
    return problems


# --- the sandbox: an OCI bundle for runsc ----------------------------------------------------

def bundle(folder: Path, argv: Sequence[str], gpus: tuple[tuple[str, int], ...],
           env: dict[str, str], stat_of: Callable[[str], os.stat_result] = os.stat) -> Path:
    """A bundle whose process runs `argv` with the host's root read-only, /tmp in memory, no
    network, and the devices and variables the agent's sandbox gets for `gpus` (uuid,
    minor) (gpu_devices: without CDI, the GPUs' nodes and the control nodes)."""
    args = gpu_devices(gpus, cdi_dirs=())
    nodes = [args[i + 1] for i, a in enumerate(args) if a == "--device"]
    variables = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "--env")
    devices = []
    for node in nodes:
        st = stat_of(node)
        devices.append({"path": node, "type": "c", "major": os.major(st.st_rdev),
                        "minor": os.minor(st.st_rdev), "fileMode": stat.S_IMODE(st.st_mode),
                        "uid": 0, "gid": 0})
    config = {
        "ociVersion": "1.0.2",
        "process": {"terminal": False, "user": {"uid": 0, "gid": 0}, "args": list(argv),
                    "env": [f"{k}={v}" for k, v in {
                        "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                        "HOME": "/tmp", **env, **variables}.items()],
                    "cwd": "/tmp"},
        "root": {"path": "/", "readonly": True},
        "hostname": "gpu-check",
        "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                   {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
                   {"destination": "/dev/shm", "type": "tmpfs", "source": "shm"}],
        "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
                  "devices": devices,
                  "resources": {"devices": [{"allow": True, "access": "rwm"}]}},
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def sandboxed(runsc: Path, folder: Path, *, nvproxy: bool, timeout: float = 240) -> dict[str, Any]:
    """Runs the bundle under runsc; the last line of its output, as JSON."""
    state = folder / "state"
    state.mkdir(exist_ok=True)
    flags = [f"--root={state}", "--network=none", "--ignore-cgroups"]
    if nvproxy:
        flags.append("--nvproxy")
    if os.geteuid() != 0:
        flags.append("--rootless")
    name = f"gpu-check-{os.getpid()}-{int(time.time() * 1000)}"
    out = subprocess.run([str(runsc), *flags, "run", "--bundle", str(folder), name],
                         capture_output=True, text=True, timeout=timeout)
    subprocess.run([str(runsc), *flags, "delete", "--force", name], capture_output=True,
                   timeout=60)
    netns = state / "null-netns"  # runsc's empty network namespace (--network=none), held by a bind mount
    if os.path.ismount(netns):
        subprocess.run(["umount", "-l", str(netns)], capture_output=True, timeout=60)
    return _last_json(out, "runsc")


def _last_json(out: subprocess.CompletedProcess[str], what: str) -> dict[str, Any]:
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{what} exited {out.returncode}: {(out.stderr or out.stdout)[-2000:]}")
    return dict(json.loads(lines[-1]))


# --- what runs natively and in the sandbox ---------------------------------------------------

def probe(alloc_mb: int, size: int = 8192, rounds: int = 100) -> dict[str, Any]:
    """The GPUs this process sees, a bf16 matmul's speed on the first, and whether
    `alloc_mb` can be allocated there (0: not tried). Without CUDA: {"cuda": false}."""
    try:
        import torch
    except ImportError:
        return {"cuda": False, "why": "no PyTorch"}
    if not torch.cuda.is_available():
        return {"cuda": False, "why": "torch.cuda.is_available() is false"}
    seen = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(rounds):
            a @ b
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    del a, b
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    allocated = None
    if alloc_mb:
        try:
            block = torch.empty(alloc_mb * MB, dtype=torch.uint8, device="cuda")
            block[-1] = 1
            torch.cuda.synchronize()
            allocated = True
            del block
        except torch.OutOfMemoryError:
            allocated = False
    return {"cuda": True, "seen": seen, "tflops": 2 * size**3 * rounds / best / 1e12,
            "free_mb_after_init": free // MB, "total_mb": total // MB, "allocated": allocated}


def native(alloc_mb: int, timeout: float = 240) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--probe", str(alloc_mb)],
                         capture_output=True, text=True, timeout=timeout)
    return _last_json(out, "the native probe")


# --- the whole check -------------------------------------------------------------------------

def check(runsc: Path, work: Path) -> dict[str, Any]:
    report: dict[str, Any] = {"checks": {}}
    found = discover(GpuPolicy())
    smi = smi_gpus()
    report["discovery"] = {"agent": [_gpu_dict(g) for g in found.gpus], "nvidia_smi": smi,
                           "note": found.note}
    if not found.gpus and not smi:
        report["gpu"] = False
        report["why"] = found.note or "nvidia-smi found no GPU"
        return report
    report["gpu"] = True
    problems = compare(found.gpus, smi)
    report["checks"]["discovery"] = {"ok": not problems, "problems": problems}
    gpu = found.gpus[0]
    view = MachineView("this", "this", gpus=(GpuView(gpu.uuid, gpu.kind, gpu.name,
                                                     gpu.memory_free_mb, 0, _cc(gpu)),),
                       gpu_isolation=True)
    granted = gpu.memory_free_mb
    placed = place(Resources(gpus=1, gpu_memory_mb=granted), view)
    over = place(Resources(gpus=1, gpu_memory_mb=granted + 1), view)
    report["native"] = native(0)
    try:
        inside = sandboxed(runsc, bundle(work / "bundle", [sys.executable, __file__, "--probe",
                                                          str(granted)],
                                         ((gpu.uuid, gpu.minor),),
                                         {"PYTHONPATH": os.pathsep.join(PATHS)}),
                           nvproxy=True)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        inside = {"cuda": False, "why": str(e)}
    report["sandbox"] = inside
    ratio = (inside["tflops"] / report["native"]["tflops"]
             if inside.get("cuda") and report["native"].get("cuda") else 0.0)
    report["checks"]["speed"] = {"ok": ratio >= GOAL_RATIO, "ratio": round(ratio, 3),
                                 "goal": GOAL_RATIO}
    report["checks"]["isolation"] = {"ok": inside.get("seen") == [gpu.uuid],
                                     "reserved": gpu.uuid, "seen": inside.get("seen")}
    report["checks"]["reservation"] = {
        "ok": placed == (gpu.uuid,) and over is None and inside.get("allocated") is True,
        "granted_mb": granted, "placed": placed is not None, "one_mb_more_refused": over is None,
        "allocated_in_sandbox": inside.get("allocated"),
        "free_mb_in_sandbox_after_init": inside.get("free_mb_after_init")}
    return report


def _cc(gpu: Gpu) -> tuple[int, int]:
    major, _, minor = gpu.compute_capability.partition(".")
    return (int(major or 0), int(minor or 0))


def _gpu_dict(g: Gpu) -> dict[str, Any]:
    return {"uuid": g.uuid, "name": g.name, "memory_total_mb": g.memory_total_mb,
            "memory_free_mb": g.memory_free_mb, "compute_capability": g.compute_capability,
            "driver_version": g.driver_version, "minor": g.minor}


def main() -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--prepare", action="store_true", help="here: write bench/.carry")
    ap.add_argument("--runsc", type=Path, default=None,
                    help="the runsc to use (default: the carried one, else runsc on the PATH)")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    ap.add_argument("--probe", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe is not None:
        print(json.dumps(probe(args.probe)))
        return 0
    if args.prepare:
        runsc = args.runsc or Path(shutil.which("runsc") or "runsc")
        for path in prepare(runsc.resolve()):
            print(f"{path.relative_to(ROOT)}: {path.stat().st_size // 1024} KB")
        return 0
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o755)
        if args.runsc is not None:
            runsc = args.runsc
        elif (CARRY / "runsc.xz").exists():
            runsc = unpack_runsc(CARRY, work)
        else:
            runsc = Path(shutil.which("runsc") or "runsc")
        version = subprocess.run([str(runsc), "--version"], capture_output=True, text=True,
                                 timeout=30).stdout.splitlines()[:1]
        report = check(runsc, work)
    report["runsc"] = version[0] if version else str(runsc)
    report["seconds"] = round(time.monotonic() - began, 1)
    text = json.dumps(report, indent=1)
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    if not report["gpu"]:
        print(f"gpu_check: nothing checked: {report['why']}", file=sys.stderr)
        return 2
    return 0 if all(c["ok"] for c in report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
