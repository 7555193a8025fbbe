"""The rules of verified jobs as pure functions (coordinator/quorum.py): what a quorum decides,
the adaptive sample, which machines count as one host, the digest /output is compared by;
and, over thousands of simulated machines and liars, how far a liar gets and what adaptive
verification costs honest machines."""

from __future__ import annotations

import gzip
import hashlib
import io
import itertools
import random
import tarfile
from pathlib import Path

import pytest

from campugrid.coordinator.quorum import (
    MALFORMED,
    NO_OUTPUT,
    SAMPLE_FLOOR,
    TRUSTED_AFTER,
    Answer,
    check_probability,
    checkpoint_digest,
    decide,
    output_digest,
    shares_host,
    simulate,
)
from campugrid.protocol.verify import ADAPTIVE, Verify

TWO = Verify(replicas=2, quorum=2, max_replicas=4)


def said(machine: str, result: str | None) -> Answer:
    return Answer(f"r-{machine}", machine, None if result is None else (0, result, "sha256:x"))


def test_a_quorum_of_agreeing_answers_is_taken_and_the_others_are_against_it():
    d = decide(TWO, [said("a", "42"), said("b", "41"), said("c", "42")], 0, 3, {}, 0.5)
    assert [a.machine_id for a in d.accept] == ["a", "c"] and [a.machine_id for a in d.against] == ["b"]
    assert d.checked and not d.more and not d.fail


def test_disagreement_runs_more_replicas_up_to_the_bound_then_fails_with_every_answer():
    assert decide(TWO, [said("a", "1"), said("b", "2")], 0, 2, {}, 0.5).more == 1
    d = decide(TWO, [said("a", "1"), said("b", "2"), said("c", "3"), said("d", "4")], 0, 4, {}, 0.5)
    assert d.fail.startswith("results disagree") and all(f"'{i}'" in d.fail for i in "1234")
    assert not d.accept


def test_a_compare_command_judges_what_equality_cannot_and_a_quorum_must_all_agree():
    def out(machine: str, digest: str, code: int = 0) -> Answer:
        return Answer(f"r-{machine}", machine, (code, "done", digest))

    a, b, c, failed = out("a", "sha256:1"), out("b", "sha256:2"), out("c", "sha256:3"), \
        out("d", "sha256:4", code=1)
    with_compare = Verify(replicas=2, quorum=2, max_replicas=4, compare=("cmp",))
    assert decide(with_compare, [a, b], 0, 2, {}, 0.5, verdicts={}).compare == (("r-a", "r-b"),)
    alike = decide(with_compare, [a, b], 0, 2, {}, 0.5, verdicts={frozenset(("r-a", "r-b")): True})
    assert alike.accept == (a, b) and not alike.against
    unlike = decide(with_compare, [a, b], 0, 2, {}, 0.5,
                    verdicts={frozenset(("r-a", "r-b")): False})
    assert unlike.more == 1 and not unlike.accept
    # Exit codes that differ are never compared; without a command nothing is.
    assert not decide(with_compare, [a, failed], 0, 2, {}, 0.5, verdicts={}).compare
    assert decide(TWO, [a, b], 0, 2, {}, 0.5).more == 1
    # b is like a and like c, but a and c differ: no quorum of three (no "likeness by way of").
    three = Verify(replicas=3, quorum=3, max_replicas=3, compare=("cmp",))
    chain = {frozenset(("r-a", "r-b")): True, frozenset(("r-b", "r-c")): True,
             frozenset(("r-a", "r-c")): False}
    assert decide(three, [a, b, c], 0, 3, {}, 0.5, verdicts=chain).fail


def test_replicas_still_running_are_waited_for_and_lost_ones_replaced():
    assert decide(TWO, [said("a", "1")], 1, 2, {}, 0.5) == decide(TWO, [], 2, 2, {}, 0.5)
    assert not decide(TWO, [said("a", "1")], 1, 2, {}, 0.5).more  # the other may agree
    assert decide(TWO, [said("a", "1"), said("b", None)], 0, 2, {}, 0.5).more == 1
    three = Verify(replicas=3, quorum=3, max_replicas=3)
    out_of_reach = decide(three, [said("a", "1"), said("b", None)], 1, 3, {}, 0.5)
    assert out_of_reach.fail  # three can no longer agree: not waited for


def test_adaptive_takes_one_answer_only_from_a_trusted_machine_that_is_not_sampled():
    alone = [said("m", "42")]
    untrusted = decide(ADAPTIVE, alone, 0, 1, {"m": TRUSTED_AFTER - 1}, 0.999)
    assert untrusted.more == 1
    trusted = decide(ADAPTIVE, alone, 0, 1, {"m": 1000}, 0.999)
    assert trusted.accept == tuple(alone) and not trusted.checked
    sampled = decide(ADAPTIVE, alone, 0, 1, {"m": 1000}, SAMPLE_FLOOR / 2)
    assert sampled.more == 1
    # Once checked, it is a quorum of two like any other.
    assert decide(ADAPTIVE, [*alone, said("n", "42")], 0, 2, {"m": 1000}, 0.999).checked


def test_the_check_probability_falls_with_trust_but_never_below_the_floor():
    probs = [check_probability(s) for s in range(0, 10_000)]
    assert probs[:TRUSTED_AFTER] == [1.0] * TRUSTED_AFTER
    assert all(a >= b for a, b in itertools.pairwise(probs))
    assert min(probs) == SAMPLE_FLOOR


@pytest.mark.parametrize(("address", "one_host"), [
    ("", False), ("127.0.0.1", False), ("::1", False), ("198.51.100.7", True),
    ("2001:db8::1", True), ("10.0.0.5", True), ("unix:/run/x", True)])
def test_which_addresses_make_machines_one_host(address: str, one_host: bool):
    assert shares_host(address) is one_host


def archive(members: list[tuple[str, bytes]], *, mtime: int = 0, level: int = 9,
            kind: bytes = tarfile.REGTYPE, form: int = tarfile.PAX_FORMAT) -> list[bytes]:
    """An archive as the agent packs /output (transfers.upload_output: PAX, plain files)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", compresslevel=level, format=form) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.type = len(data), mtime, kind
            if kind == tarfile.SYMTYPE:
                info.size, info.linkname = 0, "/etc/passwd"
            tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    raw = buf.getvalue()
    return [raw[i:i + 777] for i in range(0, len(raw), 777)]


FILES = [("model.pt", b"\x01" * 10_000), ("logs/metrics.json", b'{"loss": 0.1}')]
WHOLE = b"".join(archive(FILES))


def test_the_output_digest_is_what_the_files_hold_not_how_they_were_packed():
    d = output_digest(archive(FILES))
    assert d.startswith("sha256:")
    assert output_digest(archive(FILES[::-1], mtime=1_700_000_000, level=1)) == d
    assert output_digest(archive([FILES[0], ("logs/metrics.json", b'{"loss": 0.2}')])) != d
    assert output_digest(archive([FILES[0], ("logs/other.json", FILES[1][1])])) != d
    assert output_digest(archive([])) == NO_OUTPUT


def library_digest(chunks: list[bytes]) -> str:
    """The digest by the library's reading of the archive (tarfile extracting each file)."""
    files = {}
    with tarfile.open(fileobj=io.BytesIO(b"".join(chunks)), mode="r:gz") as tar:
        for m in tar:
            data = tar.extractfile(m).read()  # type: ignore[union-attr]
            files[m.name] = f"{len(data)}:{hashlib.sha256(data).hexdigest()}"
    if not files:
        return NO_OUTPUT
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(f"{name}\x00{files[name]}\n".encode())
    return f"sha256:{h.hexdigest()}"


@pytest.mark.parametrize("seed", range(12))
def test_the_strict_reader_agrees_with_tarfile_on_every_archive_an_agent_makes(seed: int):
    rng = random.Random(seed)
    names = set()
    while len(names) < rng.randint(0, 12):
        depth = rng.randint(1, 4)
        names.add("/".join(rng.choice(["model", "logs", "é", "a" * rng.randint(1, 120), "x y",
                                       "tab\there", "ckpt-00017"]) + str(rng.randint(0, 9))
                           for _ in range(depth)))
    members = [(n, rng.randbytes(rng.choice([0, 1, 511, 512, 513, 70_000, 2_500_000])))
               for n in sorted(names)]
    chunks = archive(members, mtime=rng.randint(0, 2**33), level=rng.randint(1, 9))
    assert output_digest(chunks) == library_digest(chunks)


def raw_tar(members: list[tuple[str, bytes]], form: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=form) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def gz(data: bytes) -> list[bytes]:
    return [gzip.compress(data)]


def sparse_pax() -> list[bytes]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("big")
        info.size, info.pax_headers = 4, {"GNU.sparse.size": str(2**50), "GNU.sparse.map": "0,4"}
        tar.addfile(info, io.BytesIO(b"abcd"))
    return gz(buf.getvalue())


def after_the_end() -> list[bytes]:
    honest = raw_tar(FILES)
    end = honest.index(bytes(1024), 512)
    return gz(honest[:end + 512] + raw_tar([("hidden", b"only tar -i sees me")]))


def bad_checksum() -> list[bytes]:
    honest = bytearray(raw_tar(FILES))
    honest[0] ^= 1  # the first header's name, its checksum unchanged
    return gz(bytes(honest))


@pytest.mark.parametrize("chunks", [
    sparse_pax(),
    gz(raw_tar([("n" * 200, b"x")], form=tarfile.GNU_FORMAT)),  # a GNU long-name header
    archive([("hard", b"")], kind=tarfile.LNKTYPE),
    after_the_end(),
    bad_checksum(),
], ids=["sparse", "gnu-longname", "hardlink", "after-the-end", "checksum"])
def test_what_tar_tools_read_differently_is_malformed(chunks: list[bytes]):
    assert output_digest(chunks).startswith(MALFORMED)


def agent_checkpoint(files: list[tuple[str, bytes]], root: Path) -> bytes:
    """A checkpoint archive as the agent packs one (checkpoints.CheckpointUploader._upload)."""
    for name, data in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    with tarfile.open(root.parent / "checkpoint.tar", "w") as tar:
        for name, _ in files:
            tar.add(root / name, arcname=name, recursive=False)
    return (root.parent / "checkpoint.tar").read_bytes()


def test_a_checkpoint_digest_is_what_its_files_hold_and_reads_plain_archives_strictly(
        tmp_path: Path):
    files = [*FILES, ("MANIFEST.json", b"{}")]
    made = agent_checkpoint(files, tmp_path / "a")
    again = agent_checkpoint(files[::-1], tmp_path / "b")
    limit = len(made)
    d = checkpoint_digest([made[i:i + 1000] for i in range(0, len(made), 1000)], limit)
    assert d.startswith("sha256:") and checkpoint_digest([again], limit) == d
    assert d == library_digest(gz(made))  # the library's reading of the same files
    assert checkpoint_digest([made.replace(b"\x01" * 10, b"\x02" * 10, 1)], limit) != d
    assert checkpoint_digest([made + raw_tar([("hidden", b"x")])], limit).startswith(MALFORMED)
    assert checkpoint_digest([made[:-2048 * 5]], limit).startswith(MALFORMED)  # cut short
    assert checkpoint_digest([made], limit // 2).startswith(MALFORMED)  # past its size
    assert checkpoint_digest(gz(made), limit).startswith(MALFORMED)  # not what agents send


def test_a_bomb_is_not_inflated_past_the_limit():
    bomb = gz(raw_tar([("zeros", bytes(50 * 1024 * 1024))]))  # 50 MiB in about 50 KiB
    assert sum(map(len, bomb)) < 200_000
    assert output_digest(bomb, limit=1024 * 1024).startswith(MALFORMED)
    assert output_digest(bomb).startswith("sha256:")  # under the real limit it is read


@pytest.mark.parametrize("chunks", [
    archive([*FILES, ("model.pt", b"evil")]),  # a path twice: tar tools keep the last
    archive([("/etc/cron.d/x", b"x")]),
    archive([("a/../../x", b"x")]),
    archive([("link", b"")], kind=tarfile.SYMTYPE),
    archive([("dir", b"")], kind=tarfile.DIRTYPE),
    [b"not a gzip stream"],
    [WHOLE[:-6]],  # cut short: its gzip trailer is missing
    [WHOLE + b"\0" * 10],  # followed by more
    [WHOLE[:-8] + bytes(4) + WHOLE[-4:]],  # its CRC does not match
], ids=["duplicate", "absolute", "dotdot", "symlink", "directory", "garbage", "truncated",
        "trailing", "bad-crc"])
def test_an_archive_an_honest_agent_cannot_make_never_agrees_with_one(chunks: list[bytes]):
    d = output_digest(chunks)
    assert d.startswith(MALFORMED) and d != output_digest(archive(FILES))
    assert output_digest(chunks) == d  # but two identical ones still agree with each other


@pytest.mark.parametrize("lie_rate", [0.01, 0.1, 1.0])
def test_replicas_on_every_task_let_no_lie_through(lie_rate: float):
    r = simulate(TWO, machines=2000, liars=100, lie_rate=lie_rate, tasks=20_000, seed=7)
    assert r.wrong == 0 and r.honest_quarantined == 0
    assert r.runs >= 2 * r.tasks
    if lie_rate == 1.0:  # caught at its first task
        assert r.caught == r.liars and r.liar_tasks == r.liars


@pytest.mark.parametrize(("lie_rate", "caught_at_least", "wrong_at_most"),
                         [(1.0, 1.0, 0), (0.1, 0.9, 0.0005), (0.01, 0.25, 0.0005)])
def test_adaptive_catches_liars_and_lets_few_lies_through(lie_rate: float, caught_at_least: float,
                                                          wrong_at_most: float):
    r = simulate(ADAPTIVE, machines=1000, liars=50, lie_rate=lie_rate, tasks=100_000, seed=3)
    assert r.honest_quarantined == 0
    assert r.caught >= caught_at_least * r.liars
    assert r.wrong <= wrong_at_most * r.tasks
    if lie_rate == 1.0:  # an untrusted machine's every answer is checked
        assert r.liar_tasks == r.liars


def test_adaptive_costs_honest_machines_little_once_they_have_earned_trust() -> None:
    early = simulate(ADAPTIVE, machines=100, liars=0, lie_rate=0, tasks=10_000, seed=5)
    steady = simulate(ADAPTIVE, machines=100, liars=0, lie_rate=0, tasks=100_000, seed=5,
                      count_from=50_000)  # 500 tasks a machine: trust earned
    assert early.extra > 0.2  # every machine starts untrusted: all its answers are checked
    assert steady.extra <= 0.10 and steady.honest_quarantined == 0


def test_replicas_that_all_end_without_an_answer_fail_the_job_saying_so():
    d = decide(TWO, [said("a", None), said("b", None), said("c", None), said("d", None)], 0, 4,
               {}, 0.5)
    assert d.fail.startswith("no replica answered")
    agent_failure = Answer("r", "m", None)  # exit -1: the agent's, not the job's
    from campugrid.coordinator.quorum import answer_key
    assert answer_key("failed", -1, "", None) is None and agent_failure.says() == "no answer"
    assert answer_key("failed", 3, "", None) == (3, "", NO_OUTPUT)
