"""The safetensors reference's verdict on a file next to stfs's, and whether they agree: for tests/test_reference.py
and the differential fuzzer (fuzz/fuzz_reference.py). stfs is stricter than the reference in two documented places
(docs/validation.md), each found here without stfs: a header that does not begin with ``{``, a repeated key."""

from __future__ import annotations

import contextlib
import json
import random
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import safetensors
from safetensors import safe_open

from stfs import errors
from stfs.formats.safetensors import fetch_header

# Number literals at the edges of what serde_json (the reference's parser) and Python disagree on.
NUMBERS = [
    "0",
    "-0",
    "1",
    "-1",
    "1.0",
    "1e0",
    "1E+0",
    "-0.0",
    "0e0",
    "0.5",
    "1e308",
    "1e309",
    "-1e309",
    "1.7976931348623157e308",
    "1.7976931348623158e308",
    "-1.7976931348623158e308",
    "1.7976931348623156224e308",
    "1.7976931348623156225e308",
    "17976931348623156224" + "9" * 289,
    "17976931348623156225" + "0" * 289,
    "-17976931348623156225" + "0" * 289,
    "9" * 308,
    "1" + "0" * 309,
    "1e-400",
    "4.9e-324",
    "0e99999999999",
    "1e2147483647",
    "1e2147483648",
    "0.0e2147483648",
    "1e-2147483649",
    "18446744073709551615",
    "18446744073709551616",
    "18446744073709551616.5e0",
    "-9223372036854775808",
    "-9223372036854775809",
    "4294967296",
    "9007199254740993",
    "0." + "0" * 400 + "1",
    "7" * 5000,
]


def boundary_number(rng: random.Random) -> str:
    """A literal near float64's largest value, in the forms where serde_json's rounding shows."""
    digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(0, 25)))
    sign = "-" if rng.random() < 0.5 else ""
    form = rng.randrange(3)
    if form == 0:
        return f"{sign}1.797693134862315{digits}e{rng.randint(306, 309)}"
    if form == 1:
        return f"{sign}179769313486231{digits}" + "0" * rng.randint(280, 300)
    return f"{sign}0.{'0' * rng.randint(0, 3)}17976931348623{digits}e{rng.randint(305, 312)}"


STRICTER = ("header-start", "duplicate-key")  # docs/validation.md: where stfs is stricter than the reference


@dataclass(frozen=True, slots=True)
class Verdict:
    """One validator's answer: accepted, or refused with a class and a message; ``crash`` for a foreign exception."""

    accepted: bool
    kind: str  # "ok", an error class, or a crash's exception type
    message: str = ""
    crash: bool = False


REFERENCE_CLASSES = [  # the reference's message -> the stfs error class of the same rule
    ("header too small", "HeaderTooSmall"),
    ("header too large", "HeaderTooLarge"),
    ("invalid header length", "InvalidHeaderLength"),
    ("invalid UTF-8", "InvalidHeaderUtf8"),
    ("recursion limit exceeded", "RecursionLimitExceeded"),
    ("number out of range", "NumberOutOfRange"),
    ("duplicate field", "DuplicateKey"),
    ("invalid type: map, expected a string", "InvalidMetadata"),
    ("expected a string", "InvalidMetadata"),
    ("unknown variant|invalid type|invalid value|invalid length|missing field", "MalformedTensorInfo"),
    ("invalid JSON", "InvalidHeaderDeserialization"),
    ("byte boundary", "MisalignedSlice"),
    ("invalid shape, data type, or offset", "TensorInvalidInfo"),
    ("overflow", "ValidationOverflow"),
    ("invalid offset", "InvalidOffset"),
    ("incomplete metadata", "MetadataIncompleteBuffer"),
]


def reference_class(message: str) -> str:
    for pattern, name in REFERENCE_CLASSES:
        if re.search(pattern, message):
            return name
    return "other"


def reference_verdict(data: bytes, path: str) -> tuple[Verdict, Verdict]:
    """``safetensors.deserialize`` of the bytes and ``safe_open`` of the file ``path`` holding them."""

    def judge(call: Callable[[], Any]) -> Verdict:
        try:
            call()
        except safetensors.SafetensorError as exc:
            return Verdict(False, reference_class(str(exc)), str(exc))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # a Rust panic (pyo3's PanicException is a BaseException): a refusal to see
            return Verdict(False, f"reference raised {type(exc).__name__}", f"{exc!r:.300}")
        return Verdict(True, "ok")

    def opened() -> None:
        with safe_open(path, "np") as handle:
            handle.keys()

    return judge(lambda: safetensors.deserialize(data)), judge(opened)


def stfs_verdict(path: str, validate: Callable[..., object] = fetch_header) -> Verdict:
    """What stfs's validation (``stfs check``, ``stfs mount``) decides about the file ``path``.

    The file's bytes go through ``fetch_header`` (or ``validate``, called as it is) as ``read_header`` sends them,
    without its ``LocalFiles``, which would pin (hold open) every file it reads.
    """
    with open(path, "rb") as stream:
        data = stream.read()
    try:
        validate(lambda offset, size: data[offset : offset + size], path=path, file_size=len(data))
    except errors.StfsError as exc:
        return Verdict(False, type(exc).__name__, exc.message)
    except Exception as exc:  # anything else is a crash
        return Verdict(False, type(exc).__name__, f"{exc!r:.300}", crash=True)
    return Verdict(True, "ok")


def stricter_rule(data: bytes) -> str | None:
    """Which documented stricter rule the file breaks, found without stfs: its header's start, a repeated key."""
    if len(data) < 8:
        return None
    (length,) = struct.unpack("<Q", data[:8])
    raw = data[8 : 8 + length]
    if 8 + length > len(data):
        return None
    if not raw.startswith(b"{"):
        return "header-start"
    repeated = False

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal repeated
        repeated = repeated or len({key for key, _ in pairs}) != len(pairs)
        return dict(pairs)

    with contextlib.suppress(ValueError, RecursionError):
        json.loads(raw.decode("utf-8"), object_pairs_hook=hook)
    return "duplicate-key" if repeated else None


@dataclass(frozen=True, slots=True)
class Outcome:
    signature: str | None  # None: stfs agrees (or is stricter as documented)
    agreement: str
    stfs: Verdict
    reference: Verdict
    split: bool


def judge(data: bytes, path: str, validate: Callable[[str], Verdict] = stfs_verdict) -> Outcome:
    """Both verdicts on ``data`` (written to ``path``) and whether they agree: a ``signature`` names a failure."""
    with open(path, "wb") as stream:
        stream.write(data)
    ours = validate(path)
    deserialized, opened = reference_verdict(data, path)
    split = deserialized.accepted != opened.accepted
    theirs = opened if split and not opened.accepted else deserialized  # a refusal by either counts
    if ours.crash:
        return Outcome(f"crash {ours.kind}", "", ours, theirs, split)
    if ours.accepted == theirs.accepted:
        agreement = "both accept" if ours.accepted else f"both refuse: {theirs.kind}"
        return Outcome(None, agreement, ours, theirs, split)
    if not ours.accepted:
        rule = stricter_rule(data)
        expected = {"header-start": "InvalidHeaderStart", "duplicate-key": "DuplicateKey"}.get(rule or "")
        if rule in STRICTER and ours.kind == expected:
            return Outcome(None, f"stricter as documented: {rule}", ours, theirs, split)
        return Outcome(f"stfs refuses ({ours.kind}), the reference accepts", "", ours, theirs, split)
    return Outcome(f"stfs accepts, the reference refuses ({theirs.kind})", "", ours, theirs, split)


# -- planted faults: validators the fuzzer must catch (fuzz_reference.py --validate tests.verdicts:NAME) ---------------


def lenient_verdict(path: str) -> Verdict:
    """stfs's verdict as it was before it read JSON as serde_json does: nesting and numbers past the reference's
    limits accepted."""
    verdict = stfs_verdict(path)
    if verdict.kind in ("RecursionLimitExceeded", "NumberOutOfRange"):
        return Verdict(True, "ok")
    return verdict


def _fetch_header_raising_key_error(fetch: Callable[[int, int], bytes], *, path: str, file_size: int) -> object:
    try:
        return fetch_header(fetch, path=path, file_size=file_size)
    except errors.DuplicateKey:
        raise KeyError("planted") from None


def crashing_verdict(path: str) -> Verdict:
    """stfs's verdict with a foreign exception, a KeyError, where stfs names a repeated key."""
    return stfs_verdict(path, _fetch_header_raising_key_error)
