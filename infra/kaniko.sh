#!/usr/bin/env bash
# Kaniko's executor for the `kaniko` builder, from a maintained fork's Go module (upstream
# GoogleContainerTools/kaniko was archived on 2025-06-03): built once per machine at a
# pinned version into /usr/local/lib/campugrid/kaniko-VERSION/executor, then made into the
# executor image in each provider user's store as upstream's is (the binary at
# /kaniko/executor, and the certificates it trusts for its own fetches, ADD's URLs: this
# host's, /etc/ssl/certs/ca-certificates.crt from Debian's ca-certificates, at
# /kaniko/ssl/certs, where SSL_CERT_DIR points). Buildah stays the default builder; this is
# for providers who choose Kaniko (`campugrid agent run --builder kaniko`) and for the tests.
# Where Go is missing or the build fails, it says so and the kaniko builder stays off.
#
#   infra/kaniko.sh USER...   (as root; infra/setup.sh runs it for the test users)
set -euo pipefail

# The pin: chainguard-dev/kaniko's newest release the Go module proxy served on 2026-12-06.
# (`go install module@version` is refused for it: its go.mod has replace directives, so it is
# downloaded as a module and built inside it.)
module=github.com/chainguard-dev/kaniko
version=v1.25.11
dir=/usr/local/lib/campugrid/kaniko-$version
# The image's own revision after the module's version: a new one is made where it is missing.
image=localhost/campugrid/kaniko-executor:$version-2
certs=/etc/ssl/certs/ca-certificates.crt
say() { printf 'kaniko: %s\n' "$*"; }
PATH=$PATH:/usr/local/go/bin

[ "$(id -u)" = 0 ] || { say "not root: nothing to do"; exit 0; }
[ -s "$certs" ] || { say "no $certs (Debian's ca-certificates): the kaniko builder is unavailable"; exit 0; }
if [ ! -x "$dir/executor" ]; then
  if ! command -v go >/dev/null; then
    say "no Go here: the kaniko builder is unavailable (install Go 1.26 and run this again)"
    exit 0
  fi
  say "building $module/cmd/executor@$version (once, a few minutes)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  export GOFLAGS=-mod=mod GOCACHE="$tmp/cache" GOMODCACHE="${GOMODCACHE:-$(go env GOMODCACHE)}"
  if ! src=$(go mod download -json "$module@$version" 2>"$tmp/download.log" |
             sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p') || [ -z "$src" ]; then
    tail -20 "$tmp/download.log" >&2
    say "could not download $module@$version: the kaniko builder is unavailable"
    exit 0
  fi
  if ! (cd "$src" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$tmp/executor" \
          ./cmd/executor) >"$tmp/build.log" 2>&1; then
    tail -20 "$tmp/build.log" >&2
    say "the build failed: the kaniko builder is unavailable"
    exit 0
  fi
  install -d -m 0755 "$dir"
  install -m 0755 "$tmp/executor" "$dir/executor"
  find /usr/local/lib/campugrid -maxdepth 1 -name 'kaniko-*' ! -name "${dir##*/}" -exec rm -rf {} +
fi

for user in "$@"; do
  uid=$(id -u "$user")
  as_user() {
    runuser -u "$user" -- env HOME="$(getent passwd "$user" | cut -d: -f6)" \
      XDG_RUNTIME_DIR="/run/user/$uid" "$@"
  }
  if as_user podman image exists "$image"; then
    say "$image present for $user"
    continue
  fi
  ctr=$(cd / && as_user buildah from --quiet scratch)
  (cd / && as_user buildah copy --quiet --chmod 0755 "$ctr" "$dir/executor" /kaniko/executor) >/dev/null
  (cd / && as_user buildah copy --quiet --chmod 0644 "$ctr" "$certs" \
     /kaniko/ssl/certs/ca-certificates.crt) >/dev/null
  (cd / && as_user buildah config --entrypoint '["/kaniko/executor"]' \
     --env PATH=/kaniko --env HOME=/root --env USER=root --env DOCKER_CONFIG=/kaniko/.docker/ \
     --env SSL_CERT_DIR=/kaniko/ssl/certs \
     --workingdir /workspace --label "campugrid.kaniko=$version" "$ctr")
  (cd / && as_user buildah commit --quiet --rm "$ctr" "$image") >/dev/null
  # The images this one replaces (earlier versions or revisions) go.
  as_user podman images --format '{{.Repository}}:{{.Tag}}' localhost/campugrid/kaniko-executor |
    { grep -vxF "$image" || true; } | while read -r old; do
      as_user podman rmi --force "$old" >/dev/null 2>&1 || true
    done
  say "$image made for $user"
done
