#!/usr/bin/env bash
# For the tests only (infra/test runs it): the training frameworks the checkpoint hooks are
# held to (PyTorch on its CPU path, Hugging Face transformers, PyTorch Lightning, Keras), as
# one image in the provider user's store, FROM the local base image, and as the same packages
# in a folder the tests put on PYTHONPATH to run the frameworks on the host.
#
# Why not a Dockerfile that pip-installs them, as a job's would: PyPI's PyTorch for Linux comes
# with NVIDIA's CUDA libraries (about 5 GB installed; its CPU build lives only on
# download.pytorch.org, which these machines cannot reach), and installing that under gVisor
# takes longer than the whole suite may (tried: over 5 minutes). Jobs' builds through the
# platform's PyPI cache are what tests/corpus holds to account.
#
#   infra/frameworks-image.sh [PROVIDER_USER]
set -euo pipefail

user=${1:-${CAMPUGRID_AGENT_USER:-campugrid}}
repo=$(cd "$(dirname "$0")/.." && pwd)
version=1  # bump when the pins change
image=localhost/campugrid/frameworks:v$version
pins=(torch==2.15.0 transformers==5.25.0 accelerate==1.16.0 lightning==2.6.6 keras==3.15.1)
cache=${CAMPUGRID_IMAGE_CACHE:-/var/cache/campugrid}
site=$cache/frameworks-v$version

as_user() {
  if [ "$(id -un)" = "$user" ]; then "$@"; else
    local uid; uid=$(id -u "$user")
    runuser -u "$user" -- env HOME="$(getent passwd "$user" | cut -d: -f6)" XDG_RUNTIME_DIR="/run/user/$uid" "$@"
  fi
}

if [ ! -f "$site/.complete" ]; then
  echo "frameworks: installing ${pins[*]} into $site (about 5 GB, once)"
  rm -rf "$site"
  mkdir -p "$site"
  "$repo/.venv/bin/python" -m pip install --quiet --no-cache-dir --target "$site" "${pins[@]}"
  chmod -R a+rX "$site"
  touch "$site/.complete"
  find "$cache" -maxdepth 1 -name 'frameworks-v*' ! -name "${site##*/}" -exec rm -rf {} +
fi

if as_user podman image exists "$image"; then
  echo "frameworks: $image present for $user"
else
  echo "frameworks: making $image for $user"
  ctr=$(as_user buildah from --pull-never localhost/campugrid/python:bookworm)
  trap 'as_user buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
  as_user buildah copy --quiet "$ctr" "$site" /usr/local/lib/python3.11/dist-packages >/dev/null
  as_user buildah config --env KERAS_BACKEND=torch "$ctr"
  as_user buildah commit --quiet --rm "$ctr" "$image" >/dev/null
  trap - EXIT
fi
