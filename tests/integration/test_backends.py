"""The agent's backends are chosen by name from one registry, and a wrong name is refused
with the names that would work."""

import subprocess
import sys

import pytest

from campugrid.agent import backends
from campugrid.builders.buildah import BuildahBuilder
from campugrid.builders.kaniko import EXECUTOR_IMAGE, KanikoBuilder
from campugrid.protocol.errors import CampugridError
from campugrid.sandbox.podman_runsc import PodmanRunsc


def test_each_backend_is_registered_under_its_own_name():
    assert set(backends.RUNTIMES) == {PodmanRunsc.name} == {"podman-runsc"}
    assert set(backends.BUILDERS) == {BuildahBuilder.name, KanikoBuilder.name}


@pytest.mark.parametrize(("runtime", "builder", "words"), [
    ("gvisor", "buildah", "--runtime 'gvisor': no such sandbox runtime (known: podman-runsc)"),
    ("podman-runsc", "docker", "--builder 'docker': no such image builder (known: buildah, kaniko)"),
])
def test_an_unknown_or_incomplete_choice_is_refused_before_anything_is_made(runtime, builder, words):
    with pytest.raises(CampugridError) as e:
        backends.choose(runtime, builder)
    assert words in str(e.value)


def test_the_command_line_names_the_known_backends():
    out = subprocess.run([sys.executable, "-m", "campugrid.cli", "agent", "run", "--runtime",
                          "gvisor", "--coordinator", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "no such sandbox runtime (known: podman-runsc)" in out.stderr


def test_kaniko_builds_with_the_executor_image_infra_makes_unless_told_another():
    assert backends.choose("podman-runsc", "kaniko")[1].executor_image == EXECUTOR_IMAGE
    options = backends.BackendOptions(kaniko_image="localhost/mine:1")
    assert backends.choose("podman-runsc", "kaniko", options)[1].executor_image == "localhost/mine:1"
