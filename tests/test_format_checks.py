"""The seam checks what a format returns (SPEC §17, ``formats.seam``): the four mistakes of issue #52, each made by a
format registered as a contributor would register it (``tests/broken_formats.py``), refused in one line that names
the format as the culprit, never served; a format that makes none passes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from stfs import errors, formats
from tests.broken_formats import SUFFIX, Broken, registered
from tests.helpers import REPO, run

CULPRIT = "stfs's Broken reader (stfs/formats/broken)"
BUG = "a bug in stfs, not in the file (please report it)"


def source_for(tmp_path: Path, mistake: str) -> Path:
    """A file the real format of ``mistake`` reads, named to be claimed by the broken one."""
    path = tmp_path / f"model{SUFFIX}"
    if mistake == "gathered":
        np.savez(tmp_path / "model.npz", w=np.asfortranarray(np.arange(15, dtype=np.float32).reshape(3, 5)))
        (tmp_path / "model.npz").rename(path)
    else:
        save_file({"a": np.arange(6, dtype=np.float32), "w": np.ones((2, 3), np.float16)}, str(path))
    return path


def read(path: Path, known: formats.Format) -> formats.Header:
    data = path.read_bytes()
    return formats.read_with(
        known, lambda offset, size: data[offset : offset + size], path=str(path), file_size=len(data)
    )


@pytest.mark.parametrize(
    ("mistake", "said"),
    [
        (
            "dtype",
            "tensor 'a' with dtype 'bfloat16', which is neither safetensors' nor one its format declares",
        ),
        ("gathered", "96 of them, but shape [3, 5] of F32 is 60 bytes (end must be begin + bytes"),
        ("past-the-end", "tensor 'w' with bytes [152, 164) past the end of its file, which is 156 bytes"),
    ],
)
def test_a_header_a_format_gets_wrong_is_its_bug_in_one_line(tmp_path: Path, mistake: str, said: str) -> None:
    path = source_for(tmp_path, mistake)
    with registered(Broken(mistake)) as known, pytest.raises(errors.FormatBug) as caught:
        read(path, known)
    line = caught.value.message
    assert line.startswith(f"{path}: {CULPRIT} returned tensor ") and said in line and line.endswith(f": {BUG}")


def test_a_format_whose_name_is_not_its_registry_name_is_its_bug(tmp_path: Path) -> None:
    path = source_for(tmp_path, "name")
    with registered(Broken("name")) as known, pytest.raises(errors.FormatBug) as caught:
        read(path, known)
    assert (
        caught.value.message
        == f"{path}: {CULPRIT} calls itself 'brokenformat' but REGISTRY lists it as 'broken': {BUG}"
    )


def test_a_format_not_in_the_registry_is_its_bug(tmp_path: Path) -> None:
    path = source_for(tmp_path, "none")
    with pytest.raises(errors.FormatBug) as caught:
        read(path, Broken("none"))
    assert caught.value.message == f"{path}: stfs's Broken reader is not in formats.REGISTRY: {BUG}"


def test_a_format_without_a_mistake_passes(tmp_path: Path) -> None:
    path = source_for(tmp_path, "none")
    with registered(Broken("none")) as known:
        header = read(path, known)
    assert header.format == "broken" and [entry.dtype for entry in header.tensors] == ["F32", "F16"]


def broken_command(mistake: str, *args: str) -> subprocess.CompletedProcess:
    """The stfs command line with the broken format ``mistake`` registered (``python3 -m tests.broken_formats``)."""
    return run([sys.executable, "-m", "tests.broken_formats", mistake, "stfs", *args], cwd=REPO, timeout=120)


@pytest.mark.parametrize("mistake", ["dtype", "gathered", "past-the-end", "name"])
def test_info_check_and_mount_refuse_a_format_s_mistake_in_one_line(
    tmp_path: Path, mistake: str, require_fuse: None
) -> None:
    path = source_for(tmp_path, mistake)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    for result in (broken_command(mistake, "info", str(path)), broken_command(mistake, "mount", str(path), str(mnt))):
        assert result.returncode == 1 and not mnt.is_mount()
        [line] = result.stderr.strip().splitlines()
        assert line.startswith(f"stfs: {path}: {CULPRIT} ") and line.endswith(BUG) and "Traceback" not in line
    check = broken_command(mistake, "check", str(path))
    assert check.returncode == 1 and check.stdout.strip().startswith(f"{path}: {CULPRIT} ") and BUG in check.stdout
    assert broken_command("none", "info", str(path.with_name("none" + SUFFIX))).returncode == 1  # no such file
    save_file({"a": np.arange(6, dtype=np.float32)}, str(tmp_path / f"fine{SUFFIX}"))
    fine = broken_command("none", "info", str(tmp_path / f"fine{SUFFIX}"))
    assert fine.returncode == 0 and "F32" in fine.stdout, fine.stderr


def rule_errors() -> list[type[errors.RuleError]]:
    """Every format's rule errors (its module's, or its package's ``rules.py``) and the ones formats share."""
    import importlib
    import inspect

    modules = [errors]
    for name, _, _ in formats.REGISTRY:
        module = importlib.import_module(f"stfs.formats.{name}")
        modules.append(module)
        if hasattr(module, "__path__"):  # a package: its rules live in rules.py
            modules.append(importlib.import_module(f"stfs.formats.{name}.rules"))
    found = {
        value
        for module in modules
        for _, value in inspect.getmembers(module, inspect.isclass)
        if issubclass(value, errors.RuleError) and value is not errors.RuleError
    }
    return sorted(found, key=lambda kind: (kind.__module__, kind.__name__))


@pytest.mark.parametrize("kind", rule_errors(), ids=lambda kind: kind.__name__)
def test_every_refusal_reads_as_a_sentence_with_a_way_out(kind: type[errors.RuleError]) -> None:
    """What is wrong, that stfs cannot mount this kind of file (its format's words), by which rule, what to do."""
    line = kind("/data/m.x", "what is wrong", "layers.0.w").message
    assert "\n" not in line and line.startswith("/data/m.x: tensor 'layers.0.w': what is wrong: stfs cannot mount ")
    assert f", by its rule '{kind.rule_text}' ({kind.__name__}); " in line and kind.rule_text and kind.advice
    kind_of_file = line.partition("stfs cannot mount ")[2].partition(", by its rule")[0]
    assert kind_of_file in ("this file", f"this {kind.format_name}", f"it as a {kind.format_name}")
    assert kind.__module__ in ("stfs.errors", "stfs.formats.zip") or kind.format_name  # a format names its files
