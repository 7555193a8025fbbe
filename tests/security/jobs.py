"""The hostile jobs' own code: what runs inside the sandbox, one attack per script.

Each script reports what it saw as one JSON object on its last line of output (the job's
result): for every attempt, "ok:<what it got>" when the attempt worked, else the errno's name
("ENOENT", "EPERM", ...) or "timeout". The tests assert on that and on the host's own state.
"""

from __future__ import annotations

PRELUDE = r'''
import ctypes, errno, json, os, socket, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def why(e):
    if isinstance(e, socket.timeout):
        return "timeout"
    if isinstance(e, socket.gaierror):
        return "EAI" + str(e.errno)
    return errno.errorcode.get(e.errno, "E" + str(e.errno))

def attempt(fn):
    try:
        return "ok:" + str(fn())[:120]
    except OSError as e:
        return why(e)

def syscall(nr, *args):
    res = libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) if isinstance(a, int) else a
                                             for a in args])
    if res < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return res

def report(**seen):
    print(json.dumps(seen), flush=True)
'''

# --- host files -------------------------------------------------------------------------------

READ_PATHS = PRELUDE + r'''
def read(path):
    path = path.format(job=os.environ["CAMPUGRID_JOB_ID"], attempt=os.environ["CAMPUGRID_ATTEMPT"])
    if os.path.isdir(path):
        return sorted(os.listdir(path))
    with open(path, "rb") as f:
        return f.read(4096).decode("utf-8", "replace")
report(**{p: attempt(lambda p=p: read(p)) for p in json.loads(os.environ["TARGETS"])})
'''

MOUNT_TABLE = PRELUDE + r'''
tables = {p: open(p).read() for p in ("/proc/self/mountinfo", "/proc/mounts", "/proc/1/mountinfo")}
print("\n".join(tables.values()), flush=True)  # into the logs: what a researcher would read
needles = json.loads(os.environ["TARGETS"])
report(**{n: [p for p, text in tables.items() if n in text] for n in needles})
'''

# --- network ----------------------------------------------------------------------------------

CONNECT = PRELUDE + r'''
# A DNS query for example.org, A record: what a resolver would answer.
QUERY = bytes.fromhex("123401000001000000000000076578616d706c65036f72670000010001")

def tcp(host, port):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.settimeout(3)
    s.connect((host, port))
    s.sendall(b"GET /v1/jobs HTTP/1.0\r\n\r\n")
    return s.recv(100)

def udp(host, port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(3)
    s.sendto(QUERY, (host, port))
    return s.recvfrom(512)[0]

def unix(path, _):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(3)
    s.connect(path)
    return "connected"

def dns(name, _):
    return socket.getaddrinfo(name, 443)

kinds = {"tcp": tcp, "udp": udp, "unix": unix, "dns": dns}
report(**{f"{k}:{h}:{p}": attempt(lambda k=k, h=h, p=p: kinds[k](h, p))
          for k, h, p in json.loads(os.environ["TARGETS"])})
'''

# --- privileged operations (x86-64 syscall numbers) -------------------------------------------

# Each defines attack(): what it returns is what the attack got; an OSError is its refusal.
PRIVILEGED = {
    "raw-socket": """
def attack():
    return socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
""",
    "packet-socket": """
def attack():
    return socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
""",
    # pid 1 is the job's own command: a child of it tries to take hold of it
    "ptrace-pid-1": """
def attack():
    r, w = os.pipe()
    if os.fork() == 0:
        os.write(w, attempt(lambda: syscall(101, 16, 1, 0, 0)).encode())  # PTRACE_ATTACH
        os._exit(0)
    os.wait()
    seen = os.read(r, 200).decode()
    if not seen.startswith("ok"):
        raise OSError(getattr(errno, seen, 0), seen)
    return seen
""",
    # the agent, by its pid on the host
    "ptrace-the-agent": """
def attack():
    return syscall(101, 16, int(os.environ["AGENT_PID"]), 0, 0)
""",
    "mount-tmpfs": """
def attack():
    return syscall(165, ctypes.c_char_p(b"tmpfs"), ctypes.c_char_p(b"/mnt"),
                   ctypes.c_char_p(b"tmpfs"), 0, 0)
""",
    # MS_REMOUNT|MS_BIND without MS_RDONLY: a writable root, then write to it
    "remount-root-writable": """
def attack():
    syscall(165, 0, ctypes.c_char_p(b"/"), 0, 32 | 4096, 0)
    return open("/etc/evil", "w").write("x")
""",
    "write-core-pattern": """
def attack():
    return open("/proc/sys/kernel/core_pattern", "w").write("|/tmp/evil %p")
""",
    # every file under /proc/sys, its own value written back
    "write-any-proc-sys-file": """
def attack():
    tried, wrote = 0, []
    for folder, _, files in os.walk("/proc/sys"):
        for name in files:
            path = os.path.join(folder, name)
            tried += 1
            if attempt(lambda: open(path, "w").write(open(path).read() or "0")).startswith("ok"):
                wrote.append(path)
    if not wrote:
        raise PermissionError(errno.EACCES, f"none of {tried} files under /proc/sys")
    return wrote
""",
    "sysrq-trigger": """
def attack():
    return open("/proc/sysrq-trigger", "w").write("h")
""",
    # init_module(image, len, params) with an ELF header, then finit_module on a file
    "init-module": """
def attack():
    image = ctypes.create_string_buffer(b"\\x7fELF" + bytes(60))
    try:
        return syscall(175, image, 64, ctypes.c_char_p(b""))
    except OSError:
        return syscall(313, os.open("/usr/bin/true", os.O_RDONLY), ctypes.c_char_p(b""), 0)
""",
    # BPF_MAP_CREATE of a one-entry array map
    "bpf": """
def attack():
    attr = ctypes.create_string_buffer((2).to_bytes(4, "little") + (4).to_bytes(4, "little") * 2
                                       + (1).to_bytes(4, "little") + bytes(56))
    return syscall(321, 0, attr, 72)
""",
    # the "shocker" escape: open a file by a guessed handle (inode 2 of the root filesystem)
    "open-by-handle-at": """
def attack():
    handle = ctypes.create_string_buffer((8).to_bytes(4, "little") + (1).to_bytes(4, "little")
                                         + (2).to_bytes(8, "little"))
    return syscall(304, os.open("/", os.O_RDONLY), handle, os.O_RDONLY)
""",
    # a device node for the host's root disk, then read it
    "mknod-host-disk": """
def attack():
    major, minor = map(int, os.environ["HOST_DISK"].split(":"))
    os.mknod("/tmp/disk", 0o600 | 0o060000, os.makedev(major, minor))
    return open("/tmp/disk", "rb").read(512)
""",
    "mknod-dev-mem": """
def attack():
    os.mknod("/tmp/mem", 0o600 | 0o020000, os.makedev(1, 1))
    return open("/tmp/mem", "rb").read(64)
""",
    # The job is the root of its user namespace without a capability: it can neither become
    # another user nor give itself a capability back (CAP_SYS_ADMIN, by capset).
    "setuid-other": """
def attack():
    os.setresuid(1000, 1000, 1000)
    return os.getuid()
""",
    "capset-sys-admin": """
def attack():
    header = ctypes.create_string_buffer((0x20080522).to_bytes(4, "little") + bytes(4))
    admin = (1 << 21).to_bytes(4, "little")
    data = ctypes.create_string_buffer(admin + admin + bytes(4) + bytes(12))
    return syscall(126, header, data)
""",
}


def privileged(attack: str) -> str:
    return PRELUDE + PRIVILEGED[attack] + "report(attack=attempt(attack))\n"


# Runs each script of $ATTACKS ({name: code}) in a process of its own; reports {name: seen}.
EACH_ATTACK = r'''
import json, os, subprocess, sys
seen = {}
for name, code in json.loads(os.environ["ATTACKS"]).items():
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    try:
        seen[name] = json.loads(done.stdout.strip().splitlines()[-1])["attack"]
    except (IndexError, ValueError, KeyError):
        seen[name] = f"no report (exit {done.returncode}): {done.stderr[-300:]}"
print(json.dumps(seen), flush=True)
'''


# --- resources --------------------------------------------------------------------------------

FORK_BOMB = PRELUDE + r'''
forked, stopped_by = 0, None
while forked < 5000:
    try:
        pid = os.fork()
    except OSError as e:
        stopped_by = why(e)
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    forked += 1
report(forked=forked, stopped_by=stopped_by)
'''

MEMORY_BOMB = r'''
held, mb = [], 0
while mb < 8192:
    block = bytearray(8 * 2**20)
    block[::4096] = b"x" * (len(block) // 4096)  # touch every page: resident, not just mapped
    held.append(block)
    mb += 8
    print(f"allocated {mb} MiB", flush=True)
print("survived", flush=True)
'''

BUSY_LOOP = "import time\nt, n = time.time(), 0\nwhile time.time() - t < 3:\n    n += 1\nprint(n)\n"

FILL = PRELUDE + r'''
def attack(target):
    fd = os.open(target, os.O_WRONLY | os.O_CREAT, 0o600)
    written, stopped_by, block = 0, None, b"x" * 2**20
    while written < 4 * 2**30:
        try:
            written += os.write(fd, block)
        except OSError as e:
            stopped_by = why(e)
            break
    return {"written": written, "stopped_by": stopped_by}
'''


def fill(target: str) -> str:
    """For EACH_ATTACK: write to `target` until refused; {"written", "stopped_by"}."""
    return FILL + f"report(attack=attack({target!r}))\n"

STDOUT_FLOOD = r'''
import os
newline, total = os.environ.get("NEWLINES", "1") == "1", int(os.environ.get("BYTES", 2 * 10**9))
block = (b"x" * 99 + b"\n") * 10486 if newline else b"x" * (1024 * 1024)
n = 0
while n < total:
    n += os.write(1, block)
os.write(1, f"\nwrote {n} bytes\n".encode())
'''

IGNORES_SIGTERM = r'''
import os, signal, time
for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(s, signal.SIG_IGN)
os.fork()  # two of us, both deaf to SIGTERM
print("ignoring SIGTERM", flush=True)
while True:
    time.sleep(0.2)
'''

DOUBLE_FORK = PRELUDE + r'''
import signal
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:  # the daemon: no parent, own session, deaf to every polite signal
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        n = 0
        while True:
            n += 1
            with open("/checkpoints/heartbeat", "w") as f:
                f.write(str(n))
            time.sleep(0.1)
    os._exit(0)
beats = []
for _ in range(10):
    time.sleep(0.2)
    try:
        beats.append(int(open("/checkpoints/heartbeat").read() or 0))
    except (OSError, ValueError):
        pass
report(daemon_beating=len(set(beats)) > 1, beats=beats[-1] if beats else 0)
'''

OUTPUT_WRITER = r'''
import errno, os, time
target, mode = os.environ["TARGET"], os.environ["MODE"]
block = os.urandom(2**20)
written = 0
try:
    if mode == "one-big-file":
        fd = os.open(f"{target}/big", os.O_WRONLY | os.O_CREAT, 0o600)
        while written < 4096:
            os.write(fd, block)
            written += 1
            print(f"wrote {written} MiB", flush=True)
    elif mode == "many-files":  # each file under any per-file limit: only the total tells
        while written < 4096:
            with open(f"{target}/part-{written:05d}", "wb") as f:
                f.write(block)
            written += 1
            print(f"wrote {written} MiB", flush=True)
    elif mode == "parallel-files":  # 16 writers at once, in 8 MiB strokes
        import threading
        stroke, errors = os.urandom(8 * 2**20), []
        def writer(i):
            global written
            try:
                for n in range(64):
                    with open(f"{target}/w{i:02d}-{n:02d}", "wb") as f:
                        f.write(stroke)
                    written += 8
            except OSError as e:
                errors.append(e)
        threads = [threading.Thread(target=writer, args=(i,)) for i in range(16)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print(f"wrote {written} MiB", flush=True)
        if errors:
            raise errors[0]
    elif mode == "sparse-files":  # GBs that take no disk, until tarred for upload
        for i in range(4096):
            with open(f"{target}/sparse-{i:04d}", "wb") as f:
                f.truncate(8 * 2**20)  # each under the per-file limit
            written += 8
            print(f"made {written} MiB of sparse files", flush=True)
except OSError as e:
    print(f"stopped by {errno.errorcode.get(e.errno, e.errno)} after {written} MiB", flush=True)
time.sleep(60)  # the agent must stop it: it does not stop by itself
print("never stopped", flush=True)
'''

OUTPUT_LINK = r'''
import json, os
open("/output/real.txt", "w").write("mine")
os.makedirs("/output/sub")
for name, target in json.loads(os.environ["TARGETS"]).items():
    os.symlink(target, f"/output/{name}")
    os.symlink(target, f"/output/sub/{name}-deeper")
print("planted")
'''

# Checkpoint folders with links in them, one epoch per shape ($SHAPES: {shape: epoch}), while
# the agent's uploader polls the folder (every second) and once more after the job ends.
CHECKPOINT_LINK = r'''
import json, os, time
from pathlib import Path
from campugrid import hooks
target, shapes = os.environ["TARGET"], json.loads(os.environ["SHAPES"])

def manual(epoch, files, links):
    """An epoch folder as hooks.save makes it, with links added before it is complete."""
    tmp = f"/checkpoints/.tmp-{epoch}"
    os.makedirs(tmp)
    listed = {}
    for name, text in files.items():
        with open(f"{tmp}/{name}", "w") as f:
            f.write(text)
        listed[name] = {"size": len(text), "sha256": hooks.sha256_file(Path(f"{tmp}/{name}"))}
    for name in links:
        os.symlink(target, f"{tmp}/{name}")
    with open(f"{tmp}/MANIFEST.json", "w") as f:
        json.dump({"epoch": epoch, "files": listed, "meta": {}}, f)
    os.rename(tmp, f"/checkpoints/{hooks.folder_name(epoch)}")

with hooks.save(1) as folder:
    (folder / "w").write_text("genuine weights 1")
for how, epoch in shapes.items():
    final = f"/checkpoints/{hooks.folder_name(epoch)}"
    if how == "epoch-folder-is-a-link":
        os.symlink(os.path.dirname(target), final)
    elif how == "file-in-epoch-is-a-link":
        manual(epoch, {"w": f"genuine weights {epoch}"}, ["leak"])
    elif how == "manifest-is-a-link":
        os.makedirs(final)
        os.symlink(target, f"{final}/MANIFEST.json")
    elif how == "swap-file-for-link":  # race the uploader: each epoch's file turns into a link
        for n in range(epoch, epoch + 38):
            with hooks.save(n) as folder:
                (folder / "w").write_text(f"genuine weights {n}")
            final = f"/checkpoints/{hooks.folder_name(n)}"
            os.symlink(target, f"{final}/w.new")
            os.replace(f"{final}/w.new", f"{final}/w")
            time.sleep(0.05)
    else:
        raise SystemExit(f"no such shape: {how}")
# Until the uploader has taken a later epoch while the job runs (it then removes epoch 1's
# folder here), at most 10 s; the agent's last pass after the job ends sees everything too.
first, deadline = f"/checkpoints/{hooks.folder_name(1)}", time.monotonic() + 10
while os.path.exists(first) and time.monotonic() < deadline:
    time.sleep(0.05)
print("taken while running:", not os.path.exists(first), flush=True)
print("planted")
'''

# --- shards -----------------------------------------------------------------------------------

# A shard runner of the job's own (on PYTHONPATH before the mounted one): it speaks the
# runner's protocol, and lies as its shard's payload asks.
LYING_RUNNER = r"""
import json, os, sys

def send(obj):
    data = memoryview(json.dumps(obj).encode() + b"\n")
    while data:  # a pipe may take less than asked: the rest follows
        data = data[os.write(1, data):]

send({"ready": True})
for line in sys.stdin.buffer:
    req = json.loads(line)
    index, payload = req["index"], json.loads(req["payload_json"])
    lie = payload.get("lie") if isinstance(payload, dict) else None
    if lie is None:
        send({"done": index, "ok": True, "exit": 0, "result": json.dumps({"honest": index})})
    elif lie == "not-json":  # garbage lines first, then a result that is no JSON
        os.write(1, b"\x00\xff garbage {{{\n[1, 2, 3]\n")
        send({"done": index, "ok": True, "exit": 0, "result": "{this is not json"})
    elif lie == "too-big":
        send({"done": index, "ok": True, "exit": 0, "result": json.dumps("x" * 100_000)})
    elif lie == "nested-too-deep":
        send({"done": index, "ok": True, "exit": 0, "result": "[" * 5000 + "]" * 5000})
    elif lie == "for-another-shard":  # claim the next shard's result, then vanish
        send({"done": index + 1, "ok": True, "exit": 0, "result": json.dumps("forged")})
        sys.exit(0)
    elif lie == "flood-after-answer":  # answer, then 2 GB of junk lines nobody asked for
        send({"done": index, "ok": True, "exit": 0, "result": json.dumps({"honest": index})})
        block = (b"j" * 1023 + b"\n") * 1024
        n = 0
        while n < 2 * 10**9:
            n += os.write(1, block)
"""
