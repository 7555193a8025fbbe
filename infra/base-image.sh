#!/usr/bin/env bash
# Makes the local base images that sample jobs build FROM, without any registry:
# a Debian bookworm root with python3 from Debian's mirror, cached as a tarball,
# imported into the provider user's rootless image store. Safe to run again.
#
#   infra/base-image.sh [PROVIDER_USER]
set -euo pipefail

user=${1:-${CAMPUGRID_AGENT_USER:-campugrid}}
image=localhost/campugrid/python:bookworm
version=3  # bump when the package list or the root changes: the image is then made again
packages=python3,python3-numpy
cache=${CAMPUGRID_IMAGE_CACHE:-/var/cache/campugrid}
tarball=$cache/bookworm-python3-v$version.tar

as_user() {
  if [ "$(id -un)" = "$user" ]; then "$@"; else
    local uid; uid=$(id -u "$user")
    runuser -u "$user" -- env HOME="$(getent passwd "$user" | cut -d: -f6)" XDG_RUNTIME_DIR="/run/user/$uid" "$@"
  fi
}

if [ ! -s "$tarball" ]; then
  [ "$(id -u)" = 0 ] || { echo "base-image: $tarball is missing and making it needs root (debootstrap)" >&2; exit 1; }
  mkdir -p "$cache"
  root=$(mktemp -d "$cache/rootfs.XXXXXX")
  trap 'rm -rf "$root"' EXIT
  echo "base-image: debootstrap bookworm + $packages (about a minute, once)"
  debootstrap --variant=minbase --include="$packages" bookworm "$root" >"$cache/debootstrap.log" 2>&1 \
    || { tail -20 "$cache/debootstrap.log" >&2; exit 1; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  # The root folder as every image has it (mktemp made it 0700): a builder that records "/"
  # in a layer (Kaniko does) would otherwise keep anyone but root out of the whole image.
  chmod 0755 "$root"
  tar --numeric-owner -C "$root" -cf "$tarball.tmp" .
  chmod 0644 "$tarball.tmp"
  mv "$tarball.tmp" "$tarball"
  find "$cache" -maxdepth 1 -name 'bookworm-python3*.tar' ! -name "${tarball##*/}" -delete
fi

have=$(as_user podman image inspect --format '{{index .Labels "campugrid.base"}}' "$image" 2>/dev/null || true)
if [ "$have" = "$version" ]; then
  echo "base-image: $image (v$version) present for $user"
else
  echo "base-image: importing $image (v$version) for $user"
  as_user podman import --quiet --change 'CMD ["/usr/bin/python3"]' \
    --change "LABEL campugrid.base=$version" - "$image" <"$tarball" >/dev/null
fi
