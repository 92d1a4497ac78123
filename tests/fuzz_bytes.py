"""Byte-level mutations shared by the fuzz tests: (kind, *args) tuples drawn by each test, applied here."""

from __future__ import annotations

BYTE_KINDS = ("flip", "truncate", "delete", "insert", "encode", "crlf", "trailing")


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
