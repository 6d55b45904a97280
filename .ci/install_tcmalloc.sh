#!/usr/bin/env bash
# Install tcmalloc (Debian's libtcmalloc-minimal4): ./run preloads it for the processes it starts
# (the test suite, `./run train`, `./run docs`) where it is installed; on CPU, XLA's compiler and
# runtime spend a tenth of their time in glibc's malloc, and tcmalloc cuts the suite's CPU time
# (docs/guides/precision_memory_export.md, Memory, gives the figures).
#
# Idempotent: does nothing when the library is already installed. Needs root (CI containers) or
# passwordless sudo; without either it only says so (./run then runs on glibc's malloc).
set -euo pipefail
PATH="$PATH:/sbin:/usr/sbin"
# grep without -q reads to the end (-q would stop early and end ldconfig with SIGPIPE: under pipefail
# the test would then fail although the library is there)
if ldconfig -p 2>/dev/null | grep 'libtcmalloc_minimal\.so\.4 ' >/dev/null; then
  echo "install_tcmalloc: present"
  exit 0
fi
if [ "$(id -u)" = 0 ]; then SUDO=""; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
  echo "install_tcmalloc: not root and no sudo: cannot install libtcmalloc-minimal4" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends libtcmalloc-minimal4 >/dev/null
echo "install_tcmalloc: installed libtcmalloc-minimal4"
