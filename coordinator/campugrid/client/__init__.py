"""The Python SDK of the REST API: the same code the CLI runs.

    from campugrid.client import Api
    with Api.from_identity() as api:          # ~/.config/campugrid/identity.json
        job = api.submit(tar_folder(folder), JobSpec(command=["python3", "train.py"]))
        print(api.wait(job["id"])["result"])

A big folder goes through a file instead (`pack_folder(folder, tmp)`, then `api.submit(tmp,
spec)`), and `api.download_output(job_id, path)` streams a job's output to disk.
"""

from campugrid.client.api import FINAL, Api, ApiError, Download, Progress, pack_folder, tar_folder
from campugrid.client.identity import Identity, Signer, StreamedBody

__all__ = ["FINAL", "Api", "ApiError", "Download", "Identity", "Progress", "Signer",
           "StreamedBody", "pack_folder", "tar_folder"]
