"""A build's network, for real: rootless Buildah as the provider user, RUN steps under gVisor,
online as the agent builds (its egress proxy in local mode: the same rules the platform's
proxy applies). Whatever a RUN step tries, it reaches package registries through the proxy or
nothing at all: each attempt below is refused, the build log says so, and a listener on the
provider's loopback sees nothing."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

import pytest

from tests.security.test_build_side import (
    BASE,
    Recorder,
    build,
    listener,  # noqa: F401 - a fixture
    make_context,
)
from tests.support.oci import busybox_image
from tests.support.runtimes import gvisor_kernel

pytestmark = pytest.mark.integration
TAG = "localhost/campugrid-test/net:1"


def host_address() -> str:
    """This machine's own address on its network (not loopback), as a job would guess it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: only the route is chosen
            return str(s.getsockname()[0])
        except OSError:
            return "10.0.2.15"


# Python inside the build: each attempt prints one line, "<name>: <what happened>".
ATTEMPTS = r'''
import os, socket, sys, urllib.request
port = int(sys.argv[1]); host = sys.argv[2]
def via_proxy(name, url):
    try:
        urllib.request.urlopen(url, timeout=10).read()
        print(name + ": REACHED")
    except Exception as e:
        print(name + ": refused " + str(getattr(e, "code", "")) + " " + type(e).__name__)
def raw(name, address, kind=socket.SOCK_STREAM):
    try:
        s = socket.socket(socket.AF_INET, kind); s.settimeout(5)
        if kind == socket.SOCK_DGRAM:
            s.sendto(b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07example\x03org\x00\x00\x01\x00\x01", address)
            s.recv(512)
        else:
            s.connect(address); s.sendall(b"GET /raw HTTP/1.0\r\n\r\n"); s.recv(100)
        print(name + ": REACHED")
    except Exception as e:
        print(name + ": failed " + type(e).__name__ + " " + str(e)[:60])
via_proxy("loopback", f"http://127.0.0.1:{port}/loopback")
via_proxy("host address", f"http://{host}:{port}/host")
via_proxy("private range", "http://10.1.2.3/private")
via_proxy("metadata", "http://169.254.169.254/latest/meta-data/")
via_proxy("coordinator REST", "http://127.0.0.1:8750/v1/jobs")
via_proxy("coordinator gRPC", "http://127.0.0.1:8751/")
via_proxy("allowed name, private address", f"http://localhost:{port}/name")
via_proxy("allowed name on loopback port 80", "http://localhost/name80")
via_proxy("not allowed", "http://example.org/")
via_proxy("https not allowed", "https://example.org/")
via_proxy("allowed registry", "http://registry.test/allowed")
raw("raw TCP to the listener", ("127.0.0.1", port))
raw("raw TCP to the host", (host, port))
raw("raw TCP outside", ("93.184.215.14", 80))
raw("DNS outside", ("8.8.8.8", 53), socket.SOCK_DGRAM)
'''

EXPECTED_REFUSALS = {  # what the proxy says, in the build log, for what went through it
    "loopback": "an address, not a name",
    "host address": "an address, not a name",
    "private range": "an address, not a name",
    "metadata": "an address, not a name",
    "coordinator REST": "an address, not a name",
    "coordinator gRPC": "an address, not a name",
    "allowed name, private address": "port",  # not 80/443: refused before resolving
    "allowed name on loopback port 80": "resolves to 127.0.0.1",
    "not allowed": "example.org is not on this platform's list",
    "https not allowed": "example.org is not on this platform's list",
}


def test_a_build_reaches_nothing_but_what_the_proxy_allows(provider, shared_tmp, listener):  # noqa: F811
    host = host_address()
    ctx = make_context(shared_tmp, provider,
                       f"FROM {BASE}\nCOPY attempts.py /\n"
                       f"RUN python3 /attempts.py {listener} {host}\n",
                       **{"attempts.py": ATTEMPTS})
    # "localhost" is on the list here: a name an operator allowed that resolves to loopback;
    # so is a registry the operator pinned to an address (the listener stands in for it)
    res = build(provider, ctx, TAG, hosts=("localhost", "pypi.org", "registry.test"),
                pins=f"registry.test:80=127.0.0.1:{listener}")
    assert res["ok"], res
    lines = res["lines"]
    said = {n: w for n, _, w in (line.partition(": ") for line in lines) if n in
            {*EXPECTED_REFUSALS, "raw TCP to the listener", "raw TCP to the host",
             "raw TCP outside", "DNS outside", "allowed registry"}}
    assert said.pop("allowed registry", "") == "REACHED", said  # the way out is there
    assert not [n for n, w in said.items() if "REACHED" in w], said
    for name, why in EXPECTED_REFUSALS.items():
        assert said.get(name, "").startswith("refused"), (name, said)  # 403, or no tunnel
        assert any(line.startswith("[egress] refused") and why in line for line in lines), \
            (name, why, [line for line in lines if line.startswith("[egress]")])
    for name in ("raw TCP to the listener", "raw TCP to the host", "raw TCP outside",
                 "DNS outside"):  # no proxy in the way: the network has nowhere to go
        assert said.get(name, "").startswith("failed"), (name, said)
    # nothing reached the provider's loopback but the one request the proxy let through
    assert Recorder.seen == ["/allowed"], Recorder.seen


def test_an_sdists_build_hook_runs_only_inside_the_build(provider, shared_tmp):
    """The job's own Python packaging code (a build backend in its context, as an sdist or a
    pyproject.toml brings one) runs when the build installs it: inside gVisor, never on the
    host. The agent reads none of it: nothing of the job's is handed to pip outside."""
    marker = f"/tmp/campugrid-hook-{uuid.uuid4().hex}"
    backend = (f"from pathlib import Path\n"
               f"def get_requires_for_build_wheel(config_settings=None):\n"
               f"    Path({marker!r}).write_text(open('/proc/version').read())\n"
               f"    return []\n"
               f"def build_wheel(*a, **k):\n"
               f"    raise SystemExit('the marker is written; no wheel is needed')\n")
    ctx = make_context(shared_tmp, provider,
                       f"FROM {BASE}\nCOPY . /src\n"
                       "RUN cd /src && python3 -c 'import hook; hook.get_requires_for_build_wheel()'"
                       f" && cat {marker}\n",
                       **{"hook.py": backend, "pyproject.toml":
                          '[build-system]\nrequires = []\nbuild-backend = "hook"\n'
                          'backend-path = ["."]\n[project]\nname = "p"\nversion = "1"\n'})
    res = build(provider, ctx, TAG)
    assert res["ok"], res
    # The hook ran in the build, on gVisor's kernel, and left nothing on the host.
    assert any(gvisor_kernel(line.split()[2]) for line in res["lines"]
               if line.startswith("Linux version ")), res["lines"]
    assert not os.path.exists(marker)
    assert not Path(marker).exists()


def test_an_offline_build_has_no_proxy_at_all(provider, shared_tmp, listener):  # noqa: F811
    ctx = make_context(shared_tmp, provider,
                       f"FROM {BASE}\nRUN env | grep -i _proxy || echo no-proxy-set\n"
                       "RUN python3 -c \"import socket; socket.create_connection(('127.0.0.1', "
                       f"3128), timeout=5)\" || echo no-relay\n")
    res = build(provider, ctx, TAG, online=False)
    assert res["ok"], res
    assert "no-proxy-set" in res["lines"] and "no-relay" in res["lines"], res["lines"]
    assert not any(line.startswith("[egress]") for line in res["lines"])


# The same attempts in BusyBox's shell, for Kaniko (which unpacks and snapshots its whole
# base for each build: the Python one took a minute): "<name>: REACHED" or "<name>: failed".
# (Not `wget -T`: Debian's static BusyBox crashes on it.)
SHELL_ATTEMPTS = """\
try() { name=$1; shift; if "$@" >/dev/null 2>&1; then echo "$name: REACHED"; else echo "$name: failed"; fi; }
try 'allowed registry' wget -q -O- http://registry.test/allowed
try 'loopback' wget -q -O- http://127.0.0.1:PORT/loopback
try 'host address' wget -q -O- http://HOST:PORT/host
try 'not allowed' wget -q -O- http://example.org/
try 'direct to the listener' wget -Y off -q -O- http://127.0.0.1:PORT/direct
try 'direct to the host' wget -Y off -q -O- http://HOST:PORT/direct
try 'raw TCP outside' nc 93.184.215.14 80
try 'DNS outside' nslookup example.org 8.8.8.8
env | grep -i _proxy || echo no-proxy-set
cat /dev/campugrid-build-ca.pem 2>/dev/null && echo || echo no-extra-certificates
"""


@pytest.mark.parametrize("online", [True, False], ids=["online", "offline"])
def test_a_kaniko_build_reaches_nothing_but_what_the_proxy_allows(provider, shared_tmp,
                                                                  listener, online):  # noqa: F811
    """Kaniko's executor in the build's own network namespace: its RUN steps reach the egress
    proxy through the relay, which lets an allowed (pinned) registry through and refuses the
    rest, and nothing else; offline, not even the proxy."""
    base = busybox_image(provider.command([]))
    host = host_address()
    script = SHELL_ATTEMPTS.replace("PORT", str(listener)).replace("HOST", host)
    ctx = make_context(shared_tmp, provider, f"FROM {base}\nCOPY attempts.sh /\n"
                                             "RUN sh /attempts.sh\n", **{"attempts.sh": script})
    ca = "operator-ca-" + uuid.uuid4().hex  # what RUN steps must find at CA_MOUNT, online
    res = build(provider, ctx, TAG, hosts=("registry.test",), builder="kaniko", base=base,
                pins=f"registry.test:80=127.0.0.1:{listener}", online=online, ca=ca)
    assert res["ok"], res
    said = dict(line.partition(": ")[::2] for line in res["lines"] if ": " in line)
    names = ("allowed registry", "loopback", "host address", "not allowed",
             "direct to the listener", "direct to the host", "raw TCP outside", "DNS outside")
    reached = [n for n in names if said.get(n) == "REACHED"]
    assert all(said.get(n) in ("REACHED", "failed") for n in names), res["lines"]
    refusals = [line for line in res["lines"] if line.startswith("[egress] refused")]
    if online:
        assert reached == ["allowed registry"], "\n".join(res["lines"])
        assert Recorder.seen == ["/allowed"], Recorder.seen
        assert any("an address, not a name" in line for line in refusals), refusals
        assert any("example.org is not on this platform's list" in line for line in refusals)
        assert "http_proxy=http://127.0.0.1:3128" in res["lines"], res["lines"]
        assert ca in res["lines"], "\n".join(res["lines"])
    else:
        assert reached == [] and Recorder.seen == [] and refusals == [], res["lines"]
        assert "no-proxy-set" in res["lines"], res["lines"]
        assert "no-extra-certificates" in res["lines"], res["lines"]
