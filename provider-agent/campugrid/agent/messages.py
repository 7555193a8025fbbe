"""What the agent and the coordinator tell each other, as frozen values: client.py converts
them to and from protobuf at the edge, so nothing past it sees a generated type."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence


@dataclasses.dataclass(frozen=True)
class Gpu:
    uuid: str
    name: str = ""
    kind: str = ""  # "nvidia" or "apple"
    memory_total_mb: int = 0
    memory_free_mb: int = 0  # after other processes' memory and the owner's reserve
    compute_capability: str = ""  # "8.6"; empty for non-NVIDIA
    temperature_c: int = 0
    driver_version: str = ""
    shared_memory: bool = False  # Apple silicon: GPU memory is the system's memory
    minor: int = 0  # /dev/nvidia<minor>


@dataclasses.dataclass(frozen=True)
class Capabilities:
    runtime: str
    builder: str
    cpus: int = 1
    memory_mb: int = 0
    limits: Mapping[str, str] = dataclasses.field(default_factory=dict)
    gpus: tuple[Gpu, ...] = ()
    gpu_isolation: bool = False
    gpu_note: str = ""
    speed_gflops: float = 0.0
    shares: Mapping[str, tuple[SharedFile, ...]] = dataclasses.field(default_factory=dict)
    held: str = ""  # why the owner holds the machine now (campugrid.agent.owner); "" takes work
    disk_mb: int = 0  # the most disk one task can be given (Room.disk_mb)


@dataclasses.dataclass(frozen=True)
class Room:
    """What one task can be given on this machine: a lease asks only for jobs that fit."""

    cpus: int
    memory_mb: int
    disk_mb: int  # the output slot's room (a build's store, then /output), else the free disk


@dataclasses.dataclass(frozen=True)
class SharedFile:
    """A file in a folder the owner shares: its path inside the folder, never on the host."""

    path: str
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class DatasetFile:
    path: str  # relative to /data/<name>
    url: str  # presigned GET
    size: int = 0
    sha256: str = ""  # checked before the job starts ("": a spec from before contents were pinned)


@dataclasses.dataclass(frozen=True)
class Dataset:
    name: str
    files: tuple[DatasetFile, ...] = ()
    share: str = ""  # the files are in this machine's share of that name (no URLs)


@dataclasses.dataclass(frozen=True)
class Resume:
    """The checkpoint a new attempt starts from."""

    epoch: int
    url: str  # presigned GET
    size: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class BaseImage:
    """A FROM on a registry, resolved at submit: pull `digest` from the first of `sources`
    that has it."""

    ref: str  # registry/repository:tag, as buildpolicy.dockerfiles normalizes the FROM
    digest: str
    sources: tuple[Source, ...] = ()


@dataclasses.dataclass(frozen=True)
class Source:
    address: str  # host[:port]
    insecure: bool = False  # plain HTTP
    token: str = ""  # a mirror's pull token; empty: anonymous


@dataclasses.dataclass(frozen=True)
class Mirror:
    """One of the platform's package caches (coordinator/mirrors.py), for this machine."""

    kind: str  # "pypi" or "apt"
    url: str
    token: str  # HTTP Basic password (any user name)
    certificate: str = ""  # PEM to trust for an https url

    def with_login(self) -> str:
        """The url with the token in it, as pip takes an index's credentials."""
        scheme, _, rest = self.url.partition("://")
        return f"{scheme}://campugrid:{self.token}@{rest}"


def mirror(mirrors: Sequence[Mirror], kind: str) -> Mirror | None:
    return next((m for m in mirrors if m.kind == kind), None)


@dataclasses.dataclass(frozen=True)
class ShardTask:
    index: int
    payload_json: str = ""
    cost: float = 0.0


@dataclasses.dataclass(frozen=True)
class Hold:
    """What this machine holds by a lease (coordinator/holds.py): the job, the kind
    ("attempt": a plain job's attempt; "session": a session of a sharded job) and the fencing
    token. Every call about the task names it."""

    job_id: str
    kind: str
    token: int


@dataclasses.dataclass(frozen=True)
class Lease:
    """One attempt of a job on this machine (or a shard session: `shard` is its first)."""

    job_id: str
    attempt: int
    fencing_token: int
    spec_json: str
    lease_seconds: float = 0.0
    context_url: str = ""  # presigned GET of the build context
    output_url: str = ""  # presigned PUT of the output tarball
    datasets: tuple[Dataset, ...] = ()
    resume: Resume | None = None
    gpu_uuids: tuple[str, ...] = ()  # reserved for this attempt: map only these
    gpu_memory_mb: int = 0  # reserved on each of them
    shard: ShardTask | None = None
    bases: tuple[BaseImage, ...] = ()
    mirrors: tuple[Mirror, ...] = ()
    hold_kind: str = "attempt"  # Hold.kind

    @property
    def hold(self) -> Hold:
        return Hold(self.job_id, self.hold_kind, self.fencing_token)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """How an attempt ended, for Complete."""

    succeeded: bool
    exit_code: int
    reason: str = ""  # why it failed, for the researcher
    result: str = ""  # the job's last line of output
    output_uploaded: bool = False
    limits: Mapping[str, str] = dataclasses.field(default_factory=dict)  # which held
    output_files: tuple[tuple[str, int], ...] = ()  # what the uploaded output holds


@dataclasses.dataclass(frozen=True)
class ShardResult:
    index: int
    succeeded: bool
    exit_code: int
    result_json: str = ""
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The coordinator's answer to a report (Complete, Release, RecordCheckpoint)."""

    accepted: bool
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Renewal:
    keep_going: bool  # false: stop the task now (cancelled, or no longer the current attempt)
    reason: str = ""
    lease_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class NextShard:
    accepted: bool  # false: the session is over
    reason: str = ""
    shard: ShardTask | None = None  # None: nothing waiting; end the session


@dataclasses.dataclass(frozen=True)
class CheckpointUpload:
    """Where to upload one checkpoint: presigned PUT per part, every part but the last
    exactly `part_size` long."""

    accepted: bool
    reason: str = ""
    key: str = ""
    upload_id: str = ""
    part_size: int = 0
    part_urls: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class CheckpointRecord:
    """An uploaded checkpoint, for the coordinator to check and record."""

    epoch: int
    key: str
    upload_id: str
    etags: tuple[str, ...]
    size: int
    sha256: str
    label: str = ""  # how the job's own code named it (autosave's entry), else ""


@dataclasses.dataclass(frozen=True)
class ImageStep:
    """The coordinator's answer about a task's image (the Image call)."""

    accepted: bool
    reason: str = ""
    action: str = ""  # "pull", "build" or "wait"; "push"; "recorded"
    registry: str = ""  # host:port; empty: no registry
    repository: str = ""
    digest: str = ""
    token: str = ""  # a short-lived bearer token for `repository` only
    push: bool = False
    retry_seconds: float = 0.0
    built_by: str = ""
