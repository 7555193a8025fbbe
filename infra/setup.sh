#!/usr/bin/env bash
# Set-up for a fresh Debian 12 machine, safe to run again: system packages, the Python
# virtual environment (.venv), the unprivileged provider user with its rootless container
# storage and delegated cgroups, and the local base image. Run as root for the full set-up;
# as an ordinary user it does what it can and says what is missing.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
user=${CAMPUGRID_AGENT_USER:-campugrid}
packages=(podman buildah runsc crun runc uidmap slirp4netns fuse-overlayfs debootstrap skopeo
          python3 python3-venv python3-dev gcc postgresql busybox-static iproute2 procps)

say() { printf 'setup: %s\n' "$*"; }

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
  # The package's own cluster is not used; tests and `up` start their own.
  systemctl disable --now postgresql >/dev/null 2>&1 || true
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

if [ "$(id -u)" = 0 ]; then
  if ! id "$user" >/dev/null 2>&1; then
    say "creating the provider user $user (the agent and every sandbox run as it)"
    useradd --create-home --shell /bin/bash "$user"
  fi
  uid=$(id -u "$user")
  home=$(getent passwd "$user" | cut -d: -f6)
  grep -q "^$user:" /etc/subuid || usermod --add-subuids 100000-165535 "$user"
  grep -q "^$user:" /etc/subgid || usermod --add-subgids 100000-165535 "$user"
  install -d -o "$user" -g "$user" -m 0700 "/run/user/$uid"
  # Native rootless overlay: container starts in ~0.25 s instead of seconds on vfs.
  conf="$home/.config/containers/storage.conf"
  if [ ! -f "$conf" ]; then
    install -d -o "$user" -g "$user" "$home/.config" "$home/.config/containers"
    printf '[storage]\ndriver = "overlay"\n' >"$conf"
    chown "$user:" "$conf"
    runuser -u "$user" -- env HOME="$home" XDG_RUNTIME_DIR="/run/user/$uid" \
      podman system reset --force >/dev/null 2>&1 || true
  fi
  # cgroup v1: rootless Podman ignores --memory/--cpus/--pids-limit, so delegate a subtree
  # in which the agent makes one cgroup per job and writes the limits itself.
  if [ ! -f /sys/fs/cgroup/cgroup.controllers ]; then
    for c in memory cpu pids; do
      if [ -d "/sys/fs/cgroup/$c" ]; then
        mkdir -p "/sys/fs/cgroup/$c/campugrid"
        chown -R "$user:" "/sys/fs/cgroup/$c/campugrid"
      fi
    done
  fi
  # The agent runs this checkout's .venv as $user: it must be able to read it.
  if ! runuser -u "$user" -- "$repo/.venv/bin/python" -c 'import campugrid.agent.worker' 2>/dev/null; then
    say "user $user cannot read $repo; put the checkout somewhere world-readable (not under /root)"
    exit 1
  fi
fi

"$repo/infra/base-image.sh" "$(if [ "$(id -u)" = 0 ]; then echo "$user"; else id -un; fi)"
say "ready"
