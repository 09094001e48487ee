"""Reading bytes: a checkpoint's only way to its file (``Read``, ``ReadMany``), and the checks on what comes back."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ... import errors

Read = Callable[[int, int], bytes]  # (offset, size) -> bytes, short only at the end of the file
# Several (offset, size) ranges -> their bytes, in order: where reads are costly (a remote source), the caller
# may issue them at once. Used for the ranges that do not depend on each other (the storages' local headers,
# a legacy file's counts); without one, they are read one after another through ``Read``.
ReadMany = Callable[[Sequence[tuple[int, int]]], Sequence[bytes]]

COALESCE_GAP = 4096  # two reads closer than this become one


def read_exact(read: Read, offset: int, size: int, path: str) -> bytes:
    data = read(offset, size) if size > 0 else b""
    if len(data) < size:
        raise errors.CheckpointTruncated(path, f"file ends at byte {offset + len(data)}, inside bytes {offset}+{size}")
    return bytes(data)


def read_ranges(many: ReadMany, ranges: Sequence[tuple[int, int]], path: str) -> list[bytes]:
    """The bytes of each ``(offset, size)``, all asked for at once; ranges closer than ``COALESCE_GAP`` are one read."""
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    groups: list[tuple[int, int, list[int]]] = []  # start, end, the ranges it holds
    for i in order:
        start, end = ranges[i][0], sum(ranges[i])
        if groups and start <= groups[-1][1] + COALESCE_GAP:
            first, last, members = groups[-1]
            groups[-1] = (first, max(last, end), [*members, i])
        else:
            groups.append((start, end, [i]))
    blocks = many([(start, end - start) for start, end, _ in groups]) if groups else []
    out: list[bytes] = [b""] * len(ranges)
    for (start, end, members), block in zip(groups, blocks, strict=True):
        if len(block) < end - start:
            raise errors.CheckpointTruncated(
                path, f"file ends at byte {start + len(block)}, inside bytes {start}+{end - start}"
            )
        for k in members:
            offset, size = ranges[k]
            out[k] = bytes(block[offset - start : offset - start + size])
    return out
