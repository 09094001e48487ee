"""``stfs check`` and ``stfs info`` through the real command, plus exit codes, --help, --version and --debug."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stfs
from stfs import formats
from stfs.cli import main
from stfs.formats import REGISTRY, named
from stfs.sources.base import URL_SCHEMES
from tests.helpers import run
from tests.models import rich_arrays, sharded_arrays, write_header, write_numpy, write_raw, write_sharded

COMMANDS = ["mount", "unmount", "info", "check", "diff"]


REPO = str(Path(__file__).resolve().parent.parent)


def stfs_run(*args: str, **kwargs: Any) -> subprocess.CompletedProcess:
    """The stfs command of this checkout: ``python -m stfs`` with the checkout first on the path (the ``stfs`` on
    PATH may be another checkout's install)."""
    env = dict(kwargs.pop("env", None) or os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return run([sys.executable, "-m", "stfs", *args], env=env, **kwargs)


def lines(text: str) -> list[str]:
    return text.splitlines()


def valid_file(tmp_path: Path, name: str = "good.safetensors") -> str:
    return write_numpy(str(tmp_path / name), rich_arrays(), metadata={"format": "np"})


def broken_file(tmp_path: Path, name: str = "bad.safetensors") -> str:
    header = {
        "ok": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
        "layers.0.bad": {"dtype": "F33", "shape": [1], "data_offsets": [1, 5]},
    }
    return write_header(str(tmp_path / name), header, data=b"\0" * 5)


# -- stfs check --------------------------------------------------------------------------------------------------------


def test_check_valid(tmp_path: Path) -> None:
    path = valid_file(tmp_path)
    result = stfs_run("check", path)
    assert result.returncode == 0, result.stderr
    assert lines(result.stdout) == [f"{path}: ok ({len(rich_arrays())} tensors)"]
    assert result.stderr == ""


def test_check_invalid(tmp_path: Path) -> None:
    path = broken_file(tmp_path)
    result = stfs_run("check", path)
    assert result.returncode == 1
    [line] = lines(result.stdout)
    assert line.startswith(f"{path}: ")
    assert "'layers.0.bad'" in line
    assert "rule 7" in line and "F33" in line
    assert "Traceback" not in result.stderr


def test_check_one_line_per_problem(tmp_path: Path) -> None:
    index = write_sharded(str(tmp_path / "set"), sharded_arrays())
    shards = sorted(p for p in os.listdir(tmp_path / "set") if p.endswith(".safetensors"))
    os.unlink(tmp_path / "set" / shards[0])
    with open(tmp_path / "set" / shards[1], "ab") as stream:
        stream.write(b"x")
    result = stfs_run("check", index)
    assert result.returncode == 1
    out = lines(result.stdout)
    assert len(out) == 2, out
    assert index in out[0] and shards[0] in out[0] and "missing" in out[0]
    assert out[1].startswith(str(tmp_path / "set" / shards[1])) and "rule 11" in out[1]


def test_check_several_sources(tmp_path: Path) -> None:
    good = valid_file(tmp_path)
    bad = broken_file(tmp_path)
    missing = str(tmp_path / "missing.safetensors")
    index = write_sharded(str(tmp_path / "set"), sharded_arrays())
    result = stfs_run("check", good, bad, missing, index)
    assert result.returncode == 1
    out = lines(result.stdout)
    assert len(out) == 4, out
    assert out[0] == f"{good}: ok ({len(rich_arrays())} tensors)"
    assert out[1].startswith(f"{bad}: tensor 'layers.0.bad': rule 7")
    assert out[2].startswith(missing) and "no such file" in out[2]
    assert out[3] == f"{index}: ok (4 tensors)"
    assert stfs_run("check", good, index).returncode == 0


def test_check_a_folder_of_models(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    first = write_numpy(str(tmp_path / "a" / "one.safetensors"), {"x": np.ones(2, np.float32)})
    second = broken_file(tmp_path / "a", "two.safetensors")
    index = write_sharded(str(tmp_path / "b"), sharded_arrays())
    result = stfs_run("check", str(tmp_path))
    assert result.returncode == 1
    out = lines(result.stdout)
    assert out[0] == f"{first}: ok (1 tensors)"
    assert out[1].startswith(f"{second}: tensor 'layers.0.bad': rule 7")
    assert out[2] == f"{index}: ok (4 tensors)"
    os.unlink(second)
    assert stfs_run("check", str(tmp_path)).returncode == 0


def test_check_reports_warnings_and_passes(tmp_path: Path) -> None:
    index = write_sharded(str(tmp_path), sharded_arrays(), total_size=7)
    result = stfs_run("check", index)
    assert result.returncode == 0
    out = lines(result.stdout)
    assert len(out) == 2
    assert out[0].startswith("warning: ") and "total_size" in out[0]
    assert out[1] == f"{index}: ok (4 tensors)"


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["check"],
        ["info"],
        ["check", "--bogus", "x"],
        ["info", "--json"],
        ["mount", "only-source"],
        ["unmount"],
        ["mount", "a", "b", "--layout", "sideways"],
        ["info", "http://127.0.0.1:9/m.safetensors", "--timeout", "inf"],  # was a first read retried for ever
        ["check", "http://127.0.0.1:9/m.safetensors", "--timeout", "1e300"],
        ["mount", "http://127.0.0.1:9/m.safetensors", "m", "--timeout", "inf"],
        ["mount", "m.safetensors", ""],  # "$MNT" unset: it mounted over the working folder
        ["mount", "", "m"],
        ["unmount", ""],
        ["info", ""],  # it listed every model under the working folder
        ["check", "m.safetensors", ""],
        ["diff", "a.safetensors"],
        ["diff", "a.safetensors", "b.safetensors", "--atol", "-1"],
        ["diff", "a.safetensors", "b.safetensors", "--rtol", "nan"],
        ["diff", "a.safetensors", ""],
    ],
)
def test_usage_errors_exit_2(argv: list[str]) -> None:
    result = stfs_run(*argv)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.startswith("stfs") and " --help)" in result.stderr  # one line: SPEC §5
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)])
def test_help_everywhere(command: list[str]) -> None:
    result = stfs_run(*command, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith(f"usage: {' '.join(['stfs', *command])} ")
    assert "--version" in result.stdout and "--debug" in result.stdout
    assert stfs_run(*command, "-h").stdout == result.stdout


@pytest.mark.parametrize("command", [[], ["mount"], ["info"], ["check"]])
def test_help_says_what_source_can_be_with_an_example(command: list[str]) -> None:
    text = " ".join(stfs_run(*command, "--help").stdout.split())  # argparse wraps lines anywhere
    for kind in ("a model file", ".safetensors.index.json", "a folder", "http://", "https://", "s3://", "hf://"):
        assert kind in text
    examples = [line for line in stfs_run(*command, "--help").stdout.splitlines() if line.startswith("example: ")]
    assert len(examples) == 1 and examples[0].startswith(" ".join(["example: stfs", *command]))


def test_help_names_every_format_and_url_scheme_stfs_reads() -> None:
    """SOURCE's help is made from what the code reads (formats.REGISTRY and each format's title, URL_SCHEMES), so
    it names GGUF, a DCP folder's .metadata or a new scheme as soon as stfs reads them."""
    titles = [named(module).title for module, _, _ in REGISTRY]
    suffixes = [suffix for _, names, indexes in REGISTRY for suffix in (*names, *indexes)]
    for command in ([], ["mount"], ["info"], ["check"], ["diff"]):
        text = " ".join(stfs_run(*command, "--help").stdout.split())
        for word in (*titles, *suffixes, *URL_SCHEMES):
            assert word in text, (command, word)


@pytest.mark.parametrize("command", [[], *([c] for c in COMMANDS)])
def test_version_everywhere(command: list[str]) -> None:
    result = stfs_run(*command, "--version")
    assert result.returncode == 0
    assert result.stdout == f"stfs {stfs.__version__}\n"


def test_python_dash_m() -> None:
    result = run([sys.executable, "-m", "stfs", "--version"])
    assert result.returncode == 0
    assert result.stdout == f"stfs {stfs.__version__}\n"


# -- a mistyped command is not a mount ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["chek", "m6"], "unknown command 'chek' (did you mean check?)"),
        (
            ["inof", "tiny.safetensors"],
            "unknown command 'inof' (did you mean info?)",
        ),  # was "mountpoint is not a dir..."
        (["moutn", "tiny.safetensors", "m6"], "unknown command 'moutn' (did you mean mount?)"),
        (["chek"], "unknown command 'chek' (did you mean check?)"),
        (["--debug", "dif", "a", "b"], "unknown command 'dif' (did you mean diff?)"),
        (["xyzzy", "m6"], "unknown command 'xyzzy' (commands: mount, unmount, info, check, diff, csi)"),
    ],
)
def test_a_mistyped_command_is_a_usage_error_not_a_mount(tmp_path: Path, argv: list[str], said: str) -> None:
    """``stfs SOURCE MNT`` is mount(8)'s form only where it can be one; a word that names no file is a command
    mistyped (it was a mount of ./chek at m6: "no such file or directory")."""
    valid_file(tmp_path, "tiny.safetensors")
    (tmp_path / "m6").mkdir()
    result = stfs_run(*argv, cwd=tmp_path)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"stfs: {said}\n")
    assert not os.path.ismount(tmp_path / "m6")


@pytest.mark.parametrize("how", ["existing", "url", "o"])
def test_the_mount8_form_where_it_can_be_one(tmp_path: Path, how: str) -> None:
    """An existing SOURCE, a URL, or ``-o`` as mount(8) always passes: ``stfs mount``, whose own error then shows."""
    source = {"existing": "m.safetensors", "url": "ftp://host/m.safetensors", "o": "missing.safetensors"}[how]
    (tmp_path / "m.safetensors").write_bytes(b"\0" * 4)
    argv = [source, str(tmp_path / "no-such-folder"), *(["-o", "ro"] if how == "o" else [])]
    result = stfs_run(*argv, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "unknown command" not in result.stderr and "Traceback" not in result.stderr


def test_umount_is_unmount(tmp_path: Path, mount: Any) -> None:
    mnt = mount(valid_file(tmp_path))
    result = stfs_run("umount", mnt)
    assert (result.returncode, result.stderr) == (0, "")
    assert not os.path.ismount(mnt)
    assert stfs_run("umount", "--help").stdout.startswith("usage: stfs unmount ")


# -- errors: one line, no traceback; --debug shows one ---------------------------------------------------------------


@pytest.mark.parametrize("command", ["info", "check"])
def test_missing_source(tmp_path: Path, command: str) -> None:
    missing = str(tmp_path / "nope.safetensors")
    result = stfs_run(command, missing)
    assert result.returncode == 1
    where = result.stderr if command == "info" else result.stdout
    assert lines(where) == [
        f"stfs: {missing}: no such file or directory" if command == "info" else f"{missing}: no such file or directory"
    ]
    assert "Traceback" not in result.stderr + result.stdout


def test_info_error_is_one_line_on_stderr(tmp_path: Path) -> None:
    path = broken_file(tmp_path)
    result = stfs_run("info", path)
    assert result.returncode == 1
    assert result.stdout == ""
    [line] = lines(result.stderr)
    assert line.startswith(f"stfs: {path}: tensor 'layers.0.bad': rule 7 (MalformedTensorInfo)")


def test_info_error_of_a_sharded_set_is_one_line(tmp_path: Path) -> None:
    index = write_sharded(str(tmp_path), sharded_arrays())
    for name in os.listdir(tmp_path):
        if name.endswith(".safetensors"):
            os.unlink(tmp_path / name)
    result = stfs_run("info", index)
    assert result.returncode == 1
    [line] = lines(result.stderr)
    assert line.startswith(f"stfs: {index}: shard ") and line.endswith("(and 1 more)")


@pytest.mark.parametrize("argv", [["--debug", "info"], ["info", "--debug"], ["--debug", "check", "--debug"]])
def test_debug_shows_a_traceback(tmp_path: Path, argv: list[str]) -> None:
    missing = str(tmp_path / "nope.safetensors")
    result = stfs_run(*argv, missing)
    assert result.returncode == 1
    if "info" in argv:
        assert "Traceback (most recent call last)" in result.stderr
        assert f"stfs.errors.SourceError: {missing}: no such file or directory" in result.stderr
    else:  # check reports problems as its output, with or without --debug
        assert lines(result.stdout) == [f"{missing}: no such file or directory"]


def test_non_fuse_commands_need_no_fuse_library(tmp_path: Path) -> None:
    path = valid_file(tmp_path)
    code = (
        "import sys; sys.modules['mfusepy'] = None; sys.modules['fuse'] = None\n"
        "from stfs.cli import main\n"
        f"sys.exit(main(['check', {path!r}]) + main(['info', '--json', {path!r}]))"
    )
    result = run([sys.executable, "-c", code])
    assert result.returncode == 0, result.stderr
    assert "ok (" in result.stdout


def test_closed_stdout_is_not_a_traceback(tmp_path: Path) -> None:
    path = write_numpy(str(tmp_path / "many.safetensors"), {f"t{i}": np.zeros(2, np.float32) for i in range(20_000)})
    process = subprocess.Popen(["stfs", "info", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.read(100)
    process.stdout.close()
    stderr = process.stderr.read().decode()
    assert process.wait(timeout=60) == 141
    assert stderr == ""


@pytest.mark.timeout(60)
def test_huge_integers_without_a_digit_limit(tmp_path: Path) -> None:
    # PYTHONINTMAXSTRDIGITS=0 lifts Python's guard against quadratic int(); the reader must not depend on it.
    env = {**os.environ, "PYTHONINTMAXSTRDIGITS": "0"}
    raw = b'{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + b"7" * 308 + b"}}"
    path = write_header(str(tmp_path / "big.safetensors"), None, raw=raw, data=b"x")
    result = stfs_run("check", path, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    for huge in (
        raw.replace(b"7" * 308, b"7" * 2_000_000),
        raw.replace(b'"shape":[1]', b'"shape":[' + b"7" * 2_000_000 + b"]"),
    ):
        path = write_header(str(tmp_path / "bad.safetensors"), None, raw=huge, data=b"x")
        result = stfs_run("check", path, env=env)
        assert result.returncode == 1
        assert "rule 5 (NumberOutOfRange)" in result.stdout


# -- stfs info --------------------------------------------------------------------------------------------------------


def info_json(*sources: str) -> dict[str, Any]:
    result = stfs_run("info", "--json", *sources)
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_info_json(tmp_path: Path) -> None:
    arrays = rich_arrays()
    path = valid_file(tmp_path)
    report = info_json(path)
    [model] = report["models"]
    assert model["source"] == path
    assert model["name"] == ""
    assert model["sharded"] is False
    assert model["metadata"] == {"format": "np"}
    assert model["warnings"] == []
    by_name = {t["name"]: t for t in model["tensors"]}
    assert set(by_name) == set(arrays)
    with open(path, "rb") as stream:
        for name, array in arrays.items():
            row = by_name[name]
            assert row["shape"] == list(array.shape)
            assert row["parameters"] == array.size
            assert row["bytes"] == array.nbytes
            assert row["file"] == path
            stream.seek(row["offset"])
            assert stream.read(row["bytes"]) == array.tobytes()
    assert by_name["model.layers.0.mlp.up_proj.weight"]["dtype"] == "F16"
    assert by_name["scalar"]["shape"] == [] and by_name["scalar"]["parameters"] == 1
    assert model["dtypes"]["F32"] == {
        "tensors": 3,
        "parameters": 64 * 16 + 1 + 0,
        "bytes": (64 * 16 + 1) * 4,
    }
    assert model["dtypes"]["BOOL"] == {"tensors": 1, "parameters": 11, "bytes": 11}
    assert list(model["dtypes"]) == sorted(model["dtypes"])
    totals = {
        "tensors": len(arrays),
        "parameters": sum(a.size for a in arrays.values()),
        "bytes": sum(a.nbytes for a in arrays.values()),
    }
    assert model["totals"] == totals
    assert report["totals"] == totals


def test_info_json_of_several_sources(tmp_path: Path) -> None:
    bf16 = write_raw(
        str(tmp_path / "bf16.safetensors"), {"w": ("BF16", [3, 5], bytes(30)), "v": ("BF16", [2], bytes(4))}
    )
    index = write_sharded(str(tmp_path / "set"), sharded_arrays())
    report = info_json(bf16, index)
    first, second = report["models"]
    assert first["dtypes"] == {"BF16": {"tensors": 2, "parameters": 17, "bytes": 34}}
    assert second["sharded"] is True
    assert second["source"] == index
    shards = sharded_arrays()
    files = {name: str(tmp_path / "set" / shard) for shard, arrays in shards.items() for name in arrays}
    assert {t["name"]: t["file"] for t in second["tensors"]} == files
    params = sum(a.size for arrays in shards.values() for a in arrays.values())
    assert second["totals"]["parameters"] == params
    assert report["totals"] == {
        "tensors": 2 + 4,
        "parameters": 17 + params,
        "bytes": 34 + sum(a.nbytes for arrays in shards.values() for a in arrays.values()),
    }


def test_info_table(tmp_path: Path) -> None:
    path = write_numpy(
        str(tmp_path / "t.safetensors"),
        {
            "model.embed_tokens.weight": np.zeros((1000, 16), np.float32),
            "model.norm.weight": np.zeros(16, np.float16),
            "scalar": np.zeros((), np.int64),
        },
    )
    result = stfs_run("info", path)
    assert result.returncode == 0, result.stderr
    out = lines(result.stdout)
    assert out[0] == f"== {path}"
    assert out[1].split() == ["name", "dtype", "shape", "params", "file"]
    rows = {line.split()[0]: line for line in out[2:5]}
    assert rows["model.embed_tokens.weight"].split() == [
        "model.embed_tokens.weight",
        "F32",
        "[1000,",
        "16]",
        "16,000",
        "t.safetensors",
    ]
    assert rows["model.norm.weight"].split() == ["model.norm.weight", "F16", "[16]", "16", "t.safetensors"]
    assert rows["scalar"].split() == ["scalar", "I64", "[]", "1", "t.safetensors"]
    # the params column is right-aligned: every row's params end in the same column
    ends = {line.rindex(line.split()[-2]) + len(line.split()[-2]) for line in out[2:5]}
    assert len(ends) == 1
    counts = {line.split()[0]: line.split()[1:] for line in out[6:9]}
    assert counts["dtype"] == ["tensors", "params", "bytes"]
    assert counts["F32"] == ["1", "16,000", "64,000"]
    assert counts["F16"] == ["1", "16", "32"]
    assert out[-1] == "total: 3 tensors, 16,017 parameters, 64,040 bytes"


def test_info_table_of_several_models_has_a_grand_total(tmp_path: Path) -> None:
    a = write_numpy(str(tmp_path / "a.safetensors"), {"x": np.zeros(10, np.uint8)})
    b = write_numpy(str(tmp_path / "b.safetensors"), {"y": np.zeros(5, np.int16)})
    result = stfs_run("info", a, b)
    assert result.returncode == 0
    assert lines(result.stdout)[-1] == "all models: total: 2 tensors, 15 parameters, 20 bytes"


def test_info_names_models_of_a_folder(tmp_path: Path) -> None:
    (tmp_path / "unet").mkdir()
    write_numpy(str(tmp_path / "unet" / "diffusion_pytorch_model.safetensors"), {"x": np.zeros(1, np.uint8)})
    write_numpy(str(tmp_path / "model.safetensors"), {"y": np.zeros(1, np.uint8)})
    report = info_json(str(tmp_path))
    assert [m["name"] for m in report["models"]] == ["model", "unet/diffusion_pytorch_model"]
    table = stfs_run("info", str(tmp_path)).stdout
    assert f"== {tmp_path / 'unet' / 'diffusion_pytorch_model.safetensors'}  (unet/diffusion_pytorch_model)" in table


def test_info_warnings_go_to_stderr(tmp_path: Path) -> None:
    index = write_sharded(str(tmp_path), sharded_arrays(), total_size=1)
    result = stfs_run("info", "--json", index)
    assert result.returncode == 0
    [warning] = lines(result.stderr)
    assert warning.startswith("stfs: warning: ") and "total_size" in warning
    report = json.loads(result.stdout)
    assert report["models"][0]["warnings"] == [warning.removeprefix("stfs: warning: ")]


def test_info_odd_names_round_trip_through_json(tmp_path: Path) -> None:
    names = ["é/🦀", "a\nb", "x\x00y", ""]
    path = write_numpy(str(tmp_path / "odd.safetensors"), {n: np.zeros(1, np.uint8) for n in names})
    report = info_json(path)
    assert sorted(t["name"] for t in report["models"][0]["tensors"]) == sorted(names)


# -- in process -------------------------------------------------------------------------------------------------------


def test_main_in_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = valid_file(tmp_path)
    bad = broken_file(tmp_path)
    assert main(["check", good]) == 0
    assert capsys.readouterr().out == f"{good}: ok ({len(rich_arrays())} tensors)\n"
    assert main(["check", good, bad]) == 1
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and "rule 7" in out[1]
    assert main(["info", "--json", good]) == 0
    assert json.loads(capsys.readouterr().out)["totals"]["tensors"] == len(rich_arrays())
    assert main(["info", bad]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"stfs: {bad}: ")
    with pytest.raises(SystemExit) as usage:
        main(["info"])
    assert usage.value.code == 2
    with pytest.raises(SystemExit) as version:
        main(["check", "--version"])
    assert version.value.code == 0


def test_main_debug_raises(tmp_path: Path) -> None:
    bad = broken_file(tmp_path)
    from stfs import errors

    with pytest.raises(errors.MalformedTensorInfo):
        main(["--debug", "info", bad])
    with pytest.raises(errors.MalformedTensorInfo):
        main(["info", bad, "--debug"])


# -- Qwen2-0.5B, header only ------------------------------------------------------------------------------------------

QWEN_HIDDEN = 896
QWEN_INTERMEDIATE = 4864
QWEN_KV = 2 * 64  # num_key_value_heads x head_dim
QWEN_VOCAB = 151936
QWEN_LAYERS = 24


def qwen2_shapes() -> dict[str, list[int]]:
    shapes = {"model.embed_tokens.weight": [QWEN_VOCAB, QWEN_HIDDEN]}
    for i in range(QWEN_LAYERS):
        layer = f"model.layers.{i}"
        shapes.update(
            {
                f"{layer}.input_layernorm.weight": [QWEN_HIDDEN],
                f"{layer}.self_attn.q_proj.weight": [QWEN_HIDDEN, QWEN_HIDDEN],
                f"{layer}.self_attn.q_proj.bias": [QWEN_HIDDEN],
                f"{layer}.self_attn.k_proj.weight": [QWEN_KV, QWEN_HIDDEN],
                f"{layer}.self_attn.k_proj.bias": [QWEN_KV],
                f"{layer}.self_attn.v_proj.weight": [QWEN_KV, QWEN_HIDDEN],
                f"{layer}.self_attn.v_proj.bias": [QWEN_KV],
                f"{layer}.self_attn.o_proj.weight": [QWEN_HIDDEN, QWEN_HIDDEN],
                f"{layer}.post_attention_layernorm.weight": [QWEN_HIDDEN],
                f"{layer}.mlp.gate_proj.weight": [QWEN_INTERMEDIATE, QWEN_HIDDEN],
                f"{layer}.mlp.up_proj.weight": [QWEN_INTERMEDIATE, QWEN_HIDDEN],
                f"{layer}.mlp.down_proj.weight": [QWEN_HIDDEN, QWEN_INTERMEDIATE],
            }
        )
    shapes["model.norm.weight"] = [QWEN_HIDDEN]  # tied embeddings: no lm_head
    return shapes


def test_qwen2_0_5b_totals(tmp_path: Path) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    position = 0
    for name, shape in sorted(qwen2_shapes().items()):  # the reference writes tensors sorted by name
        size = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [position, position + size]}
        position += size
    path = write_header(str(tmp_path / "model.safetensors"), header)
    os.truncate(path, os.path.getsize(path) + position)  # a sparse data section: nothing written, file valid

    report = info_json(path)
    assert report["totals"]["tensors"] == 290
    assert report["totals"]["parameters"] == 494_032_768
    assert report["totals"]["bytes"] == 2 * 494_032_768
    [model] = report["models"]
    assert model["dtypes"] == {"BF16": {"tensors": 290, "parameters": 494_032_768, "bytes": 988_065_536}}
    rows = {t["name"]: t for t in model["tensors"]}
    assert rows["model.layers.23.self_attn.k_proj.weight"]["shape"] == [128, 896]
    assert rows["model.layers.0.self_attn.q_proj.bias"]["parameters"] == 896
    assert rows["model.embed_tokens.weight"]["parameters"] == 136_134_656
    assert "lm_head.weight" not in rows
    table = stfs_run("info", path)
    assert lines(table.stdout)[-1] == "total: 290 tensors, 494,032,768 parameters, 988,065,536 bytes"
    assert stfs_run("check", path).stdout == f"{path}: ok (290 tensors)\n"


def test_info_table_keeps_one_row_per_tensor(tmp_path: Path) -> None:
    names = ["a\nb", "x\x00y", "\u202egnp.exe", "plain"]
    path = write_numpy(str(tmp_path / "odd.safetensors"), {n: np.zeros(1, np.uint8) for n in names})
    out = lines(stfs_run("info", path).stdout)
    rows = sorted(line.split()[0] for line in out[2:6])
    assert rows == sorted(["a\\nb", "x\\x00y", "\\u202egnp.exe", "plain"])
    assert out[6] == ""


def test_file_names_that_are_not_utf8(tmp_path: Path) -> None:
    folder = os.fsencode(tmp_path)
    path = os.path.join(folder, b"caf\xe9.safetensors")
    write_numpy(os.fsdecode(path), {"w": np.zeros(2, np.float32)})
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    result = run(["stfs", "check", path], env=env, text=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout == path + b": ok (1 tensors)\n"
    result = run(["stfs", "info", "--json", path], env=env, text=False)
    assert result.returncode == 0, result.stderr
    assert path in result.stdout


def test_check_an_empty_folder(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    result = stfs_run("check", str(tmp_path))
    assert result.returncode == 1
    [line] = lines(result.stdout)
    assert line.startswith(f"{tmp_path}: no {' or '.join(formats.MODEL_SUFFIXES)} file")
