"""The job spec a researcher submits, validated the same way by the CLI, the API and the agent.

Every refusal names the field and says what would be accepted, so the researcher can fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import posixpath
import re
from collections.abc import Iterable, Mapping
from typing import Any

from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.fields import integer, no_unknown, number, parse_command, require
from campugrid.protocol.verify import ADAPTIVE, Verify
from campugrid.protocol.verify import parse as parse_verify

CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
DATASET_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
# S3 bucket naming rules (lower-case, 3-63 chars); keys: printable, no "..", no leading "/".
S3_URI_RE = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/(?P<key>[^\x00-\x1f]*)$")

MAX_ENV = 128
MAX_ENV_VALUE = 32768
MAX_DATASETS = 16
MAX_SHARDS = 100_000
MAX_SHARD_PAYLOAD = 64 * 1024  # bytes of JSON per shard
MAX_SHARD_RESULT = 64 * 1024  # bytes of JSON a shard's result may have
MAX_SPEC_BYTES = 16 * 1024 * 1024  # room for a long list of shards
MAX_OUTPUT_BYTES = 1024**3  # the files of one /output archive, at most (agents refuse more)
SHARD_MODES = ("process", "serve")
# image.reuse: which build of the job's image a machine may run instead of building its own.
# "first": the first machine's (pushed to the registry, pulled by digest by the others);
# "verified": one that two machines built independently to the same digest; "never": each
# machine builds for itself and nothing is shared.
IMAGE_REUSE = ("first", "verified", "never")
# The limits an agent reports as enforced or not (its Capabilities.limits), in a fixed order:
# a job's resources.require_limits is stored as a bit mask over it, for the claim's filter.
LIMITS = ("memory", "cpu", "pids", "disk", "wall_time", "build_disk", "confinement",
          "sandbox_seccomp", "output")
ENFORCED = "enforced"  # what an agent reports for a limit that holds on its machine
BUILD_MB = 20480  # a build's disk where the job does not say: a PyTorch stack fits


@dataclasses.dataclass(frozen=True)
class Resources:
    cpus: float = 1.0
    memory_mb: int = 1024
    disk_mb: int = 256  # the size of the job's writable /tmp
    # The build's disk (what its steps write and download, and so the image's size); None:
    # what the machine offers, up to BUILD_MB. A machine that cannot give it hands the job back.
    build_mb: int | None = None
    output_mb: int = 4096  # /output and /checkpoints together
    gpus: int = 0
    gpu_memory_mb: int = 0  # per GPU
    wall_time_s: int = 3600
    min_compute_capability: str | None = None  # e.g. "8.0"
    gpu_kinds: tuple[str, ...] = ("nvidia",)  # GPU kinds the job was checked on
    # Limits the machine must enforce to get this job (names from LIMITS); the job waits
    # rather than run where one of them only holds on paper.
    require_limits: tuple[str, ...] = ()

    @property
    def disk_needed_mb(self) -> int:
        """The disk one machine must give the job: its build's store and then its /output and
        /checkpoints use the same room, one after the other."""
        return max(self.output_mb, self.build_mb or 0)

    @property
    def min_cc(self) -> tuple[int, int]:
        if not self.min_compute_capability:
            return (0, 0)
        major, minor = self.min_compute_capability.split(".")
        return (int(major), int(minor))


@dataclasses.dataclass(frozen=True)
class DatasetRef:
    """Files a job reads, by content: an S3 object with its sha256, the files under an S3
    prefix that `sha256` lists (path -> digest), an upload ticket (which binds one file's
    size and sha256), or files a provider's owner shares on their machine (`agent run --share
    NAME=/path`), named by their path in that share and their sha256. Never a host path.
    Mounted read-only at /data/<name>/."""

    name: str
    uri: str = ""  # s3://bucket/key (one object) or s3://bucket/prefix/ (the files listed)
    sha256: str | tuple[tuple[str, str], ...] = ""  # one object's digest, or (path, digest) pairs
    ticket: str = ""  # an upload ticket (POST /v1/uploads), instead of `uri`
    share: str = ""  # a provider's shared folder, instead of `uri`: `sha256` lists its files

    @property
    def is_prefix(self) -> bool:
        return self.uri.endswith("/")

    def pinned(self) -> bool:
        """Whether the content is named (every stored spec since issue 11 is)."""
        return bool(self.ticket or self.sha256)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name}
        if self.ticket:
            out["ticket"] = self.ticket
        elif self.share:
            out["share"] = self.share
        else:
            out["uri"] = self.uri
        if isinstance(self.sha256, tuple):
            out["sha256"] = dict(self.sha256)
        elif self.sha256:
            out["sha256"] = self.sha256
        return out

    @property
    def bucket(self) -> str:
        m = S3_URI_RE.match(self.uri)
        assert m, "validated in from_dict"
        return m["bucket"]

    @property
    def key(self) -> str:
        m = S3_URI_RE.match(self.uri)
        assert m, "validated in from_dict"
        return m["key"]


@dataclasses.dataclass(frozen=True)
class Shard:
    """One payload of a sharded job: it becomes a task of its own."""

    payload_json: str  # canonical JSON text of the payload
    cost: float = 1.0  # relative; heavy shards go to fast machines

    @property
    def payload(self) -> Any:
        return json.loads(self.payload_json)


@dataclasses.dataclass(frozen=True)
class ImageOptions:
    reuse: str = "first"  # one of IMAGE_REUSE


@dataclasses.dataclass(frozen=True)
class BuildOptions:
    """How the image is built: `network` "default" lets RUN steps (and ADD <url>) reach
    package registries through the platform's egress proxy; "none" builds offline, from the
    context alone."""

    network: str = "default"


@dataclasses.dataclass(frozen=True)
class CheckpointsFrom:
    """Where the job's own code (a framework, a plain loop) writes its checkpoints, when that
    is not a framework's default the hooks see: each entry of `dir` whose name matches `match`
    and holds a step number is taken as a checkpoint once written (hooks/autosave.py)."""

    dir: str
    match: str = "*"


CHECKPOINTS_DIR_RE = re.compile(r"[A-Za-z0-9/._+@-]+")  # what a mount's target may say
# Where a job's checkpoint folder may not be: the platform's own mounts, and the kernel's.
CHECKPOINTS_NOT_UNDER = ("/output", "/checkpoints", "/data", "/opt/campugrid", "/proc", "/sys",
                         "/dev")


def _checkpoints(value: Any) -> CheckpointsFrom | None:
    if value is None:
        return None
    require(isinstance(value, Mapping), "checkpoints",
            'must be an object, e.g. {"dir": "/app/outputs", "match": "checkpoint-*"}')
    no_unknown(value, CheckpointsFrom, "checkpoints")
    folder, match = value.get("dir"), value.get("match", "*")
    require(isinstance(folder, str) and folder.startswith("/") and 1 < len(folder) <= 512
            and bool(CHECKPOINTS_DIR_RE.fullmatch(folder)), "checkpoints.dir",
            "must be an absolute path inside the job's image, of letters, digits and "
            "/ . _ - + @ (e.g. /app/outputs)")
    assert isinstance(folder, str)
    norm = posixpath.normpath(folder).replace("//", "/")
    require(norm not in ("/", "/tmp"), "checkpoints.dir",
            f"{norm} cannot be the checkpoint folder; name a folder of its own, e.g. /app/outputs")
    require(not any(norm == r or norm.startswith(r + "/") for r in CHECKPOINTS_NOT_UNDER),
            "checkpoints.dir", f"{norm} is the platform's; choose a folder of the job's own "
            f"(not under {', '.join(CHECKPOINTS_NOT_UNDER)})")
    require(isinstance(match, str) and 0 < len(match) <= 128 and "/" not in match
            and match.isprintable(), "checkpoints.match",
            'must be a file name pattern (e.g. "checkpoint-*", "*.pt"), without "/"')
    return CheckpointsFrom(dir=norm, match=str(match))


def _is_plain(name: str, value: Any) -> bool:
    if name == "verify":
        return isinstance(value, (str, Mapping))
    if name == "command":
        return isinstance(value, (str, list))
    if name == "datasets":
        return isinstance(value, list) or (isinstance(value, tuple) and any(
            isinstance(d, Mapping) for d in value))
    return isinstance(value, Mapping)


# Fields earlier specs declared the build's packages in, before RUN steps could fetch them
# themselves: accepted (stored jobs keep working) and not needed any more.
BUILD_FORMER = ("pip", "apt", "python")
BUILD_NETWORKS = ("default", "none")


@dataclasses.dataclass(frozen=True)
class JobSpec:
    command: tuple[str, ...] | None = None  # None: the image's own CMD
    env: tuple[tuple[str, str], ...] = ()
    resources: Resources = Resources()
    datasets: tuple[DatasetRef, ...] = ()
    max_attempts: int = 3
    client_job_id: str | None = None
    name: str | None = None
    # A sharded job: one task per shard, run in a warm sandbox per machine. "process" runs the
    # command once per shard; "serve" starts it once and hands it shards (hooks.serve_shards).
    shards: tuple[Shard, ...] = ()
    shard_mode: str = "process"
    image: ImageOptions = ImageOptions()
    build: BuildOptions = BuildOptions()
    verify: Verify | None = None  # None: one machine's word is taken (the default)
    checkpoints: CheckpointsFrom | None = None  # None: the frameworks' own places, campugrid.hooks

    # Fields that may be given as plain values too, as JSON has them: JobSpec(resources=
    # {"memory_mb": 4096}, env={"SEED": "1"}, command="python3 train.py").
    _PLAIN = ("command", "env", "resources", "datasets", "image", "build", "verify",
              "checkpoints")

    def __post_init__(self) -> None:
        """Plain values (dicts, lists, a command string) are read and checked as from_dict
        reads them, into the same typed fields."""
        plain = {name: list(v) if isinstance(v, tuple) else v
                 for name in self._PLAIN if _is_plain(name, v := getattr(self, name))}
        if plain:
            typed = JobSpec.from_dict(plain)
            for name in plain:
                object.__setattr__(self, name, getattr(typed, name))
            if "verify" in plain and self.image == ImageOptions():  # as from_dict reads it
                object.__setattr__(self, "image", typed.image)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        if len(text) > MAX_SPEC_BYTES:
            raise InvalidInput(f"spec: larger than {MAX_SPEC_BYTES // 1024**2} MiB")
        try:
            data = json.loads(text or "{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidInput(f"spec: not valid JSON ({e})") from e
        except RecursionError as e:
            raise InvalidInput("spec: nested too deeply") from e
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: Any) -> JobSpec:
        require(isinstance(data, Mapping), "spec", "must be a JSON object")
        no_unknown(data, cls, "spec")
        command = parse_command(data.get("command"), "command")

        env = data.get("env") or {}
        require(isinstance(env, Mapping) and len(env) <= MAX_ENV, "env",
                f"must be an object of at most {MAX_ENV} NAME: value pairs")
        for k, v in env.items():
            require(bool(ENV_NAME_RE.match(k)), f"env.{k}",
                    "names are letters, digits and _, not starting with a digit")
            require(not k.upper().startswith("CAMPUGRID_"), f"env.{k}",
                    "names starting with CAMPUGRID_ are reserved for the platform")
            require(isinstance(v, str) and len(v) <= MAX_ENV_VALUE and "\x00" not in v,
                    f"env.{k}", f"must be a string of at most {MAX_ENV_VALUE} characters")

        res = data.get("resources") or {}
        require(isinstance(res, Mapping), "resources", "must be an object")
        no_unknown(res, Resources, "resources")
        resources = Resources(
            cpus=number(res, "cpus", 1.0, 0.1, 256, "resources"),
            memory_mb=integer(res, "memory_mb", 1024, 64, 4 * 1024 * 1024, "resources"),
            disk_mb=integer(res, "disk_mb", 256, 1, 1024 * 1024, "resources"),
            build_mb=None if res.get("build_mb") is None else
            integer(res, "build_mb", BUILD_MB, 64, 16 * 1024 * 1024, "resources"),
            output_mb=integer(res, "output_mb", 4096, 1, 1024 * 1024, "resources"),
            gpus=integer(res, "gpus", 0, 0, 16, "resources"),
            gpu_memory_mb=integer(res, "gpu_memory_mb", 0, 0, 1024 * 1024, "resources"),
            wall_time_s=integer(res, "wall_time_s", 3600, 1, 14 * 86400, "resources"),
            min_compute_capability=_cc(res.get("min_compute_capability")),
            gpu_kinds=_kinds(res.get("gpu_kinds", ["nvidia"])),
            require_limits=_limit_names(res.get("require_limits", [])),
        )
        if resources.gpus and not resources.gpu_memory_mb:
            raise InvalidInput("resources.gpu_memory_mb: say how much GPU memory each GPU needs "
                               "(it is reserved for the job)")
        if resources.gpu_memory_mb and not resources.gpus:
            raise InvalidInput("resources.gpus: gpu_memory_mb is set but gpus is 0")

        raw_ds = data.get("datasets") or []
        require(isinstance(raw_ds, list) and len(raw_ds) <= MAX_DATASETS, "datasets",
                f"must be a list of at most {MAX_DATASETS} {{name, uri}} objects")
        datasets = []
        seen: set[str] = set()
        for i, d in enumerate(raw_ds):
            where = f"datasets[{i}]"
            require(isinstance(d, Mapping), where, "must be an object {name, uri, sha256} "
                                                    "or {name, ticket}")
            no_unknown(d, DatasetRef, where)
            name = d.get("name")
            require(isinstance(name, str) and bool(DATASET_NAME_RE.match(name)), f"{where}.name",
                    "must be 1-64 of a-z 0-9 _ . - (it becomes /data/<name>)")
            require(name not in seen, f"{where}.name", f"'{name}' is used twice")
            seen.add(name)
            datasets.append(_dataset(d, where))
        shares = {ds.share for ds in datasets if ds.share}
        require(len(shares) <= 1, "datasets", "files of one share only: a job runs on one "
                f"machine, and each machine shares its own folders (got {sorted(shares)})")

        client_job_id = data.get("client_job_id")
        if client_job_id is not None:
            require(isinstance(client_job_id, str) and bool(CLIENT_ID_RE.match(client_job_id)),
                    "client_job_id", "must be 1-128 of A-Z a-z 0-9 . _ : - (starting alphanumeric)")
        name = data.get("name")
        if name is not None:
            require(isinstance(name, str) and 0 < len(name) <= 200 and name.isprintable(),
                    "name", "must be a printable string of at most 200 characters")

        shards = _shards(data.get("shards"))
        shard_mode = data.get("shard_mode", "process")
        require(shard_mode in SHARD_MODES, "shard_mode",
                f"must be one of {', '.join(SHARD_MODES)}")
        if shards and command is None:
            raise InvalidInput("command: a sharded job needs a command (it runs once per shard, "
                               "or once per sandbox with shard_mode \"serve\")")

        image = data.get("image") or {}
        require(isinstance(image, Mapping), "image", 'must be an object, e.g. {"reuse": "verified"}')
        no_unknown(image, ImageOptions, "image")
        verify = parse_verify(data.get("verify"))
        # A verified job runs an image two machines built alike, unless it says otherwise.
        reuse = image.get("reuse", "verified" if verify is not None else "first")
        require(reuse in IMAGE_REUSE, "image.reuse", f"must be one of {', '.join(IMAGE_REUSE)}")
        # A sharded job's shards keep no checkpoints: its results are what copies compare.
        require(not (shards and verify is not None
                      and (verify.checkpoints or not verify.replicated)), "verify",
                 "a sharded job keeps no checkpoints to check: verify its shards with "
                 '"replicas" or "adaptive"')
        require(not (shards and verify is not None and verify.compare), "verify.compare",
                "a sharded job's copies are compared by their results; compare is for "
                "a job's replicas")
        checkpoints = _checkpoints(data.get("checkpoints"))
        require(not (shards and checkpoints), "checkpoints",
                "a sharded job keeps no checkpoints (each shard is a task of its own)")
        return cls(
            build=_build(data.get("build")),
            checkpoints=checkpoints,
            command=command,
            env=tuple(sorted(env.items())),
            resources=resources,
            datasets=tuple(datasets),
            max_attempts=integer(data, "max_attempts", 3, 1, 50, "spec"),
            client_job_id=client_job_id,
            name=name,
            shards=shards,
            shard_mode=str(shard_mode),
            image=ImageOptions(reuse=str(reuse)),
            verify=verify,
        )

    @property
    def share(self) -> str | None:
        """The provider share this job's files come from: only machines sharing it fit."""
        return next((ds.share for ds in self.datasets if ds.share), None)

    def as_replica(self) -> JobSpec:
        """The spec a replica of a verified job runs: the same, but for the verifying (which
        is the coordinator's) and the job's own id (which is the verified job's)."""
        return dataclasses.replace(self, verify=None, client_job_id=None)

    def without_shards(self) -> JobSpec:
        """The spec as stored on the job row and sent to agents: shards live in their own
        table and reach agents one at a time."""
        return dataclasses.replace(self, shards=())

    @property
    def shards_sha256(self) -> str | None:
        if not self.shards:
            return None
        h = hashlib.sha256()
        for sh in self.shards:
            h.update(f"{sh.cost!r}\x00{sh.payload_json}\x01".encode())
        return h.hexdigest()

    def to_dict(self) -> dict[str, Any]:
        resources = {**dataclasses.asdict(self.resources),
                     "gpu_kinds": list(self.resources.gpu_kinds),
                     "require_limits": list(self.resources.require_limits)}
        if not self.resources.require_limits:  # stored specs stay as they were without it
            del resources["require_limits"]
        if self.resources.build_mb is None:  # likewise
            del resources["build_mb"]
        out: dict[str, Any] = {
            "command": list(self.command) if self.command is not None else None,
            "env": dict(self.env),
            "resources": resources,
            "datasets": [d.to_dict() for d in self.datasets],
            "max_attempts": self.max_attempts,
        }
        if self.client_job_id is not None:
            out["client_job_id"] = self.client_job_id
        if self.name is not None:
            out["name"] = self.name
        if self.shards:
            out["shards"] = [{"payload": sh.payload, "cost": sh.cost} for sh in self.shards]
        if self.shard_mode != "process":  # kept in the stored spec, which has no shards
            out["shard_mode"] = self.shard_mode
        if self.image != ImageOptions() or self.verify is not None:  # (a verified job's
            out["image"] = dataclasses.asdict(self.image)  # reuse is always said: not implied)
        if self.verify is not None:
            out["verify"] = ("adaptive" if self.verify == ADAPTIVE
                             else {k: list(v) if isinstance(v, tuple) else v
                                   for k, v in dataclasses.asdict(self.verify).items()
                                   if v is not None})
        if self.checkpoints is not None:
            out["checkpoints"] = dataclasses.asdict(self.checkpoints)
        if self.build != BuildOptions():
            out["build"] = {k: list(v) if isinstance(v, tuple) else v
                            for k, v in dataclasses.asdict(self.build).items() if v}
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


GPU_KINDS = ("nvidia", "apple")


def _build(value: Any) -> BuildOptions:
    if value is None:
        return BuildOptions()
    require(isinstance(value, Mapping), "build", 'must be an object, e.g. {"network": "none"}')
    no_unknown({k: v for k, v in value.items() if k not in BUILD_FORMER}, BuildOptions, "build")
    network = value.get("network", "default")
    require(network in BUILD_NETWORKS, "build.network",
            '"default" (package registries, through the platform\'s egress proxy) or "none" '
            "(offline: the context is the build's only input)")
    return BuildOptions(network=str(network))



def _shards(value: Any) -> tuple[Shard, ...]:
    if value is None:
        return ()
    require(isinstance(value, list) and 0 < len(value) <= MAX_SHARDS, "shards",
            f"must be a list of 1 to {MAX_SHARDS} objects {{payload, cost}}")
    out = []
    for i, item in enumerate(value):
        where = f"shards[{i}]"
        require(isinstance(item, Mapping) and "payload" in item, where,
                "must be an object with a payload (any JSON) and an optional cost")
        no_unknown(item, _ShardFields, where)
        payload = json.dumps(item["payload"], sort_keys=True, separators=(",", ":"),
                             ensure_ascii=False)
        require(len(payload.encode()) <= MAX_SHARD_PAYLOAD, f"{where}.payload",
                f"at most {MAX_SHARD_PAYLOAD // 1024} KiB of JSON (put bulk data in a dataset)")
        cost = number(item, "cost", 1.0, 1e-9, 1e12, where)
        out.append(Shard(payload_json=payload, cost=cost))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _ShardFields:  # the fields a shard may have, for unknown-field suggestions
    payload: Any
    cost: float


def _cc(value: Any) -> str | None:
    if value is None:
        return None
    require(isinstance(value, str) and bool(re.match(r"^\d{1,2}\.\d{1,2}$", value)),
            "resources.min_compute_capability", 'must be a string like "8.0"')
    return str(value)


def _kinds(value: Any) -> tuple[str, ...]:
    require(isinstance(value, list) and 0 < len(value) <= len(GPU_KINDS)
            and all(v in GPU_KINDS for v in value) and len(set(value)) == len(value),
            "resources.gpu_kinds", f"must be a non-empty list drawn from {', '.join(GPU_KINDS)}")
    return tuple(value)


def _limit_names(value: Any) -> tuple[str, ...]:
    require(isinstance(value, list) and all(isinstance(v, str) for v in value),
            "resources.require_limits", f"must be a list of limit names ({', '.join(LIMITS)})")
    for v in value:
        if v not in LIMITS:
            close = difflib.get_close_matches(v, LIMITS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known: {', '.join(LIMITS)}"
            raise InvalidInput(f"resources.require_limits: no limit '{v}' ({hint})")
    return tuple(sorted(set(value), key=LIMITS.index))


def limits_mask(names: Iterable[str]) -> int:
    """The bit mask of these limit names over LIMITS (unknown names are not counted)."""
    return sum(1 << i for i, name in enumerate(LIMITS) if name in set(names))


SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
TICKET_RE = re.compile(r"^upl_[A-Za-z0-9_-]{16,64}$")
MAX_DATASET_FILES = 1000


def _files(digest: Any, where: str, what: str) -> tuple[tuple[str, str], ...]:
    require(isinstance(digest, Mapping) and 0 < len(digest) <= MAX_DATASET_FILES,
            f"{where}.sha256", f"for a {what}: an object {{path: sha256}} of 1 to "
            f"{MAX_DATASET_FILES} files")
    for path, value in digest.items():
        require(isinstance(path, str) and _safe_path(path), f"{where}.sha256",
                f"{str(path)[:80]!r} is not a path under the {what} (no /, .., or empty "
                "parts)")
        require(isinstance(value, str) and bool(SHA256_RE.match(value)),
                f"{where}.sha256[{path!r}]", "must be 64 lowercase hex digits")
    return tuple(sorted(digest.items()))


def _dataset(d: Mapping[str, Any], where: str) -> DatasetRef:
    name, uri, ticket, digest = d["name"], d.get("uri"), d.get("ticket"), d.get("sha256")
    share = d.get("share")
    if share is not None:
        require(uri is None and ticket is None, where, "give a share or a uri or a ticket")
        require(isinstance(share, str) and bool(DATASET_NAME_RE.match(share)), f"{where}.share",
                "must be the name of a provider's shared folder (1-64 of a-z 0-9 _ . -; "
                "see GET /v1/shares)")
        return DatasetRef(name=name, share=share, sha256=_files(digest, where, "share"))
    if ticket is not None:
        require(uri is None and digest is None, where,
                "give a ticket alone: it names its file's size and sha256 itself")
        require(isinstance(ticket, str) and bool(TICKET_RE.match(ticket)), f"{where}.ticket",
                "must be an upload ticket (upl_..., from POST /v1/uploads or `submit --upload`)")
        return DatasetRef(name=name, ticket=ticket)
    m = S3_URI_RE.match(uri) if isinstance(uri, str) else None
    require(m is not None, f"{where}.uri",
            "must be s3://bucket/key or s3://bucket/prefix/ (bucket: 3-63 of a-z 0-9 . -)")
    assert m is not None and isinstance(uri, str)
    require(_safe_path(m["key"].rstrip("/"), empty_ok=True), f"{where}.uri",
            "the key may not start with / or contain a .. segment")
    pinned: str | tuple[tuple[str, str], ...] = ""
    if uri.endswith("/"):
        if digest is not None:
            pinned = _files(digest, where, "prefix")
    elif digest is not None:
        require(isinstance(digest, str) and bool(SHA256_RE.match(digest)), f"{where}.sha256",
                "must be the object's sha256: 64 lowercase hex digits")
        pinned = str(digest)
    return DatasetRef(name=name, uri=uri, sha256=pinned)


def _safe_path(path: str, empty_ok: bool = False) -> bool:
    if not path:
        return empty_ok
    parts = path.split("/")
    return not path.startswith("/") and all(p not in ("", ".", "..") for p in parts) \
        and "\x00" not in path and "\\" not in path
