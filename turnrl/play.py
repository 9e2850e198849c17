"""``turnrl play``: an env in the terminal, an action a key press or a typed line.

Keys: W/A/S/D and the arrow keys are up/left/down/right for an env whose
actions are named so, and every other action gets a letter of its own name
that no other key took (Maze2D's ``stop`` is ``t``, since ``s`` is down).
In a terminal, keys are read as they are pressed (cbreak mode: no Enter, no
``^[[A`` echo); any other key starts a typed line (an action by name, or a
command such as ``:hint``). When input is not a terminal (a pipe, a file),
every line is an action, a command or a key. Commands (``:hint``, ``:reset``,
``:help``, ``:quit`` or ``q``) never reach the env, and an unknown ``:word``
is said to be one, without a step.

Image observations are written as PNG files, one per turn, into ``out`` when
given, else into a new temporary folder, which the game names: never into
the folder the command runs in unasked.
"""

from __future__ import annotations

import codecs
import os
import re
import select
import sys
import tempfile
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console

DIRECTION_KEYS = {"w": "up", "a": "left", "s": "down", "d": "right"}
"""W/A/S/D: the direction each key stands for."""
ARROW_KEYS = {"\x1b[A": "up", "\x1b[B": "down", "\x1b[C": "right", "\x1b[D": "left",
              "\x1bOA": "up", "\x1bOB": "down", "\x1bOC": "right", "\x1bOD": "left"}
"""Arrow keys as terminals send them (xterm's normal and application cursor modes)."""
PLAY_COMMANDS = (":hint (the solver's next actions), :reset (start the episode again), :help (this list), "
                 ":quit (or q, Ctrl-D / Ctrl-C)")
COMMANDS = {":hint": "hint", ":reset": "reset", ":help": "help", ":h": "help", "?": "help", ":quit": "quit",
            ":q": "quit", "q": "quit", "quit": "quit", "exit": "quit"}
"""What a typed line may say to the game rather than to the env, and the command it stands for."""
ESCAPE_WAIT_S = 0.05
"""How long a lone Escape waits for the rest of a key's sequence (terminals send one at once)."""
MAX_KEY_LENGTH = 16


# --------------------------------------------------------------------------- keys (pure)
def action_keys(names: Sequence[str] | None) -> dict[str, str]:
    """The keys that stand for the actions ``names``: key -> action name.

    W/A/S/D and the arrow keys (as their escape sequences) for the actions named up, left, down and right
    (any case); every other action gets the first letter of its name that no key took yet (lowercase; w/a/s/d
    count as taken where they mean directions), or none when every letter of its name is taken. A key never
    stands for two actions. Free-form envs (``names`` None) have no keys.

    >>> action_keys(["up", "down", "left", "right", "stop"])["t"]
    'stop'
    """
    if not names:
        return {}
    by_direction = {name.lower(): name for name in names if name.lower() in DIRECTION_KEYS.values()}
    keys = {key: by_direction[d] for key, d in DIRECTION_KEYS.items() if d in by_direction}
    keys.update({key: by_direction[d] for key, d in ARROW_KEYS.items() if d in by_direction})
    taken = set(DIRECTION_KEYS) if by_direction else set()
    for name in names:
        if name.lower() in by_direction:
            continue
        letter = next((c for c in name.lower() if c.isascii() and c.isalpha() and c not in taken), None)
        if letter is not None:
            keys[letter] = name
            taken.add(letter)
    return keys


def keys_help(keys: dict[str, str]) -> str:
    """The keys for the game's help line: ``w=Up, a=Left, s=Down, d=Right or the arrow keys; t=stop``."""
    wasd = [f"{key}={keys[key]}" for key, direction in DIRECTION_KEYS.items() if keys.get(key, "").lower() == direction]
    arrows = " or the arrow keys" if wasd and any(key in ARROW_KEYS for key in keys) else ""
    letters = [f"{key}={name}" for key, name in keys.items()
               if key not in ARROW_KEYS and name.lower() != DIRECTION_KEYS.get(key)]
    return "; ".join(part for part in (", ".join(wasd) + arrows, ", ".join(letters)) if part)


def expand_key(line: str, keys: dict[str, str]) -> str:
    """The action a typed line stands for: a key (case-insensitive; an arrow key as its sequence), else the
    line as typed."""
    key = line.strip()
    return keys.get(key, keys.get(key.lower(), line)) if key else line


_CSI = re.compile(r"\x1b\[[0-9;]*[\x40-\x7e]")


def key_complete(buffer: str) -> bool:
    """Whether ``buffer`` (what a terminal sent so far) holds a whole key press: one character, an escape
    sequence (``ESC [ params final``, ``ESC O x``) or Alt with a character. A lone Escape is incomplete: the
    reader waits a moment for the rest, then takes it as Escape."""
    if not buffer:
        return False
    if buffer[0] != "\x1b":
        return True
    if len(buffer) == 1:
        return False
    if buffer[1] == "[":
        return _CSI.match(buffer) is not None or len(buffer) >= MAX_KEY_LENGTH
    if buffer[1] == "O":
        return len(buffer) >= 3
    return True


def play_command(line: str, names: Sequence[str] | None) -> str | None:
    """The command a typed line stands for (``hint``, ``reset``, ``help``, ``quit``, or ``unknown`` for any
    other ``:word``), or None for an action. A command is never stepped: ``q`` or ``:help`` as an env's move
    would cost a turn and a penalty. A word that is one of the env's own action names stays an action."""
    word = line.strip()
    if names is not None and word.lower() in (name.lower() for name in names):
        return None
    command = COMMANDS.get(word.lower())
    if command is None and word.startswith(":"):
        return "unknown"
    return command


# --------------------------------------------------------------------------- input
class ActionInput(Protocol):
    """Where the game's actions and commands come from."""

    def next(self, keys: dict[str, str]) -> str | None:
        """The next action or command (a key already turned into its action), or None at the end of input."""
        ...


class LineInput:
    """One action, command or key per line of input (a pipe, a file, or a terminal without termios)."""

    def __init__(self, console: Console) -> None:
        self.console = console

    def next(self, keys: dict[str, str]) -> str | None:
        try:
            line = input("action> ")
        except EOFError:
            return None
        action = expand_key(line, keys)
        if action != line:
            self.console.print(f"({action})", markup=False, highlight=False)
        return action


class KeyInput:
    """Keys of a terminal as they are pressed (cbreak mode: no Enter needed, no echo; Ctrl-C still
    interrupts). A key of an action is that action; Enter is ignored; Ctrl-D ends; any other character
    starts a line typed in the terminal's usual mode. The terminal's mode is restored on exit."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._saved: Any = None

    def __enter__(self) -> KeyInput:
        import termios
        import tty

        self._saved = termios.tcgetattr(self.fd)
        tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc: object) -> None:
        self._cooked()

    def _cooked(self) -> None:
        import termios

        termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def next(self, keys: dict[str, str]) -> str | None:
        while True:
            print("action> ", end="", flush=True)
            key = self.key()
            if key == "\x04" or key == "":  # Ctrl-D, or the terminal closed
                print()
                return None
            action = keys.get(key, keys.get(key.lower()))
            if action is not None:
                print(action, flush=True)
                return action
            if key.isprintable() and not key.startswith("\x1b"):
                return self.line(key)
            print("\r", end="", flush=True)  # Enter, Escape, a key that stands for nothing: ask again

    def key(self) -> str:
        """One key press: a character or a whole escape sequence ("" when input has ended)."""
        buffer = self._char(None)
        while buffer and not key_complete(buffer):
            more = self._char(ESCAPE_WAIT_S)
            if not more:
                break
            buffer += more
        return buffer

    def _char(self, timeout_s: float | None) -> str:
        """The next character, "" at the end of input or when ``timeout_s`` passes first."""
        while True:
            if timeout_s is not None and not select.select([self.fd], [], [], timeout_s)[0]:
                return ""
            data = os.read(self.fd, 1)
            if not data:
                return ""
            text = self._decoder.decode(data)
            if text:
                return text

    def line(self, typed: str) -> str | None:
        """The rest of a line whose first character is ``typed``, read in the terminal's usual mode (with
        line editing where Python has readline)."""
        import tty

        self._cooked()
        try:
            try:
                import readline
            except ImportError:  # no line editing: the typed character is shown and kept
                print(typed, end="", flush=True)
                return typed + input()
            readline.set_startup_hook(lambda: readline.insert_text(typed))
            try:
                return input("\raction> ")
            finally:
                readline.set_startup_hook()
        except EOFError:
            return None
        finally:
            tty.setcbreak(self.fd)


def terminal_fd() -> int | None:
    """The file descriptor of stdin when it is a terminal whose keys can be read one at a time, else None."""
    try:
        import termios  # noqa: F401  (POSIX only)

        fd = sys.stdin.fileno()
    except (ImportError, AttributeError, OSError, ValueError):  # no termios, or a stdin without a descriptor
        return None
    return fd if os.isatty(fd) else None


# --------------------------------------------------------------------------- the game
class FrameWriter:
    """Writes each image observation as ``turn_NNN.png`` into ``out``, or into a new temporary folder made
    at the first image; says where once."""

    def __init__(self, console: Console, out: str | None, env_name: str, seed: int) -> None:
        self.console = console
        self.folder = Path(out) if out else None
        self.prefix = "turnrl-play-" + re.sub(r"[^A-Za-z0-9._-]+", "_", f"{env_name}-{seed}").strip("_") + "-"

    def write(self, image: Any, turn: int) -> Path:
        from PIL import Image

        if self.folder is None:
            self.folder = Path(tempfile.mkdtemp(prefix=self.prefix))
            self.console.print(f"frames go to {self.folder} (--out DIR to choose)", markup=False, highlight=False,
                               soft_wrap=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"turn_{turn:03d}.png"
        Image.fromarray(image).save(path)
        return path


def file_in_the_way(folder: Path) -> Path | None:
    """The file that ``folder``, or a folder above it, would have to be for ``folder`` to be made; None if none."""
    existing = next((path for path in (folder, *folder.parents) if path.exists()), None)
    return existing if existing is not None and not existing.is_dir() else None


def play(env: Any, env_name: str, seed: int, out: str | None, console: Console) -> int:
    """Play ``env`` from ``seed`` until the episode ends, input ends or the player quits; returns 0.

    Keys are read as they are pressed when stdin is a terminal, else line by line.
    """
    blocker = file_in_the_way(Path(out)) if out is not None else None
    if blocker is not None:  # found now, not at the first frame as a traceback
        raise SystemExit(f"error: --out {out}: {blocker} is a file; give a folder for the frames (made if missing)")
    fd = terminal_fd()
    actions = KeyInput(fd) if fd is not None else nullcontext(LineInput(console))
    try:
        with actions as source:
            return _play(env, env_name, seed, out, console, source, typed=fd is not None)
    except KeyboardInterrupt:  # Ctrl-C ends the game like :quit
        console.print("\nbye")
        return 0


def _play(env: Any, env_name: str, seed: int, out: str | None, console: Console, actions: ActionInput,
          typed: bool) -> int:
    obs, info = env.reset(seed=seed)
    frames = FrameWriter(console, out, env_name, seed)
    console.print(f"[bold]{type(env).__name__}[/bold] seed={seed}\n")
    console.print(env.instructions(), markup=False)
    names = env.action_names()
    keys = action_keys(names)
    how = "press a key, or type an action and Enter" if typed else "one per line: an action, a key or a command"
    shown = keys_help(keys)
    console.print(
        f"\nActions: {', '.join(names) if names else 'free-form text'} ({how}).\n"
        + (f"Keys: {shown}.\n" if shown else "")
        + f"Commands: {PLAY_COMMANDS}\n",
        markup=False, highlight=False,
    )
    turn, total = 0, 0.0

    def show(obs: dict[str, Any]) -> None:
        console.print(obs["text"], markup=False, highlight=False)
        if "image" in obs:
            path = frames.write(obs["image"], turn)
            console.print(f"(image written to {path})", markup=False, highlight=False, soft_wrap=True)

    show(obs)
    while True:
        action = actions.next(keys)
        if action is None:
            break
        command = play_command(action, names)
        if command == "quit":
            break
        if command == "reset":
            obs, info = env.reset(seed=seed)
            turn, total = 0, 0.0
            show(obs)
            continue
        if command == "hint":
            console.print(f"solver: {env.solve()}", markup=False, highlight=False)
            continue
        if command == "help":
            console.print(f"Actions: {', '.join(names) if names else 'free-form text'}.\n"
                          + (f"Keys: {shown}.\n" if shown else "") + f"Commands: {PLAY_COMMANDS}",
                          markup=False, highlight=False)
            continue
        if command == "unknown":
            console.print(f"unknown command {action.strip()}; no step taken. Commands: {PLAY_COMMANDS}",
                          markup=False, highlight=False)
            continue
        obs, reward, terminated, truncated, info = env.step(action)
        turn += 1
        total += reward
        valid = "" if info.get("action_is_valid", True) else " (invalid action)"
        console.print(f"reward {reward:g}{valid}, total {total:g}", markup=False, highlight=False)
        show(obs)
        if terminated or truncated:
            outcome = "solved" if info.get("success") else ("truncated" if truncated else "failed")
            console.print(f"[bold]Episode over: {outcome}[/bold] after {turn} steps, return {total:g}")
            break
    return 0
