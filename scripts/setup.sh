#!/usr/bin/env bash
# Install everything stfs needs on a Debian machine: libfuse3, the tools the tests drive, and the package.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
    fuse3 libfuse3-3 libfuse3-dev pkg-config jq attr bsdextrautils util-linux mount gcc libc6-dev coreutils python3-venv \
    nginx-light docker-registry man-db \
    squashfuse squashfs-tools  # nginx: the remote tests' HTTP and Hub server; docker-registry: their OCI registry
                               # (tests/registry.py); man-db: man stfs; squashfuse_ll: bench_find.py's peer
# buildah and skopeo: the container images of tests/test_oci_images.py, built and copied as people do (SPEC §14a)
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq buildah skopeo
# The package starts its own registry on :5000 where systemd runs; the tests start theirs.
$SUDO systemctl disable --now docker-registry 2>/dev/null || true
DS_BUILD_OPS=0 python3 -m pip install -q --disable-pip-version-check -e ".[test]"  # deepspeed: no JIT ops built
# man stfs: the page the package's build writes, put where man(1) looks (an editable install leaves it in build/man/)
page="$(mktemp)"
python3 scripts/man_page.py "$page"
$SUDO install -D -m 0644 "$page" /usr/local/share/man/man1/stfs.1
rm -f "$page"
# lpips 0.1.4's weights (torch.save's older layout, protocol 2) for tests/test_pytorch_mount.py: the wheel only,
# never installed (it would pull torchvision and another torch)
python3 -m pip download -q --disable-pip-version-check --no-deps lpips==0.1.4 -d tests/.wheels
