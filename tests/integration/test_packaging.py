"""A provider installs the agent without the coordinator's web stack: the agent's code and its
command line must import with fastapi, sqlalchemy, alembic, uvicorn and minio absent."""

import subprocess
import sys

BLOCK = ("import sys\n"
         "for m in ('fastapi', 'sqlalchemy', 'alembic', 'uvicorn', 'minio', 'starlette'):\n"
         "    sys.modules[m] = None  # an import of it now fails\n")


def test_the_agent_imports_without_the_coordinator_stack():
    code = BLOCK + ("import campugrid.agent.worker, campugrid.agent.task, campugrid.sandbox.podman_runsc, "
                    "campugrid.builders.buildah, campugrid.builders.kaniko, campugrid.hooks\n"
                    "from typer.testing import CliRunner\n"
                    "from campugrid.cli.main import app\n"
                    "r = CliRunner().invoke(app, ['agent', 'run', '--help'])\n"
                    "assert r.exit_code == 0, r.output\n"
                    "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_blocker_really_blocks():
    out = subprocess.run([sys.executable, "-c", BLOCK + "import campugrid.coordinator.api"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "fastapi" in out.stderr


def test_this_machine_runs_the_gvisor_the_root_step_builds():
    """infra/setup.sh ran runsc-from-go.sh (Go is part of this machine kind): the runsc Podman
    runs is the pinned one that prereqs names, so providers' root step builds what CI tests."""
    from campugrid.agent.prereqs import pinned_runsc

    out = subprocess.run(["runsc", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[0] == f"runsc version {pinned_runsc()}", out.stdout
