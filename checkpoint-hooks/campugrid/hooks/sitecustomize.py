"""What every Python process of a job runs first: the agent mounts this file as
/opt/campugrid/hooks/sitecustomize.py, on the job's PYTHONPATH, and Python imports a module of
that name at startup. It starts the checkpoint hooks (autosave.py), then runs the image's own
sitecustomize, if it has one, which this file hides."""

from __future__ import annotations

import importlib.util
import os
import sys


def _image_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        path = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.abspath(entry or ".") == here or not os.path.isfile(path):
            continue
        spec = importlib.util.spec_from_file_location("_image_sitecustomize", path)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        return


try:
    from campugrid.hooks import autosave, frameworks

    if autosave.start():
        frameworks.install()
except Exception as e:  # the job runs either way
    print(f"[campugrid] the checkpoint hooks did not start: {e}", file=sys.stderr)
try:
    _image_sitecustomize()
except Exception as e:
    print(f"[campugrid] the image's sitecustomize failed: {e}", file=sys.stderr)
