"""The pickle interpreter: one loop over the opcodes (protocols 2 to 5, and the protocol 0/1 opcodes among them)
into plain values (``values``), runs nothing; ``GLOBAL`` and ``STACK_GLOBAL`` push a name and nothing more, a call
is what ``calls`` makes of it. Work and memory are bounded (``MAX_*``): past a bound the file is invalid input."""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

from ... import errors
from ..base import RangeFetcher as Read
from ..base import read_exact
from .allowed import IMPORT_MAPPING, NAME_MAPPING
from .calls import build_tensor, call, new, persistent
from .rules import InvalidPickle, PickleLimitExceeded, PickleStringTooLong, PickleTooDeep
from .values import Global, Large, Object, Set, StorageRef, TensorRef, describe, dict_key

# Bounds of the pickle reader (SPEC §12): past one, the file is invalid input.
MAX_OPCODES = (
    2_000_000  # ~25 a tensor in torch.save's pickles; at worst ~200 MB of Python objects (one new string each)
)
MAX_MEMO = 1_000_000
MAX_NESTING = 1_000  # marks open at once; containers deep in the walk
MAX_LINE = 65_536  # a GLOBAL's module or name line
MAX_INLINE = 1 << 20  # strings and bytes longer than this are not read, only skipped (a placeholder stays)
WINDOW = 16 << 20  # the most one read of a pickle asks for

_UNPACK_I32 = struct.Struct("<i").unpack_from
_UNPACK_U16 = struct.Struct("<H").unpack_from
_UNPACK_U32 = struct.Struct("<I").unpack_from
_UNPACK_U64 = struct.Struct("<Q").unpack_from
_UNPACK_F64 = struct.Struct(">d").unpack_from


class Stream:
    """The bytes of a pickle (or a run of them) from ``start`` up to ``limit``, read in windows."""

    __slots__ = ("read", "path", "base", "data", "limit", "window")

    def __init__(self, read: Read, path: str, start: int, limit: int, first: int, initial: bytes = b"") -> None:
        self.read = read
        self.path = path
        self.base = start  # absolute offset of data[0]
        self.limit = limit
        self.window = first
        self.data = initial

    def refill(self, pos: int, need: int) -> tuple[bytes, int]:
        """Data holding at least ``need`` bytes from position ``pos`` (which becomes 0)."""
        self.base += pos
        rest = self.data[pos:]
        if self.base + need > self.limit:
            raise InvalidPickle(self.path, f"the pickle ends inside an opcode (at byte {self.limit})")
        want = min(max(need - len(rest), self.window), self.limit - self.base - len(rest))
        self.window = min(self.window * 2, WINDOW)
        self.data = rest + read_exact(self.read, self.base + len(rest), want, self.path)
        return self.data, 0

    def skip(self, pos: int, size: int, what: str) -> tuple[bytes, int]:
        """Move past ``size`` bytes from ``pos`` without reading them."""
        if self.base + pos + size > self.limit:
            raise PickleStringTooLong(
                self.path, f"a {what} of {size} bytes at byte {self.base + pos} runs past the end of the pickle"
            )
        if pos + size <= len(self.data):
            return self.data, pos + size
        self.base += pos + size
        self.data = b""
        return self.data, 0


class Interpreter:
    """One pickle (protocols 2 to 5, and the protocol 0/1 opcodes among them) into plain values; runs nothing."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.globals: dict[str, None] = {}  # in the order first named
        self.storages: dict[str, StorageRef] = {}  # every storage a persistent id names, by key
        self.protocol = 0
        self.opcodes = 0
        self._names: dict[tuple[str, str], Global] = {}

    # -- values --

    def _global(self, module: str, name: str) -> Global:
        if (module, name) in NAME_MAPPING:
            module, name = NAME_MAPPING[(module, name)]
        elif module in IMPORT_MAPPING:
            module = IMPORT_MAPPING[module]
        found = self._names.get((module, name))
        if found is None:
            found = self._names[(module, name)] = Global(module, name)
            self.globals.setdefault(found.full, None)
        return found

    def _fail(self, detail: str) -> InvalidPickle:
        return InvalidPickle(self.path, detail)

    # -- the loop --

    def run(self, stream: Stream) -> Any:
        """Interpret one pickle from the stream's position up to its STOP; the stream stays after it."""
        path = self.path
        data, pos = stream.data, 0
        end = len(data)
        stack: list[Any] = []
        push = stack.append
        marks: list[int] = []
        memo: dict[int, Any] = {}
        opcodes = self.opcodes
        try:
            while True:
                if pos >= end:
                    data, pos = stream.refill(pos, 1)
                    end = len(data)
                op = data[pos]
                pos += 1
                opcodes += 1
                if opcodes > MAX_OPCODES:
                    raise PickleLimitExceeded(path, f"more than {MAX_OPCODES:,} opcodes")
                # Most frequent first, as torch.save's pickles use them (protocols 2 and 4).
                if op == 0x71 or op == 0x72:  # BINPUT, LONG_BINPUT
                    width = 1 if op == 0x71 else 4
                    if pos + width > end:
                        data, pos = stream.refill(pos, width)
                        end = len(data)
                    index = data[pos] if width == 1 else _UNPACK_U32(data, pos)[0]
                    pos += width
                    if len(memo) >= MAX_MEMO and index not in memo:
                        raise PickleLimitExceeded(path, f"more than {MAX_MEMO:,} memo entries")
                    memo[index] = stack[-1]
                elif op == 0x68 or op == 0x6A:  # BINGET, LONG_BINGET
                    width = 1 if op == 0x68 else 4
                    if pos + width > end:
                        data, pos = stream.refill(pos, width)
                        end = len(data)
                    index = data[pos] if width == 1 else _UNPACK_U32(data, pos)[0]
                    pos += width
                    if index not in memo:
                        raise self._fail(f"memo entry {index} read before it was written")
                    push(memo[index])
                elif op == 0x4D:  # BININT2
                    if pos + 2 > end:
                        data, pos = stream.refill(pos, 2)
                        end = len(data)
                    push(_UNPACK_U16(data, pos)[0])
                    pos += 2
                elif op in _SIZED:  # BINUNICODE, SHORT_BINUNICODE, BINUNICODE8; bytes; Python 2 strings
                    width, kind = _SIZED[op]
                    if pos + width > end:
                        data, pos = stream.refill(pos, width)
                        end = len(data)
                    size = (
                        _UNPACK_U32(data, pos)[0]
                        if width == 4
                        else data[pos]
                        if width == 1
                        else _UNPACK_U64(data, pos)[0]
                    )
                    if op == 0x54 and size >= 2**31:  # BINSTRING's length is signed
                        raise self._fail("BINSTRING of a negative length")
                    pos += width
                    if size > MAX_INLINE:
                        here = stream.base + pos
                        data, pos = stream.skip(pos, size, kind)
                        end = len(data)
                        push(Large(kind, here, size))
                        continue
                    if pos + size > end:
                        data, pos = stream.refill(pos, size)
                        end = len(data)
                    chunk = data[pos : pos + size]
                    pos += size
                    if kind == "string":
                        push(str(chunk, "utf-8", "surrogatepass"))
                    elif kind == "Python 2 string":  # text as torch.load reads it (utf-8), else bytes
                        try:
                            push(chunk.decode("utf-8"))
                        except UnicodeDecodeError:
                            push(chunk)
                    else:
                        push(chunk)
                elif op == 0x28:  # MARK
                    if len(marks) >= MAX_NESTING:
                        raise PickleTooDeep(path, f"more than {MAX_NESTING} marks open at once")
                    marks.append(len(stack))
                elif op == 0x74:  # TUPLE
                    start = marks.pop()
                    made_tuple = tuple(stack[start:])
                    del stack[start:]
                    push(made_tuple)
                elif op == 0x4B:  # BININT1
                    if pos + 1 > end:
                        data, pos = stream.refill(pos, 1)
                        end = len(data)
                    push(data[pos])
                    pos += 1
                elif op == 0x52:  # REDUCE
                    args = stack.pop()
                    if type(args) is list:  # torch's loader calls func(*args): a list serves as well
                        opcodes += len(args)
                        args = tuple(args)
                    if type(args) is tuple and args and type(args[0]) in _COPIED:
                        # A call may copy its first argument (OrderedDict(pairs), torch.Size(list), encode(str)):
                        # its elements count as opcodes, so that one large value called on again and again is
                        # bounded work and memory like everything else.
                        first = args[0]
                        opcodes += len(first) >> 6 if type(first) is str else len(first)
                    stack[-1] = call(stack[-1], args, path)
                elif op == 0x86:  # TUPLE2
                    second = stack.pop()
                    stack[-1] = (stack[-1], second)
                elif op == 0x94:  # MEMOIZE
                    if len(memo) >= MAX_MEMO:
                        raise PickleLimitExceeded(path, f"more than {MAX_MEMO:,} memo entries")
                    memo[len(memo)] = stack[-1]
                elif op == 0x51:  # BINPERSID
                    stack[-1] = persistent(stack[-1], self.storages, path)
                elif op == 0x89:  # NEWFALSE
                    push(False)
                elif op == 0x29:  # EMPTY_TUPLE
                    push(())
                elif op == 0x4A:  # BININT
                    if pos + 4 > end:
                        data, pos = stream.refill(pos, 4)
                        end = len(data)
                    push(_UNPACK_I32(data, pos)[0])
                    pos += 4
                elif op == 0x85:  # TUPLE1
                    stack[-1] = (stack[-1],)
                elif op == 0x87:  # TUPLE3
                    third = stack.pop()
                    second = stack.pop()
                    stack[-1] = (stack[-1], second, third)
                elif op == 0x88:  # NEWTRUE
                    push(True)
                elif op == 0x4E:  # NONE
                    push(None)
                elif op == 0x63 or op == 0x69:  # GLOBAL, INST: two lines, module and name
                    module, data, pos = self._line(stream, data, pos)
                    end = len(data)
                    name, data, pos = self._line(stream, data, pos)
                    end = len(data)
                    name_ref = self._global(module, name)
                    if op == 0x63:
                        push(name_ref)
                    else:
                        start = marks.pop()
                        arguments = tuple(stack[start:])
                        del stack[start:]
                        push(Object(name_ref, arguments))
                elif op == 0x93:  # STACK_GLOBAL
                    name = stack.pop()
                    module = stack.pop()
                    if type(module) is not str or type(name) is not str:
                        raise self._fail("STACK_GLOBAL of something other than two strings")
                    push(self._global(module, name))
                elif op == 0x95:  # FRAME: a length prefix only; frames change nothing else
                    if pos + 8 > end:
                        data, pos = stream.refill(pos, 8)
                        end = len(data)
                    pos += 8
                elif op == 0x7D:  # EMPTY_DICT
                    push({})
                elif op == 0x5D:  # EMPTY_LIST
                    push([])
                elif op == 0x73:  # SETITEM
                    value = stack.pop()
                    key = stack.pop()
                    self._setitems(stack[-1], [key, value])
                elif op == 0x75:  # SETITEMS
                    start = marks.pop()
                    items = stack[start:]
                    del stack[start:]
                    self._setitems(stack[-1], items)
                elif op == 0x61:  # APPEND
                    value = stack.pop()
                    self._extend(stack[-1], [value])
                elif op == 0x65:  # APPENDS
                    start = marks.pop()
                    items = stack[start:]
                    del stack[start:]
                    self._extend(stack[-1], items)
                elif op == 0x62:  # BUILD
                    state = stack.pop()
                    target = stack[-1]
                    if isinstance(target, Object):
                        target.state = state
                    elif type(target) is TensorRef:
                        build_tensor(state, path)
                    # BUILD on anything else (an OrderedDict's _metadata) sets attributes that are not part of
                    # its contents: kept out, as data never acted on.
                elif op == 0x81:  # NEWOBJ
                    args = stack.pop()
                    cls = stack.pop()
                    push(new(cls, args))
                elif op == 0x92:  # NEWOBJ_EX
                    stack.pop()  # kwargs
                    args = stack.pop()
                    cls = stack.pop()
                    push(new(cls, args))
                elif op == 0x8A or op == 0x8B:  # LONG1, LONG4
                    width = 1 if op == 0x8A else 4
                    if pos + width > end:
                        data, pos = stream.refill(pos, width)
                        end = len(data)
                    size = data[pos] if width == 1 else _UNPACK_I32(data, pos)[0]
                    pos += width
                    if size < 0:
                        raise self._fail("LONG4 of a negative length")
                    if size > 1024:  # no integer a checkpoint needs is this long: kept as a placeholder
                        here = stream.base + pos
                        data, pos = stream.skip(pos, size, "long integer")
                        end = len(data)
                        push(Large("integer", here, size))
                        continue
                    if pos + size > end:
                        data, pos = stream.refill(pos, size)
                        end = len(data)
                    push(int.from_bytes(data[pos : pos + size], "little", signed=True))
                    pos += size
                elif op == 0x47:  # BINFLOAT
                    if pos + 8 > end:
                        data, pos = stream.refill(pos, 8)
                        end = len(data)
                    push(_UNPACK_F64(data, pos)[0])
                    pos += 8
                elif op == 0x80:  # PROTO
                    if pos + 1 > end:
                        data, pos = stream.refill(pos, 1)
                        end = len(data)
                    self.protocol = data[pos]
                    pos += 1
                    if self.protocol > 5:
                        raise self._fail(f"pickle protocol {self.protocol}, beyond 5")
                elif op == 0x2E:  # STOP
                    if not stack:
                        raise self._fail("STOP with an empty stack")
                    stream.base += pos
                    stream.data = data[pos:]
                    self.opcodes = opcodes
                    return stack.pop()
                elif op == 0x30:  # POP
                    if stack and (not marks or marks[-1] < len(stack)):
                        stack.pop()
                    else:
                        del stack[marks.pop() :]
                elif op == 0x31:  # POP_MARK
                    del stack[marks.pop() :]
                elif op == 0x32:  # DUP
                    push(stack[-1])
                elif op == 0x6C:  # LIST
                    start = marks.pop()
                    items = stack[start:]
                    del stack[start:]
                    push(items)
                elif op == 0x64:  # DICT
                    start = marks.pop()
                    items = stack[start:]
                    del stack[start:]
                    made: dict[Any, Any] = {}
                    self._setitems(made, items)
                    push(made)
                elif op == 0x6F:  # OBJ: the class and its arguments after a mark
                    start = marks.pop()
                    items = stack[start:]
                    del stack[start:]
                    if not items:
                        raise self._fail("OBJ without a class")
                    push(Object(items[0], tuple(items[1:])))
                elif op == 0x8F:  # EMPTY_SET
                    push(Set())
                elif op == 0x90:  # ADDITEMS
                    start = marks.pop()
                    items = stack[start:]
                    del stack[start:]
                    target = stack[-1]
                    if type(target) is not Set:
                        raise self._fail(f"ADDITEMS to {describe(target)}")
                    target.extend(items)
                elif op == 0x91:  # FROZENSET
                    start = marks.pop()
                    frozen = Set(stack[start:])
                    del stack[start:]
                    push(frozen)
                elif op in (0x82, 0x83, 0x84):  # EXT1, EXT2, EXT4: the copyreg extension registry
                    width = {0x82: 1, 0x83: 2, 0x84: 4}[op]
                    if pos + width > end:
                        data, pos = stream.refill(pos, width)
                        end = len(data)
                    code = int.from_bytes(data[pos : pos + width], "little")
                    pos += width
                    push(self._global("copyreg.extension", str(code)))
                elif op in _TEXT_OPCODES:  # protocol 0: INT, LONG, FLOAT, STRING, UNICODE, GET, PUT, PERSID
                    line, data, pos = self._line(stream, data, pos, raw=True)
                    end = len(data)
                    data, pos = self._text_opcode(op, line, stack, memo, stream, data, pos)
                    end = len(data)
                elif op in (0x97, 0x98):  # NEXT_BUFFER, READONLY_BUFFER
                    raise self._fail("an out-of-band buffer (protocol 5), which a file cannot carry")
                else:
                    raise self._fail(f"unknown opcode 0x{op:02x} at byte {stream.base + pos - 1}")
        except errors.StfsError:
            raise
        except (IndexError, KeyError, TypeError, ValueError, UnicodeDecodeError, struct.error, RecursionError) as exc:
            kind = "an empty stack or mark stack" if isinstance(exc, IndexError) else f"{type(exc).__name__}: {exc}"
            raise self._fail(f"malformed at byte {stream.base + pos}: {kind}") from None

    def _line(self, stream: Stream, data: bytes, pos: int, raw: bool = False) -> tuple[Any, bytes, int]:
        end = data.find(b"\n", pos)
        while end < 0:
            if len(data) - pos > MAX_LINE:
                raise PickleStringTooLong(self.path, f"a line longer than {MAX_LINE} bytes")
            if stream.base + len(data) >= stream.limit:
                raise self._fail("the pickle ends inside a line")
            have = len(data) - pos
            data, pos = stream.refill(pos, min(have + 1, stream.limit - stream.base - pos))
            end = data.find(b"\n", pos + have)
        if end - pos > MAX_LINE:
            raise PickleStringTooLong(self.path, f"a line longer than {MAX_LINE} bytes")
        line = data[pos:end]
        if raw:
            return line, data, end + 1
        return line.decode("utf-8"), data, end + 1

    def _text_opcode(
        self, op: int, line: bytes, stack: list[Any], memo: dict[int, Any], stream: Stream, data: bytes, pos: int
    ) -> tuple[bytes, int]:
        if op == 0x49:  # INT (and the bools of protocol 0)
            stack.append({b"00": False, b"01": True}.get(line) if line in (b"00", b"01") else int(line))
        elif op == 0x4C:  # LONG
            stack.append(int(line[:-1] if line.endswith(b"L") else line))
        elif op == 0x46:  # FLOAT
            stack.append(float(line))
        elif op == 0x53:  # STRING: a quoted repr
            if len(line) < 2 or line[0] != line[-1] or line[:1] not in (b"'", b'"'):
                raise self._fail("STRING not quoted")
            stack.append(line[1:-1].decode("unicode_escape" if b"\\" in line else "latin-1"))
        elif op == 0x56:  # UNICODE
            stack.append(line.decode("raw-unicode-escape"))
        elif op == 0x67:  # GET
            index = int(line)
            if index not in memo:
                raise self._fail(f"memo entry {index} read before it was written")
            stack.append(memo[index])
        elif op == 0x70:  # PUT
            index = int(line)
            if len(memo) >= MAX_MEMO and index not in memo:
                raise PickleLimitExceeded(self.path, f"more than {MAX_MEMO:,} memo entries")
            memo[index] = stack[-1]
        elif op == 0x50:  # PERSID
            stack.append(persistent(line.decode("ascii"), self.storages, self.path))
        return data, pos

    def _setitems(self, target: Any, items: list[Any]) -> None:
        if len(items) % 2:
            raise self._fail("SETITEMS with an odd number of items")
        if type(target) is dict:
            mapping = target
        elif isinstance(target, Object):
            if target.items is None:
                target.items = {}
            mapping = target.items
        else:
            raise self._fail(f"SETITEM(S) on {describe(target)}")
        for i in range(0, len(items), 2):
            key = items[i]
            mapping[dict_key(key)] = items[i + 1]

    def _extend(self, target: Any, items: list[Any]) -> None:
        if type(target) is list:
            target.extend(items)
        elif isinstance(target, Object):
            if target.elements is None:
                target.elements = []
            target.elements.extend(items)
        else:
            raise self._fail(f"APPEND(S) to {describe(target)}")


# Opcodes of a length and that many bytes -> the width of the length, and what the bytes are.
_SIZED: Mapping[int, tuple[int, str]] = {
    0x58: (4, "string"),  # BINUNICODE
    0x8C: (1, "string"),  # SHORT_BINUNICODE
    0x8D: (8, "string"),  # BINUNICODE8
    0x55: (1, "Python 2 string"),  # SHORT_BINSTRING
    0x54: (4, "Python 2 string"),  # BINSTRING
    0x43: (1, "bytes"),  # SHORT_BINBYTES
    0x42: (4, "bytes"),  # BINBYTES
    0x8E: (8, "bytes"),  # BINBYTES8
    0x96: (8, "bytes"),  # BYTEARRAY8
}
_TEXT_OPCODES = frozenset(b"ILFSVgpP")
_COPIED = (list, tuple, dict, str)
