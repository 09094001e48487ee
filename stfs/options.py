"""``-o`` mount options sorted three ways: stfs's own settings, options mount(8) adds that mean nothing to a
read-only FUSE mount (dropped), and libfuse's, which go to libfuse; anything else is a usage error naming the closest
known option. Pure: no I/O."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass


class OptionError(ValueError):
    """An ``-o`` item names an stfs setting but its value is wrong: a usage error (exit 2)."""


def flag(value: str | None) -> bool:
    if value is not None:
        raise ValueError("takes no value")
    return True


def text(value: str | None) -> str:
    if not value:
        raise ValueError("needs a value")
    return value


def positive_int(value: str | None) -> int:
    try:
        number = int(value or "")
    except ValueError:
        raise ValueError("must be a whole number") from None
    if number < 1:
        raise ValueError("must be at least 1")
    return number


def size_bytes(value: str | None) -> int:
    """A byte count with an optional K, M or G suffix (powers of 1024): ``64M``."""
    text = (value or "").strip().upper().removesuffix("B")
    scale = 1024 ** ("KMG".index(text[-1]) + 1) if text[-1:] in ("K", "M", "G") else 1
    try:
        number = int(text[:-1] if scale > 1 else text)
    except ValueError:
        raise ValueError("must be a byte count such as 512M or 2G") from None
    if number < 1:
        raise ValueError("must be at least 1 byte")
    return number * scale


MOST_SECONDS = 1e9  # about 31 years: as good as never giving up, and a figure every timer and client takes


def seconds(value: str | None) -> float:
    try:
        number = float(value or "")
    except ValueError:
        raise ValueError("must be a number of seconds") from None
    if not number > 0:
        raise ValueError("must be more than 0")
    if not number <= MOST_SECONDS:  # inf (and 1e300) would have the first request retried for ever
        raise ValueError(f"must be at most {MOST_SECONDS:.0f} (about 31 years)")
    return number


def choice(*names: str) -> Callable[[str | None], str]:
    def read(value: str | None) -> str:
        if value not in names:
            raise ValueError(f"must be one of {', '.join(names)}")
        return value

    return read


@dataclass(frozen=True, slots=True)
class Setting:
    """An stfs setting spelled as an ``-o`` item: the ``stfs mount`` argument it sets and how its value is read."""

    dest: str
    read: Callable[[str | None], object]
    repeat: bool = False  # may be given again, each value added to a list (`view=npy,view=f32`)


VIEWS = ("npy", "f32", "stats", "png", "safetensors")  # --view NAME: what each adds is views.CHOSEN[NAME]

# One line per setting; `-o NAME=VALUE` then sets what `--NAME VALUE` sets.
SETTINGS: dict[str, Setting] = {
    "layout": Setting("layout", choice("nested", "flat")),
    "log_file": Setting("log_file", text),
    "max_open_files": Setting("max_open_files", positive_int),
    "threads": Setting("threads", flag),
    "keep_source_cache": Setting("keep_source_cache", flag),
    "cache_size": Setting("cache_size", size_bytes),
    "cache_dir": Setting("cache_dir", text),
    "cache_dir_size": Setting("cache_dir_size", size_bytes),
    "timeout": Setting("timeout", seconds),
    "plain_http": Setting("plain_http", flag),
    "view": Setting("views", choice(*VIEWS), repeat=True),
    "nonempty": Setting("nonempty", flag),  # libfuse 2's name, which libfuse 3 refuses: stfs's own check now
}

# What mount(8) and mount.fuse3 put in the list for any filesystem. stfs files are 0444 and never change, so none
# of these changes a thing; dropping dev/suid keeps libfuse's nodev,nosuid.
IGNORED = frozenset(
    {
        "defaults",
        "auto",
        "noauto",
        "user",
        "users",
        "nouser",
        "owner",
        "group",
        "nofail",
        "_netdev",
        "dev",
        "nodev",
        "suid",
        "nosuid",
        "exec",
        "noexec",
        "async",
        "sync",
        "dirsync",
        "atime",
        "noatime",
        "relatime",
        "norelatime",
        "strictatime",
        "nostrictatime",
        "lazytime",
        "nolazytime",
        "diratime",
        "nodiratime",
        "iversion",
        "noiversion",
        "mand",
        "nomand",
        "silent",
        "loud",
    }
)
# What libfuse 3 reads from the -o list, by name (its value libfuse judges): lib/helper.c, lib/fuse.c, its modules
# subdir and iconv, lib/fuse_lowlevel.c and lib/mount.c of 3.14 to 3.18 (an option a newer one adds: refused by an
# older one, in its words), and the libfuse 2 options mfusepy sets in libfuse 3's fuse_config itself.
LIBFUSE = frozenset(
    {
        *("debug", "fsname", "subtype", "clone_fd", "max_idle_threads", "max_threads"),
        *("kernel_cache", "auto_cache", "noauto_cache", "no_rofd_flush", "umask", "uid", "gid", "fmask", "dmask"),
        *("entry_timeout", "attr_timeout", "ac_attr_timeout", "negative_timeout", "noforget", "remember"),
        *("parallel_direct_write", "modules", "subdir", "rellinks", "norellinks", "from_code", "to_code"),
        *("allow_root", "io_uring", "io_uring_q_depth"),
        *("allow_other", "auto_unmount", "blkdev", "blksize", "max_read", "default_permissions", "user", "ro"),
        *("context", "fscontext", "defcontext", "rootcontext", "symfollow", "nosymfollow"),
        *("hard_remove", "use_ino", "readdir_ino", "direct_io", "nopath", "intr", "intr_signal"),
    }
)
IGNORED_PREFIXES = ("x-", "comment=")  # x-systemd.automount, x-gvfs-show, comment=...: for userspace, by definition
READ_ONLY_WARNING = "-o rw: stfs mounts are read-only; mounting read-only"


@dataclass(frozen=True, slots=True)
class MountOptions:
    """The ``-o`` items sorted: ``settings`` maps ``stfs mount`` argument names to values."""

    settings: dict[str, object]
    fuse: list[str]
    ignored: list[str]
    warnings: list[str]


def sort_options(texts: Iterable[str], settings: Mapping[str, Setting] = SETTINGS) -> MountOptions:
    """Sort ``-o`` values (each a comma-separated list); a setting given twice keeps its last value.

    Raise ``OptionError`` on a bad value for an stfs setting, and on an item neither stfs, mount(8) nor libfuse knows
    (libfuse would refuse the mount with "unknown option(s)", once the daemon had read every header).
    """
    result = MountOptions({}, [], [], [])
    for item in (item for text in texts for item in text.split(",") if item):
        name, has_value, value = item.partition("=")
        if name in settings:
            setting = settings[name]
            try:
                parsed = setting.read(value if has_value else None)
            except ValueError as exc:
                raise OptionError(f"{item}: {name} {exc}") from None
            if setting.repeat:
                values = result.settings.setdefault(setting.dest, [])
                assert isinstance(values, list)
                values.append(parsed)
            else:
                result.settings[setting.dest] = parsed
        elif item == "rw":
            if READ_ONLY_WARNING not in result.warnings:
                result.warnings.append(READ_ONLY_WARNING)
            result.ignored.append(item)
        elif item in IGNORED or item.startswith(IGNORED_PREFIXES):
            result.ignored.append(item)
        elif name in LIBFUSE:
            result.fuse.append(item)
        else:
            raise OptionError(f"{item}: no such option{_closest(name, value if has_value else None, settings)}")
    return result


def _closest(name: str, value: str | None, settings: Mapping[str, Setting]) -> str:
    """`` (did you mean view=png?)`` for ``veiw`` and ``png``, or nothing where no known option is near."""
    found = difflib.get_close_matches(name, [*settings, *LIBFUSE, *IGNORED, "rw"], n=1)
    if not found:
        return ""
    return f" (did you mean {found[0]}{'' if value is None else '=' + value}?)"
