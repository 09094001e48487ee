"""stfs gives the safetensors reference's verdict: JSON read as serde_json reads it, and a differential fuzzer.

Every boundary is checked against the real reference (``safetensors.deserialize`` and ``safe_open``) as well
as against stfs, so a newer reference that moved one would fail here rather than silently disagree.
"""

from __future__ import annotations

import ast
import json
import random
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import safetensors
from safetensors import safe_open

from stfs import errors
from stfs.formats.safetensors import reference_number
from stfs.model import read_header
from tests import verdicts
from tests.models import write_header

REPO = Path(__file__).resolve().parent.parent
TENSOR = '"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]'


def reference_accepts(path: str) -> bool:
    """The reference's verdict on the file ``path``; ``deserialize`` and ``safe_open`` must agree on it."""
    with open(path, "rb") as stream:
        data = stream.read()

    def opened() -> None:
        with safe_open(path, "np") as handle:
            handle.keys()

    verdicts = []
    for check in (lambda: safetensors.deserialize(data), opened):
        try:
            check()
        except safetensors.SafetensorError:
            verdicts.append(False)
        else:
            verdicts.append(True)
    assert verdicts[0] == verdicts[1], "deserialize and safe_open disagree"
    return verdicts[0]


def stfs_refusal(path: str) -> errors.FormatError | None:
    try:
        read_header(path)
    except errors.FormatError as exc:
        assert exc.message.startswith(f"{path}: ")
        assert f"rule {exc.rule} ({type(exc).__name__}): " in exc.message
        assert "\n" not in exc.message and len(exc.message) < 600
        return exc
    return None


def with_member(tmp_path: Path, value: str, name: str = "x") -> str:
    """A valid file whose one tensor has one more member, ``name``, holding the JSON text ``value``."""
    raw = ("{" + TENSOR + f',"{name}":{value}' + "}}").encode()
    return write_header(str(tmp_path / "member.safetensors"), None, raw=raw)


# -- numbers: the reference's float64 range ----------------------------------------------------------------------------

LARGEST_20_DIGITS = "17976931348623156224"  # as a significand, the largest serde_json multiplies by 1e289 finitely
NUMBER_BOUNDARIES = [
    # (literal, both accept it): the largest accepted and the smallest refused, in each form
    ("1.7976931348623157e308", True),  # float64's largest, as repr() writes it
    ("1.7976931348623158e308", False),  # Python rounds this to float64's largest; serde_json's product overflows
    ("1.7976931348623159e308", False),
    ("1.7976931348623156224e308", True),  # 20 significant digits, the most a u64 significand holds here
    ("1.7976931348623156225e308", False),  # smaller than 1.7976931348623157e308, yet refused
    (LARGEST_20_DIGITS + "9" * 289, True),  # a 309-digit integer: digits past the 20th are dropped
    ("17976931348623156225" + "0" * 289, False),
    ("1" + "0" * 308, True),
    ("1" + "0" * 309, False),
    ("1e308", True),
    ("1e309", False),
    ("0.1e309", True),
    ("10e308", False),
    ("1e-400", True),  # underflow is never refused
    ("0e99999999999", True),  # an exponent beyond i32 on a zero
    ("1e2147483648", False),
    ("0.0e2147483648", True),
    ("1e-2147483649", True),
]


@pytest.mark.parametrize("negative", [False, True])
@pytest.mark.parametrize(("literal", "accepted"), NUMBER_BOUNDARIES, ids=lambda v: str(v)[:26])
def test_number_range_is_the_references(tmp_path: Path, literal: str, accepted: bool, negative: bool) -> None:
    literal = "-" + literal if negative else literal
    path = with_member(tmp_path, literal)
    assert reference_accepts(path) is accepted
    refusal = stfs_refusal(path)
    if accepted:
        assert refusal is None, refusal
    else:
        assert type(refusal) is errors.NumberOutOfRange, refusal
        assert refusal.tensor == "a" and refusal.rule == 5
        assert literal[:20] in refusal.message


def test_number_out_of_range_in_a_shape_is_named_so(tmp_path: Path) -> None:
    raw = b'{"a":{"dtype":"U8","shape":[1e309],"data_offsets":[0,0]}}'
    path = write_header(str(tmp_path / "shape.safetensors"), None, raw=raw)
    assert not reference_accepts(path)
    refusal = stfs_refusal(path)
    assert type(refusal) is errors.NumberOutOfRange and refusal.tensor == "a"


def test_reference_number_agrees_with_the_reference_near_the_boundary() -> None:
    rng = random.Random(19)
    literals = [verdicts.boundary_number(rng) for _ in range(400)] + verdicts.NUMBERS
    refused = 0
    for literal in literals:
        raw = ("{" + TENSOR + ',"x":' + literal + "}}").encode()
        try:
            safetensors.deserialize(struct.pack("<Q", len(raw)) + raw)
            theirs = True
        except safetensors.SafetensorError as exc:
            assert "number out of range" in str(exc), (literal, exc)
            theirs = False
        refused += not theirs
        assert (reference_number(literal) is not None) is theirs, literal
    assert 50 < refused < len(literals) - 50  # both sides of the boundary were tried


# -- nesting: at most 127 containers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["array", "object"])
@pytest.mark.parametrize("containers", [126, 127, 128, 129, 1000, 100_000])
def test_nesting_limit_is_the_references(tmp_path: Path, containers: int, kind: str) -> None:
    inner = containers - 2  # the header's object and the tensor's info are two
    value = "[" * inner + "]" * inner if kind == "array" else '{"k":' * (inner - 1) + "{}" + "}" * (inner - 1)
    path = with_member(tmp_path, value)
    accepted = containers <= 127
    assert reference_accepts(path) is accepted
    refusal = stfs_refusal(path)
    if accepted:
        assert refusal is None, refusal
    else:
        assert type(refusal) is errors.RecursionLimitExceeded, refusal
        assert refusal.tensor == "a" and "127" in refusal.message


@pytest.mark.parametrize("containers", [128, 5000])
def test_nesting_in_metadata_names_metadata(tmp_path: Path, containers: int) -> None:
    inner = containers - 2
    raw = ('{"__metadata__":{"k":' + "[" * inner + "]" * inner + "}}").encode()
    path = write_header(str(tmp_path / "meta.safetensors"), None, raw=raw)
    assert not reference_accepts(path)  # (it also refuses a metadata value that is not a string)
    refusal = stfs_refusal(path)
    assert type(refusal) is errors.RecursionLimitExceeded and refusal.tensor is None
    assert "in __metadata__" in refusal.message


def test_a_fault_the_reference_sees_first_is_the_one_named(tmp_path: Path) -> None:
    # The reference parses the whole JSON before it looks at a tensor: a later tensor's nesting is its verdict.
    deep = "[" * 200 + "]" * 200
    raw = ('{"a":{"dtype":"NOPE","shape":[0],"data_offsets":[0,0]},"b":{"x":' + deep + "}}").encode()
    path = write_header(str(tmp_path / "order.safetensors"), None, raw=raw)
    assert not reference_accepts(path)
    refusal = stfs_refusal(path)
    assert type(refusal) is errors.RecursionLimitExceeded and refusal.tensor == "b"


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("-1e999", errors.NumberOutOfRange),
        ("9" * 400, errors.NumberOutOfRange),  # an integer Python parses, the reference refuses
        ("[" * 130 + "]" * 130, errors.RecursionLimitExceeded),  # nesting Python parses, the reference refuses
    ],
    ids=["float", "integer", "nesting"],
)
def test_a_fault_before_a_syntax_error_is_the_one_named(tmp_path: Path, value: str, error: type) -> None:
    for raw, named in [
        ('{"a":{"x":' + value + '},"b":{"y":[}', error),
        ('{"b":{"y":[},"a":{"x":' + value + "}}", errors.InvalidHeaderDeserialization),
    ]:
        path = write_header(str(tmp_path / "order.safetensors"), None, raw=raw.encode())
        assert not reference_accepts(path)
        refusal = stfs_refusal(path)
        assert type(refusal) is named, refusal
        assert refusal.tensor == ("a" if named is error else None)


# -- repeated keys: what the reference refuses too, and where stfs is stricter (docs/validation.md) ---------------

ALSO_REFUSED = [  # (header, what stfs says): serde's "duplicate field" in the reference
    ('{"__metadata__":{},"__metadata__":{}}', "__metadata__ appears twice"),
    ('{"a":{"dtype":"U8","dtype":"U8","shape":[0],"data_offsets":[0,0]}}', "key 'dtype' appears twice"),
    ('{"a":{"dtype":"U8","shape":[0],"shape":[0],"data_offsets":[0,0]}}', "key 'shape' appears twice"),
    ('{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"data_offsets":[0,0]}}', "key 'data_offsets' appears twice"),
]
STRICTER = [  # (header, stfs's error): the reference accepts each of these
    (' {"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}', errors.InvalidHeaderStart),
    ('\n{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}', errors.InvalidHeaderStart),
    ('{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]}}',
     errors.DuplicateKey),
    ('{"__metadata__":{"k":"1","k":"2"}}', errors.DuplicateKey),
    ('{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":1,"x":2}}', errors.DuplicateKey),
    ('{"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0],"x":[{"k":1,"k":1}]}}', errors.DuplicateKey),
]  # fmt: skip


@pytest.mark.parametrize(("header", "said"), ALSO_REFUSED)
def test_repeats_the_reference_refuses_too(tmp_path: Path, header: str, said: str) -> None:
    path = write_header(str(tmp_path / "twice.safetensors"), None, raw=header.encode())
    assert not reference_accepts(path)
    refusal = stfs_refusal(path)
    assert type(refusal) is errors.DuplicateKey
    assert said in refusal.message


def test_second_metadata_is_named_not_called_a_tensor(tmp_path: Path) -> None:
    path = write_header(str(tmp_path / "twice.safetensors"), None, raw=ALSO_REFUSED[0][0].encode())
    refusal = stfs_refusal(path)
    assert refusal is not None and refusal.tensor is None
    assert (
        "rule 5 (DuplicateKey): __metadata__ appears twice: stfs cannot mount this safetensors file; "
        in refusal.message
    )


@pytest.mark.parametrize(("header", "error"), STRICTER)
def test_where_stfs_is_stricter_than_the_reference(tmp_path: Path, header: str, error: type) -> None:
    path = write_header(str(tmp_path / "strict.safetensors"), None, raw=header.encode())
    assert reference_accepts(path)
    assert type(stfs_refusal(path)) is error
    assert verdicts.stricter_rule(Path(path).read_bytes()) is not None  # the fuzzer lets these pass


# -- the differential fuzzer (fuzz/fuzz_reference.py) ------------------------------------------------------------------


def fuzz(tmp_path: Path, *options: str) -> dict[str, Any]:
    """The figures (the JSON it prints) of a run of the fuzzer with ``options``."""
    command = [sys.executable, str(REPO / "fuzz" / "fuzz_reference.py"), "--work-dir", str(tmp_path), *options]
    result = subprocess.run(command, capture_output=True, text=True, timeout=110, cwd=REPO)
    assert result.returncode in (0, 1), result.stderr
    figures: dict[str, Any] = json.loads(result.stdout)
    return figures


@pytest.mark.timeout(120)
def test_bounded_fuzz_run_finds_no_disagreement(tmp_path: Path) -> None:
    figures = fuzz(tmp_path, "--seed", "1", "--inputs", "3000")
    assert figures["inputs"] == 3000
    assert not figures["disagreements"] and not figures["crashes"], figures["failures"]
    agreements = figures["agreements"]
    assert agreements["both accept"] > 200
    for kind in ("NumberOutOfRange", "RecursionLimitExceeded", "DuplicateKey", "MalformedTensorInfo"):
        assert agreements.get(f"both refuse: {kind}", 0) > 0, kind
    for rule in verdicts.STRICTER:
        assert agreements.get(f"stricter as documented: {rule}", 0) > 0, rule
    assert all(figures["inputs by mutation"].values()), figures["inputs by mutation"]  # every mutator ran


@pytest.mark.timeout(120)
def test_fuzzer_catches_the_old_json_reading_and_shrinks_it(tmp_path: Path) -> None:
    # Issue 19's two classes, as stfs had them: nesting and numbers past the reference's limits accepted.
    figures = fuzz(tmp_path, "--seed", "1", "--inputs", "1500", "--validate", "tests.verdicts:lenient_verdict")
    found = {failure["signature"]: ast.literal_eval(failure["minimal"]) for failure in figures["failures"]}
    for kind in ("RecursionLimitExceeded", "NumberOutOfRange"):
        signature = f"stfs accepts, the reference refuses ({kind})"
        minimal = found[signature]
        assert len(minimal) < 400 if kind == "RecursionLimitExceeded" else len(minimal) < 120
        replay = verdicts.judge(minimal, str(tmp_path / "replay.safetensors"), verdicts.lenient_verdict)
        assert replay.signature == signature


def test_a_refusal_for_another_rule_is_not_taken_as_a_documented_one(tmp_path: Path) -> None:
    def claims_a_repeated_key(path: str) -> verdicts.Verdict:
        return verdicts.Verdict(False, "DuplicateKey", "claims a duplicate")

    path = str(tmp_path / "input.safetensors")
    for header, signature in [
        ("{" + TENSOR + "}}", "stfs refuses (DuplicateKey), the reference accepts"),
        (" {" + TENSOR + "}}", "stfs refuses (DuplicateKey), the reference accepts"),  # stricter, for another rule
        ('{"__metadata__":{"k":"1","k":"2"}}', None),
    ]:
        raw = header.encode()
        outcome = verdicts.judge(struct.pack("<Q", len(raw)) + raw, path, claims_a_repeated_key)
        assert outcome.signature == signature, header
    assert outcome.agreement == "stricter as documented: duplicate-key"


def test_fuzzer_counts_a_foreign_exception_as_a_crash(tmp_path: Path) -> None:
    figures = fuzz(tmp_path, "--seed", "3", "--inputs", "300", "--validate", "tests.verdicts:crashing_verdict")
    assert figures["crashes"].get("crash KeyError", 0) > 0 and not figures["disagreements"]
    failure = figures["failures"][0]
    assert failure["signature"] == "crash KeyError"
    minimal = ast.literal_eval(failure["minimal"])
    assert len(minimal) < 64, minimal  # e.g. {"":{"k":[],"k":[]}}
