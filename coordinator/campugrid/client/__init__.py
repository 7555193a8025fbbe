"""The Python SDK of the REST API: the same code the CLI runs.

    from campugrid.client import Api
    with Api.from_identity() as api:          # ~/.config/campugrid/identity.json
        job = api.submit(tar_folder(folder), JobSpec(command=["python3", "train.py"]))
        print(api.wait(job["id"])["result"])
"""

from campugrid.client.api import FINAL, Api, ApiError, tar_folder
from campugrid.client.identity import Identity, Signer

__all__ = ["FINAL", "Api", "ApiError", "Identity", "Signer", "tar_folder"]
