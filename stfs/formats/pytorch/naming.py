"""Naming: every tensor reachable from the top object, by its path of keys (SPEC §12), within bounds."""

from __future__ import annotations

from typing import Any

from .rules import PickleLimitExceeded, PickleTooDeep
from .unpickler import MAX_NESTING
from .values import LEAVES, SCALARS, Global, Key, Large, Object, Set, TensorRef, Unsupported, describe

MAX_WALK_STEPS = 1_000_000  # containers and tensors entered while naming tensors, each time they are reached
MAX_NAME = 65_536  # characters of a tensor's name (its path of keys)
MAX_NAME_CHARS = 64 << 20  # characters of all the names the walk makes (a reused structure of long keys)


def _segment(key: Any) -> str:
    if type(key) is str:
        return key
    if type(key) is int:
        return str(key) if key.bit_length() < 4000 else "<a huge integer>"
    if isinstance(key, bytes):
        return key.decode("utf-8", "backslashreplace")
    if isinstance(key, Global):
        return key.full
    if isinstance(key, Large):
        return f"<a {key.size}-byte {key.kind}>"
    if isinstance(key, Key):
        return f"<{describe(key.value)}>"
    return repr(key)


def _children(value: Any) -> list[tuple[Any, Any]] | None:
    """The (key, value) pairs of a container whose values are not scalars; None for a scalar."""
    kind = type(value)
    if kind is dict:
        return [(k, v) for k, v in value.items() if type(v) not in SCALARS]
    if kind is list or kind is tuple or kind is Set:
        return [(i, v) for i, v in enumerate(value) if type(v) not in SCALARS]
    if kind is Object:
        out: list[tuple[Any, Any]] = []
        if isinstance(value.args, tuple):
            out += [(i, v) for i, v in enumerate(value.args) if type(v) not in SCALARS]
        state = value.state
        if type(state) is tuple and len(state) == 2 and all(type(s) in (dict, type(None)) for s in state):
            for part in state:
                if part:
                    out += [(k, v) for k, v in part.items() if type(v) not in SCALARS]
        elif type(state) is dict:
            out += [(k, v) for k, v in state.items() if type(v) not in SCALARS]
        elif type(state) in (list, tuple):
            out += [(i, v) for i, v in enumerate(state) if type(v) not in SCALARS]
        if value.items:
            out += [(k, v) for k, v in value.items.items() if type(v) not in SCALARS]
        if value.elements:
            out += [(i, v) for i, v in enumerate(value.elements) if type(v) not in SCALARS]
        return out
    return None


class Walker:
    """Names the leaves (tensors, left-out tensors, storages) reachable from a value, within the bounds."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.steps = 0
        self.chars = 0
        self._kids: dict[int, list[tuple[Any, Any]]] = {}

    def walk(self, root: Any) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if isinstance(root, LEAVES):
            return [("", root)]
        kids = _children(root)
        if not kids:
            return out
        frames: list[tuple[Any, str | None, int]] = [(iter(kids), None, id(root))]
        on_path = {id(root)}
        kid_cache = self._kids
        while frames:
            it, prefix, ident = frames[-1]
            step = next(it, None)
            if step is None:
                frames.pop()
                on_path.discard(ident)
                continue
            self.steps += 1
            if self.steps > MAX_WALK_STEPS:
                raise PickleLimitExceeded(
                    self.path, f"naming its tensors takes more than {MAX_WALK_STEPS:,} steps (a structure reused)"
                )
            key, child = step
            name = _segment(key) if prefix is None else f"{prefix}.{_segment(key)}"
            self.chars += len(name)
            if len(name) > MAX_NAME or self.chars > MAX_NAME_CHARS:
                raise PickleLimitExceeded(
                    self.path, f"a path of keys over {MAX_NAME:,} characters, or all of them over {MAX_NAME_CHARS:,}"
                )
            if isinstance(child, LEAVES):
                out.append((name, child))
                continue
            cid = id(child)
            if cid in on_path:  # a cycle: the container is being walked already
                continue
            grand = kid_cache.get(cid)
            if grand is None:
                grand = kid_cache[cid] = _children(child) or []
            if not grand:
                continue
            if len(frames) >= MAX_NESTING:
                raise PickleTooDeep(self.path, f"containers nest more than {MAX_NESTING} deep")
            frames.append((iter(grand), name, cid))
            on_path.add(cid)
        return out


def model_leaves(top: Any, walker: Walker) -> tuple[list[tuple[str, Any]], str | None]:
    """The named leaves of the model: ``top['state_dict']`` when it is a dict holding tensors, else ``top``."""
    if type(top) is dict:
        member = top.get("state_dict")
        if type(member) is dict or (isinstance(member, Object) and member.items is not None):
            leaves = walker.walk(member)
            if any(isinstance(leaf, (TensorRef, Unsupported)) for _, leaf in leaves):
                return leaves, "state_dict"
    return walker.walk(top), None
