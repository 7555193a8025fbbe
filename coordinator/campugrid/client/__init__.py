"""The Python SDK of the REST API: the same code the CLI runs.

    from campugrid.client import Api
    with Api.from_identity() as api:          # ~/.config/campugrid/identity.json
        job = api.submit(Path("mytrain"), {"command": ["python3", "train.py"]})
        print(api.wait(job["id"])["result"])  # JobFailed unless it succeeded

A folder is packed into a temporary file (.dockerignore honoured), never into memory, and
`api.download_output(job_id, path)` streams a job's output to disk.
"""

from campugrid.client.api import (
    FINAL,
    Api,
    ApiError,
    Download,
    JobFailed,
    Progress,
    pack_folder,
    tar_folder,
)
from campugrid.client.identity import Signer, StreamedBody
from campugrid.protocol.identities import Identity

__all__ = ["FINAL", "Api", "ApiError", "Download", "Identity", "JobFailed", "Progress", "Signer",
           "StreamedBody", "pack_folder", "tar_folder"]
