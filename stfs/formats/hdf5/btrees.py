"""HDF5's B-trees, walked to their leaves in key order with every node visited once: version 1 (an old-style
group's symbol table nodes, a chunked dataset's chunks) and version 2 (dense links and attributes by name, chunks of
a version 4 layout)."""

from __future__ import annotations

from collections.abc import Iterator

from .io import Fields, Reader
from .rules import BadStructure

MAX_DEPTH = 64


def v1_leaves(reader: Reader, root: int, node_type: int, key_size: int) -> Iterator[tuple[bytes, int]]:
    """Each (left key, child address) of the leaves of the version 1 B-tree at ``root`` of ``node_type`` (0: group
    nodes, whose children are symbol table nodes; 1: raw data chunks), keys of ``key_size`` bytes."""
    o = reader.offset_size
    seen: set[int] = set()
    level_of = {root: -1}
    stack = [root]
    while stack:
        node = stack.pop()
        reader.step()
        if node in seen or node == reader.undefined:
            raise BadStructure(reader.path, f"a version 1 B-tree comes back to node {node}")
        seen.add(node)
        head = reader.upto(node, 1024, "a version 1 B-tree node", 8 + 2 * o)
        if head[:4] != b"TREE" or head[4] != node_type:
            raise BadStructure(reader.path, f"no version 1 B-tree node (TREE, type {node_type}) at address {node}")
        level, used = head[5], int.from_bytes(head[6:8], "little")
        expected = level_of[node]
        if expected >= 0 and level != expected:
            raise BadStructure(reader.path, f"a version 1 B-tree node at {node} has level {level}, not {expected}")
        length = used * (key_size + o) + key_size
        if 8 + 2 * o + length <= len(head):
            body = head[8 + 2 * o : 8 + 2 * o + length]
        else:
            body = reader.at(node + 8 + 2 * o, length, "a version 1 B-tree node")
        step = key_size + o
        children = [
            (body[at : at + key_size], int.from_bytes(body[at + key_size : at + step], "little"))
            for at in range(0, used * step, step)
        ]
        if level == 0:
            yield from children
            continue
        for _, child in reversed(children):  # a stack: the first child is walked first
            if child in level_of and level_of[child] != level - 1:
                raise BadStructure(reader.path, f"a version 1 B-tree node {child} appears at two levels")
            level_of[child] = level - 1
            stack.append(child)


def _enc_size(value: int) -> int:
    return (max(value, 1).bit_length() - 1) // 8 + 1


def v2_records(reader: Reader, address: int, tree_type: int) -> Iterator[bytes]:
    """Each record of the version 2 B-tree whose header is at ``address`` (of ``tree_type``), in key order."""
    o, n = reader.offset_size, reader.length_size
    size = 4 + 1 + 1 + 4 + 2 + 2 + 1 + 1 + o + 2 + n + 4
    head = reader.at(address, size, "a version 2 B-tree header")
    if head[:4] != b"BTHD" or head[4] != 0:
        raise BadStructure(reader.path, f"no version 2 B-tree header (BTHD, version 0) at address {address}")
    reader.check(head, "the version 2 B-tree header", address)
    fields = Fields(reader, head, "a version 2 B-tree header", 5)
    kind, node_size, record_size, depth = fields.u8(), fields.u32(), fields.u16(), fields.u16()
    fields.skip(2)  # split and merge percents
    root, root_records = fields.address(), fields.u16()
    if kind != tree_type:
        raise BadStructure(reader.path, f"a version 2 B-tree of type {kind} where type {tree_type} belongs")
    if record_size == 0 or node_size < 10 + record_size or depth > MAX_DEPTH:
        raise BadStructure(reader.path, f"a version 2 B-tree of node size {node_size}, records of {record_size}")
    if root == reader.undefined:
        return
    # The sizes of a child pointer's record counts, as libhdf5 derives them from the node size (H5B2__hdr_init).
    max_records = [(node_size - 10) // record_size]
    cumulative = [max_records[0]]
    cumulative_size = [0]
    count_size = _enc_size(max_records[0])
    for d in range(1, depth + 1):
        pointer = o + count_size + cumulative_size[d - 1]
        max_records.append((node_size - (10 + pointer)) // (record_size + pointer))
        cumulative.append((max_records[d] + 1) * cumulative[d - 1] + max_records[d])
        cumulative_size.append(_enc_size(cumulative[d]))
    seen: set[int] = set()
    stack: list[tuple[int, int, int, int]] = [(root, root_records, depth, 0)]  # node, records, depth, records read
    pending: list[tuple[str, bytes | tuple[int, int, int]]] = []
    yield from _walk(reader, stack, pending, seen, tree_type, node_size, record_size, count_size, cumulative_size)


def _walk(
    reader: Reader,
    stack: list[tuple[int, int, int, int]],
    pending: list[tuple[str, bytes | tuple[int, int, int]]],
    seen: set[int],
    tree_type: int,
    node_size: int,
    record_size: int,
    count_size: int,
    cumulative_size: list[int],
) -> Iterator[bytes]:
    o = reader.offset_size
    # An in-order walk without recursion: each node pushes, in reverse, its children and records interleaved.
    work: list[tuple[str, bytes | tuple[int, int, int]]] = [("node", (stack[0][0], stack[0][1], stack[0][2]))]
    while work:
        what, item = work.pop()
        if what == "record":
            assert isinstance(item, bytes)
            yield item
            continue
        assert isinstance(item, tuple)
        node, records, depth = item
        reader.step()
        if node in seen or node == reader.undefined:
            raise BadStructure(reader.path, f"a version 2 B-tree comes back to node {node}")
        seen.add(node)
        data = reader.at(node, node_size, "a version 2 B-tree node")
        signature = b"BTLF" if depth == 0 else b"BTIN"
        if data[:4] != signature or data[5] != tree_type:
            raise BadStructure(reader.path, f"no version 2 B-tree node ({signature.decode()}) at address {node}")
        body = 6 + records * record_size
        if body > node_size - 4:
            raise BadStructure(reader.path, f"a version 2 B-tree node at {node} holds more records than fit")
        found = [data[6 + i * record_size : 6 + (i + 1) * record_size] for i in range(records)]
        if depth == 0:
            reader.check(data[: body + 4], "the version 2 B-tree leaf", node)
            work.extend(("record", record) for record in reversed(found))
            continue
        pointer = o + count_size + (cumulative_size[depth - 1] if depth > 1 else 0)
        end = body + (records + 1) * pointer
        if end > node_size - 4:
            raise BadStructure(reader.path, f"a version 2 B-tree node at {node} holds more children than fit")
        reader.check(data[: end + 4], "the version 2 B-tree internal node", node)
        children = []
        for i in range(records + 1):
            fields = Fields(reader, data, "a version 2 B-tree node", body + i * pointer)
            children.append((fields.address(), fields.uint(count_size), depth - 1))
        for i in range(records, -1, -1):
            work.append(("node", children[i]))
            if i:
                work.append(("record", found[i - 1]))
