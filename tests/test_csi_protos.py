"""stfs/csi's generated gRPC code is what grpcio-tools makes of stfs/csi/csi.proto (scripts/csi_protos.py --check),
and csi.proto keeps CSI v1's package, services and field numbers, which is all the kubelet's client sees on the
wire."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

from stfs.csi import csi_pb2
from tests.helpers import run

ROOT = Path(__file__).resolve().parent.parent

# CSI v1.12.0's csi.proto: message -> field -> number, for every field the plugin reads or writes
FIELDS = {
    "GetPluginInfoResponse": {"name": 1, "vendor_version": 2, "manifest": 3},
    "GetPluginCapabilitiesResponse": {"capabilities": 1},
    "ProbeResponse": {"ready": 1},
    "ControllerGetCapabilitiesResponse": {"capabilities": 1},
    "VolumeCapability": {"block": 1, "mount": 2, "access_mode": 3},
    "VolumeCapability.MountVolume": {"fs_type": 1, "mount_flags": 2, "volume_mount_group": 3},
    "VolumeCapability.AccessMode": {"mode": 1},
    "NodePublishVolumeRequest": {
        "volume_id": 1, "publish_context": 2, "staging_target_path": 3, "target_path": 4, "volume_capability": 5,
        "readonly": 6, "secrets": 7, "volume_context": 8,
    },
    "NodeUnpublishVolumeRequest": {"volume_id": 1, "target_path": 2},
    "NodeGetCapabilitiesResponse": {"capabilities": 1},
    "NodeGetInfoResponse": {"node_id": 1, "max_volumes_per_node": 2, "accessible_topology": 3},
}  # fmt: skip
ACCESS_MODES = {
    "UNKNOWN": 0, "SINGLE_NODE_WRITER": 1, "SINGLE_NODE_READER_ONLY": 2, "MULTI_NODE_READER_ONLY": 3,
    "MULTI_NODE_SINGLE_WRITER": 4, "MULTI_NODE_MULTI_WRITER": 5, "SINGLE_NODE_SINGLE_WRITER": 6,
    "SINGLE_NODE_MULTI_WRITER": 7,
}  # fmt: skip
METHODS = {
    "csi.v1.Identity": ["GetPluginInfo", "GetPluginCapabilities", "Probe"],
    "csi.v1.Controller": ["ControllerGetCapabilities"],
    "csi.v1.Node": ["NodePublishVolume", "NodeUnpublishVolume", "NodeGetCapabilities", "NodeGetInfo"],
}


def test_the_wire_is_csi_v1s() -> None:
    assert csi_pb2.DESCRIPTOR.package == "csi.v1"
    for name, fields in FIELDS.items():
        message = csi_pb2.DESCRIPTOR.message_types_by_name[name.split(".")[0]]
        for part in name.split(".")[1:]:
            message = message.nested_types_by_name[part]
        assert {field.name: field.number for field in message.fields} == fields, name
    modes = csi_pb2.VolumeCapability.AccessMode.Mode
    assert dict(modes.items()) == ACCESS_MODES
    services = {service.full_name: [method.name for method in service.methods]
                for service in csi_pb2.DESCRIPTOR.services_by_name.values()}  # fmt: skip
    assert services == METHODS


def test_the_generated_code_is_what_grpcio_tools_makes_of_csi_proto() -> None:
    pytest.importorskip("grpc_tools")
    made_by = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", (ROOT / "stfs/csi/csi_pb2_grpc.py").read_text())
    assert made_by is not None
    if importlib.metadata.version("grpcio-tools") != made_by[1]:
        pytest.skip(f"grpcio-tools {importlib.metadata.version('grpcio-tools')} here; {made_by[1]} made the code")
    checked = run([sys.executable, str(ROOT / "scripts" / "csi_protos.py"), "--check"], cwd=ROOT)
    assert checked.returncode == 0, checked.stdout + checked.stderr
