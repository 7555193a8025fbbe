"""Coordinator settings, from the command line and CAMPUGRID_* environment variables."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from campugrid.buildpolicy.dockerfiles import AllowedBase, allowed_bases, base_registries
from campugrid.coordinator.bases import Source, parse_mirrors


@dataclasses.dataclass(frozen=True)
class Settings:
    state_dir: Path
    database_url: str
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    s3_bucket: str = "campugrid"
    s3_secure: bool = False
    # CAMPUGRID_S3_REGION (empty: the endpoint's, else asked of the server once at start) and
    # CAMPUGRID_S3_ADDRESSING: auto (what the minio SDK picks for the endpoint), path or virtual.
    s3_region: str = ""
    s3_addressing: str = "auto"
    http_host: str = "127.0.0.1"
    http_port: int = 8750
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 8751
    lease_seconds: float = 12.0  # an agent renews every lease_seconds / 4
    presign_seconds: int = 6 * 3600
    max_context_bytes: int = 512 * 1024**2
    max_dataset_files: int = 1000
    max_upload_bytes: int = 4 * 1024**3  # one upload ticket's file
    upload_ttl_s: float = 600  # how long a ticket waits for its job
    keep_checkpoints: int = 3  # per job; older ones are deleted from storage
    checkpoint_part_bytes: int = 16 * 1024**2
    max_checkpoint_bytes: int = 64 * 1024**3
    # What a job's FROM may name (CAMPUGRID_ALLOWED_BASES): checked at submit, and again by
    # each agent against its own list.
    allowed_bases: tuple[AllowedBase, ...] = dataclasses.field(default_factory=allowed_bases)
    # ...or an image on one of these registries (CAMPUGRID_BASE_REGISTRIES), resolved to a
    # digest at submit through the mirrors first (CAMPUGRID_REGISTRY_MIRRORS; bases.py).
    base_registries: tuple[str, ...] = dataclasses.field(default_factory=base_registries)
    registry_mirrors: tuple[tuple[str, Source], ...] = ()
    # Unsigned REST requests act as an admin (CAMPUGRID_ALLOW_UNSIGNED=1): only for a
    # coordinator on a loopback address, and refused at start anywhere else.
    allow_unsigned: bool = False
    # Where the first start writes the local admin's identity (default: the CLI's own,
    # ~/.config/campugrid/identity.json, unless one is there already for another server).
    admin_identity: Path | None = None
    # How others reach this coordinator, for the printed join and login commands
    # (CAMPUGRID_PUBLIC_URL, CAMPUGRID_PUBLIC_GRPC; default: the addresses it listens on).
    public_url: str = ""
    public_grpc: str = ""
    # REST over TLS (the same certificate as gRPC): None serves TLS unless REST listens on a
    # loopback address only (CAMPUGRID_REST_TLS=1 or 0 decides).
    rest_tls: bool | None = None
    rest_per_key_per_s: int = 50
    rest_per_address_per_s: int = 100
    registrations_per_minute: int = 20  # per address
    # The OCI registry built images are shared through (CAMPUGRID_REGISTRY, host:port as
    # machines reach it; plain HTTP only on a loopback address). It must accept this
    # coordinator's tokens (registry/token.crt in the state folder). Empty: none, and every
    # machine builds every image itself.
    registry: str = ""
    # How long a registry token lasts (CAMPUGRID_REGISTRY_TOKEN_SECONDS): skopeo cannot renew
    # one during a copy, so it must cover the slowest push or pull of one image.
    registry_token_seconds: int = 900
    # A pushed image no queued or running job can use is deleted from the registry once
    # nobody pulled it for this long (CAMPUGRID_IMAGE_KEEP_SECONDS).
    image_keep_seconds: float = 3600.0
    # The package caches machines fetch a build's packages through (coordinator/mirrors.py):
    # proxpi's cache folder (CAMPUGRID_PIP_MIRROR_DIR; empty: no PyPI cache) and the
    # apt-cacher-ng to pass /v1/mirrors/apt to (CAMPUGRID_APT_CACHE, host:port; empty: none).
    pip_mirror_dir: str = ""
    apt_cache: str = ""
    # The platform's egress proxy for builds (campugrid.egress), on the REST host at this port
    # (CAMPUGRID_EGRESS_PORT; 0: none, and machines build offline or through their own).
    egress_port: int = 0

    @property
    def tls_dir(self) -> Path:
        return self.state_dir / "tls"

    @property
    def registry_dir(self) -> Path:
        """The registry token signing key and certificate."""
        return self.state_dir / "registry"

    @classmethod
    def from_env(cls, state_dir: Path, **overrides: object) -> Settings:
        env = os.environ
        values: dict[str, object] = {
            "state_dir": state_dir,
            "database_url": env.get("CAMPUGRID_DATABASE_URL", f"sqlite:///{state_dir}/coordinator.db"),
            "s3_endpoint": env.get("CAMPUGRID_S3_ENDPOINT", ""),
            "s3_access_key": env.get("CAMPUGRID_S3_ACCESS_KEY", ""),
            "s3_secret_key": env.get("CAMPUGRID_S3_SECRET_KEY", ""),
            "s3_bucket": env.get("CAMPUGRID_S3_BUCKET", "campugrid"),
            "s3_secure": env.get("CAMPUGRID_S3_SECURE", "") in ("1", "true", "yes"),
            "s3_region": env.get("CAMPUGRID_S3_REGION", "").strip(),
            "s3_addressing": env.get("CAMPUGRID_S3_ADDRESSING", "").strip().lower() or "auto",
            "allowed_bases": allowed_bases(env.get("CAMPUGRID_ALLOWED_BASES")),
            "base_registries": base_registries(env.get("CAMPUGRID_BASE_REGISTRIES")),
            "registry_mirrors": parse_mirrors(env.get("CAMPUGRID_REGISTRY_MIRRORS", "")),
            "allow_unsigned": env.get("CAMPUGRID_ALLOW_UNSIGNED", "") in ("1", "true", "yes"),
            "public_url": env.get("CAMPUGRID_PUBLIC_URL", ""),
            "public_grpc": env.get("CAMPUGRID_PUBLIC_GRPC", ""),
            "rest_tls": {"1": True, "0": False}.get(env.get("CAMPUGRID_REST_TLS", "")),
            "registry": env.get("CAMPUGRID_REGISTRY", "").strip(),
            "pip_mirror_dir": env.get("CAMPUGRID_PIP_MIRROR_DIR", "").strip(),
            "apt_cache": env.get("CAMPUGRID_APT_CACHE", "").strip(),
            "egress_port": int(env.get("CAMPUGRID_EGRESS_PORT", "").strip() or 0),
        }
        if values["s3_addressing"] not in ("auto", "path", "virtual"):
            raise ValueError(f"CAMPUGRID_S3_ADDRESSING={env['CAMPUGRID_S3_ADDRESSING']!r}: "
                             "expected auto, path or virtual")
        for key, name, kind in (("lease_seconds", "CAMPUGRID_LEASE_SECONDS", float),
                                ("keep_checkpoints", "CAMPUGRID_KEEP_CHECKPOINTS", int),
                                ("image_keep_seconds", "CAMPUGRID_IMAGE_KEEP_SECONDS", float),
                                ("registry_token_seconds", "CAMPUGRID_REGISTRY_TOKEN_SECONDS",
                                 int)):
            if env.get(name):
                try:
                    values[key] = kind(env[name])
                except ValueError as e:
                    raise ValueError(f"{name}={env[name]!r} is not a number") from e
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
