#!/usr/bin/env bash
# gVisor's runsc as providers install it in 2026, built from gVisor's Go module (its `go`
# branch, which gVisor documents for `go install`) at a pinned commit, once per machine: about
# 25 MB in /usr/local/lib/campugrid/runsc-STAMP, linked as /usr/local/bin/runsc, and named to
# Podman as the runtime `runsc` (before Debian's /usr/bin/runsc, which stays as the fallback).
# Where Go is missing or the build fails, the runsc already there is what runs, and this says so.
#
#   bash runsc-from-go.sh     (as root: infra/setup.sh runs it, and `campugrid provider
#                              prepare`'s root step where Go is present; prereqs.py reads the pin)
set -euo pipefail

# The pin: gVisor's go branch on 2026-09-05 (the newest the Go module proxy served on
# 2026-12-06). Bump both together; the stamp is what `runsc --version` and agents report.
module=gvisor.dev/gvisor/runsc@v0.0.0-20260905035102-160fafc42237
stamp=go-20260905-160fafc42237
dir=/usr/local/lib/campugrid/runsc-$stamp
conf=/etc/containers/containers.conf.d/50-campugrid-runsc.conf
say() { printf 'runsc: %s\n' "$*"; }
PATH=$PATH:/usr/local/go/bin  # where Go's own archive puts it

if [ "$(id -u)" != 0 ]; then
  say "not root: using $(command -v runsc || echo 'no runsc')"
  exit 0
fi
if [ ! -x "$dir/runsc" ]; then
  now="jobs run on $(runsc --version 2>/dev/null | head -1 || echo 'no runsc')"
  if ! command -v go >/dev/null; then
    say "no Go here: $now; for a current one, install Go 1.26 and run this again, or take gVisor's release from https://gvisor.dev/docs/user_guide/install/"
    exit 0
  fi
  say "building $module (once, a few minutes)"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  if ! GOBIN="$tmp/bin" GOFLAGS=-mod=mod CGO_ENABLED=0 GOCACHE="$tmp/cache" \
      go install -trimpath -ldflags "-s -w -X gvisor.dev/gvisor/runsc/version.version=$stamp" \
      "$module" >"$tmp/build.log" 2>&1; then
    tail -20 "$tmp/build.log" >&2
    say "the build failed: $now"
    exit 0
  fi
  # It must run a sandbox before Podman is told to use it (Podman takes the first that exists).
  if ! (cd / && timeout 120 "$tmp/bin/runsc" --network=none --ignore-cgroups do sh -c \
          'dmesg | grep -q "Starting gVisor"') >"$tmp/smoke.log" 2>&1; then
    tail -20 "$tmp/smoke.log" >&2
    say "the runsc built cannot start a sandbox here: $now"
    exit 0
  fi
  install -d -m 0755 "$dir"
  install -m 0755 "$tmp/bin/runsc" "$dir/runsc"
  find /usr/local/lib/campugrid -maxdepth 1 -name 'runsc-*' ! -name "${dir##*/}" -exec rm -rf {} +
fi
ln -sfn "$dir/runsc" /usr/local/bin/runsc
# Podman finds a runtime by name in this list (its default starts with /usr/bin/runsc).
install -d -m 0755 "${conf%/*}"
printf '%s\n' '# campugrid (runsc-from-go.sh): the runsc built from gVisor'"'"'s Go module first, Debian'"'"'s after.' \
  '[engine.runtimes]' 'runsc = ["/usr/local/bin/runsc", "/usr/bin/runsc"]' >"$conf"
say "$(/usr/local/bin/runsc --version | head -1)"
