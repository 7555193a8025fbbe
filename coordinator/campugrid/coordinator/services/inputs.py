"""What a job reads besides its context: files uploaded with a ticket, objects on S3 named by
digest, and files a provider's machine shares."""

from __future__ import annotations

import datetime as dt
import logging

from campugrid.coordinator.config import Settings
from campugrid.coordinator.objects import ObjectStore
from campugrid.coordinator.store import Store
from campugrid.coordinator.uploads import UploadView
from campugrid.coordinator.views import utcnow
from campugrid.protocol.errors import InvalidInput, StorageError
from campugrid.protocol.spec import DatasetRef, JobSpec

log = logging.getLogger("campugrid.coordinator")
# (path under /data/<name>, key, size, sha256, bucket) of one file of a dataset
DatasetFileRef = tuple[str, str, int, str, str | None]


class InputService:
    def __init__(self, settings: Settings, store: Store, objects: ObjectStore) -> None:
        self.settings, self.store, self.objects = settings, store, objects

    def check(self, spec: JobSpec, owner: str) -> list[str]:
        """Refuse, at submit, any input the job could not read; returns the upload tickets
        it uses."""
        tickets = []
        for ds in spec.datasets:
            if ds.ticket:
                self._check_upload(ds, owner, spec.client_job_id)
                tickets.append(ds.ticket)
                continue
            if ds.share:  # on a provider's machine: its agent checks each file by sha256
                continue
            if ds.bucket in (self.settings.s3_bucket, "campugrid-ready-probe"):
                raise InvalidInput(f"dataset {ds.name}: bucket {ds.bucket!r} holds the platform's "
                                   "own data (other jobs' contexts, outputs and checkpoints)")
            if not ds.pinned():
                raise InvalidInput(
                    f"dataset {ds.name}: name its content, not only where it is: give the "
                    "object's sha256 (for a prefix: \"sha256\": {path: sha256} of the files the "
                    "job reads), or upload the file with a ticket (`submit --upload`)")
            self.files(ds)  # refuses unknown buckets and missing files now
        return tickets

    def _check_upload(self, ds: DatasetRef, owner: str, client_job_id: str | None) -> None:
        """The ticket is the owner's, unused (or used by this very submission, retried),
        unexpired, and its object is the file it names: size and sha256 read back."""
        up = self.store.uploads.get(ds.ticket, owner)
        if up.job_id is not None:
            used_by = self.store.get(up.job_id)
            if client_job_id is None or used_by.client_job_id != client_job_id:
                raise InvalidInput(f"dataset {ds.name}: upload ticket {ds.ticket[:40]!r} was "
                                   f"used by job {up.job_id} already; a ticket is for one job")
            return
        if up.expires_at < utcnow():
            raise InvalidInput(f"dataset {ds.name}: upload ticket {ds.ticket[:40]!r} expired at "
                               f"{up.expires_at:%H:%M:%S} UTC; upload the file again")
        if not self.objects.exists(up.key):
            raise InvalidInput(f"dataset {ds.name}: nothing was uploaded with ticket "
                               f"{ds.ticket[:40]!r} (PUT the file to its url first)")
        size, sha256 = self.objects.digest(up.key)
        if (size, sha256) != (up.size, up.sha256):
            raise InvalidInput(
                f"dataset {ds.name}: the uploaded file is not the one ticket {ds.ticket[:40]!r} "
                f"is for ({size} bytes, sha256 {sha256[:12]}…; the ticket names {up.size} bytes, "
                f"sha256 {up.sha256[:12]}…)")

    def create_upload(self, owner: str, filename: str, size: int,
                      sha256: str) -> tuple[UploadView, str]:
        """An upload ticket and the presigned URL to PUT its file to."""
        up = self.store.uploads.create(owner, filename, size, sha256,
                                       max_bytes=self.settings.max_upload_bytes,
                                       ttl_s=self.settings.upload_ttl_s)
        url = self.objects.presign_put(up.key, dt.timedelta(seconds=self.settings.upload_ttl_s))
        return up, url

    def sweep_uploads(self) -> int:
        """Delete the uploads whose job has ended, and those whose ticket expired unused."""
        gone = 0
        for up in self.store.uploads.ended():
            try:
                self.objects.delete(up.key)
            except StorageError:
                log.warning("upload %s could not be deleted yet", up.ticket)
                continue
            self.store.uploads.forget(up.ticket)
            gone += 1
        return gone

    def files(self, ds: DatasetRef) -> list[DatasetFileRef]:
        """(path under /data/<name>, key, size, sha256, bucket) for each file of a dataset
        reference; the sha256 is what the agent checks the file against before the job."""
        if ds.ticket:
            up = self.store.uploads.get(ds.ticket)
            return [(up.filename, up.key, up.size, up.sha256, None)]
        if ds.share:  # no URL: the machine that shares it has the files
            assert isinstance(ds.sha256, tuple)
            return [(path, "", 0, sha, None) for path, sha in ds.sha256]
        limit = self.settings.max_dataset_files
        found = self.objects.list_objects(ds.bucket, ds.key, limit)
        if len(found) > limit:
            raise InvalidInput(f"dataset {ds.name}: more than {limit} objects under {ds.uri}")
        if not ds.is_prefix:  # one object: /data/<name>/<its file name>
            exact = [o for o in found if o.key == ds.key]
            if not exact:
                raise InvalidInput(f"dataset {ds.name}: nothing found at {ds.uri}")
            sha = ds.sha256 if isinstance(ds.sha256, str) else ""
            return [(ds.key.rsplit("/", 1)[-1], ds.key, exact[0].size, sha, ds.bucket)]
        sizes = {o.key[len(ds.key):]: o.size for o in found}
        if isinstance(ds.sha256, tuple):  # the files the job named, each by its digest
            missing = [path for path, _ in ds.sha256 if path not in sizes]
            if missing:
                raise InvalidInput(f"dataset {ds.name}: {', '.join(missing[:5])} not found "
                                   f"under {ds.uri}")
            return [(path, ds.key + path, sizes[path], sha, ds.bucket) for path, sha in ds.sha256]
        files: list[DatasetFileRef] = [
            (path, ds.key + path, size, "", ds.bucket) for path, size in sizes.items()]
        if not files:  # a spec stored before contents were pinned: what is there, unchecked
            raise InvalidInput(f"dataset {ds.name}: nothing found at {ds.uri}")
        for path, *_ in files:
            if ".." in path.split("/") or path.startswith("/"):
                raise InvalidInput(f"dataset {ds.name}: object name {path!r} is not a safe path")
        return files
