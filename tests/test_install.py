"""A plain install: ``pip install .`` (no extras, pip's isolated build) into a fresh venv, then ``stfs info`` and
``stfs mount`` of a model over HTTP from the tests' nginx, and ``man stfs``. One venv for the module (pip may reach
the package registries), about half a minute."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import stfs
from tests.helpers import read_cold, run, tensor_path
from tests.models import tensor_bytes, write_numpy
from tests.servers import Nginx

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parent.parent


def _copy_project(target: Path) -> Path:
    """The project's files (what git tracks), so the build leaves nothing behind in the worktree."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if listed.returncode == 0:
        for name in filter(None, listed.stdout.decode().split("\0")):
            if (ROOT / name).is_file():
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / name, target / name)
    else:  # not a git checkout (an sdist): the folders that make the package
        ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", ".*cache")
        shutil.copytree(ROOT, target, ignore=ignore, dirs_exist_ok=True)
    return target


@pytest.fixture(scope="module")
def plain_install(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv with ``pip install PROJECT`` in it, and the environment to run it with."""
    tmp_path = tmp_path_factory.mktemp("install")
    project = _copy_project(tmp_path / "project")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "PYTHONHOME", "MANPATH")}
    pip = run([str(venv / "bin" / "pip"), "install", "-q", str(project)], env=env, cwd=tmp_path, timeout=540)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    return venv, env


def test_a_plain_install_reads_a_model_over_http(
    plain_install: tuple[Path, dict[str, str]], nginx: Nginx, tmp_path: Path, require_fuse: None
) -> None:
    venv, env = plain_install
    # the venv's own obstore and huggingface_hub, not the machine's
    where = run(
        [str(venv / "bin" / "python"), "-c", "import obstore, huggingface_hub; print(obstore.__file__)"],
        env=env,
        cwd=tmp_path,
    )
    assert where.returncode == 0 and where.stdout.startswith(str(venv)), where.stdout + where.stderr

    local = tmp_path / "m.safetensors"
    arrays = {"embed.weight": np.arange(3000, dtype=np.float32), "head.bias": np.arange(7, dtype=np.int64)}
    write_numpy(str(local), arrays)
    url = nginx.put("models/m.safetensors", local.read_bytes())
    stfs = str(venv / "bin" / "stfs")

    info = run([stfs, "info", url], env=env, cwd=tmp_path)
    assert info.returncode == 0, info.stderr
    assert "embed.weight" in info.stdout and "total: 2 tensors" in info.stdout
    assert "Traceback" not in info.stderr

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = run([stfs, "mount", url, str(mnt), "--log-file", str(tmp_path / "daemon.log")], env=env, cwd=tmp_path)
    assert mounted.returncode == 0, mounted.stderr
    try:
        for name in arrays:
            assert read_cold(tensor_path(str(mnt), name)) == tensor_bytes(str(local), name), name
        assert read_cold(str(mnt / "files" / "m.safetensors")) == local.read_bytes()
    finally:
        if os.path.ismount(mnt):
            unmounted = run([stfs, "unmount", str(mnt)], env=env, cwd=tmp_path)
            assert unmounted.returncode == 0, unmounted.stderr


def test_a_plain_install_has_the_man_page(plain_install: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """stfs(1), written from the command line's parser as the wheel was built, is in the venv's share/man/man1,
    where ``man stfs`` finds it once the venv's bin is on PATH (man-db takes PREFIX/share/man from PATH)."""
    venv, env = plain_install
    page = venv / "share" / "man" / "man1" / "stfs.1"
    text = page.read_text()
    assert text.startswith('.TH STFS "1"') and f"stfs {stfs.__version__}" in text
    for command in ("mount", "unmount", "info", "check"):
        assert f"COMMAND \\fI\\,'stfs {command}'" in text, command
    assert "hf://" in text and "s3://" in text
    if shutil.which("man") is None:
        pytest.skip("no man here to read it with")
    shown = run(["man", "-P", "cat", "stfs"], env={**env, "PATH": f"{venv / 'bin'}:/usr/bin:/bin", "MANWIDTH": "100"})
    assert shown.returncode == 0, shown.stderr
    assert "stfs - mount safetensors, GGUF, " in " ".join(shown.stdout.split())
    assert "stfs mount [-h]" in shown.stdout.replace("‐", "-")
