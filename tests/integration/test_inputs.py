"""The agent checks every input by size and sha256 before a job starts, against real S3
(SeaweedFS, presigned URLs as leases carry them): a file changed after submit fails the job
with which file and how."""

from __future__ import annotations

import datetime as dt
import hashlib

import httpx
import pytest

from campugrid.agent.messages import Dataset, DatasetFile, Lease
from campugrid.agent.transfers import fetch_datasets
from campugrid.protocol.errors import InvalidInput

pytestmark = pytest.mark.integration
HOUR = dt.timedelta(hours=1)


def lease_for(s3, path: str, key: str, data: bytes) -> Lease:
    f = DatasetFile(path, s3.presign_get(key, HOUR), len(data), hashlib.sha256(data).hexdigest())
    return Lease("job", 1, 1, "{}", datasets=(Dataset("d", (f,)),))


def test_an_unchanged_input_is_fetched(s3, tmp_path):
    s3.put_bytes("in/a.csv", b"1,2\n")
    with httpx.Client() as http:
        fetch_datasets(http, lease_for(s3, "sub/a.csv", "in/a.csv", b"1,2\n"), tmp_path)
    assert (tmp_path / "d" / "sub" / "a.csv").read_bytes() == b"1,2\n"


@pytest.mark.parametrize(("now", "says"), [
    (b"1,3\n", "sha256 "),  # same size, other bytes
    (b"1,2\n3,4\n", "bytes, not 4"),  # grown
    (b"1\n", "2 bytes, not 4"),  # shrunk
])
def test_an_input_changed_after_submit_fails_the_job_with_that_reason(s3, tmp_path, now, says):
    s3.put_bytes("in/a.csv", b"1,2\n")
    lease = lease_for(s3, "a.csv", "in/a.csv", b"1,2\n")
    s3.put_bytes("in/a.csv", now)  # changed between submit and the agent's fetch
    with httpx.Client() as http, pytest.raises(InvalidInput) as err:
        fetch_datasets(http, lease, tmp_path)
    assert "d: a.csv is not the file the job names" in str(err.value)
    assert says in str(err.value) and "changed after the job was submitted" in str(err.value)
