"""``turnrl play``: the keys of each env's actions (pure), and keys read as pressed in a real terminal (a pty)."""

from __future__ import annotations

import io
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from turnrl.envs import make
from turnrl.play import ARROW_KEYS, DIRECTION_KEYS, action_keys, expand_key, key_complete, keys_help, play

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- keys
def test_wasd_and_the_arrow_keys_are_the_directions():
    keys = action_keys(["Left", "Down", "Right", "Up"])  # FrozenLake's order
    assert {key: keys[key] for key in "wasd"} == {"w": "Up", "a": "Left", "s": "Down", "d": "Right"}
    assert {keys[key] for key in ARROW_KEYS} == {"Up", "Down", "Left", "Right"}
    assert set(keys) == set(DIRECTION_KEYS) | set(ARROW_KEYS)  # no u/l/r: one key, one meaning
    assert keys_help(keys) == "w=Up, a=Left, s=Down, d=Right or the arrow keys"


@pytest.mark.parametrize(
    ("names", "letters"),
    [
        (["up", "down", "left", "right", "stop"], {"t": "stop"}),  # Maze2D: s is down, so stop is t
        (["down", "up", "right", "left", "pickup", "dropoff"], {"p": "pickup", "r": "dropoff"}),  # Taxi
        (["Shepherd", "Pirate"], {"s": "Shepherd", "p": "Pirate"}),  # no directions: w/a/s/d are free
        (["moveahead", "moveback", "rotateright", "rotateleft"],
         {"m": "moveahead", "o": "moveback", "r": "rotateright", "t": "rotateleft"}),
        (["go", "g", "og"], {"g": "go", "o": "og"}),  # "g" has no letter left: typed by name
    ],
)
def test_every_other_action_gets_a_letter_of_its_name_that_no_key_took(names, letters):
    keys = action_keys(names)
    assert {key: name for key, name in keys.items() if key not in ARROW_KEYS and key not in _wasd(keys)} == letters


def _wasd(keys: dict[str, str]) -> set[str]:
    return {key for key, direction in DIRECTION_KEYS.items() if keys.get(key, "").lower() == direction}


def test_keys_help_lists_the_directions_then_the_letters():
    assert keys_help(action_keys(["up", "down", "left", "right", "stop"])) == (
        "w=up, a=left, s=down, d=right or the arrow keys; t=stop")
    assert keys_help(action_keys(["Shepherd", "Pirate"])) == "s=Shepherd, p=Pirate"
    assert keys_help(action_keys(["left", "right"])) == "a=left, d=right or the arrow keys"
    assert action_keys(None) == {} and keys_help({}) == ""


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(min_size=1, max_size=12), max_size=10, unique=True))
def test_no_key_stands_for_two_actions_and_letters_come_from_the_name(names):
    keys = action_keys(names)
    directions = {name for name in names if name.lower() in DIRECTION_KEYS.values()}
    for key, name in keys.items():
        assert name in names
        if name in directions:
            assert key in ARROW_KEYS or DIRECTION_KEYS.get(key) == name.lower()
        else:
            assert key in name.lower() and not (directions and key in DIRECTION_KEYS)
    others = [name for name in names if name not in directions]
    assert len([key for key, name in keys.items() if name in others]) <= len(others)  # a letter each at most


def test_a_typed_line_is_a_key_or_itself():
    keys = action_keys(["Up", "Down", "Left", "Right"])
    assert expand_key("d", keys) == expand_key("D", keys) == expand_key("\x1b[C", keys) == "Right"
    assert expand_key("\x1bOB", keys) == "Down" and expand_key(" w ", keys) == "Up"
    assert expand_key("push", keys) == "push" and expand_key("", keys) == ""


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_expand_key_takes_any_line(line):
    keys = action_keys(["Up", "Down", "Left", "Right"])
    assert expand_key(line, keys) in {line, *keys.values()}


@pytest.mark.parametrize(
    ("buffer", "complete"),
    [("", False), ("w", True), ("é", True), ("\x1b", False), ("\x1b[", False), ("\x1b[A", True),
     ("\x1b[1;5", False), ("\x1b[1;5C", True), ("\x1bO", False), ("\x1bOA", True), ("\x1bx", True)],
)
def test_a_key_is_whole_once_its_escape_sequence_ends(buffer, complete):
    assert key_complete(buffer) is complete


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=20))
def test_key_complete_takes_any_text(buffer):
    assert key_complete(buffer) in (True, False)


# --------------------------------------------------------------------------- a real terminal
class Terminal:
    """``turnrl play`` in a pseudo-terminal that is its controlling terminal (so Ctrl-C there interrupts it)."""

    def __init__(self, *args: str) -> None:
        import termios

        self.master, self.slave = os.openpty()
        self.before = termios.tcgetattr(self.slave)
        environment = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "COLUMNS": "120", "TERM": "xterm"}

        def controlling_terminal() -> None:
            import fcntl

            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.process = subprocess.Popen(
            [sys.executable, "-m", "turnrl.cli", "play", *args], stdin=self.slave, stdout=self.slave,
            stderr=self.slave, cwd=ROOT, env=environment, preexec_fn=controlling_terminal,
        )
        self.output = ""

    def read_until(self, text: str, timeout_s: float = 60.0) -> str:
        return self.read_until_count(text, 1, timeout_s)

    def read_until_count(self, text: str, count: int, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while self.output.count(text) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} not {count} times in:\n{self.output}"
            if select.select([self.master], [], [], min(left, 0.5))[0]:
                self.output += os.read(self.master, 65536).decode(errors="replace")
        return self.output

    def send(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def close(self) -> int:
        """Wait for the game to end; its exit status. ``after`` is then the terminal's mode it left."""
        import termios

        try:
            code = self.process.wait(timeout=30)
            self.after = termios.tcgetattr(self.slave)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            os.close(self.master)
            os.close(self.slave)
        return code


@pytest.fixture
def terminal():
    opened: list[Terminal] = []

    def start(*args: str) -> Terminal:
        opened.append(Terminal(*args))
        return opened[-1]

    yield start
    for term in opened:
        if term.process.poll() is None:
            term.process.kill()
            term.process.wait()


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_keys_act_as_pressed_without_enter_or_echo_and_the_terminal_mode_is_restored(terminal):
    env = make("FrozenLake")
    env.reset(seed=0)
    plan = env.solve()
    keys = {"Up": "\x1b[A", "Down": "s", "Left": "\x1b[D", "Right": "d"}
    term = terminal("FrozenLake", "--seed", "0")
    term.read_until("action> ")
    for step, action in enumerate(plan, 1):
        term.send(keys[action])  # no Enter
        term.read_until_count("reward ", step)
    term.read_until("Episode over: solved")
    assert term.close() == 0
    assert "^[" not in term.output  # an arrow key is read, not echoed as ^[[A
    assert term.output.count("(invalid action)") == 0
    assert term.after == term.before


@pytest.mark.skipif(sys.platform == "win32", reason="pseudo-terminals are POSIX")
def test_a_typed_line_and_ctrl_c_in_a_terminal(terminal):
    term = terminal("FrozenLake", "--seed", "0")
    term.read_until("action> ")
    term.send(":hint\r")  # ':' is no key: the line is read as typed
    term.read_until("solver: ")
    term.send("Jump\r")  # J is no key either (FrozenLake's are w/a/s/d and the arrows)
    term.read_until("(invalid action)")
    # Ctrl-C at the next prompt, as a player presses it: sent while the board is still being printed, it races
    # the printing (seen once on a loaded machine: neither the board nor "bye" came out).
    term.read_until_count("action> ", term.output[:term.output.index("(invalid action)")].count("action> ") + 1)
    term.send("\x03")
    term.read_until("bye")
    assert term.close() == 0
    assert term.after == term.before and "Traceback" not in term.output


@pytest.mark.parametrize("under", ["", "frames"])
def test_frames_folder_that_a_file_is_in_the_way_of_stops_before_the_game(under, tmp_path):
    # The first image frame raised FileExistsError (NotADirectoryError below it) as a traceback, mid-game.
    (tmp_path / "notes.txt").write_text("kept")
    out = tmp_path / "notes.txt" / under
    console = Console(file=io.StringIO())
    with pytest.raises(SystemExit) as info:
        play(make("FrozenLake", mode="image"), "FrozenLake", 0, str(out), console)
    assert str(info.value.code) == (f"error: --out {out}: {tmp_path / 'notes.txt'} is a file; give a folder for the "
                                    "frames (made if missing)")
    assert console.file.getvalue() == ""
