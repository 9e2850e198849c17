"""``turnrl view``: arguments, errors, and serving the report over HTTP until Ctrl-C."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import threading

import httpx
import pytest

from turnrl.viz.view_command import add_arguments, main, make_server


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="turnrl view")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_view_writes_the_report_and_prints_its_path(eval_dir, capsys):
    assert main(parse(str(eval_dir))) == 0
    assert capsys.readouterr().out.strip() == f"report: {eval_dir / 'report.html'}"
    assert (eval_dir / "report.html").is_file()


@pytest.mark.parametrize("argv, message", [
    (["{tmp}/absent"], "is not a folder"),
    (["{tmp}"], "holds neither a training run"),
    (["{eval}", "--max-episodes", "0"], "--max-episodes must be at least 1"),
    (["{eval}", "--max-step-files", "0"], "--max-step-files must be at least 1"),
    (["{eval}", "--max-turns", "0"], "--max-turns must be at least 1"),
    (["{eval}", "--max-heatmap-tokens", "-1"], "--max-heatmap-tokens must be 0 (no heatmaps) or more"),
    (["{eval}", "--port", "70000"], "is not a port number"),
])
def test_bad_arguments_are_one_line_errors(tmp_path, eval_dir, argv, message):
    args = parse(*(a.format(tmp=tmp_path, eval=eval_dir) for a in argv))
    with pytest.raises(SystemExit) as error:
        main(args)
    assert str(error.value).startswith("error: ") and message in str(error.value)


def test_max_turns_reaches_the_page(tmp_path):
    from tests.viz.test_report import trainer_episodes
    from turnrl.rollout.trajectory import write_trajectories

    write_trajectories(trainer_episodes(1, 9), tmp_path)
    assert main(parse(str(tmp_path), "--max-turns", "3")) == 0
    html = (tmp_path / "report.html").read_text()
    assert html.count("<strong>Turn ") == 3 and "6 more turns (turns 3 to 8 of 9) not shown" in html


def test_defaults_serve_this_machine_only():
    args = parse("some/dir")
    assert (args.serve, args.port, args.host, args.max_episodes, args.max_step_files, args.max_heatmap_tokens) == (
        False, 8008, "127.0.0.1", 128, 16, 100_000)


def test_the_server_serves_the_folder(eval_dir):
    report = main(parse(str(eval_dir)))
    assert report == 0
    server = make_server(eval_dir, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        page = httpx.get(f"{base}/report.html", timeout=10)
        assert page.status_code == 200 and page.text == (eval_dir / "report.html").read_text()
        image = httpx.get(f"{base}/images/trajectories_00000_000.png", timeout=10)
        assert image.status_code == 200 and image.content[:4] == b"\x89PNG"
        assert httpx.get(f"{base}/../../etc/passwd", timeout=10).status_code == 404
    finally:
        server.shutdown()
        server.server_close()


SERVE = """
import argparse, sys
from turnrl.viz.view_command import add_arguments, main
parser = argparse.ArgumentParser()
add_arguments(parser)
sys.exit(main(parser.parse_args(sys.argv[1:])))
"""


def test_serve_runs_until_ctrl_c_and_exits_cleanly(eval_dir):
    process = subprocess.Popen([sys.executable, "-c", SERVE, str(eval_dir), "--serve", "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        assert process.stdout.readline().startswith("report: ")
        url = process.stdout.readline().split()[1]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/report.html")
        assert httpx.get(url, timeout=10).status_code == 200
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 0 and out.strip() == "stopped" and "Traceback" not in err
