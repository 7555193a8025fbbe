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
import ipaddress
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence

from campugrid.protocol.spec import MAX_OUTPUT_BYTES
from campugrid.protocol.verify import Verify

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
    it ended without one: cancelled, or failed with no exit code of its own (a negative one
    is the agent's: the build failed, the sandbox could not start)."""
    if state == "succeeded" or (state == "failed" and exit_code is not None and exit_code >= 0):
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
    # Pairs of replicas (ids) whose outputs the job's compare command must judge first.
    compare: tuple[tuple[str, str], ...] = ()


def check_probability(streak: int) -> float:
    """How likely an adaptive job's single answer from a machine with this many agreeing
    answers in a row is checked by a second replica: always until TRUSTED_AFTER, then
    TRUSTED_AFTER/streak (as BOINC's 1/N), never below SAMPLE_FLOOR."""
    if streak < TRUSTED_AFTER:
        return 1.0
    return max(SAMPLE_FLOOR, TRUSTED_AFTER / streak)


def checkpoint_probability(verify: Verify, streak: int) -> float:
    """How likely a checkpoint that a machine with this streak made is recomputed elsewhere
    (coordinator/checks.py): the fraction the job asked for, or under adaptive as likely as
    its answer would be checked."""
    if verify.checkpoints is not None:
        return verify.checkpoints
    return check_probability(streak) if verify.adaptive else 0.0


def decide(verify: Verify, answers: Sequence[Answer], pending: int, made: int,
           streak: dict[str, int], draw: float,
           verdicts: Mapping[frozenset[str], bool | None] | None = None) -> Decision:
    """What to do once a replica has ended. `answers`: the ended replicas, in the order they
    were made; `pending`: replicas not ended; `made`: all made so far; `streak`: the agreeing
    answers in a row of the machines that answered; `draw`: a uniform number in [0, 1), the
    adaptive check's sample. `verdicts`: for a job with its own compare command, what it said
    of pairs of replicas (by id) that exited alike with other outputs or result lines: equal
    answers agree, and so do those it judged alike; a quorum is answers that all agree with
    each other."""
    got = [a for a in answers if a.key is not None]
    best = alike_group(got, verdicts)
    if verify.adaptive and len(got) == 1 and pending == 0 and len(answers) == 1:
        only = got[0]
        if draw >= check_probability(streak.get(only.machine_id, 0)):
            return Decision(accept=(only,), checked=False)
    if len(best) >= verify.quorum:
        return Decision(accept=tuple(best), against=against(got, best, verdicts))
    if verdicts is not None and (pairs := unjudged(got, verdicts)):
        return Decision(compare=pairs)  # the job's compare command judges what equality cannot
    needed = verify.quorum - len(best)
    more = min(needed - pending, verify.max_replicas - made)
    if more > 0:
        return Decision(more=more)
    if pending and needed <= pending + verify.max_replicas - made:
        return Decision()  # those still running may yet agree
    said = "; ".join(f"machine {a.machine_id[:8]}: {a.says()}" for a in answers)
    if not got:
        return Decision(fail=f"no replica answered: each of the {made} ended without an exit "
                             f"code of its job's ({said})")
    return Decision(fail=f"results disagree: no {verify.quorum} of {made} replicas agreed "
                         f"({said})")


def alike_group(got: Sequence[Answer],
                verdicts: Mapping[frozenset[str], bool | None] | None) -> list[Answer]:
    """The largest group of answers that all agree with each other, pair by pair: equal, or
    (with `verdicts`, a compare command's) exited alike and judged alike."""
    def alike(a: Answer, b: Answer) -> bool:
        if a.key == b.key:
            return True
        return (verdicts is not None and comparable(a, b)
                and verdicts.get(frozenset((a.replica, b.replica))) is True)

    best: list[Answer] = []
    for a in got:
        clique = [a]
        for b in got:
            if b is not a and all(alike(b, c) for c in clique):
                clique.append(b)
        if len(clique) > len(best):
            best = clique
    return best


def comparable(a: Answer, b: Answer) -> bool:
    """May a compare command call these two answers alike: they exited alike, and neither is
    an archive an honest agent cannot make (never alike with anything, never shown to it)?"""
    return (a.key is not None and b.key is not None and a.key[0] == b.key[0]
            and not a.key[2].startswith(MALFORMED) and not b.key[2].startswith(MALFORMED))


def unjudged(got: Sequence[Answer],
             verdicts: Mapping[frozenset[str], bool | None]) -> tuple[tuple[str, str], ...]:
    """Pairs that exited alike with other outputs, which the compare command has not judged."""
    return tuple((a.replica, b.replica) for i, a in enumerate(got) for b in got[i + 1:]
                 if a.key != b.key and comparable(a, b)
                 and frozenset((a.replica, b.replica)) not in verdicts)


def against(got: Sequence[Answer], best: Sequence[Answer],
            verdicts: Mapping[frozenset[str], bool | None] | None) -> tuple[Answer, ...]:
    """The answers that disagreed with an accepted quorum. With a compare command, only those
    shown to: another exit code, an archive no honest agent makes, or judged unlike one of the
    quorum; one never compared is neither credited nor blamed."""
    if verdicts is None:
        return tuple(a for a in got if a not in best)
    return tuple(a for a in got if a not in best and any(
        not comparable(a, b) or verdicts.get(frozenset((a.replica, b.replica))) is False
        for b in best))


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
MAX_PAX_BYTES = 64 * 1024  # an extended header's records, at most (a long path needs far less)
# The extended-header keys Python's tarfile writes for a plain file (the agent's archives).
_PAX_KEYS = frozenset({"path", "mtime", "atime", "ctime", "uid", "gid", "uname", "gname"})
_ZEROS = bytes(512)
_USTAR = b"ustar\x0000"  # POSIX ustar's magic and version, as the PAX format writes them


class _Malformed(Exception):
    """Not an archive an honest agent makes."""


def output_digest(chunks: Iterable[bytes], limit: int = MAX_OUTPUT_BYTES) -> str:
    return read_output(chunks, limit)[0]


def checkpoint_digest(chunks: Iterable[bytes], limit: int) -> str:
    """The digest of a checkpoint's archive (the agent's plain tar), as read_output's of an
    /output: what checks compare (coordinator/checks.py)."""
    return read_output(chunks, limit, gzipped=False)[0]


def read_output(chunks: Iterable[bytes], limit: int = MAX_OUTPUT_BYTES,
                gzipped: bool = True) -> tuple[str, list[tuple[str, int]]]:
    """(digest, [(path, size), ...] of its files, as read here; none if malformed). The digest
    is of what an /output archive (the agent's tar.gz) holds, independent of its
    order, timestamps, owners and compression: sha256 over each regular file's path and
    bytes, sorted by path. The archive is read strictly as the agent writes it (POSIX ustar
    headers, PAX records of a few known keys, regular files, nothing after its end but
    zeros, one whole gzip stream) and never inflated past `limit` plus its headers: anything
    else (a link, a sparse file, a path twice, a damaged or cut stream, a bomb) digests to
    MALFORMED plus a digest of its bytes, which never agrees with an honest archive. So no
    tar tool can be shown files other than the ones compared."""
    raw = _Raw(iter(chunks))
    # A compressed archive inflates to its files plus headers; a plain one is read as it is.
    stream = (_Inflated(raw, limit + limit // 16 + 1024 * 1024) if gzipped
              else _Plain(raw, limit))
    try:
        files = _read_tar(stream)
        stream.finish()
    except (_Malformed, zlib.error, UnicodeDecodeError, ValueError):
        return raw.malformed(), []
    if not files:
        return NO_OUTPUT, []
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\x00{files[name]}\n".encode())
    return f"sha256:{h.hexdigest()}", [(n, int(files[n].split(":")[0])) for n in sorted(files)]


def _read_tar(r: _Inflated) -> dict[str, str]:
    files: dict[str, str] = {}
    path: str | None = None  # from the extended header just read, for the next entry
    while True:
        h = r.read(512)
        if h == _ZEROS:
            if r.read(512) != _ZEROS:
                raise _Malformed("one zero block")
            return files
        if h[257:265] != _USTAR or _octal(h[148:156]) != sum(h[:148]) + 256 + sum(h[156:]):
            raise _Malformed("not a POSIX ustar header, or its checksum is wrong")
        kind, size = h[156:157], _octal(h[124:136])
        if kind == b"x":
            if size > MAX_PAX_BYTES or path is not None:
                raise _Malformed("an extended header too long, or two in a row")
            path = _pax_path(r.read(size))
            r.skip(-size % 512)
            continue
        if kind not in (b"0", b"\0"):
            raise _Malformed("an entry that is not a regular file")
        name = path if path is not None else _ustar_name(h)
        path = None
        if not _plain_path(name) or name in files:
            raise _Malformed("a path that is not plain, or a path twice")
        digest = hashlib.sha256()
        for piece in r.pieces(size):
            digest.update(piece)
        r.skip(-size % 512)
        files[name] = f"{size}:{digest.hexdigest()}"


def _octal(field: bytes) -> int:
    text = field.rstrip(b"\0 ").lstrip(b" ")
    if not text or any(c not in b"01234567" for c in text):
        raise _Malformed("a number field that is not octal")
    return int(text, 8)


def _ustar_name(h: bytes) -> str:
    name = h[:100].split(b"\0", 1)[0].decode("utf-8")
    prefix = h[345:500].split(b"\0", 1)[0].decode("utf-8")
    return f"{prefix}/{name}" if prefix else name


def _pax_path(data: bytes) -> str | None:
    """The path an extended header gives; only the keys tarfile writes for a file."""
    path, at = None, 0
    while at < len(data):
        length_text, space, _ = data[at:at + 20].partition(b" ")
        if not space or not length_text.isdigit():
            raise _Malformed("an extended header record without its length")
        length = int(length_text)
        record = data[at:at + length]
        if length <= len(length_text) + 1 or len(record) != length or not record.endswith(b"\n"):
            raise _Malformed("an extended header record of the wrong length")
        key, eq, value = record[len(length_text) + 1:-1].partition(b"=")
        if not eq or key.decode("utf-8") not in _PAX_KEYS:
            raise _Malformed("an extended header key an agent does not write")
        if key == b"path":
            path = value.decode("utf-8")
        at += length
    return path


def _plain_path(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\0" not in name and all(
        p not in ("", ".", "..") for p in parts)


class _Raw:
    """The archive's bytes as they come, hashed."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self.chunks, self.sha256 = chunks, hashlib.sha256()

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.chunks:
            self.sha256.update(chunk)
            yield chunk

    def malformed(self) -> str:
        for _ in self:
            pass
        return f"{MALFORMED}:{self.sha256.hexdigest()[:32]}"


class _Inflated:
    """The gzip stream inflated, a megabyte at a time, never past `cap` bytes in all."""

    def __init__(self, raw: _Raw, cap: int) -> None:
        self._raw, self._cap = iter(raw), cap
        self._gz = zlib.decompressobj(wbits=31)  # gzip: its CRC and length checked at its end
        self._pending, self._buf, self._at, self._total = b"", b"", 0, 0

    def _more(self) -> bool:
        """Inflate some more into the buffer (which has been read whole); False at the end."""
        while not self._gz.eof:
            if not self._pending:
                chunk = next(self._raw, None)
                if chunk is None:
                    raise _Malformed("the gzip stream is cut short")
                self._pending = chunk
            out = self._gz.decompress(self._pending, 1024 * 1024)
            self._pending = self._gz.unconsumed_tail
            if out:
                self._total += len(out)
                if self._total > self._cap:
                    raise _Malformed("it inflates past the output limit")
                self._buf, self._at = out, 0
                return True
        return False

    def pieces(self, n: int) -> Iterator[bytes]:
        while n:
            if self._at >= len(self._buf) and not self._more():
                raise _Malformed("it ends inside an entry")
            take = min(n, len(self._buf) - self._at)
            yield self._buf[self._at:self._at + take]
            self._at += take
            n -= take

    def read(self, n: int) -> bytes:
        return b"".join(self.pieces(n))

    def skip(self, n: int) -> None:
        for _ in self.pieces(n):
            pass

    def finish(self) -> None:
        """After the tar's end: zeros only, then the end of one gzip stream and no more."""
        self._zeros_to_the_end()
        if self._gz.unused_data or self._pending or next(self._raw, None) is not None:
            raise _Malformed("more after the gzip stream")

    def _zeros_to_the_end(self) -> None:
        while True:
            if any(self._buf[self._at:]):
                raise _Malformed("data after the end of the archive")
            self._at = len(self._buf)
            if not self._more():
                return


class _Plain(_Inflated):
    """An archive that is not compressed (a checkpoint's), read the same way."""

    def _more(self) -> bool:
        for chunk in self._raw:
            if chunk:
                self._total += len(chunk)
                if self._total > self._cap:
                    raise _Malformed("it is larger than its limit")
                self._buf, self._at = chunk, 0
                return True
        return False

    def finish(self) -> None:
        self._zeros_to_the_end()


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
