"""``turnrl view --serve``: the folder's files and nothing else, over real HTTP on a free port.

Outside files are reached through symlinks made in the test's folder; nothing outside ``tmp_path`` is read.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.viz.test_view_command import SERVE
from turnrl.viz.view_command import exposure_warning, make_server, served_file, still_names

PNG = b"\x89PNG\r\n\x1a\n" + bytes(32)


@pytest.fixture
def folder(tmp_path) -> Path:
    """A run folder beside an outside folder, with symlinks from the one into both."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret")
    run = tmp_path / "run"
    (run / "images").mkdir(parents=True)
    (run / "report.html").write_text("<html>report</html>")
    (run / "images" / "a.png").write_bytes(PNG)
    (run / "site").mkdir()
    (run / "site" / "index.html").write_text("<html>site</html>")
    (run / "leaky").mkdir()
    (run / "leaky" / "index.html").symlink_to(outside / "secret.txt")
    (run / "outside_dir").symlink_to(outside)
    (run / "outside_file.txt").symlink_to(outside / "secret.txt")
    (run / "inside_file.html").symlink_to(run / "report.html")
    (run / "inside_dir").symlink_to("images")
    return run


def get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=10)


@pytest.mark.parametrize("path", ["/outside_dir/secret.txt", "/outside_file.txt", "/leaky/", "/outside_dir/"])
def test_symlinks_out_of_the_folder_answer_404(folder, serve, path):
    base = serve(folder)
    response = get(base + path)
    assert response.status_code == 404 and "secret" not in response.text


def test_symlinks_inside_the_folder_still_serve(folder, serve):
    base = serve(folder)
    assert get(f"{base}/inside_file.html").text == "<html>report</html>"
    assert get(f"{base}/inside_dir/a.png").content == PNG


def test_a_folder_reached_through_a_symlink_serves_its_files(folder, serve, tmp_path):
    link = tmp_path / "run_link"
    link.symlink_to(folder)
    base = serve(link)
    assert get(f"{base}/report.html").status_code == 200 and get(f"{base}/images/a.png").content == PNG


@pytest.mark.parametrize("path", ["/", "/images/", "/images", "/images/?C=M;O=A"])
def test_directories_are_not_listed(folder, serve, path):
    response = get(serve(folder) + path)
    assert response.status_code == 404 and "a.png" not in response.text


def test_the_root_of_the_command_s_server_leads_to_the_report(folder, serve):
    """The page's address is /report.html; an address typed without it found a 404."""
    response = get(serve(folder, home="report.html") + "/")
    assert response.status_code == 302 and response.headers["location"] == "/report.html"


def test_a_directory_with_an_index_file_serves_it(folder, serve):
    base = serve(folder)
    assert get(f"{base}/site/").text == "<html>site</html>"
    redirect = get(f"{base}/site")
    assert redirect.status_code == 301 and redirect.headers["location"] == "/site/"


@pytest.mark.parametrize("method", ["GET", "HEAD"])
@pytest.mark.parametrize("path", ["/%00", "/report.html%00", "/images/%00/a.png", "/%ED%A0%80"])
def test_a_path_that_cannot_name_a_file_is_a_bad_request(folder, serve, method, path):
    port = int(serve(folder).rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(method, path)
        assert connection.getresponse().status == 400
    finally:
        connection.close()


def test_a_client_that_hangs_up_mid_download_prints_nothing(tmp_path, capsys):
    # Far more than the loopback socket buffers hold, so the server is still writing when the client resets.
    with open(tmp_path / "big.bin", "wb") as big:
        big.truncate(64 * 2**20)
    server = make_server(tmp_path, "127.0.0.1", 0)
    server.daemon_threads = False  # server_close then waits for the handler's thread, and what it printed
    errors: list[type[BaseException] | None] = []
    handle_error = server.handle_error

    def record(request, client_address) -> None:
        errors.append(sys.exc_info()[0])
        handle_error(request, client_address)

    server.handle_error = record  # type: ignore[method-assign]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = socket.create_connection(server.server_address, timeout=10)
        client.sendall(b"GET /big.bin HTTP/1.1\r\nHost: test\r\n\r\n")
        assert client.recv(12).startswith(b"HTTP/1.")
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        client.close()
    finally:
        server.shutdown()
        server.server_close()
    assert errors and all(error is not None and issubclass(error, ConnectionError) for error in errors)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("sent", [b"", b"GET /report.html HTTP/1.1\r\n", b"GET /report.html HTTP/1.1\r\nHost: te"])
def test_a_connection_silent_past_the_timeout_is_dropped(folder, serve, sent):
    port = int(serve(folder, timeout=0.2).rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        client.sendall(sent)
        assert client.recv(100) == b""  # closed by the server, with no answer


def test_the_timeout_leaves_a_prompt_request_alone(folder, serve):
    assert get(serve(folder, timeout=0.2) + "/report.html").text == "<html>report</html>"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_a_loopback_host_gets_no_warning(host):
    assert exposure_warning(host) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.5", "myhost.example"])
def test_any_other_host_gets_a_warning(host):
    assert exposure_warning(host) == (
        f"warning: serving on {host}: anyone who can reach this port can read this folder's files (the report, "
        "trajectories, config); the default --host 127.0.0.1 keeps them on this machine")


def test_serving_on_all_addresses_prints_the_warning_before_the_address(eval_dir):
    process = subprocess.Popen([sys.executable, "-c", SERVE, str(eval_dir), "--serve", "--host", "0.0.0.0",
                                "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        lines = [process.stdout.readline()]
        while lines[-1] and not lines[-1].startswith("serving "):  # the last line before it serves
            lines.append(process.stdout.readline())
        process.send_signal(signal.SIGINT)
        process.communicate(timeout=30)
    finally:
        process.kill()
    assert len(lines) == 3 and lines[0].startswith("report: ") and lines[2].startswith("serving http://0.0.0.0:")
    assert lines[1].strip() == exposure_warning("0.0.0.0")


def test_a_directory_swapped_for_a_symlink_after_the_check_is_not_served(folder, tmp_path):
    """The check and the open look at the path twice: between them a directory on it may become a symlink out."""
    root = os.path.realpath(folder)
    real = served_file(root, str(folder / "images" / "a.png"))
    assert real is not None
    (folder / "images").rename(folder / "images_moved")
    (tmp_path / "outside" / "a.png").write_bytes(b"outside")
    (folder / "images").symlink_to(tmp_path / "outside")
    with open(real, "rb") as handle:  # the open the server would make now reads the outside file
        assert handle.read() == b"outside"
        assert not still_names(root, real, handle)


def test_a_file_opened_during_a_swap_and_swapped_back_is_not_served(folder, tmp_path):
    """A swap to a symlink, the open, and a swap back before the second look: the path names the inside file again,
    but not the file that is open."""
    root = os.path.realpath(folder)
    real = os.path.realpath(folder / "images" / "a.png")
    with open(tmp_path / "outside" / "secret.txt", "rb") as handle:
        assert not still_names(root, real, handle)
    with open(real, "rb") as handle:
        assert still_names(root, real, handle)
