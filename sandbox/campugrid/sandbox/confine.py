"""Run one function on untrusted bytes in a confined child process, outside gVisor.

The agent itself unpacks build contexts and checkpoints, parses Dockerfiles, hashes datasets
and reads shard results. Each of those runs here instead: in a fresh Python interpreter under
rlimits, a Landlock domain (where the kernel has Landlock) and a seccomp filter, so a bug in a
parser costs at most that child. `call()` is one child per call; `Worker` keeps one child for
many calls (shard results).

    info = confine.call(extract_context, data, dest, writable=[dest],
                        limits=confine.Limits(memory_mb=512, cpu_s=60, fsize_mb=2048, nofile=256))

Why a fresh interpreter (`sys.executable -I`), not `os.fork()` of the agent: the agent has
gRPC's threads, and a fork copies whatever locks they hold and the agent's whole address space
(which RLIMIT_AS would then count). A spawn costs ~0.1 s, which a task pays once per context
or checkpoint; shards use a `Worker`, which pays it once per job.

Trust runs one way. The parent pickles (function, args) to the child; the child answers in
JSON that the parent reads bounded and never unpickles, so a subverted child can lie in its
answer but cannot run code in the agent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import functools
import json
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
import typing
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, TypeVar

from campugrid.protocol.errors import CampugridError, SandboxError
from campugrid.protocol.spec import ENFORCED
from campugrid.sandbox import hardening

R = TypeVar("R")

MAX_MESSAGE = 4000  # characters of a child's exception message that reach the agent
STDERR_TAIL = 2000



@dataclasses.dataclass(frozen=True)
class Limits:
    """What one confined child may use. cpu_s, memory and files are the kernel's rlimits;
    wall_s is enforced by the parent, per call."""

    memory_mb: int = 512  # RLIMIT_DATA; RLIMIT_AS is this plus hardening.ADDRESS_SPACE_SLACK_MB
    cpu_s: int = 60  # RLIMIT_CPU (for a Worker: its child's lifetime, see Worker)
    fsize_mb: int = 64  # RLIMIT_FSIZE: the largest file the child may write
    nofile: int = 64  # RLIMIT_NOFILE
    wall_s: float = 120.0
    max_result_bytes: int = 16 * 1024**2  # a longer answer is refused unread


class ConfinementError(SandboxError):
    """The confined child did not return normally. `cause` says what stopped it:

    seccomp   killed by the seccomp filter (SIGSYS): it made a forbidden system call
    memory    ran out of memory (RLIMIT_DATA / RLIMIT_AS)
    cpu       used up its CPU time (RLIMIT_CPU: SIGXCPU, or SIGKILL at the hard limit)
    killed    SIGKILL with CPU time to spare: the kernel's out-of-memory killer, or someone
    fsize     wrote past RLIMIT_FSIZE (SIGXFSZ)
    nofile    ran out of file descriptors (RLIMIT_NOFILE)
    wall_time did not answer within Limits.wall_s; the parent killed it
    exception the function raised something that is not a CampugridError
    crash     died otherwise (another signal, an exit without an answer)
    protocol  answered something the parent refuses (too long, not our JSON)
    """

    def __init__(self, message: str, *, cause: str, stderr_tail: str = "") -> None:
        super().__init__(message)
        self.cause = cause
        self.stderr_tail = stderr_tail

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text}\nits stderr ended with:\n{self.stderr_tail}" if self.stderr_tail else text


def call(fn: Callable[..., R], *args: Any, limits: Limits = Limits(),
         writable: Sequence[Path] = (), _skip: Collection[str] = ()) -> R:
    """fn(*args) in a fresh confined child: its return value, or its CampugridError (same
    type and message), or a ConfinementError saying what stopped it.

    fn must be a top-level function of an importable module. Its return value must be JSON
    data or dataclasses of it; the parent rebuilds it by fn's return annotation (dataclasses,
    nested too, tuples, optionals; plain types are checked), and without one it comes back as
    plain JSON (a dataclass as a dict, a tuple as a list). `writable` lists the folders the child may write
    under (created if missing); with Landlock, everywhere else is read-only to it. `_skip`
    ("seccomp", "landlock") is for tests only: it leaves a layer off to show what it stops.
    """
    with Worker(limits, writable=writable, _skip=_skip) as worker:
        return worker.call(fn, *args)


class Worker:
    """One confined child kept for many calls, one at a time (a lock serialises threads).

    The child is confined once, at start, so every call shares its limits and `writable`
    folders, and a call that subverted it could falsify the calls after it: use one Worker per
    job, never across jobs. A child that dies or times out fails that call; the next call starts
    a fresh child. RLIMIT_CPU counts the child's whole life, so the Worker replaces a child that
    has used half of `cpu_s`: every call has at least cpu_s / 2 (and wall_s per call).
    """

    def __init__(self, limits: Limits = Limits(), *, writable: Sequence[Path] = (),
                 _skip: Collection[str] = ()) -> None:
        self.limits = limits
        self._writable = [str(Path(p).absolute()) for p in writable]
        self._skip = sorted(_skip)
        self._child: _Child | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the child (a later call starts a new one)."""
        with self._lock:
            if self._child is not None:
                self._child.stop()
                self._child = None

    def call(self, fn: Callable[..., R], *args: Any) -> R:
        """fn(*args) in this Worker's child; results and errors as for `call()`."""
        request = _request(fn, args)
        name = getattr(fn, "__qualname__", repr(fn))
        with self._lock:
            child = self._child
            if child is None or child.cpu_seconds() > self.limits.cpu_s / 2:
                if child is not None:
                    child.stop()
                child = self._child = _Child(self.limits, self._writable, self._skip)
            try:
                answer = child.exchange(request, self.limits, name)
            except ConfinementError:
                child.stop()
                self._child = None
                raise
            except _ChildGone:
                self._child = None
                raise child.death(name, self.limits) from None
        try:
            return _decode(fn, name, answer, self.limits)
        except ConfinementError:
            # A garbled answer, a MemoryError or a bug we did not expect: the next call
            # should not inherit whatever state this child is in.
            self.close()
            raise


def layers() -> dict[str, str]:
    """Which layers of confinement hold on this host: 'enforced' or 'not enforced: <why>'."""
    abi = hardening.landlock_abi()
    return {
        "rlimits": ENFORCED,
        "seccomp": ENFORCED if hardening.libseccomp_present() else
        "not enforced: libseccomp is missing, so every confined call fails",
        "landlock": f"{ENFORCED} (ABI {abi})" if abi > 0 else
        "not enforced: this kernel has no Landlock; the child can write wherever the agent "
        "can, and (without Yama) open /proc/PID/mem of the agent and its other processes",
    }


# --- the parent's side -----------------------------------------------------------------------

_HEADER = struct.Struct(">Q")  # every message on the pipes is its length, then its bytes
# The child loads this module from the parent's sys.path, so both sides run the same code.
_BOOT = ("import json, sys; sys.path[:] = json.loads(sys.argv[1])['sys_path']; "
         "from campugrid.sandbox.confine import _serve; _serve(sys.argv[1])")
_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}  # none of the agent's own environment
_EXIT_NO_MEMORY = 86  # the child's status when a request alone does not fit in memory_mb


class _ChildGone(Exception):
    """The child closed its end: it died (or exited) before answering."""


def _request(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    if getattr(fn, "__module__", None) == "__main__":
        raise ValueError(f"{fn!r} is defined in __main__; a confined child cannot import it")
    try:
        return pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(f"{fn!r} and its arguments cannot be sent to a confined child (it must "
                         f"be a top-level function of an importable module): {e}") from e


class _Child:
    def __init__(self, limits: Limits, writable: list[str], skip: list[str]) -> None:
        setup = {"limits": dataclasses.asdict(limits), "writable": writable, "skip": skip,
                 "sys_path": sys.path}
        # A file, not a pipe, so nobody has to drain it; O_APPEND so that reading its tail
        # (pread) never moves where the child writes. RLIMIT_FSIZE bounds it.
        self.stderr = tempfile.TemporaryFile(mode="a+b")  # noqa: SIM115 - closed in _close()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _BOOT, json.dumps(setup)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, bufsize=0,
                env=_ENV, start_new_session=True)
        except OSError as e:
            self.stderr.close()
            raise SandboxError(f"cannot start a confined child ({sys.executable}): {e}") from e
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.to_child, self.from_child = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        # Non-blocking, so that a child that stops reading or writing cannot hang the agent
        # past the deadline.
        os.set_blocking(self.to_child, False)
        os.set_blocking(self.from_child, False)

    def exchange(self, request: bytes, limits: Limits, name: str) -> bytes:
        """Send one request, return the answer's bytes; _ChildGone if the child died."""
        deadline = time.monotonic() + limits.wall_s
        try:
            self._write(_HEADER.pack(len(request)), deadline)
            self._write(request, deadline)
            (size,) = _HEADER.unpack(self._read(_HEADER.size, deadline))
            if size > limits.max_result_bytes:
                raise ConfinementError(f"{name}: the confined child's answer is {size} bytes, "
                                       f"over the {limits.max_result_bytes} allowed",
                                       cause="protocol")
            return self._read(size, deadline)
        except TimeoutError:
            raise ConfinementError(f"{name}: no answer from the confined child within "
                                   f"{limits.wall_s:g} s (Limits.wall_s); it was killed",
                                   cause="wall_time", stderr_tail=self.stderr_tail()) from None

    def _write(self, data: bytes, deadline: float) -> None:
        view = memoryview(data)
        while view:
            self._wait(self.to_child, select.POLLOUT, deadline)
            try:
                view = view[os.write(self.to_child, view[:1 << 20]):]
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                raise _ChildGone from None

    def _read(self, size: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < size:
            self._wait(self.from_child, select.POLLIN, deadline)
            try:
                chunk = os.read(self.from_child, min(size - len(buf), 1 << 20))
            except BlockingIOError:
                continue
            if not chunk:
                raise _ChildGone
            buf += chunk
        return bytes(buf)

    @staticmethod
    def _wait(fd: int, event: int, deadline: float) -> None:
        poller = select.poll()
        poller.register(fd, event)
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError

    def cpu_seconds(self) -> float:
        """CPU time the child has used, from /proc (the kernel's count, not the child's word)."""
        try:
            stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        except OSError:
            return float("inf")
        fields = stat.rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stderr_tail(self) -> str:
        size = os.fstat(self.stderr.fileno()).st_size
        start = max(0, size - STDERR_TAIL)
        return os.pread(self.stderr.fileno(), size - start, start).decode("utf-8", "replace")

    def stop(self) -> None:
        self.proc.kill()  # it keeps no state worth a clean exit, and cannot have children
        self.proc.wait()
        self._close()

    def _close(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self.stderr):
            with contextlib.suppress(OSError):
                if f is not None:
                    f.close()

    def death(self, name: str, limits: Limits) -> ConfinementError:
        """Why the child went away, from its exit status (the kernel's word, not the child's)."""
        cpu = self.cpu_seconds()  # still readable: the child is not reaped yet
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        tail = self.stderr_tail()
        self._close()
        causes = {
            signal.SIGSYS: ("seccomp", "was killed by the seccomp filter (SIGSYS): it made a "
                            "forbidden system call"),
            signal.SIGXCPU: ("cpu", f"used up its CPU time (RLIMIT_CPU, {limits.cpu_s} s: "
                             "SIGXCPU)"),
            signal.SIGXFSZ: ("fsize", f"tried to write a file over its size limit "
                             f"(RLIMIT_FSIZE, {limits.fsize_mb} MiB: SIGXFSZ)"),
            signal.SIGKILL: ("cpu", f"was killed by SIGKILL at its CPU hard limit "
                             f"({limits.cpu_s + 1} s of RLIMIT_CPU)") if cpu >= limits.cpu_s else
            ("killed", "was killed by SIGKILL (by the kernel's out-of-memory killer, or from "
             "outside)"),
        }
        if code == _EXIT_NO_MEMORY:
            cause, what = "memory", (f"could not hold the call's arguments in its memory limit "
                                     f"(RLIMIT_DATA {limits.memory_mb} MiB)")
        elif code < 0 and -code in causes:
            cause, what = causes[signal.Signals(-code)]
        elif code < 0:
            cause, what = "crash", f"was killed by {_signal_name(-code)}"
        else:
            cause, what = "crash", f"exited with status {code} without answering"
        return ConfinementError(f"{name}: the confined child {what}", cause=cause, stderr_tail=tail)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _decode(fn: Callable[..., R], name: str, answer: bytes, limits: Limits) -> R:
    """The child's JSON answer as fn's value, or as the exception it stands for."""
    try:
        msg = json.loads(answer)
    except (ValueError, RecursionError) as e:
        raise ConfinementError(f"{name}: the confined child's answer is not JSON ({e})",
                               cause="protocol") from None
    if isinstance(msg, dict) and "value" in msg:
        return typing.cast(R, _rebuild(fn, name, msg["value"]))
    err = msg.get("error") if isinstance(msg, dict) else None
    if not isinstance(err, dict):
        raise ConfinementError(f"{name}: the confined child's answer has neither a value nor an "
                               "error", cause="protocol")
    module, kind = str(err.get("module"))[:200], str(err.get("type"))[:200]
    message = str(err.get("message"))[:MAX_MESSAGE]
    cls = _campugrid_error(module, kind)
    exc: CampugridError | None = None
    if cls is not None:
        with contextlib.suppress(Exception):  # its constructor may want more than a message
            exc = cls(message)
    if exc is not None:
        raise exc
    if (module, kind) == ("builtins", "MemoryError"):
        raise ConfinementError(f"{name}: the confined child ran out of memory (RLIMIT_DATA "
                               f"{limits.memory_mb} MiB)", cause="memory")
    if err.get("errno") == errno.EMFILE:
        raise ConfinementError(f"{name}: the confined child ran out of file descriptors "
                               f"(RLIMIT_NOFILE {limits.nofile}): {message}", cause="nofile")
    raise ConfinementError(f"{name} failed in its confined child with {module}.{kind}: {message}",
                           cause="exception")


def _campugrid_error(module: str, kind: str) -> type[CampugridError] | None:
    """Our own error type, if the child names one that the agent has already imported (looked
    up, never imported on the child's say-so)."""
    if not module.startswith("campugrid."):
        return None
    cls = getattr(sys.modules.get(module), kind, None)
    return cls if isinstance(cls, type) and issubclass(cls, CampugridError) else None


def _rebuild(fn: Callable[..., Any], name: str, value: Any) -> Any:
    hint = _hints(fn).get("return", Any)
    try:
        return _build(hint, value)
    except (TypeError, ValueError) as e:
        raise ConfinementError(f"{name}: the confined child's answer does not fit its return "
                               f"type {hint} ({e})", cause="protocol") from None


def _build(hint: Any, value: Any) -> Any:
    """JSON `value` as the type `hint` names: dataclasses (nested too), tuples, lists, dicts
    and optionals of them are rebuilt, plain types are checked, anything else passes as is."""
    origin, params = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise TypeError(f"{hint.__name__} expected, got {type(value).__name__}")
        fields = _hints(hint)
        return hint(**{k: _build(fields.get(k, Any), v) for k, v in value.items()})
    if hint in _PLAIN:
        if not isinstance(value, _PLAIN[hint]):
            raise TypeError(f"{hint.__name__} expected, got {type(value).__name__}")
        return value
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in params:
            return None
        others = [p for p in params if p is not type(None)]
        return _build(others[0], value) if len(others) == 1 else value
    if origin in (tuple, list) and not isinstance(value, list):
        raise TypeError(f"a list expected, got {type(value).__name__}")
    if origin is tuple and params:
        if len(params) == 2 and params[1] is Ellipsis:
            return tuple(_build(params[0], v) for v in value)
        return tuple(_build(p, v) for p, v in zip(params, value, strict=True))
    if origin is tuple:
        return tuple(value)
    if origin is list and params:
        return [_build(params[0], v) for v in value]
    if origin is dict and params and isinstance(value, dict):
        return {k: _build(params[1], v) for k, v in value.items()}
    return value


_PLAIN: dict[Any, type | tuple[type, ...]] = {
    int: int, float: (int, float), str: str, bool: bool, type(None): type(None)}


@functools.lru_cache(maxsize=256)
def _hints(obj: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except Exception:  # an annotation that does not resolve at run time: plain JSON then
        return {}


# --- the child's side ------------------------------------------------------------------------

def _serve(setup_json: str) -> None:
    """The child's main loop: confine this process, then answer requests until EOF."""
    setup = json.loads(setup_json)
    requests, answers = os.dup(0), os.dup(1)
    # A print() in a confined function must not corrupt the channel: fd 1 becomes stderr,
    # and fd 0 /dev/null (opened now: Landlock may forbid it later).
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    limits = Limits(**setup["limits"])
    hardening.apply(memory_mb=limits.memory_mb, cpu_s=limits.cpu_s, fsize_mb=limits.fsize_mb,
                    nofile=limits.nofile, writable=[Path(p) for p in setup["writable"]],
                    skip=set(setup["skip"]))
    while (answer := _answer(requests)) is not None:
        _write_all(answers, _HEADER.pack(len(answer)))
        _write_all(answers, answer)


def _answer(requests: int) -> bytes | None:
    """Read one request and run it: the answer's JSON, or None at EOF."""
    try:
        request = _read_frame(requests)
    except MemoryError:
        os._exit(_EXIT_NO_MEMORY)  # the rest of the request is still in the pipe: give up
    if request is None:
        return None
    try:
        fn, args = pickle.loads(request)  # noqa: S301 - written by the parent, the trusted side
        # The arguments are a copy: holding the request as well would double what a large
        # build context costs against memory_mb.
        del request
        return json.dumps({"value": fn(*args)}, default=_plain).encode()
    except MemoryError:
        return b'{"error": {"module": "builtins", "type": "MemoryError", "message": ""}}'
    except BaseException as e:  # everything goes back to the parent, even exit()
        return json.dumps({"error": {
            "module": type(e).__module__, "type": type(e).__qualname__,
            "message": str(e)[:MAX_MESSAGE], "errno": e.errno if isinstance(e, OSError) else None,
        }}).encode()


def _plain(obj: object) -> object:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    raise TypeError(f"a confined function must return JSON data, not {type(obj).__name__}")


def _read_frame(fd: int) -> bytearray | None:
    header = _read_exact(fd, _HEADER.size)
    return None if header is None else _read_exact(fd, _HEADER.unpack(header)[0])


def _read_exact(fd: int, size: int) -> bytearray | None:
    buf = bytearray(size)
    view, done = memoryview(buf), 0
    while done < size:
        n = os.readv(fd, [view[done:]])
        if n == 0:
            return None
        done += n
    return buf


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
