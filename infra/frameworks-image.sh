#!/usr/bin/env bash
# For the tests only (infra/test runs it): the training frameworks the checkpoint hooks are
# held to (tests/frameworks/requirements.txt: PyTorch, Hugging Face transformers, PyTorch
# Lightning, Keras), as one image in the provider user's store and as the same packages in a
# folder the tests put on PYTHONPATH to run the frameworks on the host.
#
# The image is built as a researcher's is, through the platform (tests/support/
# frameworks_image.py: a job whose Dockerfile pip-installs them, its RUN steps under gVisor,
# wheels through the coordinator's PyPI cache): about 6 minutes and 5 GB (PyPI's PyTorch
# brings NVIDIA's CUDA libraries), once. The folder is copied out of that image.
#
#   infra/frameworks-image.sh [PROVIDER_USER]
set -euo pipefail

user=${1:-${CAMPUGRID_AGENT_USER:-campugrid}}
repo=$(cd "$(dirname "$0")/.." && pwd)
version=1  # bump when tests/frameworks/requirements.txt changes (and the image's tag with it)
image=localhost/campugrid/frameworks:v$version
cache=${CAMPUGRID_IMAGE_CACHE:-/var/cache/campugrid}
site=$cache/frameworks-v$version

as_user() {
  if [ "$(id -un)" = "$user" ]; then "$@"; else
    local uid; uid=$(id -u "$user")
    runuser -u "$user" -- env HOME="$(getent passwd "$user" | cut -d: -f6)" XDG_RUNTIME_DIR="/run/user/$uid" "$@"
  fi
}

if [ -f "$site/.complete" ] && as_user podman image exists "$image"; then
  echo "frameworks: $image and $site present for $user"
  exit 0
fi
echo "frameworks: building $image through the platform for $user (about 6 minutes, once)"
mkdir -p "$cache"
(cd "$repo" && "$repo/.venv/bin/python" -m tests.support.frameworks_image "$user" "$image" "$site")
touch "$site/.complete"
find "$cache" -maxdepth 1 -name 'frameworks-v*' ! -name "${site##*/}" -exec rm -rf {} +
