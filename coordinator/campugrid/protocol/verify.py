"""What a job asks to have checked, as its spec's `verify` says: replicas and their quorum,
adaptive replication, checked checkpoints, its own comparison (coordinator/quorum.py,
verified.py and checks.py apply it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from campugrid.protocol.fields import integer, no_unknown, number, parse_command, require


@dataclasses.dataclass(frozen=True)
class Verify:
    """Results checked by agreement between machines (coordinator/quorum.py): `replicas` run
    at first, on different machines; `quorum` of them must agree (the same exit code, result
    line and /output content); on disagreement more run, up to `max_replicas` in all. With
    `adaptive`, one runs where its machine has earned trust, and a second only when the
    machine has not (or is sampled), as BOINC does.

    `checkpoints`: the fraction of the job's checkpoints recomputed on another machine from the
    one before and compared (coordinator/checks.py); None: none, or under `adaptive` as many
    as the machine's record asks. A job that checks only its checkpoints runs once
    (replicas = quorum = 1): `{"checkpoints": 0.1}`."""

    replicas: int = 2
    quorum: int = 2
    max_replicas: int = 4
    adaptive: bool = False
    checkpoints: float | None = None
    # The job's own comparison, for results and checkpoints that differ bit for bit between
    # honest machines: run like the job (its image, in a sandbox) on another machine, with two
    # replicas' /output archives at /data/a/output.tar.gz and /data/b/output.tar.gz (their
    # result lines in $COMPARE_RESULT_A and _B), or two checkpoints at /data/a/checkpoint.tar
    # and /data/b/checkpoint.tar, read-only; exit 0 says they agree. Only replicas that exited
    # alike are compared.
    compare: tuple[str, ...] | None = None

    @property
    def replicated(self) -> bool:
        """Is the result taken from a quorum of replicas (else the job runs once, and only
        its checkpoints are checked)?"""
        return self.quorum > 1



MAX_REPLICAS = 16
ADAPTIVE = Verify(replicas=1, quorum=2, max_replicas=4, adaptive=True)


def parse(value: Any) -> Verify | None:
    """The spec's verify: absent or null (off), "adaptive", or {replicas, quorum,
    max_replicas, checkpoints}."""
    if value is None:
        return None
    if value == "adaptive":
        return ADAPTIVE
    require(isinstance(value, Mapping), "verify",
            'must be "adaptive" or an object such as {"replicas": 2, "quorum": 2}')
    no_unknown(value, Verify, "verify")
    if value.get("adaptive"):
        require(set(value) == {"adaptive"}, "verify", 'adaptive sets replicas and quorum '
                'itself: give "adaptive" alone')
        return ADAPTIVE
    checkpoints = (None if value.get("checkpoints") is None
                   else number(value, "checkpoints", 0.0, 0.0, 1.0, "verify"))
    # Checkpoints alone: the job runs once, and its checkpoints are what is checked.
    replicas = integer(value, "replicas", 1 if checkpoints is not None and "quorum" not in value
                       else 2, 1, MAX_REPLICAS, "verify")
    if replicas == 1:
        require(bool(checkpoints), "verify", "one replica and no checkpoints checked verify "
                "nothing: give replicas 2 or more, or checkpoints above 0")
        require(value.get("quorum", 1) == 1 and value.get("max_replicas", 1) == 1, "verify",
                "one replica has no quorum: give replicas 2 or more to compare results")
        return Verify(replicas=1, quorum=1, max_replicas=1, checkpoints=checkpoints,
                      compare=parse_command(value.get("compare"), "verify.compare"))
    quorum = integer(value, "quorum", min(2, replicas), 2, replicas, "verify")
    bound = integer(value, "max_replicas", max(4, replicas), replicas, MAX_REPLICAS, "verify")
    return Verify(replicas=replicas, quorum=quorum, max_replicas=bound, checkpoints=checkpoints,
                  compare=parse_command(value.get("compare"), "verify.compare"))
