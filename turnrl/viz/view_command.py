"""``turnrl view RUN_DIR_OR_EVAL_DIR [--serve] [--port N]``: write the HTML report, and serve it on localhost.

The report is a static page (``report.html`` beside the run's files), so
``--serve`` is only a file server over the folder: Python's standard
``http.server``, bound to the loopback address unless ``--host`` says
otherwise.
"""

from __future__ import annotations

import argparse
import functools
import http.server
from pathlib import Path

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


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files without a log line per request (a page with many images would flood the terminal)."""

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        return


def make_server(folder: Path, host: str, port: int) -> http.server.ThreadingHTTPServer:
    """An HTTP server of ``folder``'s files (not started).

    Raises:
        OSError: the address is taken or cannot be bound.
    """
    handler = functools.partial(_QuietHandler, directory=str(folder))
    return http.server.ThreadingHTTPServer((host, port), handler)


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
        server = make_server(folder.resolve(), args.host, args.port)
    except OSError as error:
        raise SystemExit(f"error: cannot serve on {args.host}:{args.port} ({error}); pick another --port") from None
    port = server.server_address[1]
    print(f"serving http://{args.host}:{port}/{REPORT_NAME} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped")
    finally:
        server.server_close()
    return 0
