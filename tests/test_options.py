"""``-o`` items sorted into stfs settings, ignored mount(8) options and libfuse's, and the allow_other check;
``stfs SOURCE MNT -o OPTS`` read as ``stfs mount``. No mounts here."""

from __future__ import annotations

import grp
import os
import shlex
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stfs import daemon
from stfs.cli import main, mount8_form
from stfs.errors import MountError
from stfs.fuse_conf import allows_other, check_allow_other
from stfs.options import READ_ONLY_WARNING, OptionError, Setting, choice, sort_options
from stfs.sources import LocalFiles, descriptor_budget
from tests.helpers import REPO, run
from tests.models import write_numpy

# What mount.fuse3 passed to the program for `mount -t fuse.stfs SRC MNT [-o ...]` here (traced with a stub).
FROM_MOUNT_FUSE3 = {
    "no -o": "rw,dev,suid",
    "-o ro,allow_other": "ro,allow_other,dev,suid",
    "-o ro,nofail,noauto,_netdev,x-systemd.automount,user,nodev,noatime,layout=flat,defaults,rw,users,exec,noexec,"
    "async,sync,relatime,x-foo=1,comment=xx,nouser,owner,group": (
        "rw,nodev,noatime,noexec,sync,relatime,nosuid,layout=flat"
    ),
}


@pytest.mark.parametrize("given", list(FROM_MOUNT_FUSE3))
def test_what_mount_fuse3_passes_leaves_only_fuse_options(given: str) -> None:
    options = sort_options([FROM_MOUNT_FUSE3[given]])
    assert [item for item in options.fuse if item not in ("ro", "allow_other")] == []
    assert options.warnings == ([READ_ONLY_WARNING] if "rw" in FROM_MOUNT_FUSE3[given].split(",") else [])


def test_every_stfs_setting() -> None:
    options = sort_options(["layout=flat,log_file=/var/log/a b.log", "max_open_files=7,threads,keep_source_cache"])
    assert options.settings == {
        "layout": "flat",
        "log_file": "/var/log/a b.log",
        "max_open_files": 7,
        "threads": True,
        "keep_source_cache": True,
    }
    assert options.fuse == [] and options.warnings == []


def test_libfuse_items_go_to_libfuse_in_order() -> None:
    options = sort_options(["allow_other,ro", "fsname=x,max_read=65536,", "kernel_cache"])
    assert options.fuse == ["allow_other", "ro", "fsname=x", "max_read=65536", "kernel_cache"]
    assert options.settings == {}


LIBFUSE_ITEMS = (
    "allow_other,allow_root,auto_unmount,default_permissions,blkdev,blksize=4096,max_read=131072,fsname=a:b,"
    "subtype=x,ro,context=system_u:object_r:tmp_t:s0,user=joe,kernel_cache,auto_cache,noauto_cache,umask=022,uid=0,"
    "gid=0,entry_timeout=1,attr_timeout=1.5,ac_attr_timeout=2,negative_timeout=0,noforget,remember=10,debug,"
    "clone_fd,max_threads=4,max_idle_threads=2,direct_io,use_ino,readdir_ino,hard_remove,nopath,intr,intr_signal=10,"
    "modules=subdir,subdir=/x,rellinks,norellinks,no_rofd_flush,fmask=022,dmask=022,symfollow,nosymfollow"
)


def test_every_option_libfuse_reads_goes_to_it() -> None:
    """libfuse's own (lib/helper.c, fuse.c, fuse_lowlevel.c, mount.c, modules/) and those mfusepy sets in its
    fuse_config: known, so handed on; libfuse still judges their values."""
    options = sort_options([LIBFUSE_ITEMS])
    assert options.fuse == LIBFUSE_ITEMS.split(",")


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("veiw=png", "veiw=png: no such option (did you mean view=png?)"),
        ("alow_other", "alow_other: no such option (did you mean allow_other?)"),
        ("max_reads=65536", "max_reads=65536: no such option (did you mean max_read=65536?)"),
        ("treads", "treads: no such option (did you mean threads?)"),
        ("zzz_qqq", "zzz_qqq: no such option"),
    ],
)
def test_an_unknown_item_is_an_error_naming_the_closest(item: str, message: str) -> None:
    """It was handed to libfuse, whose refusal came back as "libfuse refused the mount: fuse: unknown option(s)"."""
    with pytest.raises(OptionError) as caught:
        sort_options([f"ro,{item}"])
    assert str(caught.value) == message


def test_ignored_items() -> None:
    items = [
        "dev",
        "nosuid",
        "noexec",
        "defaults",
        "nofail",
        "_netdev",
        "x-systemd.automount",
        "x-systemd.mount-timeout=30",
        "comment=systemd.automount",
        "noatime",
        "async",
        "users",
    ]
    options = sort_options([",".join(items)])
    assert options.ignored == items and options.fuse == [] and options.warnings == []


def test_rw_warns_once() -> None:
    options = sort_options(["rw", "rw,ro"])
    assert options.warnings == [READ_ONLY_WARNING]
    assert options.fuse == ["ro"]


def test_last_value_wins() -> None:
    assert sort_options(["layout=flat", "layout=nested"]).settings == {"layout": "nested"}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("layout=round", "layout=round: layout must be one of nested, flat"),
        ("layout", "layout: layout must be one of nested, flat"),
        ("log_file", "log_file: log_file needs a value"),
        ("log_file=", "log_file=: log_file needs a value"),
        ("max_open_files=many", "max_open_files=many: max_open_files must be a whole number"),
        ("max_open_files=0", "max_open_files=0: max_open_files must be at least 1"),
        ("threads=yes", "threads=yes: threads takes no value"),
        ("keep_source_cache=1", "keep_source_cache=1: keep_source_cache takes no value"),
        ("timeout=0", "timeout=0: timeout must be more than 0"),
        ("timeout=nan", "timeout=nan: timeout must be more than 0"),
        ("timeout=soon", "timeout=soon: timeout must be a number of seconds"),
        ("timeout=inf", "timeout=inf: timeout must be at most 1000000000 (about 31 years)"),
        ("timeout=1e300", "timeout=1e300: timeout must be at most 1000000000 (about 31 years)"),
    ],
)
def test_bad_values(item: str, message: str) -> None:
    with pytest.raises(OptionError) as caught:
        sort_options([f"ro,{item}"])
    assert str(caught.value) == message


def test_a_repeatable_setting_collects_its_values() -> None:
    table = {"view": Setting("views", choice("npy", "f32"), repeat=True)}
    assert sort_options(["view=npy,ro", "view=f32"], table).settings == {"views": ["npy", "f32"]}


# -- allow_other without user_allow_other ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "allowed"),
    [
        ("user_allow_other\n", True),
        ("  user_allow_other  # yes\nmount_max = 10\n", True),
        ("#user_allow_other\n", False),
        ("# user_allow_other - allows users to use allow_other\n", False),
        ("user_allow_others\n", False),
        ("", False),
    ],
)
def test_fuse_conf(text: str, allowed: bool) -> None:
    assert allows_other(text) is allowed


def test_allow_other_needs_root_or_user_allow_other(tmp_path: Path) -> None:
    conf = tmp_path / "fuse.conf"
    conf.write_text("#user_allow_other\n")
    with pytest.raises(MountError) as caught:
        check_allow_other(["ro", "allow_other"], 1000, str(conf))
    assert str(caught.value) == f"-o allow_other: only root may use it unless {conf} has a line user_allow_other"
    with pytest.raises(MountError):
        check_allow_other(["allow_root"], 1000, str(tmp_path / "missing.conf"))
    check_allow_other(["allow_other"], 0, str(conf))
    check_allow_other(["ro"], 1000, str(conf))
    conf.write_text("user_allow_other\n")
    check_allow_other(["allow_other"], 1000, str(conf))


def test_allow_other_refused_for_an_unprivileged_user_before_anything_starts() -> None:
    """The real command as uid nobody (privileges dropped after Python has started: /root is not for nobody)."""
    if os.getuid() != 0:
        pytest.skip("needs root to become nobody")
    with tempfile.TemporaryDirectory(prefix="stfs-nobody-") as folder:
        os.chmod(folder, 0o755)  # pytest's tmp_path lies below a 0700 folder
        model = write_numpy(os.path.join(folder, "m.safetensors"), {"w": np.ones(4, dtype=np.float32)})
        conf = os.path.join(folder, "fuse.conf")
        with open(conf, "w") as stream:
            stream.write("# user_allow_other\n")
        become_nobody = (
            "import os, sys, stfs.cli, stfs.daemon, stfs.fuse_conf; os.setgroups([]); os.setgid(65534); "
            "os.setuid(65534); sys.exit(stfs.cli.main(sys.argv[1:]))"
        )
        for argv in (["mount", model, folder], [model, folder]):
            result = run(
                [sys.executable, "-c", become_nobody, *argv, "-o", "ro,allow_other"],
                env={**os.environ, "STFS_FUSE_CONF": conf},
            )
            assert result.returncode == 1
            refusal = f"-o allow_other: only root may use it unless {conf} has a line user_allow_other"
            assert result.stderr == f"stfs: {refusal}\n"
            assert not os.path.ismount(folder)


def test_no_access_to_dev_fuse_says_what_to_do(tmp_path: Path) -> None:
    """As uid nobody, in a mount namespace of its own where /dev/fuse is a root-only file of group ``disk`` (the
    machine's /dev/fuse is not touched): one line naming the group to join, or root; it was libfuse's "fuse: failed
    to open /dev/fuse: Permission denied" after the daemon had started."""
    if os.getuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare")
    with tempfile.TemporaryDirectory(prefix="stfs-nobody-") as folder:
        os.chmod(folder, 0o755)
        model = write_numpy(os.path.join(folder, "m.safetensors"), {"w": np.ones(4, dtype=np.float32)})
        os.chmod(model, 0o644)
        mnt = os.path.join(folder, "mnt")
        os.mkdir(mnt)
        os.chmod(mnt, 0o777)
        device = os.path.join(folder, "fuse")
        Path(device).touch()
        os.chown(device, 0, grp.getgrnam("disk").gr_gid)
        os.chmod(device, 0o660)
        become_nobody = (
            "import os, sys, stfs.cli, stfs.daemon, stfs.fuse_conf, stfs.stats, stfs.secrets; os.setgroups([]); "
            "os.setgid(65534); os.setuid(65534); sys.exit(stfs.cli.main(sys.argv[1:]))"
        )
        for argv in (["mount", model, mnt], ["mount", model, mnt, "-f"], [model, mnt, "-o", "ro,dev,suid"]):
            command = shlex.join([sys.executable, "-c", become_nobody, *argv])
            result = run(
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "sh",
                    "-c",
                    f"mount --bind {device} /dev/fuse && exec {command}",
                ],
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            assert result.returncode == 1, result.stderr
            assert result.stderr == (
                "stfs: /dev/fuse: permission denied: mounting needs read and write access to it; add this user to "
                "group disk (usermod -aG disk USER, then log in again), or mount as root\n"
            )
            assert not os.path.ismount(mnt)


# -- the command line --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/srv/m", "/mnt/m", "-o", "ro,dev,suid"], ["mount", "/srv/m", "/mnt/m", "-o", "ro,dev,suid"]),
        (["hf://org/model", "mnt"], ["mount", "hf://org/model", "mnt"]),
        (["missing.safetensors", "mnt"], ["missing.safetensors", "mnt"]),  # no such SOURCE, no -o: a mistyped command
        (["chek", "mnt", "-oro"], ["mount", "chek", "mnt", "-oro"]),  # -o: as mount(8) runs it, whatever SOURCE is
        (["umount", "mnt"], ["umount", "mnt"]),
        (["mount", "a", "b"], ["mount", "a", "b"]),
        (["info", "a", "b"], ["info", "a", "b"]),
        (["--debug", "info", "a"], ["--debug", "info", "a"]),
        (["bogus"], ["bogus"]),  # one word is a mistyped command, not a mount
        ([], []),
    ],
)
def test_mount8_form(argv: list[str], expected: list[str]) -> None:
    assert mount8_form(argv) == expected


def planned(monkeypatch: pytest.MonkeyPatch, folder: Path, argv: list[str]) -> dict[str, Any]:
    """What ``main(argv)`` passes to ``plan_mount`` (stopped there, nothing mounted), run in ``folder`` holding the
    empty mountpoint ``m`` (the command checks it first)."""
    monkeypatch.chdir(folder)
    os.makedirs("m", exist_ok=True)
    seen: dict[str, Any] = {}

    def plan_mount(
        source: LocalFiles, key: str, mountpoint: str, layout: str, options: list[str], threads: bool, views: list[str]
    ) -> None:
        seen.update(
            source=key,
            mountpoint=mountpoint,
            layout=layout,
            options=options,
            max_open_files=source.max_open,
            threads=threads and source.threaded,
            keep_source_cache=not source.drop_behind,
            views=views,
        )
        raise MountError("planned")

    monkeypatch.setattr(daemon, "plan_mount", plan_mount)
    assert main([*argv, "-f"]) == 1  # in the foreground the plan is made in this process
    return seen


def test_o_settings_are_the_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    by_flags = planned(
        monkeypatch,
        tmp_path,
        [
            "mount",
            "s",
            "m",
            "--layout",
            "flat",
            "--log-file",
            "x",
            "--max-open-files",
            "3",
            "--threads",
            "--keep-source-cache",
            "--view",
            "f32",
            "--view",
            "npy",
            "-o",
            "kernel_cache",
        ],
    )
    by_o = planned(
        monkeypatch,
        tmp_path,
        [
            "s",
            "m",
            "-o",
            "layout=flat,log_file=x,max_open_files=3,threads,view=f32",
            "-o",
            "keep_source_cache,kernel_cache,dev,suid,nofail,view=npy",
        ],
    )
    assert (
        by_o
        == by_flags
        == {
            "source": os.path.abspath("s"),
            "mountpoint": "m",
            "layout": "flat",
            "options": ["kernel_cache"],
            "max_open_files": 3,
            "threads": True,
            "keep_source_cache": True,
            "views": ["f32", "npy"],
        }
    )


def test_o_views_add_to_view_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert planned(monkeypatch, tmp_path, ["mount", "s", "m", "--view", "npy", "-o", "view=f32"])["views"] == [
        "npy",
        "f32",
    ]


def test_defaults_unchanged(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert planned(monkeypatch, tmp_path, ["mount", "s", "m"]) == {
        "source": os.path.abspath("s"),
        "mountpoint": "m",
        "layout": "nested",
        "options": [],
        "max_open_files": descriptor_budget(),  # every source held open, as the descriptor limit allows
        "threads": False,
        "keep_source_cache": False,
        "views": [],
    }


def test_rw_warns_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert planned(monkeypatch, tmp_path, ["s", "m", "-o", "rw,dev,suid"])["options"] == []
    assert capsys.readouterr().err == f"stfs: warning: {READ_ONLY_WARNING}\nstfs: planned\n"


@pytest.mark.parametrize(
    "options",
    ["layout=round", "max_open_files=0", "threads=1", "log_file", "view=bogus", "view", "timeout=inf", "veiw=png"],
)
def test_bad_o_values_are_usage_errors(options: str) -> None:
    for argv in (["mount", "s", "m", "-o", options], ["s", "m", "-o", f"ro,{options}"]):
        result = run([sys.executable, "-m", "stfs", *argv])
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("stfs mount: error: ") and len(result.stderr.splitlines()) == 1
        assert f"error: argument -o: {options}: " in result.stderr
