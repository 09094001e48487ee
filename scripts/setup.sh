#!/usr/bin/env bash
# Install everything stfs needs on a Debian machine: libfuse3, the tools the tests drive, and the package.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
packages="fuse3 libfuse3-3 jq attr bsdextrautils util-linux gcc libc6-dev coreutils"
missing=""
for package in $packages; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing="$missing $package"
done
if [ -n "$missing" ]; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing >/dev/null
fi
python3 -m pip install -q --disable-pip-version-check -e ".[test]"
