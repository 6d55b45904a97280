#!/usr/bin/env bash
# Install Chromium from the Debian packages for the browser tests of the run report (tests/report/)
# and of the documentation site (tests/docs/).
#
# Idempotent: does nothing when a chromium binary is already on PATH. Needs root (CI containers) or
# passwordless sudo; without either it only says so (the report test then fails under CI=true).
set -euo pipefail
for bin in chromium chromium-browser; do
  if command -v "$bin" >/dev/null 2>&1; then
    echo "install_chromium: $(command -v "$bin") present"
    exit 0
  fi
done
if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
  echo "install_chromium: not root and no sudo: cannot install chromium" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
echo "install_chromium: installed $(command -v chromium)"
