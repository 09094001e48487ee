#!/usr/bin/env python3
"""A remote session: the sample model of demo.py served by nginx, as plain files and as a Hub-shaped repository,
mounted over HTTP and hf:// with nothing downloaded whole. The servers are the tests' own (tests/servers.py),
on 127.0.0.1; nothing leaves this machine.

Usage: python3 scripts/demo_remote.py [WORKDIR]   (default: a new temporary folder; needs nginx-light)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from scripts.demo import write_sample  # noqa: E402
from tests.servers import FakeHub, Nginx  # noqa: E402


def show(command: str, env: dict[str, str]) -> None:
    print(f"$ {command}", flush=True)
    subprocess.run(command, shell=True, check=False, env=env)


def main() -> int:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="stfs-remote-demo-"))
    model = work / "model"
    model.mkdir(parents=True, exist_ok=True)
    write_sample(str(model))
    (model / "config.json").write_text('{"model_type": "toy", "hidden_size": 64}\n')
    nginx = Nginx(work / "nginx")
    nginx.start()
    try:
        files = {path.name: path.read_bytes() for path in sorted(model.iterdir())}
        for name, data in files.items():
            nginx.put(f"models/toy/{name}", data)
        hub = FakeHub(nginx)
        commit = hub.publish_repo("demo", "toy", files)
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
        os.chdir(work)
        (work / "mnt").mkdir(exist_ok=True)
        url = f"{nginx.url}/models/toy/model.safetensors.index.json"
        print(f"# nginx on {nginx.url}; the Hub's API and /resolve/ at {hub.endpoint}; commit {commit[:12]}")
        show(f"stfs info {url} --json | jq -c .transfer", env)
        show(f"stfs check {url}", env)
        show("stfs mount hf://demo/toy mnt", env)
        try:
            show("ls mnt mnt/files", env)
            show("getfattr -n user.safetensors.file --only-values mnt/tensors/model/norm/weight; echo", env)
            show(
                "cmp mnt/files/model-00002-of-00002.safetensors model/model-00002-of-00002.safetensors && echo same",
                env,
            )
            show(
                "python3 -c \"from safetensors import safe_open; f = safe_open('mnt/files/"
                "model-00001-of-00002.safetensors', 'numpy'); print(f.get_tensor('model.layers.0.mlp.up_proj.weight')"
                '.shape)"',
                env,
            )
            show("getfattr -n user.stfs.changed --only-values mnt; echo", env)
        finally:
            show("stfs unmount mnt", env)
        print(
            f"# requests the CDN served: {len(hub.cdn_log.entries())}, "
            f"bytes: {hub.cdn_log.transfer().bytes:,} of {sum(len(d) for d in files.values()):,}"
        )
    finally:
        nginx.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
