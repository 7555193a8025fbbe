"""Kaniko's command construction (its real build runs in tests/integration when an executor
image is present)."""

from pathlib import Path

from campugrid.builders.kaniko import EXECUTOR_CERTS, container_config, service_argv
from campugrid.sandbox.podman_runsc import RUNSC_FLAGS


def test_kaniko_command_runs_offline_with_a_read_only_context():
    cfg = container_config("kaniko:test", Path("/w/ctx"), Path("/w/b"), "localhost/job:1",
                           Path("/slot/kaniko-image-x"))
    assert cfg["network_mode"] == "none" and cfg["runtime"] == "runsc"
    assert cfg["volumes"]["/w/ctx"] == {"bind": "/workspace", "mode": "ro"}
    # The pinned Dockerfile and the bases it starts from are the build's, read-only.
    assert cfg["volumes"]["/w/b/build"] == {"bind": "/build", "mode": "ro"}
    assert cfg["volumes"]["/w/b/bases"] == {"bind": "/bases", "mode": "ro"}
    # The one host folder its RUN steps could write to: on the output slot's bounded disk
    assert cfg["volumes"]["/slot/kaniko-image-x"] == {"bind": "/image", "mode": "rw"}
    writable = [host for host, v in cfg["volumes"].items() if v["mode"] == "rw"]
    assert writable == ["/slot/kaniko-image-x"]
    assert "--no-push" in cfg["command"] and "--destination=localhost/job:1" in cfg["command"]
    assert "--tar-path=/image/image.tar" in cfg["command"]
    assert "--dockerfile=/build/Dockerfile" in cfg["command"] and "--cache-dir=/bases" in cfg["command"]
    assert "--no-push-cache" in cfg["command"] and "--cache-run-layers=false" in cfg["command"]
    svc = service_argv(Path("/run/user/1/podman/k.sock"))
    assert svc[:3] == ["podman", "--runtime", "runsc"]
    assert svc[3:3 + len(RUNSC_FLAGS)] == list(RUNSC_FLAGS)
    assert svc[-1] == "unix:///run/user/1/podman/k.sock"


def test_the_executors_root_is_a_bounded_overlay_when_the_build_names_one():
    svc = service_argv(Path("/b/api.sock"), upper=Path("/b/upper"), upper_mb=700)
    flags = svc[3:3 + len(RUNSC_FLAGS)]
    assert "overlay2=root:dir=/b/upper,size=700m" in flags and "overlay2=none" not in flags
    assert "network=none" in flags  # the rest as the jobs' sandboxes have them


def test_online_the_executor_shares_the_services_namespace_and_gets_the_relay_as_its_proxy():
    """The namespace (a loopback and the relay) is made around the service (KanikoBuilder's
    _client); the executor joins it (runsc on its sockets) and names the relay as its proxy,
    for its own fetches and, as Docker's predefined build arguments, for its RUN steps."""
    cfg = container_config("kaniko:test", Path("/w/ctx"), Path("/w/b"), "localhost/job:1",
                           Path("/slot/i"), online=True,
                           volumes=[(Path("/etc/ca.pem"), "/dev/campugrid-build-ca.pem")])
    assert cfg["network_mode"] == "host"
    assert cfg["environment"]["https_proxy"] == "http://127.0.0.1:3128"
    assert "--build-arg=http_proxy=http://127.0.0.1:3128" in cfg["command"]
    assert cfg["volumes"]["/etc/ca.pem"] == {"bind": "/dev/campugrid-build-ca.pem", "mode": "ro"}
    # and where Kaniko's own fetches (ADD's URLs) trust it, beside the executor image's own
    assert cfg["mounts"] == [{"Type": "bind", "Source": "/etc/ca.pem", "ReadOnly": True,
                              "Target": f"{EXECUTOR_CERTS}/extra-0.pem"}]
    writable = [host for host, v in cfg["volumes"].items() if v["mode"] == "rw"]
    assert writable == ["/slot/i"]
    flags = service_argv(Path("/b/api.sock"), online=True)[3:3 + len(RUNSC_FLAGS)]
    assert "network=host" in flags and "network=none" not in flags
    offline = container_config("kaniko:test", Path("/w/ctx"), Path("/w/b"), "t:1", Path("/s"))
    assert offline["network_mode"] == "none" and offline["environment"] == {}
    assert offline["mounts"] == []
    assert not any(a.startswith("--build-arg") for a in offline["command"])
