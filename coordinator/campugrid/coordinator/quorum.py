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
import zlib
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


def answer_key(state: str, exit_code: int | None, result: str | None,
               digest: str | None) -> tuple[int | None, str, str] | None:
    """What a replica that ended in `state` answered, as quorums compare answers; None where
    it ended without one (a failure that was not its code's, so no exit code; cancelled)."""
    if state == "succeeded" or (state == "failed" and exit_code is not None):
        return (exit_code, result or "", digest or NO_OUTPUT)
    return None


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
    if pending and needed <= pending + verify.max_replicas - made:
        return Decision()  # those still running may yet agree
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
    with plain relative paths, a path twice, a gzip stream that is cut short, damaged or
    followed by more) digests to MALFORMED plus a digest of its bytes, which never agrees
    with an honest one; so a tar tool cannot be shown bytes other than the ones compared."""
    raw = _Raw(iter(chunks))
    gz = zlib.decompressobj(wbits=31)  # gzip, its CRC and length checked at its end
    stream = _ChunkReader(_inflate(raw, gz))
    files: dict[str, str] = {}
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                name = member.name
                if not member.isreg() or not _plain_path(name) or name in files:
                    return raw.malformed()
                f = tar.extractfile(member)
                assert f is not None
                h = hashlib.sha256()
                while block := f.read(1024 * 1024):
                    h.update(block)
                files[name] = f"{member.size}:{h.hexdigest()}"
        while stream.read(1024 * 1024):  # what follows the tar's end must still inflate
            pass
    except (tarfile.TarError, OSError, EOFError, zlib.error):
        return raw.malformed()
    if not gz.eof or gz.unused_data or raw.more():
        return raw.malformed()
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


class _Raw:
    """The archive's bytes as they come, hashed."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks, self.sha256 = chunks, hashlib.sha256()

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.chunks:
            self.sha256.update(chunk)
            yield chunk

    def more(self) -> bool:
        return any(True for chunk in self if chunk)

    def malformed(self) -> str:
        for _ in self:
            pass
        return f"{MALFORMED}:{self.sha256.hexdigest()[:32]}"


def _inflate(raw: _Raw, gz: Any) -> Iterator[bytes]:
    """The gzip stream inflated, up to its end (what follows is left in `raw`)."""
    for chunk in raw:
        out = gz.decompress(chunk)
        if out:
            yield out
        if gz.eof:
            return
    if not gz.eof:
        raise EOFError("the gzip stream is cut short")


class _ChunkReader(io.RawIOBase):
    """A file over an iterator of byte chunks."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._chunk, self._at = b"", 0

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
        self._at += n
        return n


@dataclasses.dataclass(frozen=True)
class Simulated:
    """What `simulate` found: over `tasks` tasks, `runs` replicas run in all; `wrong` tasks
    accepted with a liar's answer; `caught` liars quarantined, after `liar_tasks` tasks of
    theirs in all (those of liars still free included); `honest_quarantined` (always 0 if
    the rule is right)."""

    tasks: int
    runs: int
    wrong: int
    caught: int
    liars: int
    liar_tasks: int
    honest_quarantined: int

    @property
    def extra(self) -> float:
        """Machine-time beyond one run per task, as a fraction of it."""
        return self.runs / self.tasks - 1.0


def simulate(verify: Verify, *, machines: int, liars: int, lie_rate: float, tasks: int,
             seed: int = 0, count_from: int = 0) -> Simulated:
    """`tasks` verified tasks over `machines` machines of which `liars` answer wrongly (each
    in its own way: liars do not collude) on `lie_rate` of their tasks, by exactly the rules
    the coordinator applies: `decide`, `check_probability`, a quarantine on disagreement,
    never two replicas of a task on one machine. Replicas are dealt to machines at random.
    Tasks and runs are counted from task `count_from` on (the steady state, after trust was
    earned)."""
    import random as _random

    rng = _random.Random(seed)  # noqa: S311 - a seeded simulation, reproducible on purpose
    free = list(range(machines))
    liar = set(range(liars))
    streak = dict.fromkeys(free, 0)
    quarantined: set[int] = set()
    runs = wrong = liar_tasks = 0
    for task in range(tasks):
        if task == count_from:
            runs = 0
        answers: list[Answer] = []
        used: set[int] = set()
        want = verify.replicas
        while True:
            for _ in range(want):
                pool = [m for m in rng.sample(free, min(len(free), len(used) + 8))
                        if m not in used]
                if not pool:
                    break
                m = pool[0]
                used.add(m)
                runs += 1
                lies = m in liar and rng.random() < lie_rate
                liar_tasks += m in liar
                answers.append(Answer(str(len(answers)), str(m),
                                      (0, f"wrong-{m}" if lies else "right", "")))
            d = decide(verify, answers, 0, len(answers), {str(m): streak[m] for m in used},
                       rng.random())
            if not d.more:
                break
            want = d.more
        if d.accept:
            assert d.accept[0].key is not None
            wrong += d.accept[0].key[1] != "right"
            if d.checked:
                for a in d.accept:
                    streak[int(a.machine_id)] += 1
                for a in d.against:
                    m = int(a.machine_id)
                    streak[m] = 0
                    quarantined.add(m)
                    free.remove(m)
    return Simulated(tasks - count_from, runs, wrong, len(quarantined & liar), liars, liar_tasks,
                     len(quarantined - liar))
