from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HoldKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTEMPT: _ClassVar[HoldKind]
    SESSION: _ClassVar[HoldKind]
ATTEMPT: HoldKind
SESSION: HoldKind

class AgentEvent(_message.Message):
    __slots__ = ("ready", "heartbeat")
    READY_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    ready: LeaseRequest
    heartbeat: HeartbeatRequest
    def __init__(self, ready: _Optional[_Union[LeaseRequest, _Mapping]] = ..., heartbeat: _Optional[_Union[HeartbeatRequest, _Mapping]] = ...) -> None: ...

class CoordinatorEvent(_message.Message):
    __slots__ = ("lease", "closing")
    LEASE_FIELD_NUMBER: _ClassVar[int]
    CLOSING_FIELD_NUMBER: _ClassVar[int]
    lease: LeaseReply
    closing: str
    def __init__(self, lease: _Optional[_Union[LeaseReply, _Mapping]] = ..., closing: _Optional[str] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("runtime", "builder", "cpus", "memory_mb", "limits", "gpus", "gpu_isolation", "gpu_note", "speed_gflops", "shares", "held", "disk_mb")
    class LimitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    BUILDER_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_ISOLATION_FIELD_NUMBER: _ClassVar[int]
    GPU_NOTE_FIELD_NUMBER: _ClassVar[int]
    SPEED_GFLOPS_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    DISK_MB_FIELD_NUMBER: _ClassVar[int]
    runtime: str
    builder: str
    cpus: int
    memory_mb: int
    limits: _containers.ScalarMap[str, str]
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    gpu_isolation: bool
    gpu_note: str
    speed_gflops: float
    shares: _containers.RepeatedCompositeFieldContainer[Share]
    held: str
    disk_mb: int
    def __init__(self, runtime: _Optional[str] = ..., builder: _Optional[str] = ..., cpus: _Optional[int] = ..., memory_mb: _Optional[int] = ..., limits: _Optional[_Mapping[str, str]] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., gpu_isolation: _Optional[bool] = ..., gpu_note: _Optional[str] = ..., speed_gflops: _Optional[float] = ..., shares: _Optional[_Iterable[_Union[Share, _Mapping]]] = ..., held: _Optional[str] = ..., disk_mb: _Optional[int] = ...) -> None: ...

class Share(_message.Message):
    __slots__ = ("name", "files")
    class File(_message.Message):
        __slots__ = ("path", "size", "sha256")
        PATH_FIELD_NUMBER: _ClassVar[int]
        SIZE_FIELD_NUMBER: _ClassVar[int]
        SHA256_FIELD_NUMBER: _ClassVar[int]
        path: str
        size: int
        sha256: str
        def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    name: str
    files: _containers.RepeatedCompositeFieldContainer[Share.File]
    def __init__(self, name: _Optional[str] = ..., files: _Optional[_Iterable[_Union[Share.File, _Mapping]]] = ...) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("uuid", "name", "kind", "memory_total_mb", "memory_free_mb", "compute_capability", "temperature_c", "driver_version", "shared_memory", "minor")
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_MB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_MB_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_C_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    name: str
    kind: str
    memory_total_mb: int
    memory_free_mb: int
    compute_capability: str
    temperature_c: int
    driver_version: str
    shared_memory: bool
    minor: int
    def __init__(self, uuid: _Optional[str] = ..., name: _Optional[str] = ..., kind: _Optional[str] = ..., memory_total_mb: _Optional[int] = ..., memory_free_mb: _Optional[int] = ..., compute_capability: _Optional[str] = ..., temperature_c: _Optional[int] = ..., driver_version: _Optional[str] = ..., shared_memory: _Optional[bool] = ..., minor: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("name", "capabilities")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    name: str
    capabilities: Capabilities
    def __init__(self, name: _Optional[str] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("machine_id", "status", "fingerprint")
    MACHINE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    machine_id: str
    status: str
    fingerprint: str
    def __init__(self, machine_id: _Optional[str] = ..., status: _Optional[str] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("capabilities",)
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    capabilities: Capabilities
    def __init__(self, capabilities: _Optional[_Union[Capabilities, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("gpus", "gpu_isolation", "enforced_limits", "shares", "cpus", "memory_mb", "disk_mb", "hold_kinds")
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_ISOLATION_FIELD_NUMBER: _ClassVar[int]
    ENFORCED_LIMITS_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    CPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    DISK_MB_FIELD_NUMBER: _ClassVar[int]
    HOLD_KINDS_FIELD_NUMBER: _ClassVar[int]
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    gpu_isolation: bool
    enforced_limits: _containers.RepeatedScalarFieldContainer[str]
    shares: _containers.RepeatedScalarFieldContainer[str]
    cpus: int
    memory_mb: int
    disk_mb: int
    hold_kinds: bool
    def __init__(self, gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., gpu_isolation: _Optional[bool] = ..., enforced_limits: _Optional[_Iterable[str]] = ..., shares: _Optional[_Iterable[str]] = ..., cpus: _Optional[int] = ..., memory_mb: _Optional[int] = ..., disk_mb: _Optional[int] = ..., hold_kinds: _Optional[bool] = ...) -> None: ...

class Dataset(_message.Message):
    __slots__ = ("name", "share", "files")
    class File(_message.Message):
        __slots__ = ("path", "url", "size", "sha256")
        PATH_FIELD_NUMBER: _ClassVar[int]
        URL_FIELD_NUMBER: _ClassVar[int]
        SIZE_FIELD_NUMBER: _ClassVar[int]
        SHA256_FIELD_NUMBER: _ClassVar[int]
        path: str
        url: str
        size: int
        sha256: str
        def __init__(self, path: _Optional[str] = ..., url: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    name: str
    share: str
    files: _containers.RepeatedCompositeFieldContainer[Dataset.File]
    def __init__(self, name: _Optional[str] = ..., share: _Optional[str] = ..., files: _Optional[_Iterable[_Union[Dataset.File, _Mapping]]] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("has_task", "job_id", "attempt", "fencing_token", "lease_seconds", "spec_json", "context_url", "output_url", "datasets", "resume", "gpu_uuids", "gpu_memory_mb", "shard", "bases", "mirrors", "hold_kind")
    HAS_TASK_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_URL_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_URL_FIELD_NUMBER: _ClassVar[int]
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_MB_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    BASES_FIELD_NUMBER: _ClassVar[int]
    MIRRORS_FIELD_NUMBER: _ClassVar[int]
    HOLD_KIND_FIELD_NUMBER: _ClassVar[int]
    has_task: bool
    job_id: str
    attempt: int
    fencing_token: int
    lease_seconds: float
    spec_json: str
    context_url: str
    output_url: str
    datasets: _containers.RepeatedCompositeFieldContainer[Dataset]
    resume: Resume
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    gpu_memory_mb: int
    shard: ShardTask
    bases: _containers.RepeatedCompositeFieldContainer[BaseImage]
    mirrors: _containers.RepeatedCompositeFieldContainer[Mirror]
    hold_kind: HoldKind
    def __init__(self, has_task: _Optional[bool] = ..., job_id: _Optional[str] = ..., attempt: _Optional[int] = ..., fencing_token: _Optional[int] = ..., lease_seconds: _Optional[float] = ..., spec_json: _Optional[str] = ..., context_url: _Optional[str] = ..., output_url: _Optional[str] = ..., datasets: _Optional[_Iterable[_Union[Dataset, _Mapping]]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., gpu_memory_mb: _Optional[int] = ..., shard: _Optional[_Union[ShardTask, _Mapping]] = ..., bases: _Optional[_Iterable[_Union[BaseImage, _Mapping]]] = ..., mirrors: _Optional[_Iterable[_Union[Mirror, _Mapping]]] = ..., hold_kind: _Optional[_Union[HoldKind, str]] = ...) -> None: ...

class Mirror(_message.Message):
    __slots__ = ("kind", "url", "token", "certificate")
    KIND_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    url: str
    token: str
    certificate: str
    def __init__(self, kind: _Optional[str] = ..., url: _Optional[str] = ..., token: _Optional[str] = ..., certificate: _Optional[str] = ...) -> None: ...

class BaseImage(_message.Message):
    __slots__ = ("ref", "digest", "sources")
    class Source(_message.Message):
        __slots__ = ("address", "insecure", "token")
        ADDRESS_FIELD_NUMBER: _ClassVar[int]
        INSECURE_FIELD_NUMBER: _ClassVar[int]
        TOKEN_FIELD_NUMBER: _ClassVar[int]
        address: str
        insecure: bool
        token: str
        def __init__(self, address: _Optional[str] = ..., insecure: _Optional[bool] = ..., token: _Optional[str] = ...) -> None: ...
    REF_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    ref: str
    digest: str
    sources: _containers.RepeatedCompositeFieldContainer[BaseImage.Source]
    def __init__(self, ref: _Optional[str] = ..., digest: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[BaseImage.Source, _Mapping]]] = ...) -> None: ...

class ShardTask(_message.Message):
    __slots__ = ("index", "payload_json", "cost")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_JSON_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    index: int
    payload_json: str
    cost: float
    def __init__(self, index: _Optional[int] = ..., payload_json: _Optional[str] = ..., cost: _Optional[float] = ...) -> None: ...

class ShardResult(_message.Message):
    __slots__ = ("index", "succeeded", "exit_code", "result_json", "reason")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    RESULT_JSON_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    index: int
    succeeded: bool
    exit_code: int
    result_json: str
    reason: str
    def __init__(self, index: _Optional[int] = ..., succeeded: _Optional[bool] = ..., exit_code: _Optional[int] = ..., result_json: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class NextShardRequest(_message.Message):
    __slots__ = ("job_id", "fencing_token", "done", "hold_kind")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    HOLD_KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    fencing_token: int
    done: ShardResult
    hold_kind: HoldKind
    def __init__(self, job_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., done: _Optional[_Union[ShardResult, _Mapping]] = ..., hold_kind: _Optional[_Union[HoldKind, str]] = ...) -> None: ...

class NextShardReply(_message.Message):
    __slots__ = ("accepted", "reason", "has_shard", "shard")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HAS_SHARD_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    has_shard: bool
    shard: ShardTask
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., has_shard: _Optional[bool] = ..., shard: _Optional[_Union[ShardTask, _Mapping]] = ...) -> None: ...

class Resume(_message.Message):
    __slots__ = ("epoch", "url", "size", "sha256")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    url: str
    size: int
    sha256: str
    def __init__(self, epoch: _Optional[int] = ..., url: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("job_id", "fencing_token", "phase", "hold_kind")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    HOLD_KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    fencing_token: int
    phase: str
    hold_kind: HoldKind
    def __init__(self, job_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., phase: _Optional[str] = ..., hold_kind: _Optional[_Union[HoldKind, str]] = ...) -> None: ...

class RenewReply(_message.Message):
    __slots__ = ("keep_going", "reason", "lease_seconds")
    KEEP_GOING_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    keep_going: bool
    reason: str
    lease_seconds: float
    def __init__(self, keep_going: _Optional[bool] = ..., reason: _Optional[str] = ..., lease_seconds: _Optional[float] = ...) -> None: ...

class LogsRequest(_message.Message):
    __slots__ = ("job_id", "fencing_token", "stream", "seq", "text", "hold_kind")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    HOLD_KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    fencing_token: int
    stream: str
    seq: int
    text: str
    hold_kind: HoldKind
    def __init__(self, job_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., stream: _Optional[str] = ..., seq: _Optional[int] = ..., text: _Optional[str] = ..., hold_kind: _Optional[_Union[HoldKind, str]] = ...) -> None: ...

class LogsReply(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("job_id", "fencing_token", "succeeded", "exit_code", "reason", "result", "output_uploaded", "limits", "output_files", "hold_kind")
    class LimitsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SUCCEEDED_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_UPLOADED_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FILES_FIELD_NUMBER: _ClassVar[int]
    HOLD_KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    fencing_token: int
    succeeded: bool
    exit_code: int
    reason: str
    result: str
    output_uploaded: bool
    limits: _containers.ScalarMap[str, str]
    output_files: _containers.RepeatedCompositeFieldContainer[OutputFile]
    hold_kind: HoldKind
    def __init__(self, job_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., succeeded: _Optional[bool] = ..., exit_code: _Optional[int] = ..., reason: _Optional[str] = ..., result: _Optional[str] = ..., output_uploaded: _Optional[bool] = ..., limits: _Optional[_Mapping[str, str]] = ..., output_files: _Optional[_Iterable[_Union[OutputFile, _Mapping]]] = ..., hold_kind: _Optional[_Union[HoldKind, str]] = ...) -> None: ...

class OutputFile(_message.Message):
    __slots__ = ("path", "size")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    path: str
    size: int
    def __init__(self, path: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class CompleteReply(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class BeginCheckpointRequest(_message.Message):
    __slots__ = ("job_id", "fencing_token", "epoch", "size", "sha256", "hold_kind")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    HOLD_KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    fencing_token: int
    epoch: int
    size: int
    sha256: str
    hold_kind: HoldKind
    def __init__(self, job_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., epoch: _Optional[int] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., hold_kind: _Optional[_Union[HoldKind, str]] = ...) -> None: ...

class BeginCheckpointReply(_message.Message):
    __slots__ = ("accepted", "reason", "key", "upload_id", "part_size", "part_urls")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    PART_SIZE_FIELD_NUMBER: _ClassVar[int]
    PART_URLS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    key: str
    upload_id: str
    part_size: int
    part_urls: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., key: _Optional[str] = ..., upload_id: _Optional[str] = ..., part_size: _Optional[int] = ..., part_urls: _Optional[_Iterable[str]] = ...) -> None: ...

class RecordCheckpointRequest(_message.Message):
    __slots__ = ("job_id", "fencing_token", "epoch", "key", "upload_id", "etags", "size", "sha256", "hold_kind", "label")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    ETAGS_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    HOLD_KIND_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    fencing_token: int
    epoch: int
    key: str
    upload_id: str
    etags: _containers.RepeatedScalarFieldContainer[str]
    size: int
    sha256: str
    hold_kind: HoldKind
    label: str
    def __init__(self, job_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., epoch: _Optional[int] = ..., key: _Optional[str] = ..., upload_id: _Optional[str] = ..., etags: _Optional[_Iterable[str]] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ..., hold_kind: _Optional[_Union[HoldKind, str]] = ..., label: _Optional[str] = ...) -> None: ...

class RecordCheckpointReply(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("job_id", "fencing_token", "reason", "failed", "cannot_run_here", "hold_kind")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    CANNOT_RUN_HERE_FIELD_NUMBER: _ClassVar[int]
    HOLD_KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    fencing_token: int
    reason: str
    failed: bool
    cannot_run_here: bool
    hold_kind: HoldKind
    def __init__(self, job_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., reason: _Optional[str] = ..., failed: _Optional[bool] = ..., cannot_run_here: _Optional[bool] = ..., hold_kind: _Optional[_Union[HoldKind, str]] = ...) -> None: ...

class ReleaseReply(_message.Message):
    __slots__ = ("accepted", "reason")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class ImageRequest(_message.Message):
    __slots__ = ("job_id", "fencing_token", "step", "inputs_json", "digest", "hold_kind")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    FENCING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    INPUTS_JSON_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    HOLD_KIND_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    fencing_token: int
    step: str
    inputs_json: str
    digest: str
    hold_kind: HoldKind
    def __init__(self, job_id: _Optional[str] = ..., fencing_token: _Optional[int] = ..., step: _Optional[str] = ..., inputs_json: _Optional[str] = ..., digest: _Optional[str] = ..., hold_kind: _Optional[_Union[HoldKind, str]] = ...) -> None: ...

class ImageReply(_message.Message):
    __slots__ = ("accepted", "reason", "action", "registry", "repository", "digest", "token", "push", "retry_seconds", "built_by")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    REGISTRY_FIELD_NUMBER: _ClassVar[int]
    REPOSITORY_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    RETRY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUILT_BY_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    reason: str
    action: str
    registry: str
    repository: str
    digest: str
    token: str
    push: bool
    retry_seconds: float
    built_by: str
    def __init__(self, accepted: _Optional[bool] = ..., reason: _Optional[str] = ..., action: _Optional[str] = ..., registry: _Optional[str] = ..., repository: _Optional[str] = ..., digest: _Optional[str] = ..., token: _Optional[str] = ..., push: _Optional[bool] = ..., retry_seconds: _Optional[float] = ..., built_by: _Optional[str] = ...) -> None: ...
