"""The timing lines a build log ends with (agent/task.py and builders/buildah.py write them),
as the acceptance test and bench/builds.py read them."""

from __future__ import annotations

import re

# total, then context and inputs, base images, image (which includes BUILT's two)
READY = re.compile(r"ready to run ([\d.]+) s after the lease: context and inputs ([\d.]+) s, "
                   r"base images ([\d.]+) s, image ([\d.]+) s")
# the build, then the commit of its image into the machine's own store
BUILT = re.compile(r"built in ([\d.]+) s, committed into this machine's store in ([\d.]+) s")
