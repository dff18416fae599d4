#!/usr/bin/env bash
# Debian packages the test suite needs: installed once, skipped when present.
set -euo pipefail
# libtcmalloc-minimal4: the allocator the runner image preloads (tests/test_doctor.py checks its detection).
packages=(dataset-fashion-mnist libtcmalloc-minimal4)
missing=()
for package in "${packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "system-deps: missing ${missing[*]}; install them with: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
