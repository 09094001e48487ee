"""The Kubernetes node plugin (SPEC §15): CSI's Identity and Node services over gRPC in, ``stfs mount`` daemons out.

``volumes`` reads a request into a ``Volume`` (no I/O), ``policy`` decides whether the operator allows its SOURCE
and cache (``--allow-source``, ``--allow-path``, ``--max-cache-size``), ``environment`` makes its daemon's
environment (its own secret's credentials only, unless ``--node-credentials``), ``mounts`` runs ``stfs mount``/``stfs
unmount`` and reads the mount table, ``state`` keeps what was published under ``--state-dir``, ``server`` answers
the calls. No format or source code here: a volume's SOURCE goes to ``stfs mount`` as it came. ``csi_pb2*`` are
generated from ``csi.proto`` (scripts/csi_protos.py).
"""

DRIVER_NAME = "stfs.csi.k8s.io"
DEFAULT_STATE_DIR = "/var/lib/stfs-csi"
