"""Stand-ins for the hosts research Dockerfiles fetch from besides PyPI and Debian, which these
machines cannot reach: GitHub (a git repository over HTTPS, a release file, a raw install
script), the PyTorch index (a find-links page and wheels by URL) and conda.anaconda.org (two
conda channels, indexed by py-rattler as a channel's host indexes them). One HTTPS server on
loopback, with a certificate of a test authority for those names; the egress proxy is told
to send the names there (CAMPUGRID_EGRESS_PINS, the operator's setting) and builds trust the
authority (CAMPUGRID_BUILD_CA_FILE), so a Dockerfile names them as it would the real hosts."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import http.server
import io
import json
import os
import socket
import ssl
import subprocess
import tarfile
import tempfile
import threading
import time
import zipfile
from functools import partial
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from rattler.index import index_fs

NAMES = ("github.com", "raw.githubusercontent.com", "download.pytorch.org",
         "conda.anaconda.org")
HOST_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")


def this_network() -> dict[str, str]:
    """The operator's settings this machine's network needs for builds to reach the real
    registries: outbound TLS passes through an intercepting authority only the host's bundle
    holds, and its DNS answers every registry with one gateway address in a reserved range
    (../shared/PLATFORM.md). A real provider needs neither: nothing is set where PyPI
    resolves to a public address."""
    from campugrid.egress.policy import not_public
    try:
        found = {str(i[4][0]) for i in socket.getaddrinfo("pypi.org", 443,
                                                             type=socket.SOCK_STREAM)}
    except OSError:
        found = set()
    return {"CAMPUGRID_BUILD_CA_FILE": str(HOST_BUNDLE),
            "CAMPUGRID_EGRESS_GATEWAYS": " ".join(sorted(a for a in found if not_public(a)))}


def _certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A test authority, a server certificate for NAMES signed by it, and a bundle of the
    host's authorities plus the test one: (bundle, server certificate, server key)."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "campugrid test authority")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=2))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, NAMES[0])]))
            .issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in NAMES]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    bundle, cert_file, key_file = folder / "bundle.pem", folder / "server.pem", folder / "server.key"
    bundle.write_bytes(HOST_BUNDLE.read_bytes() + b"\n" + ca.public_bytes(pem))
    cert_file.write_bytes(cert.public_bytes(pem))
    key_file.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return bundle, cert_file, key_file


def wheel(name: str, version: str, code: str) -> bytes:
    """A pure-Python wheel of one module, as a build backend would write it."""
    dist = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": code.encode(),
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: campugrid-tests\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}\n"
                     for path, data in files.items()) + f"{dist}/RECORD,,\n"
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for path, data in {**files, f"{dist}/RECORD": record.encode()}.items():
            z.writestr(path, data)
    return out.getvalue()


def conda_package(name: str, version: str, files: dict[str, bytes],
                  depends: tuple[str, ...] = ()) -> bytes:
    """A noarch conda package (.tar.bz2) of `files`, as conda-build would write it: the files
    under their prefix paths, info/index.json and info/paths.json."""
    index = {"name": name, "version": version, "build": "0", "build_number": 0,
             "depends": list(depends), "noarch": "generic", "subdir": "noarch",
             "license": "MIT", "timestamp": int(time.time() * 1000)}
    paths = {"paths_version": 1, "paths": [{"_path": path, "path_type": "hardlink",
                                            "size_in_bytes": len(data)}
                                           for path, data in files.items()]}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:bz2") as tar:
        for path, data in {**files, "info/index.json": json.dumps(index).encode(),
                           "info/paths.json": json.dumps(paths).encode()}.items():
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o755 if path.startswith("bin/") else 0o644
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


# bioconda's tool: it reads its data from the prefix it was installed into.
SEQSTAT = b"""#!/bin/sh
k=$(cat "$(dirname "$0")/../share/kmerdb/k.txt")
printf '{"seqstat": "2.1", "k": %s}\\n' "$k"
"""


def _channels(root: Path) -> None:
    """conda-forge and bioconda as a bioinformatics environment file names them: a tool on
    bioconda that needs a data package from conda-forge."""
    packages = {
        "conda-forge": ("kmerdb", "1.0", {"share/kmerdb/k.txt": b"31\n"}, ()),
        "bioconda": ("seqstat", "2.1", {"bin/seqstat": SEQSTAT}, ("kmerdb >=1.0",))}
    for channel, (name, version, files, depends) in packages.items():
        for subdir in ("noarch", "linux-64"):
            (root / channel / subdir).mkdir(parents=True)
        (root / channel / "noarch" / f"{name}-{version}-0.tar.bz2").write_bytes(
            conda_package(name, version, files, depends))
        asyncio.run(index_fs(root / channel, write_zst=False, write_shards=False))


def _content(root: Path) -> None:
    """What the stand-in hosts serve, by path (the same for each name)."""
    _channels(root)
    whl = root / "whl"
    (whl / "cpu").mkdir(parents=True)
    for name in ("tinyops", "tinyvec"):
        (whl / "cpu" / f"{name}-1.0-py3-none-any.whl").write_bytes(
            wheel(name, "1.0", f"NAME = {name!r}\ndef double(x):\n    return 2 * x\n"))
    (whl / "torch_stable.html").write_text(
        "<html><body>\n" + "".join(f'<a href="cpu/{n}-1.0-py3-none-any.whl">cpu/{n}-1.0-py3-none-any.whl</a><br>\n'
                                   for n in ("tinyops", "tinyvec")) + "</body></html>\n")
    # A git repository of a small project, served over "dumb" HTTP as plain files.
    work = Path(tempfile.mkdtemp(prefix="tally-"))
    (work / "tally").mkdir()
    (work / "tally" / "__init__.py").write_text("def count(xs):\n    return len(list(xs))\n")
    (work / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=61"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "tally"\nversion = "0.1.0"\n[tool.setuptools]\npackages = ["tally"]\n')
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.test", "-C"]
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True)
    subprocess.run([*git, str(work), "add", "."], check=True)
    subprocess.run([*git, str(work), "commit", "-q", "-m", "tally 0.1.0"], check=True)
    subprocess.run([*git, str(work), "tag", "v0.1.0"], check=True)
    bare = root / "campugrid-corpus" / "tally.git"
    bare.parent.mkdir(parents=True)
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True)
    subprocess.run(["git", "-C", str(bare), "update-server-info"], check=True)
    # A release file and a raw install script, as GitHub serves them.
    release = root / "campugrid-corpus" / "tool" / "releases" / "download" / "v1"
    release.mkdir(parents=True)
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:gz") as tar:
        payload = b"weights 42\n"
        info = tarfile.TarInfo("weights.txt")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    (release / "data.tar.gz").write_bytes(data.getvalue())
    raw = root / "campugrid-corpus" / "tool" / "main"
    raw.mkdir(parents=True)
    (raw / "install.sh").write_text(
        "#!/bin/sh\nset -e\n"
        "printf '#!/bin/sh\\necho tool 1.0\\n' > /usr/local/bin/corpus-tool\n"
        "chmod 755 /usr/local/bin/corpus-tool\necho installed corpus-tool\n")


class Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


class StandIns:
    """The HTTPS server for NAMES, the pins that send them to it, and the bundle to trust."""

    def __init__(self, root: Path) -> None:
        root.mkdir(parents=True, exist_ok=True)
        os.chmod(root, 0o755)
        self.bundle, cert, key = _certificates(root)
        os.chmod(self.bundle, 0o644)
        served = root / "served"
        _content(served)
        self.server = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), partial(Handler, directory=str(served)))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def pins(self) -> str:
        return " ".join(f"{name}:443=127.0.0.1:{self.port}" for name in NAMES)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
