"""A DeepSpeed tag folder's rank files: which there are (probed by name, as ``engine.save_checkpoint`` names them),
and each read as a PyTorch checkpoint (§12: interpreted, never run) for its tensors' places and its plain values."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ... import errors
from ..base import Folder
from ..pytorch import Checkpoint, read_checkpoint
from ..pytorch.values import Global, Object
from .rules import InvalidRankState, MissingRankFile, ModelParallelCheckpoint, NotZeroCheckpoint, RanksDisagree

MAX_LATEST = 4096  # bytes of a ``latest`` file: a tag name and a newline
TAG = re.compile(r"[A-Za-z0-9_.+=-]{1,255}")  # a tag as a folder name of one component (not "." or "..")
OWN_NAME = re.compile(r"(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt")


@dataclass(frozen=True, slots=True)
class Rank:
    """One rank's files, read: its optimizer state and (ZeRO-3: every rank; else rank 0 only) its model state;
    ``*_file`` their names relative to the header's folder."""

    optim_file: str
    optim: Checkpoint
    model_file: str | None
    model: Checkpoint | None


@dataclass(frozen=True, slots=True)
class Run:
    """A tag folder read: its ZeRO stage, data-parallel world size and ranks (rank 0 first)."""

    tag: str
    stage: int
    world_size: int
    ranks: tuple[Rank, ...]

    @property
    def model(self) -> Checkpoint:
        """Rank 0's model state, as ``zero_to_fp32`` reads it (param_shapes, buffers, shared_params, ds_config)."""
        found = self.ranks[0].model
        assert found is not None
        return found

    @property
    def files(self) -> list[str]:
        return [name for rank in self.ranks for name in (rank.model_file, rank.optim_file) if name is not None]


def tag_of(latest: bytes, path: str) -> str:
    """The tag a ``latest`` file names (its text less surrounding white space)."""
    try:
        tag = latest.decode("ascii").strip()
    except UnicodeDecodeError:
        tag = ""
    if not TAG.fullmatch(tag) or tag in (".", ".."):
        raise NotZeroCheckpoint(path, f"a 'latest' file names the tag folder; this one holds {latest[:40]!r}")
    return tag


def read_run(folder: Folder, prefix: str, own: str | None, path: str) -> Run:
    """The tag folder ``prefix`` (``""``: the header's own folder; else ``TAG/``) of ``folder``; ``own``: the name of
    the model state file the header is, where it is one."""
    if own is not None:
        found = OWN_NAME.fullmatch(own)
        if found is not None and int(found.group(2)):
            raise ModelParallelCheckpoint(path, _MERGE_FIRST)
    for name in ("mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_model_states.pt"):
        if folder.size(prefix + name) is not None:
            raise ModelParallelCheckpoint(path, f"{prefix + name} is there: {_MERGE_FIRST}")
    if folder.size(prefix + "layer_00-model_00-model_states.pt") is not None:
        raise ModelParallelCheckpoint(path, f"its layers are in layer_*-model_states.pt files: {_MERGE_FIRST}")
    kind = next(
        (k for k in ("", "bf16_") if folder.size(f"{prefix}{k}zero_pp_rank_0_mp_rank_00_optim_states.pt")), None
    )
    if kind is None:
        if folder.size(prefix + "mp_rank_00_model_states.pt") is None and own is None:
            raise NotZeroCheckpoint(path, f"its tag folder {prefix!r} holds no DeepSpeed model or optimizer state")
        raise MissingRankFile(
            path,
            f"no {prefix}zero_pp_rank_0_mp_rank_00_optim_states.pt: a ZeRO checkpoint has one per rank (one saved "
            "without ZeRO or without its optimizer holds no float32 weights to consolidate)",
        )
    first = _read(folder, f"{prefix}{kind}zero_pp_rank_0_mp_rank_00_optim_states.pt", path)
    stage, world_size = _zero(first, path)
    if folder.size(f"{prefix}{kind}zero_pp_rank_{world_size}_mp_rank_00_optim_states.pt") is not None:
        raise RanksDisagree(
            path, f"rank 0 says the world size is {world_size}, but there is a file for rank {world_size}"
        )
    ranks = []
    for rank in range(world_size):
        optim_file = f"{prefix}{kind}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
        optim = first if rank == 0 else _read(folder, optim_file, path)
        if rank and _zero(optim, path) != (stage, world_size):
            raise RanksDisagree(
                path,
                f"{optim_file} says ZeRO stage {_zero(optim, path)[0]}, world size {_zero(optim, path)[1]}; "
                f"rank 0 says stage {stage}, world size {world_size}",
            )
        model_file = None
        if stage == 3:
            model_file = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        elif rank == 0:
            model_file = f"{prefix}mp_rank_00_model_states.pt"
        model = _read(folder, model_file, path) if model_file is not None else None
        ranks.append(Rank(optim_file, optim, model_file, model))
    return Run(prefix.rstrip("/"), stage, world_size, tuple(ranks))


_MERGE_FIRST = (
    "a tensor- or pipeline-parallel checkpoint: merge its model-parallel ranks first (DeepSpeed's ds_to_universal, "
    "or Megatron's checkpoint converter), then mount the result"
)


def _read(folder: Folder, name: str, path: str) -> Checkpoint:
    size = folder.size(name)
    if size is None:
        raise MissingRankFile(path, f"{name} is missing: a ZeRO checkpoint has one per rank")
    fetch = folder.fetcher(name)
    try:
        return read_checkpoint(fetch, size, path=f"{path} ({name})", read_many=getattr(fetch, "many", None))
    except errors.FormatError as exc:
        if not exc.refutes_format:
            raise
        raise InvalidRankState(path, f"{name}: {exc.detail}") from None  # a rank file that is no checkpoint is broken


def _zero(optim: Checkpoint, path: str) -> tuple[int, int]:
    """(ZeRO stage, world size) as a rank's optimizer state says (``zero_stage``, ``partition_count``)."""
    state = member(optim.top_object, "optimizer_state_dict")
    stage = number(member(state, "zero_stage"))
    count = member(state, "partition_count")
    counts = count if isinstance(count, (list, tuple)) else [count]
    sizes = [number(item) for item in counts]
    if stage not in (1, 2, 3) or not sizes or any(size is None or size < 1 for size in sizes):
        raise InvalidRankState(
            f"{path} ({optim.path})", f"zero_stage {stage!r} and partition_count are not a ZeRO optimizer's"
        )
    return stage, max(size for size in sizes if size is not None)


def member(value: Any, key: str) -> Any:
    """``value[key]`` where ``value`` is a dict holding it, else ``None``."""
    return value.get(key) if isinstance(value, dict) else None


def number(value: Any) -> int | None:
    """An int, or an int enum (``ZeroStageEnum.weights``, an opaque call of the enum's class on its value)."""
    if type(value) is int:
        return value
    enum = isinstance(value, Object) and isinstance(value.callee, Global) and isinstance(value.args, tuple)
    if enum and len(value.args) == 1 and type(value.args[0]) is int:
        return int(value.args[0])
    return None
