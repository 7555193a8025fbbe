"""The sample job. At build time it records facts about the build sandbox; at run time it
computes a result, checks its own isolation, and prints one JSON line (the job's result)."""

import json
import os
import platform
import socket
import subprocess
import sys


def facts():
    try:
        dmesg = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except OSError as e:
        dmesg = f"dmesg unavailable: {e}"
    return {"kernel": platform.release(), "dmesg_first": dmesg.splitlines()[0] if dmesg else ""}


def network():
    """Which interfaces exist, and can we reach anything (the coordinator's port, say)?"""
    with open("/proc/net/dev") as f:
        interfaces = sorted(line.split(":")[0].strip() for line in f.readlines()[2:])
    port = int(os.environ.get("PROBE_PORT", "8750"))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            reached = True
    except OSError:
        reached = False
    return {"interfaces": interfaces, "reached_127.0.0.1:%d" % port: reached}


def capabilities():
    """The effective capabilities this process has, as a number (0: none)."""
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("CapEff:")), 16)


if "--build" in sys.argv:
    print(json.dumps({**facts(), "squares": sum(i * i for i in range(1, 101))}))
    sys.exit(0)

with open("/app/build.json") as f:
    build = json.load(f)
run = facts()
result = {
    "message": "hello from campugrid",
    "build": build,
    "run": run,
    "primes_below_1000": sum(1 for n in range(2, 1000) if all(n % d for d in range(2, int(n**0.5) + 1))),
    "uid_inside": os.getuid(),
    "capabilities": capabilities(),
    "network": network(),
}
os.makedirs("/output", exist_ok=True)
with open("/output/result.json", "w") as f:
    json.dump(result, f, indent=2)
print("build ran on kernel", build["kernel"], "-", build["dmesg_first"])
print("job ran on kernel", run["kernel"], "-", run["dmesg_first"])
print(json.dumps(result, sort_keys=True))
