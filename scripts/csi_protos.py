#!/usr/bin/env python3
"""Generate stfs/csi's gRPC code from stfs/csi/csi.proto with grpcio-tools, or check that what is checked in is
what it generates.

Usage: python3 scripts/csi_protos.py [--check]

The generated files name the versions that made them (protobuf's in csi_pb2.py, grpcio's in csi_pb2_grpc.py) and
refuse an older runtime: the csi extra of pyproject.toml asks for at least those. A new grpcio-tools: run this,
then raise the extra's floors to the versions the files name.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTO = "stfs/csi/csi.proto"
GENERATED = ("stfs/csi/csi_pb2.py", "stfs/csi/csi_pb2.pyi", "stfs/csi/csi_pb2_grpc.py")


def generate(into: str) -> None:
    """Write the generated files under ``into`` (their paths in the repository below it)."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    # -I the repository: the files import one another as stfs.csi.csi_pb2
    status = protoc.main(
        ["protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={into}", f"--pyi_out={into}",
         f"--grpc_python_out={into}", os.path.join(ROOT, PROTO)]
    )  # fmt: skip
    if status != 0:
        raise SystemExit(f"protoc failed on {PROTO} (exit {status})")


def stale() -> list[str]:
    """The generated files that differ from what grpcio-tools makes of csi.proto now."""
    with tempfile.TemporaryDirectory() as folder:
        generate(folder)
        return [name for name in GENERATED if not filecmp.cmp(os.path.join(folder, name), os.path.join(ROOT, name))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, write nothing; exit 1 if any file differs")
    args = parser.parse_args()
    if args.check:
        different = stale()
        for name in different:
            print(f"{name}: not what grpcio-tools generates from {PROTO}; run python3 scripts/csi_protos.py")
        return 1 if different else 0
    generate(ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
