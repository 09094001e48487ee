"""What the plugin published, kept under ``--state-dir`` so that a restarted plugin knows it: one JSON file per
published target (``volumes/HASH.json``: the volume's id, target, SOURCE without credentials and attributes; never
a secret), each mount daemon's log beside it (``logs/HASH.log``) and its home folder (``homes/HASH/``: empty when
the daemon starts, so that it finds no credentials but its volume's, SPEC §15a)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator


class State:
    """The state folder: ``save``, ``load`` and ``forget`` a target's record; ``records`` lists them all."""

    def __init__(self, folder: str) -> None:
        self.folder = os.path.abspath(folder)
        for part in ("volumes", "logs", "homes"):
            os.makedirs(os.path.join(self.folder, part), mode=0o700, exist_ok=True)

    def _name(self, target: str) -> str:
        return hashlib.sha256(target.encode("utf-8", "surrogateescape")).hexdigest()[:32]

    def record_path(self, target: str) -> str:
        return os.path.join(self.folder, "volumes", self._name(target) + ".json")

    def log_path(self, target: str) -> str:
        return os.path.join(self.folder, "logs", self._name(target) + ".log")

    def home_path(self, target: str) -> str:
        return os.path.join(self.folder, "homes", self._name(target))

    def fresh_home(self, target: str) -> str:
        """The target's home folder, empty (what a previous daemon left there removed)."""
        path = self.home_path(target)
        shutil.rmtree(path, ignore_errors=True)
        os.mkdir(path, mode=0o700)
        return path

    def save(self, record: dict[str, object]) -> None:
        """Write ``record`` (its ``target`` names the file) whole or not at all: a new file renamed over the old."""
        path = self.record_path(str(record["target"]))
        partial = f"{path}.{os.getpid()}.partial"
        with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w", encoding="utf-8") as stream:
            json.dump(record, stream, indent=1, sort_keys=True)
            stream.write("\n")
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(partial, path)

    def load(self, target: str) -> dict[str, object] | None:
        try:
            with open(self.record_path(target), encoding="utf-8") as stream:
                record = json.load(stream)
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("target") == target else None

    def forget(self, target: str, log: bool = True) -> None:
        """Remove the target's record and home folder, and its daemon's log unless ``log`` is False (a failed
        mount's, which its error names)."""
        for path in (self.record_path(target), *([self.log_path(target)] if log else [])):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        shutil.rmtree(self.home_path(target), ignore_errors=True)

    def records(self) -> Iterator[dict[str, object]]:
        folder = os.path.join(self.folder, "volumes")
        for name in sorted(os.listdir(folder)):
            record = None
            if name.endswith(".json"):
                with contextlib.suppress(OSError, ValueError), open(os.path.join(folder, name)) as stream:
                    record = json.load(stream)
            if isinstance(record, dict):
                yield record
