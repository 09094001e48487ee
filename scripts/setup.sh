#!/usr/bin/env bash
# Install everything stfs needs on a Debian machine: libfuse3, the tools the tests drive, and the package.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
    fuse3 libfuse3-3 libfuse3-dev pkg-config jq attr bsdextrautils util-linux mount gcc libc6-dev coreutils python3-venv \
    nginx-light \
    squashfuse squashfs-tools  # nginx: the remote tests' HTTP and Hub server; squashfuse_ll: bench_find.py's peer
python3 -m pip install -q --disable-pip-version-check -e ".[test]"
