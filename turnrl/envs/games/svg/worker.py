"""The SVG render worker: a sandboxed process that turns SVG text into PNG bytes with resvg.

:class:`turnrl.envs.games.svg.render.SvgRenderer` starts this file as a script (not
as a turnrl module, so it imports nothing but the standard library and
``resvg_py``) and talks to it over stdin/stdout:

- request: 4-byte big-endian length, then the SVG as UTF-8;
- reply: 1 status byte (0: PNG follows, 1: an error message follows), a
  4-byte big-endian length, then the payload.

Before it reads anything the worker limits itself: address space (the first
argument, in bytes), no new file descriptors (so no file or socket can be
opened: fonts are not loaded and SVG resources are never resolved), no file
writes, no core dumps. A render that panics inside resvg
is answered as an error; one that aborts or runs out of memory ends the
process, and one that takes too long is killed by the parent, which then
starts a fresh worker.
"""

from __future__ import annotations

import os
import resource
import struct
import sys

import resvg_py  # imported before the limits: importing needs to open files

MAX_REQUEST_BYTES = 1 << 22
"""Largest SVG accepted (4 MiB); the parent sends far less."""


def _limit(memory_bytes: int) -> None:
    """Sandbox this process: memory cap, no new descriptors, no file writes, no core files."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (3, 3))  # stdin, stdout, stderr and nothing more


def _read_exact(stream, count: int) -> bytes | None:
    data = stream.read(count)
    return data if data is not None and len(data) == count else None


def _reply(stream, status: int, payload: bytes) -> None:
    stream.write(struct.pack(">BI", status, len(payload)) + payload)
    stream.flush()


def serve(size: int) -> None:
    """Answer render requests until stdin closes."""
    source, sink = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = _read_exact(source, 4)
        if header is None:
            return
        (length,) = struct.unpack(">I", header)
        if length > MAX_REQUEST_BYTES:
            _reply(sink, 1, b"request too large")
            return
        body = _read_exact(source, length)
        if body is None:
            return
        try:
            png = resvg_py.svg_to_bytes(
                svg_string=body.decode("utf-8", errors="replace"),
                width=size,
                height=size,
                background="white",
                skip_system_fonts=True,
            )
        except BaseException as error:  # noqa: BLE001 - resvg's Rust panics arrive as PanicException (a BaseException)
            _reply(sink, 1, f"{type(error).__name__}: {error}"[:300].encode("utf-8", errors="replace"))
            continue
        _reply(sink, 0, bytes(png))


def main() -> None:
    memory_bytes, size = int(sys.argv[1]), int(sys.argv[2])
    _limit(memory_bytes)
    os.environ.clear()
    serve(size)


if __name__ == "__main__":
    main()
