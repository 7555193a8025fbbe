"""The limits an agent reports are exactly the names a job may require, and the build disk is
reported by what the builder says it can do."""

from types import SimpleNamespace

from campugrid.agent.worker import enforceable
from campugrid.builders.buildah import BuildahBuilder
from campugrid.builders.fake import FakeBuilder
from campugrid.builders.kaniko import KanikoBuilder
from campugrid.protocol.spec import ENFORCED, LIMITS
from campugrid.sandbox import limits as host_limits


def test_the_agent_reports_every_limit_a_job_can_require_and_no_other():
    sandbox = SimpleNamespace(limits=host_limits.detect(), seccomp=None)
    for builder in (BuildahBuilder(), KanikoBuilder(executor_image=""), FakeBuilder()):
        reported = enforceable(sandbox, builder, "enforced")  # type: ignore[arg-type]
        assert tuple(reported) == LIMITS
        assert reported["sandbox_seccomp"].startswith("not enforced")
        # Buildah's store on a bounded disk, Kaniko's root in gVisor's bounded overlay
        assert (reported["build_disk"] == ENFORCED) == (builder.name != "fake"), reported
    assert reported["build_disk"].startswith("not enforced: the fake builder")
    # Kaniko's /image is bounded by the output slot it is put on: without one, not enforced
    slotless = enforceable(sandbox, KanikoBuilder(executor_image=""),  # type: ignore[arg-type]
                           "not enforced exactly: no slot")
    assert slotless["build_disk"].startswith("not enforced: the kaniko builder is bounded on an "
                                             "output slot only"), slotless
    tmpfs = enforceable(sandbox, BuildahBuilder(), "not enforced exactly")  # type: ignore[arg-type]
    assert tmpfs["build_disk"] == ENFORCED  # Buildah's store goes on a tmpfs of disk_mb
