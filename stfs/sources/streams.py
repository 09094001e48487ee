"""The readers of a remote file, followed by where they are in it: which one a read goes on with, and when to
fetch ahead of it (``RemoteFiles._read_ahead`` fetches the blocks).

A reader is keyed by where it is in the file (within the kernel's reordering: a little back, up to 16 MiB
forward), not by the span (the tensor) it reads. One that starts a span at its first byte gets a window of blocks
fetched ahead of it, doubling up to the source's ``max_window``, within the span; once it goes on into the next
span, the window runs on across spans. A reader that lands inside a span (or in a header) is a jump: it gets
exactly the bytes it asks for until it has read on ``JUMP_PROOF`` (``HEADER_PROOF``) bytes.
"""

from __future__ import annotations

from .base import PAGE

MIB = 1 << 20
FORWARD_SLACK = 16 * MIB  # the kernel's readahead may skip ahead this far and still be one sequential reader
JUMP_SLACK = 2 * MIB  # the same for a reader not yet sequential: two requests taken out of order, not a jump
BACKWARD_SLACK = 1 * MIB
FIRST_WINDOW = 2  # blocks fetched ahead of a reader that has just shown it is sequential
JUMP_PROOF = 16 * MIB  # read on from a jump before it counts as sequential (a 4 MiB tensor through mmap never does)
HEADER_PROOF = 2 * MIB  # the same from a header (the first read's bytes): dd of files/ is sequential from there
MAX_STREAMS = 8  # readers followed per file


class Stream:
    """One reader of a file: where it is, the span it is in, and how far ahead of it to fetch."""

    __slots__ = ("next", "low", "high", "jump", "proof", "crossed", "window", "read", "passed")

    def __init__(self, next_offset: int, low: int, high: int, jump: bool) -> None:
        self.next = next_offset
        self.low, self.high = low, high  # the span (tensor) it reads now
        self.jump = jump  # it started inside a span (or a header): exactly what it asks until ``proof`` bytes on
        self.proof = JUMP_PROOF
        self.crossed = False  # it went on from one span into the next: its window crosses spans
        self.window = 0
        self.read = 0
        self.passed = 0  # blocks before this one have been marked as read past (``SlotCache.pass_by``)


def follow(streams: list[Stream], offset: int, end: int, low: int, high: int, head: int) -> tuple[Stream, bool]:
    """The reader that a read of ``[offset, end)`` in the span ``[low, high)`` goes on with, moved last in
    ``streams`` (a file's readers, most recent last), or a new one (a read in the file's first ``head`` bytes is
    a header's: safe_open reads it, then jumps); and whether it went on with one already followed."""
    stream = next((s for s in streams if follows(s, offset)), None)
    if stream is None:
        stream = Stream(end, low, high, jump=offset != low or offset < head)
        stream.proof = HEADER_PROOF if offset < head else JUMP_PROOF
        left = next((s for s in streams if s.jump and near(s, offset, FORWARD_SLACK)), None)
        if left is not None:  # a reader not yet sequential that jumped on from there: this one, anew
            streams.remove(left)
        streams.append(stream)
        if len(streams) > MAX_STREAMS:
            del streams[0]
        return stream, False
    streams.remove(stream)
    streams.append(stream)
    # On into the next span: a whole-file reader. For one that started at its span's first byte, where that span
    # ends, not where it was last seen: stfs._native answers the reads of blocks already here without telling
    # this code. (A jump stays one until it has read to the end of its span.)
    ends = (stream.next,) if stream.jump else (stream.next, stream.high)
    if low != stream.low and any(abs(e - low) <= PAGE for e in ends):
        stream.crossed, stream.jump, stream.low, stream.high = True, False, low, high
    elif low != stream.low:  # another span, not the next one: a new start
        streams[-1] = stream = Stream(end, low, high, jump=offset != low)
    stream.read += max(0, end - stream.next)
    stream.next = max(stream.next, end)
    return stream, True


def fetch_ahead(stream: Stream, max_window: int) -> bool:
    """Whether to fetch ahead of ``stream`` now (a jump: once it has read ``proof`` bytes on), its window of
    blocks grown if so: ``FIRST_WINDOW``, then doubling up to ``max_window``."""
    if stream.jump:
        if stream.read < stream.proof:
            return False
        stream.jump = False
    stream.window = FIRST_WINDOW if stream.window == 0 else min(stream.window * 2, max_window)
    return True


def follows(stream: Stream, offset: int) -> bool:
    """Whether a read at ``offset`` goes on with ``stream``: near where it is (the kernel's readahead skips pages
    already cached, up to ``FORWARD_SLACK``), or, while it has not yet shown it is sequential (a jump, a header),
    within ``JUMP_SLACK`` of where it left off (requests the thread pool took out of order): a longer gap is
    another jump. (safe_open reads the header, then faults in the tensor it wants a few MiB on: counted as one
    reader, the gap made it sequential, and it fetched ahead far past the tensor.)"""
    return near(stream, offset, JUMP_SLACK if stream.jump else FORWARD_SLACK)


def near(stream: Stream, offset: int, ahead: int) -> bool:
    return stream.next - BACKWARD_SLACK <= offset <= stream.next + ahead
