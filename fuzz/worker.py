"""The process a fuzzer's cases run in, and its keeper: a case goes in on stdin (a u32 length, then its bytes), one
JSON line comes out on stdout. The worker's address space is capped at what its imports took plus ``--memory``
MiB, so a reader that allocates past its bound dies (or raises ``MemoryError``) there; the keeper turns no answer
within the timeout (a hang) and a dead worker (a crash, the cap) into findings, and starts a new worker."""

from __future__ import annotations

import json
import os
import resource
import select
import struct
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

MIB = 1 << 20
Answers = dict[str, Any] | Iterator[dict[str, Any]]


def cap_memory(memory_mib: int) -> None:
    """Cap this process's address space at its size now plus ``memory_mib`` MiB (call it after the imports)."""
    with open("/proc/self/status") as stream:
        size_kib = next(int(line.split()[1]) for line in stream if line.startswith("VmSize:"))
    cap = size_kib * 1024 + memory_mib * MIB
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def serve(check: Callable[[bytes], Answers], memory_mib: int, key: str = "status") -> None:
    """The worker's loop: each case from stdin through ``check``, its answer (or each of its answers, where it
    yields several: a verdict, then a reference's comparison) a JSON line on stdout. A ``MemoryError`` before the
    first answer is a finding (``key`` names the field a fuzzer keeps its verdict in); after it, the worker dies,
    as its keeper expects no finding in place of a later answer."""
    cap_memory(memory_mib)
    source, sink = sys.stdin.buffer, sys.stdout
    while True:
        head = source.read(4)
        if len(head) < 4:
            return
        (length,) = struct.unpack("<I", head)
        data = source.read(length)
        answered = False
        try:
            found = check(data)
            for answer in [found] if isinstance(found, dict) else found:
                sink.write(json.dumps(answer) + "\n")
                sink.flush()
                answered = True
        except MemoryError:
            if answered:
                raise
            sink.write(json.dumps({key: "finding", "why": "MemoryError: the reader allocated past the cap"}) + "\n")
            sink.flush()


class Worker:
    """The keeper of a worker process running ``script --worker --memory N``: ``run(data, timeout)`` is its
    answer, or a finding (``key``: ``"finding"``) where it hangs or dies, after which a new worker starts."""

    def __init__(self, script: str, memory_mib: int, key: str = "status", quiet: bool = False) -> None:
        self.command = [sys.executable, os.path.abspath(script), "--worker", "--memory", str(memory_mib)]
        self.key = key
        self.stderr = subprocess.DEVNULL if quiet else None
        self.process = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr)

    def send(self, data: bytes) -> bool:
        """Hand the worker a case; ``False`` where it had died before."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(struct.pack("<I", len(data)) + data)
            self.process.stdin.flush()
        except BrokenPipeError:
            return False
        return True

    def answer(self, timeout: float) -> dict[str, Any] | str:
        """The worker's next JSON line, or why there is none (a hang or its death)."""
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return f"hang: no answer in {timeout} s"
        line = self.process.stdout.readline()
        if not line:
            return f"worker died (exit {self.process.wait()}): a crash or the memory cap"
        return dict(json.loads(line))

    def run(self, data: bytes, timeout: float) -> dict[str, Any]:
        if not self.send(data):
            return self.restart("worker died before the case")
        found = self.answer(timeout)
        return self.restart(found) if isinstance(found, str) else found

    def restart(self, why: str) -> dict[str, Any]:
        """A finding saying ``why``, with a new worker started for the next case."""
        self.stop()
        self.process = self._start()
        return {self.key: "finding", "why": why}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
