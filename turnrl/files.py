"""Files written whole: a file replaced whole or not at all (:func:`atomic_write_text`), the temporary files a
killed writer left (:func:`remove_unfinished_writes`), and a file's or folder's bytes flushed to the disk
(:func:`fsync_path`). The run directory's small files (config, summary, owner, ``latest``) and the trajectory
files a run and ``turnrl eval`` write go through here, so that a reader (the viewer, a resume) never sees a file
cut short by a kill, a full disk or a power loss.

And text read from a file or a peer, JSON (:func:`parse_json`) or YAML (:func:`parse_yaml`), whose every
failure is the parser's own error: nesting deeper than the interpreter's stack is one too."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` whole or not at all: written to a temporary file of its folder (a name no
    other process uses: ``tempfile`` creates it exclusively), flushed to the disk, then renamed over ``path``.
    A failed write (a full disk, a file-size limit) leaves the old file as it was and no temporary file.

    The file gets the permissions a plain write would give it (``0o666`` less the umask): ``mkstemp`` makes its
    file readable by its owner alone, which would hide the run's settings and summary from the rest of a group
    that shares the run directory."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """This process's umask: read from ``/proc/self/status`` where Linux says it, since ``os.umask`` can only
    read it by setting it, and a file another thread creates in between would get the value set."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def remove_unfinished_writes(folder: Path) -> list[Path]:
    """Delete the temporary files of :func:`atomic_write_text` (``.NAME.PID.RANDOM.tmp``) that a process killed
    mid-write left in ``folder``; the caller is the folder's one writer, so no other write is under way.

    Returns:
        The files deleted.
    """
    left = [path for path in folder.glob(".*.*.tmp") if path.is_file()] if folder.is_dir() else []
    for path in left:
        path.unlink(missing_ok=True)
    return left


def fsync_path(path: Path) -> None:
    """Flush a file's bytes, or a folder's entries (the names made, renamed and deleted in it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


TOO_DEEP = "nested deeper than Python can read"
"""What is wrong with JSON or YAML some hundred levels deep: the parsers read a level by recursion, and no file
or answer turnrl reads goes deeper than a few."""


def parse_json(text: str | bytes) -> Any:
    """``json.loads``, with text nested deeper than the interpreter's stack refused as a ``json.JSONDecodeError``
    (a ``ValueError``), as damaged JSON is.

    Written by hand because the standard library raises ``RecursionError`` there (``"[" * 100_000``), which the
    readers of damaged files and peers' answers, catching ``ValueError``, would let through: a metrics line of
    brackets stopped a resume with a traceback.
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError(TOO_DEEP, "", 0) from None


def parse_yaml(text: str) -> Any:
    """``yaml.safe_load``, with text nested deeper than the interpreter's stack refused as a ``yaml.YAMLError``
    (PyYAML raises ``RecursionError`` there, past a few hundred levels of keys or brackets)."""
    try:
        return yaml.safe_load(text)
    except RecursionError:
        raise yaml.YAMLError(TOO_DEEP) from None
