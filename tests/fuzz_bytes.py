"""Byte-level and line-level mutations shared by the fuzz tests: (kind, *args) tuples drawn by each
test, applied here."""

from __future__ import annotations

BYTE_KINDS = ("flip", "truncate", "delete", "insert", "encode", "crlf", "trailing")
LINE_OPS = ("dup", "del", "swap", "blank", "spaces")


def apply_bytes(data: bytes, m: tuple) -> bytes:
    kind, *args = m
    n = len(data)
    if kind == "flip":
        if not n:
            return data
        i = args[0] % n
        return data[:i] + bytes([data[i] ^ args[1]]) + data[i + 1:]
    if kind == "truncate":
        return data[: args[0] % (n + 1)]
    if kind == "delete":
        i = args[0] % (n + 1)
        return data[:i] + data[i + args[1]:]
    if kind == "insert":
        i = args[0] % (n + 1)
        return data[:i] + args[1] + data[i:]
    if kind == "encode":
        try:
            return data.decode("utf-8-sig").encode(args[0], errors="replace")
        except UnicodeDecodeError:
            return data
    if kind == "crlf":
        return data.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
    assert kind == "trailing", m
    return data + args[0]


def apply_line_op(lines: list[bytes], op: str, i: int) -> bool:
    """A whole-line mutation of `lines` in place at line i (already in range): a line repeated, dropped,
    swapped with the next, or a blank or whitespace-only line inserted before it. False where `op` is
    not one of LINE_OPS (a field mutation, the caller's)."""
    if op == "dup":
        lines.insert(i, lines[i])
    elif op == "del":
        del lines[i]
    elif op == "swap":
        if i + 1 < len(lines):
            lines[i], lines[i + 1] = lines[i + 1], lines[i]
    elif op == "blank":
        lines.insert(i, b"")
    elif op == "spaces":
        lines.insert(i, b" \t ")
    else:
        return False
    return True
