#!/usr/bin/env bash
# Build the sdist and the wheel (the wheel from the sdist), fail on any build warning, `twine check` both, then
# install the wheel in a fresh venv (dependencies from PyPI) and run it. Build tools live in a venv of their own,
# so nothing is installed into the Python running this. Usage: bash scripts/check_package.sh [OUTDIR]
set -euo pipefail
cd "$(dirname "$0")/.."
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
out="${1:-$work/dist}"
pip_quiet=(-q --disable-pip-version-check --no-input)

python3 -m venv "$work/tools"
"$work/tools/bin/pip" install "${pip_quiet[@]}" build twine

# PYTHONDONTWRITEBYTECODE would make setuptools warn that byte-compiling is disabled.
env -u PYTHONDONTWRITEBYTECODE "$work/tools/bin/python" -m build --outdir "$out" . >"$work/build.log" 2>&1 || {
    cat "$work/build.log"; echo "check_package: build failed" >&2; exit 1; }
if grep -inE 'warning|deprecat' "$work/build.log"; then
    echo "check_package: the build printed the warnings above" >&2
    exit 1
fi
"$work/tools/bin/twine" check --strict "$out"/*.tar.gz "$out"/*.whl

python3 -m venv "$work/fresh"  # no --system-site-packages: only what the wheel pulls in
"$work/fresh/bin/pip" install "${pip_quiet[@]}" "$out"/*.whl
"$work/fresh/bin/python" - "$work/tiny.safetensors" <<'PY'
import json, struct, sys
header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
with open(sys.argv[1], "wb") as stream:
    stream.write(struct.pack("<Q", len(header)) + header + struct.pack("<2f", 1.0, 2.0))
PY
"$work/fresh/bin/stfs" --version
"$work/fresh/bin/stfs" info "$work/tiny.safetensors"
"$work/fresh/bin/stfs" diff "$work/tiny.safetensors" "$work/tiny.safetensors"
"$work/fresh/bin/stfs" check --values "$work/tiny.safetensors"
"$work/fresh/bin/python" -c "import stfs.fs"  # mfusepy (pinned <4) loads libfuse3 and has what stfs overrides
# The GGUF reader's type table and decoders come from the gguf package, a dependency of the wheel.
"$work/fresh/bin/python" -c "from stfs.formats import gguf; assert gguf.ggml_type('Q4_K').dequantizable"
# The wheel carries the C extensions (stfs._native built against the libfuse3 headers, stfs._tls, _scan) and a mount
# from it answers in C. Its listing is taken whole first: `grep -q` stops reading at its match, and under pipefail
# the lister's broken pipe failed the check now and then.
listing=$(python3 -m zipfile -l "$out"/*.whl)
grep -q 'stfs/_native\..*\.so' <<<"$listing" || { echo "check_package: the wheel has no stfs/_native" >&2; exit 1; }
grep -q 'stfs/_tls\..*\.so' <<<"$listing" || { echo "check_package: the wheel has no stfs/_tls" >&2; exit 1; }
grep -q 'stfs/formats/hdf5/_scan\..*\.so' <<<"$listing" || { echo "check_package: the wheel has no _scan" >&2; exit 1; }
# The man page stfs(1), written from stfs.cli's parser at build time, goes to PREFIX/share/man/man1.
grep -q 'stfs-[^/]*\.data/data/share/man/man1/stfs\.1' <<<"$listing" || {
    echo "check_package: the wheel has no share/man/man1/stfs.1" >&2; exit 1; }
man_head=$(head -n 1 "$work/fresh/share/man/man1/stfs.1" 2>/dev/null || true)
[[ $man_head == '.TH STFS "1"'* ]] || { echo "check_package: the fresh venv has no man page stfs(1)" >&2; exit 1; }
mkdir "$work/mnt"
(cd "$work" && "$work/fresh/bin/stfs" mount "$work/tiny.safetensors" "$work/mnt" --log-file "$work/mount.log")
status=0
[ "$(od -An -f "$work/mnt/tensors/w" | tr -s ' ')" = " 1 2" ] || { echo "check_package: wrong bytes" >&2; status=1; }
"$work/fresh/bin/stfs" unmount "$work/mnt"
grep -q "answered in C" "$work/mount.log" || { cat "$work/mount.log"; echo "check_package: not the C path" >&2; exit 1; }
[ "$status" = 0 ] || exit 1
echo "check_package: ok ($(cd "$out" && echo *.tar.gz *.whl))"
