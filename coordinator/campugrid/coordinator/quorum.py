"""Results checked by agreement: the rules of verified jobs, as pure functions.

A verified job (spec.verify) is never leased itself. Its replicas are: each a plain job of its
own (its `replica_of` names the verified job), run on a different machine (`shares_host`: nor
on two machines behind one address), with its own attempts, logs and checkpoints. When a
replica ends, `decide` reads every replica's answer (exit code, result line and the digest of
its /output, read by the coordinator: `output_digest`) and says what happens next: accept a
quorum's answer, wait, run more replicas, or fail the job because the results disagree.
Machines that answered against an accepted quorum are quarantined by the caller
(`store_quorum.py`, which applies the decisions in the job's transaction).

Adaptive verification follows BOINC's adaptive replication: one replica runs; its answer is
taken alone only from a machine that has agreed with quorums TRUSTED_AFTER times in a row,
and even then it is checked by a second replica with probability `check_probability` (never
below SAMPLE_FLOOR); any disagreement resets the machine's streak (and quarantines it).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import ipaddress
import tarfile
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from campugrid.protocol.spec import Verify

TRUSTED_AFTER = 10  # agreeing answers in a row before adaptive takes a machine's word alone
SAMPLE_FLOOR = 0.05  # the least fraction of a trusted machine's answers still checked


@dataclasses.dataclass(frozen=True)
class Answer:
    """What one replica answered: None for `key` if it ended without an answer (its machine
    failed it, its attempts ran out, it was cancelled)."""

    replica: str  # the replica's job id
    machine_id: str
    key: tuple[int | None, str, str] | None  # (exit code, result line, output digest)

    def says(self) -> str:
        if self.key is None:
            return "no answer"
        code, result, digest = self.key
        return f"exit {code}, result {result[:80]!r}, output {digest[:19]}"


@dataclasses.dataclass(frozen=True)
class Decision:
    """`accept`: the agreeing answers (the first is the job's result), `against`: answers that
    disagreed with them; `more`: replicas to start; `fail`: why the job fails; none of these:
    wait for the replicas still running."""

    accept: tuple[Answer, ...] = ()
    against: tuple[Answer, ...] = ()
    more: int = 0
    fail: str = ""
    checked: bool = True  # False: one trusted machine's word, taken unchecked (adaptive)


def check_probability(streak: int) -> float:
    """How likely an adaptive job's single answer from a machine with this many agreeing
    answers in a row is checked by a second replica: always until TRUSTED_AFTER, then
    TRUSTED_AFTER/streak (as BOINC's 1/N), never below SAMPLE_FLOOR."""
    if streak < TRUSTED_AFTER:
        return 1.0
    return max(SAMPLE_FLOOR, TRUSTED_AFTER / streak)


def decide(verify: Verify, answers: Sequence[Answer], pending: int, made: int,
           streak: dict[str, int], draw: float) -> Decision:
    """What to do once a replica has ended. `answers`: the ended replicas, in the order they
    were made; `pending`: replicas not ended; `made`: all made so far; `streak`: the agreeing
    answers in a row of the machines that answered; `draw`: a uniform number in [0, 1), the
    adaptive check's sample."""
    got = [a for a in answers if a.key is not None]
    groups: dict[tuple[int | None, str, str], list[Answer]] = {}
    for a in got:
        assert a.key is not None
        groups.setdefault(a.key, []).append(a)
    best = max(groups.values(), key=len, default=[])
    if verify.adaptive and len(got) == 1 and pending == 0 and len(answers) == 1:
        only = got[0]
        if draw >= check_probability(streak.get(only.machine_id, 0)):
            return Decision(accept=(only,), checked=False)
    if len(best) >= verify.quorum:
        return Decision(accept=tuple(best), against=tuple(a for a in got if a.key != best[0].key))
    needed = verify.quorum - len(best)
    more = min(needed - pending, verify.max_replicas - made)
    if more > 0:
        return Decision(more=more)
    if pending:
        return Decision()
    said = "; ".join(f"machine {a.machine_id[:8]}: {a.says()}" for a in answers)
    return Decision(fail=f"results disagree: no {verify.quorum} of {made} replicas agreed "
                         f"({said})")


def shares_host(address: str) -> bool:
    """Do machines that registered from this address count as one host for replicas (never
    two replicas of a job behind one address)? Not for an address that tells nothing: none,
    or loopback (machines on the coordinator's own host, whose operator runs them)."""
    if not address:
        return False
    try:
        return not ipaddress.ip_address(address).is_loopback
    except ValueError:
        return True  # a name of some other kind: taken as it is


NO_OUTPUT = "none"
MALFORMED = "malformed"


def output_digest(chunks: Iterable[bytes]) -> str:
    """A digest of what an /output archive (the agent's tar.gz) holds, independent of its
    order, timestamps, owners and compression: sha256 over each regular file's path and
    bytes, sorted by path. An archive an honest agent cannot make (anything but regular files
    with plain relative paths, a path twice, or not a tar.gz) digests to MALFORMED plus what
    it held, which never agrees with an honest one; so a tar tool cannot be shown bytes
    other than the ones compared."""
    stream = _ChunkReader(iter(chunks))
    files: dict[str, str] = {}
    try:
        with tarfile.open(fileobj=stream, mode="r|gz") as tar:
            for member in tar:
                name = member.name
                if not member.isreg() or not _plain_path(name) or name in files:
                    return f"{MALFORMED}:{_raw_digest(stream)}"
                f = tar.extractfile(member)
                assert f is not None
                h = hashlib.sha256()
                while block := f.read(1024 * 1024):
                    h.update(block)
                files[name] = f"{member.size}:{h.hexdigest()}"
    except (tarfile.TarError, OSError, EOFError):
        return f"{MALFORMED}:{_raw_digest(stream)}"
    if not files:
        return NO_OUTPUT
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\x00{files[name]}\n".encode())
    return f"sha256:{h.hexdigest()}"


def _plain_path(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\\" not in name and all(
        p not in ("", ".", "..") for p in parts) and name.isprintable()


def _raw_digest(stream: _ChunkReader) -> str:
    """The sha256 of every byte read so far and of the rest (a malformed archive's mark)."""
    while stream.read(1024 * 1024):
        pass
    return stream.sha256.hexdigest()[:32]


class _ChunkReader(io.RawIOBase):
    """A file over an iterator of byte chunks (an object's stream), hashing what it reads."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._chunk, self._at = b"", 0
        self.sha256 = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._at >= len(self._chunk):
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._chunk, self._at = chunk, 0
        view = memoryview(buffer).cast("B")
        n = min(len(view), len(self._chunk) - self._at)
        view[:n] = self._chunk[self._at:self._at + n]
        self.sha256.update(view[:n])
        self._at += n
        return n
