"""Small OCI images written straight to an OCI layout folder (skopeo's `oci:DIR:TAG`), for
registry tests that need an image without any container storage."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from pathlib import Path


def _blob(layout: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    (layout / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
    (layout / "blobs" / "sha256" / digest).write_bytes(data)
    return f"sha256:{digest}"


def oci_image(layout: Path, files: dict[str, bytes], tag: str = "latest", *,
              gzipped: bool = False) -> str:
    """An image of one layer holding `files`, at `layout` (reproducible: same files, same
    digests), its layer gzipped or not; returns skopeo's reference to it."""
    layout.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            tar.addfile(info, io.BytesIO(data))
    tar_bytes = buf.getvalue()
    diff_id = f"sha256:{hashlib.sha256(tar_bytes).hexdigest()}"
    layer = gzip.compress(tar_bytes, mtime=0) if gzipped else tar_bytes
    layer_digest = _blob(layout, layer)
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "config": {"Cmd": ["/bin/true"]},
                         "rootfs": {"type": "layers", "diff_ids": [diff_id]}}).encode()
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": _blob(layout, config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar"
                    + ("+gzip" if gzipped else ""),
                    "digest": layer_digest, "size": len(layer)}]}).encode()
    (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": _blob(layout, manifest), "size": len(manifest),
        "annotations": {"org.opencontainers.image.ref.name": tag}}]}))
    return f"oci:{layout}:{tag}"
