"""The console's submit form: its fields turned into the same JobSpec and context tarball the
REST API takes, and every refusal put next to the field it is about."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import PurePosixPath
from typing import Any, BinaryIO, cast

from starlette.datastructures import FormData, UploadFile

from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.spec import JobSpec

NUMBERS = {"cpus": float, "memory_mb": int, "gpus": int, "gpu_memory_mb": int,
           "wall_time_s": int, "max_attempts": int}
TEXT_FIELDS = ("name", "command", "dockerfile", "datasets", "shards", "client_job_id",
               "image_reuse", "verify", *NUMBERS)
# The submit form's choices of spec.verify.
VERIFY = {"": None, "2": {"replicas": 2}, "3": {"replicas": 3, "quorum": 2}, "adaptive": "adaptive",
          "checkpoints": {"checkpoints": 0.1}}
MAX_FILES = 1000  # each is a spooled file, with a file handle past 1 MiB
SPOOL_BYTES = 8 * 1024**2  # a folder's tarball is on disk past this


@dataclasses.dataclass
class FormErrors(Exception):
    """What is wrong, by field ("" for the form as a whole)."""

    fields: dict[str, str]


def field_of(message: str) -> str:
    """The form field an error from the spec or the context is about."""
    head = re.split(r"[:\s\[]", message, maxsplit=1)[0]
    head = head.removeprefix("resources.")
    if head in NUMBERS or head in ("name", "command"):
        return head
    if head.startswith(("dataset", "datasets")):
        return "datasets"
    if head.startswith(("shard", "shard_mode")):
        return "shards"
    if head.startswith("image"):
        return "image_reuse"
    if head.startswith("verify"):
        return "verify"
    if head.startswith("build"):
        return "build_offline"
    if head.startswith(("context", "Dockerfile", "FROM", "RUN", "ADD", "COPY")):
        return "context"
    return ""


def _json_list(form: FormData, key: str, errors: dict[str, str]) -> list[Any] | None:
    text = str(form.get(key) or "").strip()
    if not text:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        errors[key] = f"not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        return None
    if not isinstance(value, list):
        errors[key] = "a JSON list, like [{...}, {...}]"
        return None
    return value


def spec_of(form: FormData) -> JobSpec:
    errors: dict[str, str] = {}
    data: dict[str, Any] = {}
    resources: dict[str, Any] = {}
    for key in ("name", "command", "client_job_id"):
        text = str(form.get(key) or "").strip()
        if text:
            data[key] = text
    for key, kind in NUMBERS.items():
        text = str(form.get(key) or "").strip()
        if not text:
            continue
        try:
            value = kind(text)
        except ValueError:
            errors[key] = "a whole number" if kind is int else "a number, like 1 or 0.5"
            continue
        (data if key == "max_attempts" else resources)[key] = value
    if resources:
        data["resources"] = resources
    reuse = str(form.get("image_reuse") or "").strip()
    if reuse:
        data["image"] = {"reuse": reuse}
    verify = str(form.get("verify") or "").strip()
    if verify not in VERIFY:
        errors["verify"] = "one of the choices offered"
    elif VERIFY[verify] is not None:
        data["verify"] = VERIFY[verify]
    for key in ("datasets", "shards"):
        value = _json_list(form, key, errors)
        if value is not None:
            data[key] = value
    if form.get("build_offline"):
        data["build"] = {"network": "none"}
    if errors:
        raise FormErrors(errors)
    try:
        return JobSpec.from_dict(data)
    except InvalidInput as e:
        raise FormErrors({field_of(str(e)): str(e)}) from e


def _member_path(name: str) -> str:
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if not parts or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise FormErrors({"context": f"a file in the folder has an unusable path {name!r}"})
    return "/".join(parts)


def context_of(form: FormData, limit: int) -> BinaryIO:
    """The build context, as a file (never whole in memory): the tarball as sent, or a tar.gz
    of the folder's files and the typed Dockerfile (which replaces the folder's own). The
    caller closes it."""
    dockerfile = str(form.get("dockerfile") or "").replace("\r\n", "\n")
    tarball = form.get("context")
    files = [f for f in form.getlist("folder") if isinstance(f, UploadFile) and f.filename]
    if isinstance(tarball, UploadFile) and tarball.filename:
        if files or dockerfile.strip():
            raise FormErrors({"context": "give the context once: a tarball (with its own "
                                         "Dockerfile), or a folder and/or a typed Dockerfile"})
        if tarball.file.seek(0, io.SEEK_END) > limit:
            raise FormErrors({"context": f"larger than {limit // 1024**2} MiB"})
        return tarball.file  # (closing it twice, here and with the form, is harmless)
    if not files and not dockerfile.strip():
        raise FormErrors({"dockerfile": "type a Dockerfile, or choose a folder or a tarball "
                                        "that holds one"})
    return _tar(files, dockerfile, limit)


def _tar(files: Sequence[UploadFile], dockerfile: str, limit: int) -> BinaryIO:
    if len(files) > MAX_FILES:
        raise FormErrors({"context": f"more than {MAX_FILES} files in the folder: send it as "
                                     "a tarball (tar -C FOLDER -czf context.tgz .)"})
    paths = [_member_path(f.filename or "") for f in files]
    # A chosen folder arrives as FOLDER/...: its contents are the context.
    tops = {p.split("/", 1)[0] for p in paths}
    if len(tops) == 1 and all("/" in p for p in paths):
        paths = [p.split("/", 1)[1] for p in paths]
    buf = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115 - returned
    total = 0
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, f in zip(paths, files, strict=True):
            if dockerfile.strip() and path == "Dockerfile":
                continue
            size = f.file.seek(0, io.SEEK_END)
            total += size
            if total > limit:
                buf.close()
                raise FormErrors({"context": f"larger than {limit // 1024**2} MiB"})
            f.file.seek(0)
            info = tarfile.TarInfo(path)
            info.size, info.mode = size, 0o644
            tar.addfile(info, f.file)
        if dockerfile.strip():
            data = dockerfile.encode()
            info = tarfile.TarInfo("Dockerfile")
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return cast(BinaryIO, buf)
