"""``turnrl view RUN_DIR_OR_EVAL_DIR [--serve] [--port N]``: write the HTML report, and serve it on localhost.

The report is a static page (``report.html`` beside the run's files), so
``--serve`` is only a file server over the folder: Python's standard
``http.server``, bound to the loopback address unless ``--host`` says
otherwise (with a warning), that serves the folder's files and nothing else
(no listings, no symlink out of it) and drops silent connections.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import stat
import sys
import urllib.parse
from http import HTTPStatus
from pathlib import Path
from typing import Any, BinaryIO

# Only the light records module here: `turnrl --help` builds this parser, and the report's libraries
# (jinja2, matplotlib) load when the command runs.
from turnrl.viz.records import (
    DEFAULT_MAX_EPISODES,
    DEFAULT_MAX_HEATMAP_TOKENS,
    DEFAULT_MAX_STEP_FILES,
    DEFAULT_MAX_TURNS,
)

DEFAULT_PORT = 8008


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``turnrl view``."""
    parser.add_argument("folder", metavar="RUN_DIR_OR_EVAL_DIR",
                        help="a run folder (run.output_dir/run.name of `turnrl train`) or the --out folder of "
                             "`turnrl eval`; report.html and plots/ are written into it")
    parser.add_argument("--serve", action="store_true",
                        help="serve the folder over HTTP after writing the report (Ctrl-C stops)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"port for --serve (default {DEFAULT_PORT}; 0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address for --serve (default 127.0.0.1: this machine only)")
    parser.add_argument("--max-episodes", type=int, default=DEFAULT_MAX_EPISODES, metavar="N",
                        help=f"episodes shown per trajectories file (default {DEFAULT_MAX_EPISODES})")
    parser.add_argument("--max-turns", type=int, default=DEFAULT_MAX_TURNS, metavar="N",
                        help="turns shown per episode: a longer one shows its first and last N/2 and says how many "
                             f"it leaves out (default {DEFAULT_MAX_TURNS})")
    parser.add_argument("--max-step-files", type=int, default=DEFAULT_MAX_STEP_FILES, metavar="N",
                        help="training steps whose trajectories the page shows, spread from the first to the last "
                             f"(default {DEFAULT_MAX_STEP_FILES}); validation and evaluation files are always shown")
    parser.add_argument("--max-heatmap-tokens", type=int, default=DEFAULT_MAX_HEATMAP_TOKENS, metavar="N",
                        help="tokens of the page drawn in per-token advantage heatmaps, shared by the files that "
                             f"have them, whole episodes from the first (default {DEFAULT_MAX_HEATMAP_TOKENS})")


INDEX_NAMES = ("index.html", "index.htm")
"""The files that answer for a directory, in the order the standard library's handler looks for them."""
DEFAULT_TIMEOUT_S = 30.0
"""Seconds a connection may stay silent (a request sent halfway, a reader that stopped) before it is dropped."""


def served_file(root: str, local: str) -> str | None:
    """The real path of the file that a request for ``local`` serves, or None when it must answer 404.

    ``root`` is the folder's real path, ``local`` a request's path joined under it (as ``translate_path`` makes
    it). A directory serves its index file. None: nothing there (or not a regular file), a directory without an
    index file, or a file whose real path (symlinks followed) is outside ``root``.

    Raises:
        ValueError: ``local`` cannot name a file (a NUL byte, a lone surrogate).
    """
    real = os.path.realpath(local)
    if os.path.isdir(real):
        index = next((os.path.join(real, name) for name in INDEX_NAMES if os.path.isfile(os.path.join(real, name))),
                     None)
        if index is None:
            return None
        real = os.path.realpath(index)
    if not os.path.isfile(real) or os.path.commonpath([root, real]) != root:
        return None
    return real


def still_names(root: str, real: str, handle: BinaryIO) -> bool:
    """Whether ``handle``, opened from ``real`` after :func:`served_file` chose it, is the regular file that ``real``
    names now, inside ``root``.

    The check and the open are two looks at the path: a directory on it swapped for a symlink between them opens a
    file outside the folder. Looking again after the open closes that gap: the path must still resolve to itself
    and name the very file open (its device and inode), so a swap, or a swap and a swap back, is seen.
    """
    try:
        opened, named = os.fstat(handle.fileno()), os.stat(real)
    except OSError:
        return False
    return (stat.S_ISREG(opened.st_mode) and os.path.realpath(real) == real
            and os.path.commonpath([root, real]) == root
            and (opened.st_dev, opened.st_ino) == (named.st_dev, named.st_ino))


class _RunFolderHandler(http.server.SimpleHTTPRequestHandler):
    """The files of one folder and nothing else: no directory listings, no symlink out of it, no request that
    holds a thread forever, and no log line per request (a page with many images would flood the terminal).

    The standard library's handler is kept (a static page and its files need nothing more, and the viewer adds
    no dependency); this class refuses what it would serve outside the folder and sends the file it checked.
    """

    def __init__(self, *args: Any, directory: str, timeout: float, home: str | None, **kwargs: Any) -> None:
        # Read by setup and send_head, which the base class's __init__ runs (it handles the request): set first.
        self.connection_timeout, self.home = timeout, home
        super().__init__(*args, directory=directory, **kwargs)

    def setup(self) -> None:
        # A timeout on the socket makes a silent connection's read (or write) raise TimeoutError, on which
        # BaseHTTPRequestHandler closes the connection and ends its thread.
        self.request.settimeout(self.connection_timeout)
        super().setup()

    def send_head(self) -> Any:
        if self.home is not None and urllib.parse.urlsplit(self.path).path == "/":  # the folder's page, not a 404
            self.send_response(HTTPStatus.FOUND)
            self.send_header("Location", f"/{self.home}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        local = self.translate_path(self.path)
        try:
            real = served_file(self.directory, local)
        except ValueError:
            self.send_error(HTTPStatus.BAD_REQUEST, "Bad path")
            return None
        if real is not None and os.path.isdir(local) and not urllib.parse.urlsplit(self.path).path.endswith("/"):
            return super().send_head()  # the base class's redirect to the address with a slash; it opens nothing
        handle = _open_checked(self.directory, real) if real is not None else None
        if real is None or handle is None:
            self.send_error(HTTPStatus.NOT_FOUND, "File not found")
            return None
        try:
            # The base class's send_head would open the path again; this sends the file already checked.
            self.send_response(HTTPStatus.OK)
            self.send_header("Content-type", self.guess_type(real))
            modified = os.fstat(handle.fileno())
            self.send_header("Content-Length", str(modified.st_size))
            self.send_header("Last-Modified", self.date_time_string(int(modified.st_mtime)))
            self.end_headers()
        except BaseException:
            handle.close()
            raise
        return handle

    def list_directory(self, path: str | os.PathLike[str]) -> None:
        # send_head answers 404 for a directory without an index file before the base class would list it.
        self.send_error(HTTPStatus.NOT_FOUND, "File not found")
        return None

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        return


def _open_checked(root: str, real: str) -> BinaryIO | None:
    """``real`` opened for reading when it :func:`still_names` the file chosen, else None (answered 404)."""
    try:
        handle = open(real, "rb")  # noqa: SIM115 - returned open: the base class copies it out and closes it
    except OSError:
        return None
    if not still_names(root, real, handle):
        handle.close()
        return None
    return handle


class _RunFolderServer(http.server.ThreadingHTTPServer):
    """The threading server of the standard library, quiet about clients that hang up (a closed tab, a reload
    while images load): those are not errors of the server, and each would print a full traceback."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return
        super().handle_error(request, client_address)


def make_server(folder: Path, host: str, port: int, *, timeout: float = DEFAULT_TIMEOUT_S,
                home: str | None = None) -> http.server.ThreadingHTTPServer:
    """An HTTP server of ``folder``'s files (not started); a connection silent for ``timeout`` seconds is dropped,
    and ``/`` redirects to the file ``home`` names, where one is given.

    Raises:
        OSError: the address is taken or cannot be bound.
    """
    handler = functools.partial(_RunFolderHandler, directory=os.path.realpath(folder), timeout=timeout, home=home)
    return _RunFolderServer((host, port), handler)


def exposure_warning(host: str) -> str | None:
    """The warning for serving on ``host``, None for a loopback address (this machine only)."""
    # Here, not at the top: http_guards loads starlette, and `turnrl --help` imports this module.
    from turnrl.envservice.http_guards import is_loopback

    if is_loopback(host):
        return None
    return (f"warning: serving on {host}: anyone who can reach this port can read this folder's files (the report, "
            "trajectories, config); the default --host 127.0.0.1 keeps them on this machine")


def main(args: argparse.Namespace) -> int:
    """Write the report of ``args.folder``; with ``--serve``, serve it until Ctrl-C. Returns the exit code."""
    from turnrl.viz.report import REPORT_NAME, write_report

    folder = Path(args.folder)
    if args.max_episodes < 1:
        raise SystemExit("error: --max-episodes must be at least 1")
    if args.max_turns < 1:
        raise SystemExit("error: --max-turns must be at least 1")
    if args.max_step_files < 1:
        raise SystemExit("error: --max-step-files must be at least 1")
    if args.max_heatmap_tokens < 0:
        raise SystemExit("error: --max-heatmap-tokens must be 0 (no heatmaps) or more")
    if not 0 <= args.port <= 65535:
        raise SystemExit(f"error: --port {args.port} is not a port number (0 to 65535)")
    try:
        report = write_report(folder, max_episodes=args.max_episodes, max_step_files=args.max_step_files,
                              max_heatmap_tokens=args.max_heatmap_tokens, max_turns=args.max_turns)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    except OSError as error:
        raise SystemExit(f"error: cannot write the report into {folder}: {error}") from None
    print(f"report: {report}")
    if not args.serve:
        return 0
    try:
        server = make_server(folder.resolve(), args.host, args.port, home=REPORT_NAME)
    except OSError as error:
        raise SystemExit(f"error: cannot serve on {args.host}:{args.port} ({error}); pick another --port") from None
    port = server.server_address[1]
    warning = exposure_warning(args.host)
    if warning is not None:
        print(warning, flush=True)
    print(f"serving http://{args.host}:{port}/{REPORT_NAME} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped")
    finally:
        server.server_close()
    return 0
