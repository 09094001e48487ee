"""Where each consolidated tensor's bytes lie in a ZeRO run's rank files, as ``zero_to_fp32``'s
``get_fp32_state_dict_from_zero_checkpoint`` puts them together (learnt from it; a copy of nothing):

* buffers: rank 0's module state, the names ``buffer_names`` lists, in the module's order;
* frozen parameters (``frozen_param_shapes``): ZeRO-1/2 rank 0's ``frozen_param_fragments``, whole; ZeRO-3 each
  rank's fragment of ``ceil(numel / world_size)`` elements, one after another, cut at ``numel``;
* trainable parameters (``param_shapes``, a dict per parameter group), float32: ZeRO-1/2 a group is the ranks'
  ``single_partition_of_fp32_groups`` one after another, its parameters one after another from its start, padded
  to a multiple of ``2 * world_size``; ZeRO-3 each rank holds ``ceil(numel / world_size)`` elements of each
  parameter, one after another along its groups' ``fp32_flat_groups``;
* shared parameters (``shared_params``): the tensor they are tied to, under their own name.

An optimizer state held per element (Adam's ``exp_avg``, ``exp_avg_sq``) lies in flat partitions of the same
layout as the float32 groups, so each parameter's is placed alike (``optimizer/STATE/NAME``, as ``ds_to_universal``
writes ``zero/NAME/STATE.pt``). A tensor is a list of ``Segment``: runs of the rank files, joined in order."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..pytorch import Checkpoint, Tensor
from .ranks import Run, member
from .rules import InvalidRankState, PartitionTooShort, RanksDisagree

Segment = tuple[str, int, int]  # (file relative to the header's folder, absolute offset, bytes)
OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq")  # per-element states ds_to_universal writes


@dataclass(frozen=True, slots=True)
class Placed:
    """A consolidated tensor: its name, safetensors dtype and shape, and where its bytes lie in C order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    segments: tuple[Segment, ...]


@dataclass(frozen=True, slots=True)
class _Flat:
    """A rank's flat partition: a 1-D float32 tensor, ``numel`` elements at ``offset`` of ``file``."""

    file: str
    offset: int
    numel: int


def weights(run: Run, path: str) -> list[Placed]:
    """The tensors ``get_fp32_state_dict_from_zero_checkpoint`` gives, in its order (a shared name last)."""
    model = run.model
    top = model.top_object
    found: dict[str, Placed] = {}
    for placed in _buffers(run):
        found[placed.name] = placed
    for placed in _frozen(run, path):
        found[placed.name] = placed
    for placed in _trainable(run, path, None):
        found[placed.name] = placed
    shared = member(top, "shared_params")
    for name, target in shared.items() if isinstance(shared, dict) else ():
        if isinstance(name, str) and isinstance(target, str) and target in found:
            tied = found[target]
            found[name] = Placed(name, tied.dtype, tied.shape, tied.segments)
    return list(found.values())


def optimizer_states(run: Run, path: str) -> list[tuple[str, Placed]]:
    """``(STATE, tensor)`` for each per-element optimizer state of each trainable parameter the ranks hold."""
    found = []
    for state in OPTIMIZER_STATES:
        if all(_state_tensor(rank.optim, run.stage, 0, state) is not None for rank in run.ranks):
            found += [(state, placed) for placed in _trainable(run, path, state)]
    return found


def _tensors(checkpoint: Checkpoint) -> dict[str, Tensor]:
    return {tensor.name: tensor for tensor in checkpoint.tensors}


def _whole(tensor: Tensor, file: str, name: str, path: str) -> tuple[Segment, ...]:
    if not tensor.contiguous:
        raise InvalidRankState(path, f"{file} stores it strided, as DeepSpeed does not", name)
    return ((file, tensor.offset, tensor.nbytes),) if tensor.nbytes else ()


def _buffers(run: Run) -> Iterator[Placed]:
    rank = run.ranks[0]
    assert rank.model is not None and rank.model_file is not None
    names = member(rank.model.top_object, "buffer_names")
    wanted = {name for name in names if isinstance(name, str)} if isinstance(names, list) else set()
    for tensor in rank.model.tensors:
        name = tensor.name.removeprefix("module.")
        if tensor.name.startswith("module.") and name in wanted:
            yield Placed(name, tensor.dtype, tensor.shape, _whole(tensor, rank.model_file, name, run.model.path))


def _shapes(value: Any, what: str, path: str) -> dict[str, tuple[int, ...]]:
    """A dict of parameter name -> shape (``torch.Size``, read as a tuple of ints)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRankState(path, f"{what} is not a dict of parameter shapes")
    shapes = {}
    for name, shape in value.items():
        if not isinstance(name, str) or not isinstance(shape, (tuple, list)):
            raise InvalidRankState(path, f"{what}: {name!r} has no shape of integers")
        if not all(type(n) is int and n >= 0 for n in shape):
            raise InvalidRankState(path, f"{what}: the shape of {name!r} is not integers", name)
        shapes[name] = tuple(shape)
    return shapes


def _frozen(run: Run, path: str) -> Iterator[Placed]:
    top = run.model.top_object
    shapes = _shapes(member(top, "frozen_param_shapes"), "frozen_param_shapes", path)
    ranks = run.ranks if run.stage == 3 else run.ranks[:1]
    held = [_tensors(rank.model) if rank.model is not None else {} for rank in ranks]
    for name, shape in shapes.items():
        numel = math.prod(shape)
        pieces = []
        for rank, tensors in zip(ranks, held, strict=True):
            assert rank.model_file is not None
            tensor = tensors.get(f"frozen_param_fragments.{name}")
            if tensor is None:
                raise InvalidRankState(path, f"{rank.model_file} has no frozen_param_fragments entry for it", name)
            pieces.append((rank.model_file, tensor))
        dtype = pieces[0][1].dtype
        if any(tensor.dtype != dtype for _, tensor in pieces):
            raise RanksDisagree(path, "the ranks' fragments of a frozen parameter have different dtypes", name)
        if run.stage != 3:  # rank 0's fragment is the whole parameter, as it was saved
            file, tensor = pieces[0]
            yield Placed(name, tensor.dtype, tensor.shape, _whole(tensor, file, name, path))
            continue
        flats = [[_Flat(file, tensor.offset, tensor.numel)] for file, tensor in pieces]
        if any(not tensor.contiguous or len(tensor.shape) != 1 for _, tensor in pieces):
            raise InvalidRankState(path, "a rank's fragment of a frozen parameter is not a flat tensor", name)
        yield Placed(name, dtype, shape, _zero3_segments(flats, 0, numel, pieces[0][1].itemsize, name, path))


def _state_tensor(optim: Checkpoint, stage: int, group: int, state: str | None) -> Tensor | None:
    """A rank's flat partition of ``group``: its float32 weights (``state`` None) or an optimizer state."""
    if state is None:
        key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
        name = f"optimizer_state_dict.{key}.{group}"
    else:
        inner = "optimizer_state_dict" if stage == 3 else "base_optimizer_state"
        name = f"optimizer_state_dict.{inner}.state.{group}.{state}"
    return _tensors(optim).get(name)


def _groups(run: Run, state: str | None, path: str) -> list[list[_Flat]]:
    """Each rank's flat partitions, group by group; every rank has as many as rank 0's model state has groups."""
    shapes = member(run.model.top_object, "param_shapes")
    if not isinstance(shapes, list):
        raise InvalidRankState(path, "param_shapes is not a list of parameter groups")
    found = []
    for rank in run.ranks:
        key = "fp32_flat_groups" if run.stage == 3 else "single_partition_of_fp32_groups"
        held = member(member(rank.optim.top_object, "optimizer_state_dict"), key)
        if not isinstance(held, list) or len(held) != len(shapes):
            count = len(held) if isinstance(held, list) else "no"
            raise RanksDisagree(path, f"{rank.optim_file} holds {count} parameter groups, param_shapes {len(shapes)}")
        flats = []
        for group in range(len(shapes)):
            tensor = _state_tensor(rank.optim, run.stage, group, state)
            what = state or key
            if tensor is None or tensor.dtype != "F32" or len(tensor.shape) != 1 or not tensor.contiguous:
                raise InvalidRankState(path, f"{rank.optim_file}: {what} of group {group} is not a flat float32 tensor")
            flats.append(_Flat(rank.optim_file, tensor.offset, tensor.numel))
        found.append(flats)
    return found


def _trainable(run: Run, path: str, state: str | None) -> Iterator[Placed]:
    groups = [
        _shapes(shapes, f"param_shapes[{index}]", path)
        for index, shapes in enumerate(member(run.model.top_object, "param_shapes") or [])
    ]
    flats = _groups(run, state, path)
    if run.stage == 3:
        merged = {name: shape for shapes in groups for name, shape in shapes.items()}
        offset = 0
        for name, shape in merged.items():
            numel = math.prod(shape)
            yield Placed(name, "F32", shape, _zero3_segments(flats, offset, numel, 4, name, path))
            offset += math.ceil(numel / run.world_size)
        totals = sorted({sum(flat.numel for flat in rank) for rank in flats})
        if totals != [offset]:  # zero_to_fp32's check: each rank holds its pieces of every parameter, no more
            raise PartitionTooShort(
                path, f"the parameters take {offset} elements of each rank; the ranks hold {totals}"
            )
        return
    align = 2 * run.world_size
    for group, shapes in enumerate(groups):
        whole = [rank[group] for rank in flats]  # the group: the ranks' partitions one after another
        held = sum(flat.numel for flat in whole)
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            if offset + numel > held:
                raise PartitionTooShort(
                    path, f"group {group}'s partitions hold {held} elements, its parameters need more", name
                )
            yield Placed(name, "F32", shape, _cut(whole, offset, numel, 4))
            offset += numel
        if math.ceil(offset / align) != math.ceil(held / align):
            raise PartitionTooShort(
                path, f"group {group}'s partitions hold {held} elements, its parameters {offset}: more than padding"
            )


def _cut(flats: list[_Flat], first: int, count: int, itemsize: int) -> tuple[Segment, ...]:
    """The elements ``first`` .. ``first + count`` of ``flats`` one after another, as runs of their files."""
    segments: list[Segment] = []
    start = 0
    for flat in flats:
        low, high = max(first, start), min(first + count, start + flat.numel)
        if low < high:
            segments.append((flat.file, flat.offset + (low - start) * itemsize, (high - low) * itemsize))
        start += flat.numel
    return tuple(segments)


def _zero3_segments(
    flats: list[list[_Flat]], offset: int, numel: int, itemsize: int, name: str, path: str
) -> tuple[Segment, ...]:
    """A ZeRO-3 parameter of ``numel`` elements: from each rank, ``ceil(numel / world_size)`` elements at ``offset``
    of its partitions one after another, cut at ``numel``."""
    piece = math.ceil(numel / len(flats))
    segments: list[Segment] = []
    for rank, held in enumerate(flats):
        if offset + piece > sum(flat.numel for flat in held):
            raise PartitionTooShort(
                path, f"rank {rank}'s partitions end before its {piece} elements of the parameter at {offset}", name
            )
        segments += _cut(held, offset, max(0, min(piece, numel - rank * piece)), itemsize)
    return _merged(segments)


def _merged(segments: list[Segment]) -> tuple[Segment, ...]:
    """Runs that follow one another in one file as one."""
    out: list[Segment] = []
    for file, offset, size in segments:
        if out and out[-1][0] == file and out[-1][1] + out[-1][2] == offset:
            out[-1] = (file, out[-1][1], out[-1][2] + size)
        else:
            out.append((file, offset, size))
    return tuple(out)
