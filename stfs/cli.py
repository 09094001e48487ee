"""The command line: ``stfs mount|unmount|info|check|diff|csi``, and ``stfs SOURCE MNT -o OPTS`` as mount(8) runs it.
``main(argv) -> int``; one top-level error handler."""

from __future__ import annotations

import argparse
import codecs
import difflib
import io
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from . import __version__, errors
from .csi import DEFAULT_STATE_DIR
from .model import Model, discover, load, load_all
from .options import VIEWS, OptionError, positive_int, seconds, size_bytes, sort_options
from .sources import ByteSource, named_source, open_source
from .sources.base import DEFAULT_CACHE_SIZE, DEFAULT_TIMEOUT, URL_SCHEMES, is_url

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
EXIT_DIFFERENT, EXIT_TROUBLE = 1, 2  # stfs diff's, as diff(1) and cmp(1)

SOURCE_HELP = "{sources}"  # in any help text: what SOURCE can be, filled in as help is shown (source_text())


def _listed(words: Sequence[str]) -> str:
    return ", ".join(words[:-1]) + " or " + words[-1] if len(words) > 1 else "".join(words)


def source_text() -> str:
    """What SOURCE can be, from what the code reads: each format of ``formats.REGISTRY`` by its title and file
    names, its index files, a folder, and a URL of each scheme of ``URL_SCHEMES``. It imports every format's module
    (a fifth of a second for GGUF's), so only help and the man page ask for it."""
    from .formats import REGISTRY, named

    files = []
    for module, suffixes, _ in REGISTRY:
        title = named(module).title
        named_as = ", ".join(suffix for suffix in suffixes if suffix not in title)
        files.append(f"{title} ({named_as})" if named_as else title)
    indexes = [index for _, _, names in REGISTRY for index in names]
    return (
        f"a model file ({_listed(files)}), an index ({_listed(indexes)}: the sharded set it names), a folder "
        f"(every model in it; an OCI image layout or Ollama's models folder: every model its manifests name), "
        f"or an {_listed(URL_SCHEMES)} URL of any of these (oci://HOST/REPO[:TAG] or docker://…: a model or a "
        f"container image in an OCI registry; PATH:REF: one manifest of an OCI image layout)"
    )


def summary() -> str:
    """The man page's NAME line, from the same registry as ``source_text()``."""
    from .formats import REGISTRY, named

    titles = []
    for module, suffixes, _ in REGISTRY:  # "DCP .metadata" names a DCP folder's file; its models are DCP's
        title = named(module).title
        cut = min((title.index(end) for end in suffixes if end in title), default=len(title))
        titles.append(title[:cut].strip())
    return f"mount {_listed(titles)} models, local or at {_listed(URL_SCHEMES)} URLs, read-only: every tensor a file"


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose texts say what SOURCE can be (``SOURCE_HELP``) once help is shown, and whose usage
    errors are one line (SPEC §5: every error is), pointing at ``--help`` rather than printing the usage."""

    def format_help(self) -> str:
        _fill_sources(self, source_text())
        return super().format_help()

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _fill_sources(parser: argparse.ArgumentParser, text: str) -> None:
    parser.description = parser.description and parser.description.replace(SOURCE_HELP, text)
    for action in parser._actions:
        if action.help:
            action.help = action.help.replace(SOURCE_HELP, text)


def _common(parser: argparse.ArgumentParser, top: bool = False) -> None:
    parser.add_argument("--version", action="version", version=f"stfs {__version__}")
    # A subcommand's own default would overwrite ``stfs --debug COMMAND``'s True: only the top level has one.
    parser.add_argument(
        "--debug",
        action="store_true",
        default=False if top else argparse.SUPPRESS,
        help="show tracebacks and debug logs",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="stfs",
        description="Mount model weights read-only, every tensor an ordinary file; list, validate and compare them. "
        f"SOURCE is {SOURCE_HELP}. `stfs SOURCE MNT -o OPTIONS` is stfs mount as mount(8) runs it for fstab's type "
        "fuse.stfs.",
        epilog="example: stfs mount hf://Qwen/Qwen2.5-0.5B mnt",
    )
    _common(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    mount = commands.add_parser(
        "mount",
        help="mount a model, index or folder of models read-only",
        description="Validate every header of SOURCE, mount it read-only at MNT and return once MNT answers "
        "(the daemon runs in the background; -f keeps it in the foreground).",
        epilog="example: stfs mount hf://Qwen/Qwen2.5-0.5B /mnt/qwen --view f32",
    )
    _common(mount)
    mount.add_argument("source", metavar="SOURCE", type=_given, help=SOURCE_HELP)
    mount.add_argument("mountpoint", metavar="MNT", type=_given, help="an existing folder, the mountpoint")
    mount.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground")
    mount.add_argument(
        "-o",
        dest="options",
        action="append",
        default=[],
        metavar="OPT,...",
        type=_checked_options,
        help="mount options, comma-separated: FUSE's (allow_other, max_read=N, ...) and stfs's own, each option "
        "below as NAME=VALUE with _ for - (layout=flat, view=npy, log_file=PATH, cache_dir=DIR, threads, ...)",
    )
    mount.add_argument(
        "--nonempty",
        action="store_true",
        help="mount over a folder that is not empty, what it holds hidden while mounted (default: refused)",
    )
    mount.add_argument(
        "--layout",
        choices=("nested", "flat"),
        default="nested",
        help="tensors/ as folders split at dots (nested, default) or one file per name (flat)",
    )
    mount.add_argument(
        "--view",
        dest="views",
        action="append",
        choices=VIEWS,
        default=[],
        help="add npy/ (each tensor a .npy file), f32/ (float tensors as float32), stats/ (each tensor's "
        "statistics as JSON), png/ (a heatmap of each tensor) or safetensors/ (at the root: the source with each "
        "PyTorch checkpoint or ONNX model as a safetensors file); may be repeated",
    )
    mount.add_argument("--log-file", metavar="PATH", help="daemon log (default: $XDG_RUNTIME_DIR/stfs...log)")
    mount.add_argument(
        "--max-open-files",
        type=positive_int,
        default=None,
        metavar="N",
        help="source files held open at once (default: all, as the descriptor limit allows; past N the least "
        "recently used are closed and reopened only if their path still holds the mounted file)",
    )
    mount.add_argument(
        "--threads",
        action="store_true",
        help="serve requests with libfuse's thread pool (default: one thread, faster under the GIL)",
    )
    mount.add_argument(
        "--keep-source-cache",
        action="store_true",
        help="keep the source's page cache; by default pages served into the mount's own cache "
        "are dropped from the source's, so each page is in RAM once",
    )
    mount.add_argument(
        "--cache-size",
        type=_option_type(size_bytes),
        default=DEFAULT_CACHE_SIZE,
        metavar="SIZE",
        help="remote sources: bytes of fetched blocks kept in memory, K/M/G suffixes (default 1G)",
    )
    mount.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="remote sources: also keep every range fetched on disk in DIR, keyed by object and version, for later "
        "mounts and other daemons sharing DIR",
    )
    mount.add_argument(
        "--cache-dir-size",
        type=_option_type(size_bytes),
        default=None,
        metavar="SIZE",
        help="at most this much in --cache-dir, across the daemons sharing it, least recently used pieces deleted "
        "first; K/M/G suffixes (default 10G)",
    )
    _timeout(mount)
    _plain_http(mount)

    unmount = commands.add_parser(
        "unmount",
        aliases=list(ALIASES),
        help="unmount, also a mount whose daemon died",
        description="Unmount MNT (as umount or fusermount3 -u would); also clears a mount whose daemon died.",
        epilog="example: stfs unmount /mnt/qwen",
    )
    _common(unmount)
    unmount.add_argument("mountpoint", metavar="MNT", type=_given, help="the mountpoint")
    unmount.add_argument("-z", "--lazy", action="store_true", help="detach now even if busy")

    info = commands.add_parser(
        "info",
        help="tensor table, per-dtype counts and totals from headers",
        description="Print each tensor (name, dtype, shape, parameters, file), counts per dtype and totals, "
        "read from the headers alone (over a URL: a Range request per file, never the data).",
        epilog="example: stfs info https://example.com/llama/model.safetensors.index.json",
    )
    _common(info)
    info.add_argument("sources", nargs="+", metavar="SOURCE", type=_given, help=SOURCE_HELP)
    info.add_argument("--json", action="store_true", help="print JSON")
    _timeout(info)
    _plain_http(info)

    check = commands.add_parser(
        "check",
        help="validate; one line per problem; exit 0 only if all are valid",
        description="Validate every header as stfs mount does: one line per problem (file, tensor, rule), "
        "one ok line per valid model; exit 0 only if all are valid.",
        epilog="example: stfs check s3://my-bucket/checkpoints/step-1000/",
    )
    _common(check)
    check.add_argument("sources", nargs="+", metavar="SOURCE", type=_given, help=SOURCE_HELP)
    check.add_argument(
        "--values",
        action="store_true",
        help="also read every tensor's values: a line for each tensor holding NaN or infinities (exit 1 if any)",
    )
    _quiet(check)
    _timeout(check)
    _plain_http(check)

    diff = commands.add_parser(
        "diff",
        help="compare two models tensor by tensor; exit 0 if the same, 1 if they differ, 2 on trouble",
        description="Compare two models tensor by tensor, matched by name: a line per tensor that is not equal "
        "(- only in A, + only in B, ! another dtype or shape, ~ values differ), then a summary line. "
        "Exit 0 if every tensor is equal in both, 1 if anything differs, 2 on trouble.",
        epilog="example: stfs diff ./downloaded-model hf://org/model",
    )
    _common(diff)
    diff.add_argument("a", metavar="A", type=_given, help=SOURCE_HELP)
    diff.add_argument("b", metavar="B", type=_given, help="another SOURCE")
    diff.add_argument("--json", action="store_true", help="print one JSON object")
    diff.add_argument(
        "--atol", type=_tolerance, default=0.0, metavar="X", help="absolute tolerance (numpy.isclose; default 0)"
    )
    diff.add_argument(
        "--rtol", type=_tolerance, default=0.0, metavar="Y", help="relative tolerance (numpy.isclose; default 0)"
    )
    _quiet(diff)
    _timeout(diff)

    csi = commands.add_parser(
        "csi",
        help="serve Kubernetes' Container Storage Interface: a pod gets a model as a read-only volume",
        description="Serve CSI v1's Identity and Node services on a unix socket, as the kubelet drives a node "
        "plugin: each volume published is a `stfs mount` of the volume's source attribute at the pod's target, its "
        "daemon outliving this process (docs/kubernetes.md). Needs the csi extra: pip install 'stfs[csi]'.",
        epilog="example: stfs csi --endpoint unix:///csi/csi.sock --node-id node-1",
    )
    _common(csi)
    csi.add_argument("--endpoint", required=True, metavar="unix:///PATH", help="the socket to serve on")
    csi.add_argument("--node-id", required=True, metavar="NODE", help="this node's name, as NodeGetInfo answers")
    csi.add_argument(
        "--state-dir",
        default=DEFAULT_STATE_DIR,
        metavar="DIR",
        help="where the volumes published are recorded (no secrets), for a restarted plugin (default %(default)s)",
    )
    csi.add_argument(
        "--allow-source",
        action="append",
        metavar="PATTERN",
        help="a shell pattern a URL source must match, e.g. 'oci://registry.example.com/*' (repeatable; patterns "
        "given replace the defaults hf://*, s3://*, oci://*, https://*; plain http:// only where a pattern names it)",
    )
    csi.add_argument(
        "--allow-path",
        action="append",
        metavar="DIR",
        help="a folder on the node whose models volumes may mount, once '..' and symbolic links are resolved "
        "(repeatable; none by default: no path on the node is allowed)",
    )
    csi.add_argument(
        "--max-cache-size",
        default="1G",
        metavar="SIZE",
        help="the most a volume's cacheSize may be, K/M/G suffix (default %(default)s); a volume's daemon takes it "
        "and about 150 MiB of memory",
    )
    csi.add_argument(
        "--node-credentials",
        action="store_true",
        help="volumes use the plugin's own credentials (environment, home folder, cloud instance role) where their "
        "secret has none: every pod creator then acts as the node (default: a volume has its secret's alone)",
    )
    return parser


def man_parser() -> argparse.ArgumentParser:
    """``build_parser()`` with every text filled in and the NAME line (``summary()``), for argparse-manpage, which
    writes the man page stfs(1) from it (pyproject.toml, [tool.build_manpages]) and reads a parser's texts without
    asking it for help."""
    parser = build_parser()
    text = source_text()
    commands = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    for each in (parser, *(command for action in commands for command in action.choices.values())):
        _fill_sources(each, text)
    parser.man_short_description = summary()  # type: ignore[attr-defined]  # argparse-manpage's NAME
    return parser


def _quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar (shown only on a terminal)")


def _tolerance(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not number >= 0 or number == float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r}: a tolerance is a finite number, 0 or more")
    return number


def _timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=_option_type(seconds),
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"remote sources: a read gives up with EIO after this long without a byte (default {DEFAULT_TIMEOUT:g})",
    )


def _plain_http(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plain-http",
        action="store_true",
        help="oci:// sources: ask the registry over HTTP, not HTTPS (a loopback host always is)",
    )


def _given(value: str) -> str:
    """A path or URL argument that is not empty: ``""`` would be the current folder (``"$MNT"`` of a script whose
    variable is unset mounted over its working folder)."""
    if not value:
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def _option_type(read: Callable[[str | None], object]) -> Callable[[str], object]:
    """An argparse type from an ``options`` reader: its ValueError becomes a usage error."""

    def convert(value: str) -> object:
        try:
            return read(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _checked_options(value: str) -> str:
    """An ``-o`` value, unchanged once its stfs settings are known to be valid (else a usage error)."""
    try:
        sort_options([value])
    except OptionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def cmd_mount(args: argparse.Namespace) -> int:
    from .daemon import MountPlan, check_mountpoint, default_log_file, plan_mount, run_background, run_foreground
    from .fuse_conf import check_allow_other, check_fuse_device, fuse_conf_path
    from .secrets import hide_from_command_line, secrets_of
    from .stats import hold_dump_signal

    hold_dump_signal()  # before a remote source's threads start, here or in the daemon forked from here
    args.source = named_source(args.source)
    options = sort_options(args.options)
    views = options.settings.pop("views", [])
    assert isinstance(views, list)
    args.views += views  # `-o view=f32` adds to `--view npy`: a setting that is repeated, not replaced
    vars(args).update(options.settings)  # `-o layout=flat` is `--layout flat`; given both ways, -o wins
    for warning in options.warnings:
        print(f"stfs: warning: {warning}", file=sys.stderr)
    check_allow_other(options.fuse, os.getuid(), fuse_conf_path())
    check_fuse_device()
    check_mountpoint(os.path.abspath(args.mountpoint), empty=not args.nonempty)
    if args.whole_program:
        hide_from_command_line(secrets_of(args.source))  # a URL's password: not in /proc/PID/cmdline
    remote = is_url(args.source)
    threads = args.threads or remote  # a request that waits on the network must not hold up the others

    def make_plan() -> MountPlan:
        source, key = open_source(
            args.source,
            max_open_files=args.max_open_files,
            threads=threads,
            keep_source_cache=args.keep_source_cache,
            cache_size=args.cache_size,
            timeout=args.timeout,
            cache_dir=args.cache_dir,
            cache_dir_size=args.cache_dir_size,
            mounting=True,
            plain_http=args.plain_http,
        )
        return plan_mount(source, key, args.mountpoint, args.layout, options.fuse, threads=threads, views=args.views)

    if args.foreground:
        default = signal.getsignal(signal.SIGINT)
        interrupt_at_once(args)
        plan = make_plan()
        signal.signal(signal.SIGINT, default)  # serving: SIGINT unmounts cleanly (SPEC §6)
        for warning in plan.warnings:
            print(f"stfs: warning: {warning}", file=sys.stderr)
        run_foreground(plan, debug=args.debug)
    else:
        run_background(make_plan, args.mountpoint, args.log_file or default_log_file(args.mountpoint))
        if args.whole_program:  # the stfs command, its work done: skip the interpreter's teardown (~20 ms)
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_OK)
    return EXIT_OK


def cmd_unmount(args: argparse.Namespace) -> int:
    from .daemon import unmount

    unmount(args.mountpoint, lazy=args.lazy)
    return EXIT_OK


def cmd_csi(args: argparse.Namespace) -> int:
    try:
        from .csi.policy import Policy
        from .csi.server import serve
    except (ImportError, RuntimeError) as exc:  # no grpcio, or one older than the generated code asks for
        raise errors.StfsError(f"stfs csi needs the csi extra (pip install 'stfs[csi]'): {exc}") from None
    policy = Policy.of(args.allow_source, args.allow_path, args.max_cache_size, args.node_credentials)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(name)s[%(process)d] %(levelname)s %(message)s",
        force=True,
    )
    serve(args.endpoint, args.node_id, args.state_dir, policy)
    return EXIT_OK


def interrupt_at_once(args: argparse.Namespace) -> None:
    """Let Ctrl-C end the stfs command at once while it reads sources, nothing mounted yet: a remote request waits in
    obstore's Rust code, where Python cannot run its SIGINT handler until the request gives up (``--timeout``).
    Only the command itself (not ``main()`` called from Python), and not where SIGINT is ignored (a shell's
    background job)."""
    if args.whole_program and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def cmd_info(args: argparse.Namespace) -> int:
    from .info import render_json, render_table, summarize

    interrupt_at_once(args)
    models = []
    transfer: dict[str, int] | None = None  # what went over the wire, for remote sources
    for text in map(named_source, args.sources):
        source, key = open_source(text, timeout=args.timeout, plain_http=args.plain_http)
        try:
            models += load_all(discover(key, source), source)
        finally:
            source.close()
        if is_url(text):  # a RemoteFiles: what went over the wire
            counts = source.transfer()  # type: ignore[attr-defined]
            transfer = {name: (transfer or {}).get(name, 0) + count for name, count in counts.items()}
    for model in models:
        for warning in model.warnings:
            print(f"stfs: warning: {warning}", file=sys.stderr)
    report = summarize(models, transfer)
    print(render_json(report) if args.json else render_table(report))
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    interrupt_at_once(args)
    problems = 0
    checked = 0
    for text in args.sources:
        try:
            text = named_source(text)
            # reading values: the page cache left as it is, and a remote source's block cache bounded as diff's
            reading: dict[str, Any] = {}
            if args.values:
                from .scan import REMOTE_CACHE

                reading = {"keep_source_cache": True, "cache_size": REMOTE_CACHE}
            source, key = open_source(text, timeout=args.timeout, plain_http=args.plain_http, **reading)
            model_sources = discover(key, source)
        except errors.StfsError as exc:
            print(exc.message)
            problems += 1
            continue
        hash_as_read = getattr(source, "hash_as_read", None)  # an OCI artifact's blobs: fetched once, not twice
        if args.values and hash_as_read is not None:
            hash_as_read()
        for model_source in model_sources:
            checked += 1
            try:
                model = load(model_source, source)
            except errors.InvalidModel as exc:
                for problem in exc.problems:
                    print(problem.message)
                problems += len(exc.problems)
                continue
            except errors.StfsError as exc:
                print(exc.message)
                problems += 1
                continue
            # what a mount serves but check fails on (a pickle naming a global torch.load would call): a problem
            failing = [line for shard in model.shards for line in shard.header.check_problems]
            for warning in model.warnings:
                if warning not in failing:
                    print(f"warning: {warning}")
            for line in failing:
                print(line)
            tensors = sum(len(shard.header.tensors) for shard in model.shards)
            unsafe = len(failing)
            problems += unsafe
            holding = _check_values(model, source, args.quiet) if args.values else 0
            if holding:
                print(f"{model.path}: {holding} of {tensors} tensors hold NaN or infinities")
                problems += holding
            if not unsafe and not holding:
                print(f"{model.path}: ok ({tensors} tensors{', values checked' if args.values else ''})")
        check_blobs = getattr(source, "check_blobs", None)  # an OCI artifact's blobs: each against its digest
        if args.values and check_blobs is not None:
            for line in check_blobs():
                print(line)
                problems += 1
    return EXIT_OK if problems == 0 else EXIT_INVALID


def _check_values(model: Model, source: ByteSource, quiet: bool) -> int:
    """Print a line for each tensor of ``model`` holding NaN or infinities; how many do."""
    from .progress import ByteProgress, shown
    from .scan import Reader, check_values, checked

    bar = ByteProgress(sum(t.size for t in checked(model)), "checking values", shown(quiet))
    try:
        found = check_values(model, Reader(source, bar))
    finally:
        bar.close()
    for tensor in found:
        print(tensor.line)
    return len(found)


def cmd_diff(args: argparse.Namespace) -> int:
    """``stfs diff``: exit 0 same, 1 different, 2 on trouble (as diff(1) and cmp(1)), trouble in one line."""
    from .diff import diff, render_json, render_text
    from .progress import shown

    interrupt_at_once(args)
    try:
        report = diff(args.a, args.b, atol=args.atol, rtol=args.rtol, timeout=args.timeout, progress=shown(args.quiet))
    except (errors.StfsError, OSError) as exc:
        if args.debug:
            raise
        print(f"stfs: {exc.message if isinstance(exc, errors.StfsError) else exc}", file=sys.stderr)
        return EXIT_TROUBLE
    for warning in report.warnings:
        print(f"stfs: warning: {warning}", file=sys.stderr)
    print(render_json(report) if args.json else render_text(report))
    return EXIT_OK if report.same else EXIT_DIFFERENT


def _tolerant_output() -> None:
    """Print any path or name rather than die on it: a file name that is not UTF-8 keeps its bytes
    (surrogateescape), a character the terminal cannot show is escaped."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            utf8 = codecs.lookup(stream.encoding).name == "utf-8"
            stream.reconfigure(errors="surrogateescape" if utf8 else "backslashreplace")


COMMANDS = {
    "mount": cmd_mount,
    "unmount": cmd_unmount,
    "info": cmd_info,
    "check": cmd_check,
    "diff": cmd_diff,
    "csi": cmd_csi,
}
ALIASES = {"umount": "unmount"}  # what umount(8) taught the fingers
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def mount8_form(argv: Sequence[str]) -> list[str]:
    """``stfs SOURCE MNT -o OPTS``, what mount(8) runs (through mount.fuse3) for type fuse.stfs, as ``stfs mount``;
    only where it can be that: with ``-o`` (mount(8) always passes it), or a SOURCE that exists or is a URL. Any
    other first word is a command, or a mistyped one (``stfs chek m6`` is no mount of ./chek)."""
    if len(argv) < 2 or argv[0] in COMMANDS or argv[0] in ALIASES or argv[0].startswith("-"):
        return list(argv)
    if any(arg.startswith("-o") for arg in argv[1:]) or _URL.match(argv[0]) or os.path.lexists(argv[0]):
        return ["mount", *argv]
    return list(argv)


def unknown_command(argv: Sequence[str]) -> str | None:
    """The line for a first word that is no command (``stfs chek m6``): the closest command, or the commands."""
    word = next((arg for arg in argv if not arg.startswith("-")), None)
    if word is None or word in COMMANDS or word in ALIASES:
        return None
    found = difflib.get_close_matches(word, [*COMMANDS, *ALIASES], n=1)
    hint = f"did you mean {found[0]}?" if found else f"commands: {', '.join(COMMANDS)}"
    return f"unknown command {word!r} ({hint})"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code."""
    words = mount8_form(sys.argv[1:] if argv is None else argv)
    mistyped = unknown_command(words)
    if mistyped is not None:
        print(f"stfs: {mistyped}", file=sys.stderr)
        return EXIT_USAGE
    args = build_parser().parse_args(words)
    args.whole_program = argv is None  # run as the stfs command, not called from Python: may exit at once
    _tolerant_output()
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="stfs: %(message)s")
    try:
        return COMMANDS[ALIASES.get(args.command, args.command)](args)
    except errors.StfsError as exc:
        if args.debug:
            raise
        print(f"stfs: {exc.message}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # stdout was closed early (``stfs info ... | head``): stop quietly, and keep the interpreter's final
        # flush of stdout from raising again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141


if __name__ == "__main__":
    sys.exit(main())
