#!/usr/bin/env bash
# Set-up for a fresh Debian 12 machine, safe to run again: system packages, the Python
# virtual environment (.venv), the unprivileged provider user with its rootless container
# storage and delegated cgroups, and the local base image. Run as root for the full set-up;
# as an ordinary user it does what it can and says what is missing.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
user=${CAMPUGRID_AGENT_USER:-campugrid}
second_user=${CAMPUGRID_SECOND_AGENT_USER:-campugrid2}  # the tests' second worker's
packages=(podman buildah crun runc uidmap slirp4netns fuse-overlayfs debootstrap skopeo docker-registry
          apt-cacher-ng debian-archive-keyring ca-certificates
          python3 python3-venv python3-dev gcc postgresql busybox-static iproute2 procps)
# infra/test adds what only the tests need: the browser the console's tests drive.
if [ "${CAMPUGRID_TEST_TOOLS:-}" = 1 ]; then
  packages+=(chromium fonts-dejavu-core)
fi

say() { printf 'setup: %s\n' "$*"; }
runsc_min=0.0~20240729

if [ "$(id -u)" = 0 ]; then
  missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  # gVisor: Debian 12's own runsc (2022) has only the ptrace platform, where every system
  # call of a job or a RUN step costs host context switches. bookworm-backports (Debian's
  # archive, signed by the same key) has one with systrap and directfs: `pip --version` in
  # a sandbox takes 1.1 s instead of 1.6 s, a NumPy + SciPy build's RUN steps 20 % less.
  # Only runsc is taken from backports.
  if ! dpkg --compare-versions "$(dpkg-query -W -f='${Version}' runsc 2>/dev/null || echo 0)" ge "$runsc_min"; then
    export DEBIAN_FRONTEND=noninteractive
    backports=/etc/apt/sources.list.d/campugrid-bookworm-backports.sources
    if grep -q '^VERSION_CODENAME=bookworm$' /etc/os-release &&
       ! grep -rqs bookworm-backports /etc/apt/sources.list /etc/apt/sources.list.d/; then
      printf '%s\n' 'Types: deb' 'URIs: http://deb.debian.org/debian' 'Suites: bookworm-backports' \
        'Components: main' 'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' >"$backports"
    fi
    say "installing runsc (gVisor) from bookworm-backports"
    if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends \
             -t bookworm-backports runsc >/dev/null; }; then
      # No backports here (another release, or a mirror without them): the release's own.
      rm -f "$backports"
      apt-get update -qq
      apt-get install -y -qq --no-install-recommends runsc >/dev/null
    fi
    dpkg --compare-versions "$(dpkg-query -W -f='${Version}' runsc)" ge "$runsc_min" ||
      say "warning: runsc older than $runsc_min: jobs and builds run on the slower ptrace platform"
  fi
  # And the runsc providers install today, built from gVisor's Go module where Go is here
  # (Podman then runs it as `runsc`; Debian's stays as the fallback).
  bash "$repo/provider-agent/campugrid/agent/runsc-from-go.sh"
  # The packages' own services are not used; tests and `up` start their own (the registry's
  # would listen on :5000 without authentication, apt-cacher-ng's on :3142 as anyone's proxy).
  systemctl disable --now postgresql >/dev/null 2>&1 || true
  systemctl disable --now docker-registry >/dev/null 2>&1 || true
  systemctl disable --now apt-cacher-ng >/dev/null 2>&1 || true
else
  for t in podman buildah runsc python3; do
    command -v "$t" >/dev/null || { say "missing $t: as root, apt-get install ${packages[*]}"; exit 1; }
  done
fi

# Python environment. Debian's python3, so the unprivileged provider user can run it too.
stamp="$repo/.venv/.campugrid-installed"
want=$(sha256sum "$repo/pyproject.toml" | cut -d' ' -f1)
if [ ! -x "$repo/.venv/bin/python" ]; then
  say "creating .venv"
  /usr/bin/python3 -m venv "$repo/.venv"
fi
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing campugrid and its dependencies into .venv"
  "$repo/.venv/bin/pip" install -q --disable-pip-version-check -U pip
  "$repo/.venv/bin/pip" install -q --disable-pip-version-check -e "$repo[dev]"
  echo "$want" >"$stamp"
fi

# One provider user, as root: the account with its subordinate ids (from SUBID_START, where
# useradd gave none), its rootless container storage, its delegated cgroups and SLOTS output
# slots numbered from FIRST_SLOT. Several users may lend one machine.
provider_account() {
  local user=$1 subid=$2 first=$3
  if ! id "$user" >/dev/null 2>&1; then
    say "creating the provider user $user (the agent and every sandbox run as it)"
    useradd --create-home --shell /bin/bash "$user"
  fi
  local uid home remount=
  uid=$(id -u "$user")
  home=$(getent passwd "$user" | cut -d: -f6)
  grep -q "^$user:" /etc/subuid || usermod --add-subuids "$subid-$((subid + 65535))" "$user"
  grep -q "^$user:" /etc/subgid || usermod --add-subgids "$subid-$((subid + 65535))" "$user"
  install -d -o "$user" -g "$user" -m 0700 "/run/user/$uid"
  # Native rootless overlay: container starts in ~0.25 s instead of seconds on vfs.
  local conf="$home/.config/containers/storage.conf"
  if [ ! -f "$conf" ]; then
    install -d -o "$user" -g "$user" "$home/.config" "$home/.config/containers"
    printf '[storage]\ndriver = "overlay"\n' >"$conf"
    chown "$user:" "$conf"
    runuser -u "$user" -- env HOME="$home" XDG_RUNTIME_DIR="/run/user/$uid" \
      podman system reset --force >/dev/null 2>&1 || true
  fi
  # cgroup v1: rootless Podman ignores --memory/--cpus/--pids-limit, so delegate a subtree
  # in which the agent makes one cgroup per job and writes the limits itself, named as the
  # agent looks for it (sandbox/limits.py).
  local subtree
  subtree=$("$repo/.venv/bin/python" -c 'import sys; from campugrid.sandbox.limits import delegated_subtree; print(delegated_subtree(sys.argv[1]))' "$user")
  if [ ! -f /sys/fs/cgroup/cgroup.controllers ]; then
    for c in memory cpu pids; do
      if [ -d "/sys/fs/cgroup/$c" ]; then
        mkdir -p "/sys/fs/cgroup/$c/$subtree"
        chown -R "$user:" "/sys/fs/cgroup/$c/$subtree"
      fi
    done
  fi
  # Output slots: rootless Podman has no quota for bind mounts, so each agent's /output and
  # /checkpoints go on a size-bounded filesystem of its own (campugrid.sandbox.slots):
  # sparse ext4 images, which take disk only for what jobs write. An agent takes a free one
  # that its user can write.
  local slots=/var/lib/campugrid/slots i img dir
  install -d -m 0755 /var/lib/campugrid "$slots"
  for i in $(seq "$first" $((first + ${CAMPUGRID_SLOTS:-4} - 1))); do
    img="$slots/$i.img" dir="$slots/$i"
    install -d -m 0700 -o "$user" -g "$user" "$dir"
    mountpoint -q "$dir" && continue
    if [ ! -f "$img" ]; then
      (umask 077 && truncate -s "${CAMPUGRID_SLOT_GB:-32}G" "$img")
      mkfs.ext4 -q -m 0 -i 65536 -J size=16 -E root_owner="$uid:$(id -g "$user")" "$img"
    fi
    if mount -o loop,discard,noinit_itable,nodev,nosuid "$img" "$dir" 2>/dev/null; then
      chmod 0700 "$dir"
      remount=1
      grep -q " $dir " /etc/fstab || \
        echo "$img $dir ext4 loop,discard,noinit_itable,nodev,nosuid,nofail 0 0" >>/etc/fstab
    else
      say "cannot mount $img (no loop devices here?): agents check /output every 0.25 s instead"
      break
    fi
  done
  # Where / is not a shared mount (containers), mounts made after Podman's rootless
  # namespace was set up stay invisible in it: start that namespace afresh.
  if [ -n "$remount" ]; then
    runuser -u "$user" -- env HOME="$home" XDG_RUNTIME_DIR="/run/user/$uid" \
      podman system migrate >/dev/null 2>&1 || true
  fi
  # The agent runs this checkout's .venv as $user: it must be able to read it.
  if ! runuser -u "$user" -- "$repo/.venv/bin/python" -c 'import campugrid.agent.worker' 2>/dev/null; then
    say "user $user cannot read $repo; put the checkout somewhere world-readable (not under /root)"
    exit 1
  fi
}

if [ "$(id -u)" = 0 ]; then
  provider_account "$user" 100000 0
  # The tests' second worker lends the machine as a second user (tests/conftest.py): its
  # agents and sandboxes, processes, cgroups and images are apart from the first's.
  if [ "${CAMPUGRID_TEST_TOOLS:-}" = 1 ]; then
    provider_account "$second_user" 165536 "${CAMPUGRID_SLOTS:-4}"
  fi
fi

"$repo/infra/base-image.sh" "$(if [ "$(id -u)" = 0 ]; then echo "$user"; else id -un; fi)"
if [ "${CAMPUGRID_TEST_TOOLS:-}" = 1 ] && [ "$(id -u)" = 0 ]; then
  "$repo/infra/base-image.sh" "$second_user"
fi
if [ "${CAMPUGRID_TEST_TOOLS:-}" = 1 ] && [ "$(id -u)" = 0 ]; then  # the kaniko builder's executor
  "$repo/infra/kaniko.sh" "$user" "$second_user"
fi
if [ "${CAMPUGRID_TEST_TOOLS:-}" = 1 ]; then  # the frameworks the checkpoint hooks are tested on
  "$repo/infra/frameworks-image.sh" "$(if [ "$(id -u)" = 0 ]; then echo "$user"; else id -un; fi)"
fi
say "ready"
