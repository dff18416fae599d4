#!/usr/bin/env bash
# A private Docker engine for building and running the runner image on a machine with no registry access.
#
#   scripts/docker-rig.sh start        install docker.io + debootstrap if missing, start dockerd; prints
#                                      DOCKER_HOST=..., DOCKERD_PID=... and DOCKERD_STARTED=1 (0: it was running)
#   scripts/docker-rig.sh base [TAG]   import the stand-in base image as TAG (default: the Dockerfile's BASE_IMAGE)
#   scripts/docker-rig.sh stop         stop the dockerd that `start` started (by its PID file)
#
# dockerd gets its own data root, exec root and socket, and never touches the host network: no bridge, no
# iptables, no forwarding. Builds and containers use `--network host` (pip) or `--network none` (jobs).
# No base image can be pulled here, so `base` makes one with debootstrap (Debian bookworm + Python 3.11, the
# release the real python:3.11-slim-bookworm is built from) and tags it as the Dockerfile's real base: the
# Dockerfile itself is built unchanged. The debootstrap tarball is cached; the engine's layer cache persists.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DATA_ROOT="${RUNNER_DOCKER_ROOT:-/var/lib/runner-docker}"
RUN_DIR="${RUNNER_DOCKER_RUN:-/run/runner-docker}"
CACHE_DIR="${RUNNER_DOCKER_CACHE:-/var/cache/runner-docker}"
SOCKET="$RUN_DIR/docker.sock"
PIDFILE="$RUN_DIR/dockerd.pid"
LOG="$RUN_DIR/dockerd.log"
DOCKER=/usr/bin/docker  # Debian's client: its built-in BuildKit needs no buildx plugin
START_TIMEOUT_S=60

die() { echo "docker-rig: $*" >&2; exit 1; }

need_packages() {
  local missing=() package
  for package in "$@"; do
    dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "missing ${missing[*]}; install them with: sudo apt-get install -y ${missing[*]}"
  echo "docker-rig: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  # docker.io's install script would start a system dockerd with default (bridge, iptables) settings:
  # a policy-rc.d that says "no" keeps it from starting any service.
  local policy=/usr/sbin/policy-rc.d made_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod +x "$policy" && made_policy=1
  fi
  local status=0
  apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || status=$?
  [ "$made_policy" -eq 1 ] && rm -f "$policy"
  [ "$status" -eq 0 ] || die "apt-get install ${missing[*]} failed (exit $status)"
}

engine_answers() {
  "$DOCKER" -H "unix://$SOCKET" version --format '{{.Server.Version}}' >/dev/null 2>&1
}

running_pid() {
  [ -f "$PIDFILE" ] || return 1
  local pid
  pid="$(cat "$PIDFILE")"
  kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = dockerd ] && echo "$pid"
}

start() {
  [ "$(id -u)" -eq 0 ] || die "dockerd needs root here (it mounts overlay2 layers); run as root"
  need_packages docker.io debootstrap
  mkdir -p "$DATA_ROOT" "$RUN_DIR"
  if pid="$(running_pid)"; then
    engine_answers || die "dockerd (pid $pid) runs but does not answer on $SOCKET; stop it: $0 stop"
    echo "docker-rig: dockerd already running (pid $pid)" >&2
    printf 'DOCKER_HOST=unix://%s\nDOCKERD_PID=%s\nDOCKERD_STARTED=0\n' "$SOCKET" "$pid"
    return 0
  fi
  # A config file of our own, so /etc/docker/daemon.json (if any) cannot change the safe flags.
  echo '{}' >"$RUN_DIR/daemon.json"
  rm -f "$SOCKET" "$PIDFILE"
  dockerd \
    --config-file "$RUN_DIR/daemon.json" \
    --data-root "$DATA_ROOT" --exec-root "$RUN_DIR/exec" \
    --host "unix://$SOCKET" --pidfile "$PIDFILE" \
    --storage-driver overlay2 --bridge=none --iptables=false --ip-forward=false --ip-masq=false \
    >"$LOG" 2>&1 </dev/null &
  local pid=$! waited=0
  until engine_answers; do
    if ! kill -0 "$pid" 2>/dev/null; then
      die "dockerd exited during start-up; the end of $LOG says:
$(tail -n 15 "$LOG")"
    fi
    if [ "$waited" -ge $((START_TIMEOUT_S * 4)) ]; then
      kill "$pid" 2>/dev/null || true
      die "dockerd did not answer on $SOCKET within ${START_TIMEOUT_S}s; the end of $LOG says:
$(tail -n 15 "$LOG")"
    fi
    sleep 0.25
    waited=$((waited + 1))
  done
  echo "docker-rig: dockerd $("$DOCKER" -H "unix://$SOCKET" version --format '{{.Server.Version}}') up (pid $pid)" >&2
  printf 'DOCKER_HOST=unix://%s\nDOCKERD_PID=%s\nDOCKERD_STARTED=1\n' "$SOCKET" "$pid"
}

dockerfile_base() {
  sed -n 's/^ARG BASE_IMAGE=\(.*\)$/\1/p' "$REPO/Dockerfile" | head -n 1
}

base() {
  local tag="${1:-$(dockerfile_base)}"
  [ -n "$tag" ] || die "no tag given and no 'ARG BASE_IMAGE=...' line in $REPO/Dockerfile"
  engine_answers || die "dockerd is not answering on $SOCKET; run: scripts/docker-rig.sh start"
  need_packages debootstrap
  local tarball="$CACHE_DIR/bookworm-python3-minbase.tar"
  if [ ! -s "$tarball" ]; then
    mkdir -p "$CACHE_DIR"
    local root
    root="$(mktemp -d "$CACHE_DIR/rootfs.XXXXXX")"
    echo "docker-rig: debootstrap bookworm into $root (about a minute)" >&2
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
      bookworm "$root" http://deb.debian.org/debian >"$CACHE_DIR/debootstrap.log" 2>&1 \
      || { rm -rf "$root"; die "debootstrap failed; see $CACHE_DIR/debootstrap.log"; }
    # What a slim image leaves out: apt lists and caches.
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
    tar -C "$root" -cf "$tarball.partial" . && mv "$tarball.partial" "$tarball"
    rm -rf "$root"
  fi
  # The tarball's checksum is kept as a label: a changed tarball is imported again, an unchanged one is not.
  local sum current
  sum="$(sha256sum "$tarball" | cut -c1-16)"
  current="$("$DOCKER" -H "unix://$SOCKET" image inspect --format '{{index .Config.Labels "runner.standin"}}' "$tag" 2>/dev/null || true)"
  if [ "$current" != "$sum" ]; then
    "$DOCKER" -H "unix://$SOCKET" import \
      --change "LABEL runner.standin=$sum" \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
      --change 'CMD ["python3"]' \
      "$tarball" "$tag" >/dev/null
    echo "docker-rig: imported the stand-in base as $tag" >&2
  fi
  echo "$tag"
}

stop() {
  local pid
  if ! pid="$(running_pid)"; then
    echo "docker-rig: no dockerd of ours is running" >&2
    return 0
  fi
  kill -TERM "$pid"
  for _ in $(seq 120); do
    kill -0 "$pid" 2>/dev/null || { rm -f "$PIDFILE"; echo "docker-rig: dockerd stopped" >&2; return 0; }
    sleep 0.25
  done
  kill -KILL "$pid" 2>/dev/null || true
  rm -f "$PIDFILE"
  echo "docker-rig: dockerd did not stop within 30s; killed pid $pid" >&2
}

case "${1:-}" in
  start) start ;;
  base) base "${2:-}" ;;
  stop) stop ;;
  *) die "usage: $0 start | base [TAG] | stop" ;;
esac
