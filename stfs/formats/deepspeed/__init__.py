"""DeepSpeed ZeRO checkpoints (SPEC §16): a tag folder as ``engine.save_checkpoint`` writes it (``global_stepN/``
holding ``*_model_states.pt`` and ``*_optim_states.pt``), or the folder above it whose ``latest`` names the tag,
mounted as the model the run trained, nothing converted.

The format's files are a model state (``mp_rank_00_model_states.pt``, ZeRO-3's ``zero_pp_rank_R_..._model_states.pt``)
and ``latest``; either stands for the whole folder holding it (``Format.folder_model``). The rank files are found
by the names DeepSpeed gives them (``ranks``) and read as PyTorch checkpoints (§12: the pickle interpreted, never
run; only the pickles and the storages' places are read, never a partition's bytes). Each tensor of
``get_fp32_state_dict_from_zero_checkpoint`` is placed in them (``consolidate``) and served as one range of a rank
file where it is one, else gathered from its runs (``Joined``), read by ranges and never assembled in memory.

Choices where SPEC §16 is silent: a buffer is served in the dtype it was saved in, as §16 says (DeepSpeed 0.19's
``zero_to_fp32`` makes a float16 or bfloat16 buffer float32; integer and float32 ones it keeps, as here); the
per-element optimizer states (Adam's ``exp_avg``, ``exp_avg_sq``) are ``optimizer/STATE/NAME``, placed as the
weights are (``ds_to_universal``'s ``zero/NAME/STATE.pt``), outside ``header.json`` and the views; a tensor's name
is the model's (no ``module.`` prefix); ``metadata/`` adds ``tag``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ... import errors
from .. import zip
from ..base import Folder, Format, Header, RangeFetcher, Read, Rows, TensorEntry, made_header, read_exact
from ..pytorch import WEIGHTS_ONLY_GLOBALS
from ..pytorch.values import Global, Object
from .consolidate import Placed, Segment, optimizer_states, weights
from .ranks import MAX_LATEST, TAG, Run, member, read_run, tag_of
from .rules import NotZeroCheckpoint

__all__ = ["DS_GLOBALS", "FORMAT", "DeepSpeedEntry", "Joined", "fetch_header"]

# DeepSpeed's own classes that ``engine.save_checkpoint`` pickles beside the tensors: the ZeRO stage enum, the loss
# scaler's settings, a fragment's (start, numel) address. They are DeepSpeed's, not the training code's (loading
# the checkpoint needs DeepSpeed installed anyway), so they are read as opaque values without a warning; any other
# global outside ``torch.load(weights_only=True)``'s allow-list is warned of and fails ``stfs check``, as §12 says.
DS_GLOBALS = frozenset(
    {
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)


@dataclass(frozen=True, slots=True)
class Joined:
    """A tensor whose bytes in C order are ``segments`` (file, absolute offset, bytes) one after another: a ZeRO
    parameter's pieces in its ranks' partitions, as a ``Scattered``."""

    segments: tuple[Segment, ...]

    @property
    def offset(self) -> int:
        return self.segments[0][1]

    @property
    def span(self) -> tuple[int, int]:
        return (self.segments[0][1], self.segments[0][2])

    def read_into(self, read: Read, begin: int, view: memoryview) -> None:
        start = 0
        done = 0
        for file, offset, size in self.segments:
            low, high = max(begin + done, start), min(begin + len(view), start + size)
            if low < high:
                data = read(offset + low - start, high - low, file, (offset, offset + size))
                view[done : done + high - low] = data
                done += high - low
            start += size

    def layout(self, limit: int) -> tuple[Rows | bytes, ...] | str:
        if len(self.segments) > limit:
            return f"it is more than {limit} runs"
        return (Rows(1, tuple((file, offset, size, size) for file, offset, size in self.segments)),)


@dataclass(frozen=True, slots=True)
class DeepSpeedEntry(TensorEntry):
    """A consolidated tensor: one range ``begin``/``end`` of ``location`` (a rank file), or ``joined`` from runs of
    several (``begin`` where its first byte lies in ``location``). xattrs ``user.deepspeed.*`` add ``runs``."""

    location: str | None = None
    joined: Joined | None = None
    runs: int = 0

    @property
    def file(self) -> str | None:
        return self.location

    @property
    def scattered(self) -> Joined | None:
        return self.joined

    @property
    def xattrs(self) -> dict[str, str]:
        return {"runs": str(self.runs)}


def fetch_header(
    fetch: RangeFetcher,
    *,
    path: str,
    file_size: int,
    mtime_ns: int = 0,
    first_read: int = 0,
    folder: Folder | None = None,
) -> Header:
    """Read and validate the ZeRO checkpoint ``path`` stands for (a model state of its tag folder, or ``latest``)
    through the other files of its ``folder``, as a ``Header``: the consolidated tensors, ``metadata/`` and the
    rank files as ``other_files``."""
    if folder is None:
        raise errors.MissingDataFile(path, "its tensors lie in the rank files of its folder, which were not given")
    name = path.rpartition("/")[2]
    if name.endswith("_model_states.pt"):
        run = read_run(folder, "", name, path)
    else:
        tag = tag_of(read_exact(fetch, 0, min(file_size, MAX_LATEST), path), path)
        if not _has_tag(folder, tag):
            raise NotZeroCheckpoint(path, f"it names the tag {tag!r}, and no DeepSpeed checkpoint is in {tag}/")
        run = read_run(folder, f"{tag}/", None, path)
    sizes = {file: folder.size(file) for file in run.files}
    entries = [_entry(placed, sizes, path) for placed in weights(run, path)]
    states: dict[str, list[DeepSpeedEntry]] = {}
    for state, placed in optimizer_states(run, path):
        states.setdefault(f"optimizer/{state}", []).append(_entry(placed, sizes, path))
    problems = _unsafe(run, path)
    metadata = _metadata(run)
    return made_header(
        path=path,
        file_size=file_size,
        mtime_ns=mtime_ns,
        tensors=entries,
        metadata=metadata,
        parsed=run,
        warnings=problems,
        check_problems=problems,
        other_files=tuple(run.files),
        folders={name: tuple(found) for name, found in states.items()},
    )


def _has_tag(folder: Folder, tag: str) -> bool:
    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
    return any(folder.size(f"{tag}/{name}") is not None for name in names)


def _entry(placed: Placed, sizes: dict[str, int | None], path: str) -> DeepSpeedEntry:
    """A consolidated tensor as an entry: one range where it is one run, else joined; each run inside its file
    (``sizes``: the rank files')."""
    for file, offset, size in placed.segments:
        held = sizes.get(file)
        if held is None or offset + size > held:
            raise errors.DataFileTooShort(
                path, f"its bytes are [{offset}, {offset + size}) of {file!r}, which is {held} bytes", placed.name
            )
    segments = placed.segments
    if not segments:
        return DeepSpeedEntry(placed.name, placed.dtype, placed.shape, 0, 0)
    nbytes = sum(size for _, _, size in segments)
    file, begin, _ = segments[0]
    # a gathered tensor reads the other files of its first file's folder (the tag folder), by their names there
    joined = (
        Joined(tuple((name.rpartition("/")[2], at, size) for name, at, size in segments)) if len(segments) > 1 else None
    )
    return DeepSpeedEntry(placed.name, placed.dtype, placed.shape, begin, begin + nbytes, file, joined, len(segments))


def _unsafe(run: Run, path: str) -> tuple[str, ...]:
    """One line per global a rank file names outside torch's weights_only allow-list and DeepSpeed's own."""
    lines = []
    for rank in run.ranks:
        for checkpoint in (rank.model, rank.optim):
            if checkpoint is None:
                continue
            lines += [
                f"{checkpoint.path}: names the global {name!r}: loading it without weights_only=True would import "
                "and call it"
                for name in checkpoint.globals
                if name not in WEIGHTS_ONLY_GLOBALS and name not in DS_GLOBALS
            ]
    return tuple(dict.fromkeys(lines))


def _metadata(run: Run) -> dict[str, str]:
    """``metadata/``: ``format`` ``pt``, then what the run's rank 0 model state says of it."""
    top = run.model.top_object
    shown = {"format": "pt", "zero_stage": str(run.stage), "world_size": str(run.world_size)}
    for key in ("ds_version", "global_steps"):
        value = member(top, key)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            shown[key] = str(value)
    config = member(top, "ds_config")
    if config is not None:
        shown["ds_config"] = json.dumps(_plain(config, 0), indent=2, sort_keys=False)
    if run.tag:
        shown["tag"] = run.tag
    return shown


def _plain(value: Any, depth: int) -> Any:
    """A pickled value as JSON: dicts, lists and scalars as they are; anything else described."""
    if depth > 64:
        return "..."
    if isinstance(value, dict):
        return {str(key): _plain(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, depth + 1) for item in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, Object) and isinstance(value.callee, Global):
        return f"<{value.callee.full}>"
    return f"<{type(value).__name__}>"


_TEXT = re.compile(rb"[A-Za-z0-9_.+=-]{1,255}\r?\n?")


class _DeepSpeed(Format):
    name = "deepspeed"
    title = "DeepSpeed ZeRO checkpoint"
    head_size = 512
    confirm_in_folder = True  # a folder's other file named latest is no tag's name
    folder_model = True  # its rank files, its other tags and anything else below its folder are this one model

    def sniff(self, head: bytes) -> bool:
        """A torch.save archive whose top folder is a model state's (``X_model_states/data.pkl`` first), or a
        whole ``latest`` file: a tag's name."""
        if head[:4] == b"PK\x03\x04":
            first = zip.first_member(head) or ""
            return first.endswith("_model_states/data.pkl")
        return (
            len(head) < self.head_size
            and _TEXT.fullmatch(head) is not None
            and TAG.fullmatch(head.decode("ascii").strip()) is not None
        )

    def read_header(
        self, fetch: RangeFetcher, *, path: str, file_size: int, mtime_ns: int = 0, first_read: int = 0
    ) -> Header:
        folder: Folder | None = getattr(fetch, "folder", None)
        return fetch_header(
            fetch, path=path, file_size=file_size, mtime_ns=mtime_ns, first_read=first_read, folder=folder
        )

    def safetensors_name(self, path: str) -> str | None:
        """The model state (or ``latest``) -> ``model.safetensors`` beside it: the run's weights as one file."""
        folder = path.rpartition("/")[0]
        return f"{folder}/model.safetensors" if folder else "model.safetensors"


FORMAT: Format = _DeepSpeed()
