from collections.abc import Callable
from typing import Any

def v1_messages(first: bytes, length: int, address: int, message: type[Any], /) -> tuple[list[Any], int] | None: ...
def symbol_entries(
    entries: bytes, offset_size: int, names: bytes, max_name: int, link: type[Any], /
) -> list[Any] | int: ...
def symbol_table(
    window_for: Callable[[int, int, str], tuple[int, bytes]],
    base: int,
    message: bytes,
    offset_size: int,
    length_size: int,
    max_name: int,
    link: type[Any],
    budget: int,
    /,
) -> tuple[list[Any], int] | None: ...
