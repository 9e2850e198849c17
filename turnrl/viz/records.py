"""What the viewer reads from a run or an evaluation folder, as typed records.

A **run folder** (``turnrl train``) holds ``metrics.jsonl``, ``summary.json``,
``config.yaml`` and ``trajectories/`` with ``val_before_rl.jsonl``,
``step_NNNNNN.jsonl`` (every ``run.trajectories_every`` steps) and
``val_after_rl.jsonl``, images under ``trajectories/images/``; the SFT stage
adds ``sft/metrics.jsonl`` and ``sft/demos_sample.jsonl``. An **evaluation
folder** (``turnrl eval --out``) holds ``summary.json``, ``config.yaml``,
``trajectories.jsonl`` and ``images/``; one of several env variants
(``turnrl eval --variants``) holds the same in ``variants/<name>/`` for each
variant, and the table of all of them in ``summary.json`` (``variants``).

Per-token advantages, where a run has them, sit beside a trajectories file
as ``<stem>.advantages.jsonl``: one JSON line per trained turn,
``{"episode": i, "turn": k, "tokens": [str, ...], "advantages": [float, ...]}``
where ``episode`` is the line number (0-based) of the episode in
``<stem>.jsonl``, ``turn`` its turn index, ``tokens`` the decoded text of
each sampled token of that turn's response and ``advantages`` the advantage
each token was trained with. :func:`token_advantage_records` builds these
lines from a padded training batch and :func:`write_token_advantages` writes
them.

Everything here is read as untrusted data: a line that is not JSON, a field
of the wrong type or an image path that leaves the folder becomes a warning
or a default, never an exception. A non-finite reward or advantage (``NaN``,
``Infinity``, as Python's ``json`` writes them, or ``null``, as strict writers
do) is kept as it is, so that the page shows it rather than a plausible 0; so is a
non-finite figure of an env's ``env_metrics``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote

from turnrl.files import atomic_write_text, parse_json
from turnrl.rollout.trajectory import sum_by_name

ADVANTAGES_SUFFIX = ".advantages.jsonl"
DEFAULT_MAX_EPISODES = 128
"""Episodes shown per trajectories file: a long run's files together would make a page too heavy to open."""
DEFAULT_MAX_HEATMAP_TOKENS = 100_000
"""Tokens of a page drawn in per-token advantage heatmaps, shared evenly by the files that have advantages: each
token is an element of its own, and every token of a step file (128 episodes of five 128-token turns: 80,000) in
each of the files shown would make a page of a million elements and over a hundred megabytes."""
DEFAULT_MAX_STEP_FILES = 16
"""Training steps' trajectories files shown: a long run writes one every ``run.trajectories_every`` steps, and
hundreds of them (each up to :data:`DEFAULT_MAX_EPISODES` episodes) would make a page of hundreds of megabytes."""
DEFAULT_MAX_TURNS = 20
"""Turns drawn per episode, the first half and the last half of them where an episode has more: each turn is a
block of its own (observation, response, image), and an evaluation of 128 image Sokoban episodes of up to 200 turns
made a page of 12 MB (2.2 MB at 20 turns), a run of 18 such files 244 MB (44 MB). The configs' episodes (at most 16
turns, but for a few long-horizon ones) are never cut."""
_STEP_FILE = re.compile(r"step_(\d+)")
VARIANTS_DIR = "variants"
"""The folder of a variants evaluation that holds one evaluation folder per variant."""
VARIANT_COLUMNS = (
    ("episodes", "episodes"),
    ("success_rate", "success"),
    ("mean_reward", "mean reward"),
    ("format_valid_rate", "format valid"),
    ("mean_turns", "mean turns"),
    ("errors", "errors"),
)
"""The figures of a row of a variants evaluation's table (``summary.json``'s ``variants``): (the key in the row,
the column's title), printed by ``turnrl eval`` and shown by the page."""


# --------------------------------------------------------------------------- records
@dataclass(frozen=True)
class TokenAdvantages:
    """The advantage of every sampled token of one turn's response."""

    tokens: tuple[str, ...]
    """Decoded text of each sampled token, in order."""
    advantages: tuple[float, ...]
    """Advantage of each token (same length as ``tokens``)."""


@dataclass
class TurnView:
    """One turn of an episode as the page shows it."""

    index: int
    prompt: str = ""
    """The observation text the response answers."""
    response: str = ""
    finish_reason: str = ""
    format_ok: bool = False
    fields: dict[str, str] = field(default_factory=dict)
    """Reasoning fields parsed from the response (``think``, ``observation``, ``answer``, ...)."""
    parse_errors: list[str] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)
    actions_valid: list[bool] = field(default_factory=list)
    actions_effective: list[bool] = field(default_factory=list)
    """Whether each action changed the env's state (empty in records written before it was kept)."""
    rewards: dict[str, float] = field(default_factory=dict)
    """Unweighted named rewards (``env``, ``format``, added rewards); NaN or infinite where the record says so."""
    reward: float = 0.0
    """The weighted turn reward (NaN or infinite where the record says so)."""
    reward_errors: list[str] = field(default_factory=list)
    num_response_tokens: int = 0
    weights_version: int | None = None
    """The trainer's update count of the weights that sampled the response (None in records written before it was
    kept, and for policies whose weights are no trainer's)."""
    images: list[str] = field(default_factory=list)
    """URLs (relative to the report) of the observation's images."""
    advantages: TokenAdvantages | None = None


@dataclass
class EpisodeView:
    """One episode as the page shows it."""

    source: str
    """The trajectories file's stem (``val_before_rl``, ``step_000005``, ``trajectories``)."""
    index: int
    """Line number (0-based) of the episode in its file."""
    env_id: str = "?"
    seed: int = 0
    group: int = 0
    sample: int = 0
    status: str = "?"
    truncation_reason: str | None = None
    success: bool = False
    error: str | None = None
    total_reward: float = 0.0
    system_prompt: str = ""
    final_observation: str = ""
    turns: list[TurnView] = field(default_factory=list)
    images: list[str] = field(default_factory=list)
    """Image URLs not tied to a turn (when the record does not say which turn showed which image)."""
    final_images: list[str] = field(default_factory=list)
    """Images of the observation after the last turn."""
    env_metrics: dict[str, float] = field(default_factory=dict)
    """The env's own figures of the episode (Sokoban: boxes on targets, deadlocked); NaN or infinite where the
    record says so."""
    max_shown_turns: int | None = None
    """Turns the page draws where the episode has more (see :func:`split_turns`); None draws every turn."""

    @property
    def turn_parts(self) -> tuple[list[TurnView], int, list[TurnView]]:
        """The turns drawn first, how many are left out after them, and the turns drawn last."""
        return split_turns(self.turns, self.max_shown_turns)

    @property
    def named_rewards(self) -> dict[str, float]:
        """Each named reward summed over the turns."""
        return sum_by_name(turn.rewards for turn in self.turns)

    @property
    def has_advantages(self) -> bool:
        return any(turn.advantages is not None for turn in self.turns)

    @property
    def has_non_finite_reward(self) -> bool:
        """A turn's reward, one of its named rewards or the episode's total is NaN or infinite."""
        values = [self.total_reward, *(v for turn in self.turns for v in (turn.reward, *turn.rewards.values()))]
        return not all(math.isfinite(value) for value in values)

    @property
    def has_non_finite_figure(self) -> bool:
        """One of the env's figures is NaN or infinite."""
        return not all(math.isfinite(value) for value in self.env_metrics.values())


def split_turns(turns: Sequence[TurnView], limit: int | None) -> tuple[list[TurnView], int, list[TurnView]]:
    """``turns`` as (first ones drawn, count left out, last ones drawn): all of them first where there are at most
    ``limit`` (or no limit), else the first ``ceil(limit / 2)`` and the last ``floor(limit / 2)``, so that the page
    shows how the episode began and how it ended (the hole, the deadlock, the goal)."""
    if limit is not None and limit < 1:
        raise ValueError(f"the turns drawn per episode must be at least 1 (or None: every turn), got {limit}")
    if limit is None or len(turns) <= limit:
        return list(turns), 0, []
    head, tail = (limit + 1) // 2, limit // 2
    return list(turns[:head]), len(turns) - head - tail, list(turns[len(turns) - tail:])


@dataclass
class EpisodeSource:
    """One trajectories file and the episodes read from it."""

    name: str
    """File stem, the filter value."""
    label: str
    """What the page calls it: ``validation before RL``, ``step 5``, ``evaluation``, ..."""
    step: int | None
    """The training step the episodes come from (None for evaluations and SFT demos)."""
    episodes: list[EpisodeView] = field(default_factory=list)
    total: int = 0
    """Episodes in the file (more than ``len(episodes)`` when the page shows only the first ones)."""
    advantage_scale: float = 0.0
    """Largest absolute token advantage in the file (0 without advantages): the heatmap's full colour."""


# --------------------------------------------------------------------------- untrusted values
def _as_str(value: Any, default: str = "") -> str:
    return value if isinstance(value, str) else default


def _as_int(value: Any, default: int = 0) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return int(value)
    return default


def _as_optional_int(value: Any) -> int | None:
    """An integer, or None for a missing or non-numeric value."""
    return _as_int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _as_reward(value: Any, default: float = 0.0) -> float:
    """A reward as the record has it: any number, NaN and infinities included; null (how a strict JSON writer
    writes a non-finite number) as NaN; any other value ``default``. Pass ``record.get(key, default)``, so that
    a missing reward is the default and a null one NaN."""
    if value is None:
        return math.nan
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def _as_reward_dict(value: Any) -> dict[str, float]:
    """Named rewards or an env's figures (:func:`_as_reward` each); entries that are neither numbers nor null are
    left out."""
    if not isinstance(value, dict):
        return {}
    return {str(k): _as_reward(v) for k, v in value.items()
            if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))}


def _as_bool(value: Any) -> bool:
    return value is True or (isinstance(value, (int, float)) and not isinstance(value, bool) and value != 0)


def _as_str_list(value: Any) -> list[str]:
    return [item for item in value if isinstance(item, str)] if isinstance(value, list) else []


def _as_str_dict(value: Any) -> dict[str, str]:
    return {str(k): v for k, v in value.items() if isinstance(v, str)} if isinstance(value, dict) else {}


def safe_relative_path(text: str) -> PurePosixPath | None:
    """``text`` as a relative path that stays inside its folder, or None (absolute, ``..``, URL, empty)."""
    if not text or "\\" in text or ":" in text or "\x00" in text:
        return None
    path = PurePosixPath(text)
    if path.is_absolute() or any(part in ("..", "") for part in path.parts) or not path.parts:
        return None
    return path


# --------------------------------------------------------------------------- one episode
@dataclass
class ImageResolver:
    """Turns the image paths of a record (relative to its file's folder) into URLs relative to the report."""

    base: Path
    """The folder of the trajectories file."""
    report_dir: Path
    missing: list[str] = field(default_factory=list)
    """Paths that were unsafe or had no file."""

    def url(self, text: str) -> str | None:
        relative = safe_relative_path(text)
        path = self.base / relative if relative is not None else None
        if path is None or not path.is_file():
            self.missing.append(text)
            return None
        return quote(Path(os.path.relpath(path, self.report_dir)).as_posix())

    def urls(self, value: Any) -> list[str | None]:
        """The URL of each path of a JSON list, in order, None for each that is unsafe or has no file (so that the
        others keep their places: the k-th image is the k-th observation's); [] for anything but a list."""
        return [self.url(text) for text in _as_str_list(value)]


Resolve = Callable[[Any], Sequence[str | None]]
"""Image paths of a record (any JSON value) -> their URLs in order, None for each missing one."""


def _found(urls: Iterable[str | None]) -> list[str]:
    return [url for url in urls if url is not None]


def parse_turn(record: Any, index: int, resolve: Resolve) -> TurnView:
    """One turn of a trajectory record (any JSON value; wrong types become defaults)."""
    if not isinstance(record, dict):
        return TurnView(index=index, parse_errors=["this turn's record is not a JSON object"])
    valid, effective = record.get("actions_valid"), record.get("actions_effective")
    return TurnView(
        index=_as_int(record.get("index"), index),
        prompt=_as_str(record.get("prompt")),
        response=_as_str(record.get("response")),
        finish_reason=_as_str(record.get("finish_reason")),
        format_ok=_as_bool(record.get("format_ok")),
        fields=_as_str_dict(record.get("fields")),
        parse_errors=_as_str_list(record.get("parse_errors")),
        actions=_as_str_list(record.get("actions")),
        actions_valid=[_as_bool(v) for v in valid] if isinstance(valid, list) else [],
        actions_effective=[_as_bool(v) for v in effective] if isinstance(effective, list) else [],
        rewards=_as_reward_dict(record.get("rewards")),
        reward=_as_reward(record.get("reward", 0.0)),
        reward_errors=_as_str_list(record.get("reward_errors")),
        num_response_tokens=_as_int(record.get("num_response_tokens")),
        weights_version=_as_optional_int(record.get("weights_version")),
        images=_found(resolve(record.get("images"))),
    )


def parse_episode(record: Any, source: str, index: int, resolve: Resolve) -> EpisodeView:
    """One line of a trajectories file, already decoded from JSON.

    Images: a turn's own ``images`` list when the record has one; otherwise the episode's ``images`` in
    order, one per turn when there are as many as turns (image modes show one image per observation), the
    one left over after that as the final observation's, and as a plain list when the counts do not fit. A
    missing image keeps its place (its turn shows none; the next turn still shows its own). The record's
    ``final_images`` are the final observation's, where it has them.

    Raises:
        ValueError: ``record`` is not a JSON object.
    """
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    raw_turns = record.get("turns")
    turns = [parse_turn(t, k, resolve) for k, t in enumerate(raw_turns)] if isinstance(raw_turns, list) else []
    turns_total = sum(t.reward for t in turns)
    images = list(resolve(record.get("images")))
    final_images = _found(resolve(record.get("final_images")))
    episode = EpisodeView(
        source=source,
        index=index,
        env_id=_as_str(record.get("env_id"), "?"),
        seed=_as_int(record.get("seed")),
        group=_as_int(record.get("group")),
        sample=_as_int(record.get("sample")),
        status=_as_str(record.get("status"), "?"),
        truncation_reason=record.get("truncation_reason") if isinstance(record.get("truncation_reason"), str) else None,
        success=_as_bool(record.get("success")),
        error=record.get("error") if isinstance(record.get("error"), str) else None,
        total_reward=_as_reward(record.get("total_reward", turns_total), turns_total),
        system_prompt=_as_str(record.get("system_prompt")),
        final_observation=_as_str(record.get("final_observation")),
        turns=turns,
        final_images=final_images,
        env_metrics=_as_reward_dict(record.get("env_metrics")),
    )
    if any(turn.images for turn in turns):
        return episode  # the record says which turn showed which image
    if turns and len(images) in (len(turns), len(turns) + 1):
        for turn, url in zip(turns, images):
            turn.images = _found([url])
        episode.final_images = final_images or _found(images[len(turns):])
    else:
        episode.images = _found(images)
    return episode


def parse_episode_line(line: str, source: str, index: int, resolve: Resolve) -> EpisodeView:
    """One line of a trajectories file.

    Raises:
        ValueError: the line is not a JSON object.
    """
    try:
        record = parse_json(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error})") from None
    return parse_episode(record, source, index, resolve)


def parse_token_advantages(line: str) -> tuple[int, int, TokenAdvantages]:
    """One line of an ``.advantages.jsonl`` file: ``(episode, turn, advantages)``.

    Raises:
        ValueError: not JSON, missing fields, or tokens and advantages of different lengths.
    """
    try:
        record = parse_json(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error})") from None
    if not isinstance(record, dict):
        raise ValueError("expected a JSON object")
    episode, turn = record.get("episode"), record.get("turn")
    tokens, values = record.get("tokens"), record.get("advantages")
    if not isinstance(episode, int) or not isinstance(turn, int) or isinstance(episode, bool) or episode < 0:
        raise ValueError("'episode' and 'turn' must be non-negative integers")
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError("'tokens' must be a list of strings")
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ValueError("'advantages' must be a list of numbers")
    if len(tokens) != len(values):
        raise ValueError(f"{len(tokens)} tokens but {len(values)} advantages")
    # Non-finite values kept: a NaN advantage is drawn clear and labelled NaN, where a 0 would look trained on.
    return episode, turn, TokenAdvantages(tuple(tokens), tuple(float(v) for v in values))


# --------------------------------------------------------------------------- files
def _lines(path: Path) -> Iterable[tuple[int, str]]:
    """Non-blank lines with their 1-based numbers (undecodable bytes replaced)."""
    with path.open(encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            if line.strip():
                yield number, line


def _is_json(line: str) -> bool:
    try:
        parse_json(line)
    except json.JSONDecodeError:
        return False
    return True


def source_name(path: Path, folder: Path) -> str:
    """The name of a trajectories file of ``folder``: its stem (``step_000005``), or for a variant's file its
    path without ``.jsonl`` (``variants/sokoban-8x8/trajectories``), since every variant's file is
    ``trajectories.jsonl``."""
    relative = path.relative_to(folder).as_posix() if path.is_relative_to(folder) else path.name
    if relative.startswith(f"{VARIANTS_DIR}/"):
        return relative.removesuffix(".jsonl")
    return path.name.removesuffix(".jsonl")


def source_label(stem: str) -> tuple[str, int | None]:
    """What the page calls a trajectories file, and its training step: ``step_000005`` -> ``("step 5", 5)``,
    ``variants/NAME/trajectories`` -> ``("variant NAME", None)``."""
    if stem.startswith(f"{VARIANTS_DIR}/"):
        return f"variant {stem.split('/')[1]}", None
    if stem == "val_before_rl":
        return "validation before RL", 0
    if stem == "val_after_rl":
        return "validation after RL", None
    if stem == "trajectories":
        return "evaluation", None
    if stem == "demos_sample":
        return "SFT demos", None
    match = _STEP_FILE.fullmatch(stem)
    if match:
        return f"step {int(match.group(1))}", int(match.group(1))
    return stem, None


def read_source(path: Path, report_dir: Path, max_episodes: int, warnings: list[str],
                max_heatmap_tokens: int = DEFAULT_MAX_HEATMAP_TOKENS,
                max_turns: int | None = DEFAULT_MAX_TURNS) -> EpisodeSource:
    """The episodes of one trajectories file (the first ``max_episodes``), each to be drawn with at most
    ``max_turns`` of its turns (:func:`split_turns`; None draws all), with the token advantages of the first
    episodes that have at most ``max_heatmap_tokens`` of them together in the turns drawn.

    Problems (bad lines, missing images, advantages that fit no turn) are appended to ``warnings``, and so is
    a note where turns or advantages were left out to keep the page light.
    """
    stem = source_name(path, report_dir)
    label, step = source_label(stem)
    source = EpisodeSource(name=stem, label=label, step=step)
    resolver = ImageResolver(path.parent, report_dir)
    bad: list[str] = []
    unfinished = 0
    for number, line in _lines(path):
        if not line.endswith("\n") and not _is_json(line):
            unfinished = number  # only the last line can lack its newline: one its writer has not finished
            continue
        source.total += 1
        if len(source.episodes) >= max_episodes:
            continue
        try:
            source.episodes.append(parse_episode_line(line, stem, number - 1, resolver.urls))
        except ValueError as error:
            bad.append(f"line {number}: {error}")
    rel = path.relative_to(report_dir).as_posix()
    if bad:
        warnings.append(f"{rel}: {len(bad)} line(s) could not be read ({'; '.join(bad[:3])})")
    if unfinished:
        warnings.append(f"{rel}: line {unfinished} is cut short and left out (the run is still writing this file, "
                        "or stopped while it wrote it)")
    if resolver.missing:
        warnings.append(f"{rel}: {len(resolver.missing)} image(s) missing or outside the folder "
                        f"(first: {resolver.missing[0]!r})")
    non_finite = sum(episode.has_non_finite_reward for episode in source.episodes)
    if non_finite:
        warnings.append(f"{rel}: {non_finite} episode(s) have a NaN or infinite reward, shown as such (a reward "
                        "function returned one, or the sum of rewards overflowed)")
    non_finite = sum(episode.has_non_finite_figure for episode in source.episodes)
    if non_finite:
        warnings.append(f"{rel}: {non_finite} episode(s) have a NaN or infinite env figure (env_metrics), shown as "
                        "such")
    for episode in source.episodes:
        episode.max_shown_turns = max_turns
    cut = [episode for episode in source.episodes if episode.turn_parts[1]]
    if cut and max_turns is not None:
        warnings.append(f"{rel}: {len(cut)} episode(s) have more than {max_turns} turns (the longest "
                        f"{max(len(episode.turns) for episode in cut)}); each shows its first {(max_turns + 1) // 2} "
                        f"and last {max_turns // 2} (turnrl view --max-turns N shows more)")
    if source.total > len(source.episodes) + len(bad):
        warnings.append(f"{rel}: showing the first {max_episodes} of {source.total} episodes "
                        "(turnrl view --max-episodes N shows more)")
    advantages = advantages_path(path)
    if advantages.is_file():
        _attach_advantages(source, advantages, report_dir, warnings)
        for episode in cut:  # the turns not drawn take no share of the heatmap budget
            head, hidden, _ = episode.turn_parts
            for turn in episode.turns[len(head):len(head) + hidden]:
                turn.advantages = None
        _keep_heatmaps_within(source, max_heatmap_tokens, advantages.relative_to(report_dir).as_posix(), warnings)
    return source


def advantages_path(path: Path) -> Path:
    """The per-token advantages file beside the trajectories file ``path`` (which may not exist)."""
    return path.with_name(path.name.removesuffix(".jsonl") + ADVANTAGES_SUFFIX)


def _keep_heatmaps_within(source: EpisodeSource, max_tokens: int, name: str, warnings: list[str]) -> None:
    """Drop the token advantages of the episodes past the first ones with at most ``max_tokens`` of them, whole
    episodes at a time (an episode's heatmap is never cut between its turns); the file's colour scale stays."""
    used, kept, dropped = 0, 0, 0
    for episode in source.episodes:
        tokens = sum(len(turn.advantages.tokens) for turn in episode.turns if turn.advantages is not None)
        if not tokens:
            continue
        if dropped or used + tokens > max_tokens:
            for turn in episode.turns:
                turn.advantages = None
            dropped += 1
        else:
            used, kept = used + tokens, kept + 1
    if dropped:
        warnings.append(f"{name}: per-token advantages drawn for the first {kept} of {kept + dropped} episodes "
                        f"({used} tokens) to keep the page light (turnrl view --max-heatmap-tokens N draws more)")


def _attach_advantages(source: EpisodeSource, path: Path, report_dir: Path, warnings: list[str]) -> None:
    by_line = {episode.index: episode for episode in source.episodes}
    problems: list[str] = []
    scale = 0.0
    for number, line in _lines(path):
        try:
            episode_index, turn_index, values = parse_token_advantages(line)
        except ValueError as error:
            problems.append(f"line {number}: {error}")
            continue
        episode = by_line.get(episode_index)
        if episode is None:
            continue  # an episode past the ones shown
        if not 0 <= turn_index < len(episode.turns):
            problems.append(f"line {number}: episode {episode_index} has no turn {turn_index}")
            continue
        episode.turns[turn_index].advantages = values
        scale = max([scale, *(abs(v) for v in values.advantages if math.isfinite(v))])
    source.advantage_scale = scale
    if problems:
        warnings.append(f"{path.relative_to(report_dir).as_posix()}: {len(problems)} line(s) skipped "
                        f"({'; '.join(problems[:3])})")


def source_order(stem: str) -> tuple[int, int, str]:
    """Sort key of trajectories files: SFT demos, validation before RL, steps in order, after RL, the rest."""
    label, step = source_label(stem)
    rank = {"demos_sample": 0, "val_before_rl": 1, "val_after_rl": 3}.get(stem, 2 if step is not None else 4)
    return rank, step if step is not None else 0, stem


def trajectory_files(folder: Path, variants: Sequence[str] = ()) -> list[Path]:
    """The trajectories files of a run or evaluation folder, in page order; a variants evaluation's in the
    order of ``variants`` (the table's), then any other variant folder's by name."""
    candidates = [folder / "trajectories.jsonl", folder / "sft" / "demos_sample.jsonl"]
    trajectories_dir = folder / "trajectories"
    if trajectories_dir.is_dir():
        candidates += sorted(trajectories_dir.glob("*.jsonl"))
    files = [p for p in candidates if p.is_file() and not p.name.endswith(ADVANTAGES_SUFFIX)]
    files = sorted(files, key=lambda p: source_order(p.name.removesuffix(".jsonl")))
    found = {p.parent.name: p for p in sorted((folder / VARIANTS_DIR).glob("*/trajectories.jsonl")) if p.is_file()}
    ordered = [name for name in variants if name in found] + [name for name in found if name not in variants]
    return files + [found[name] for name in ordered]


def spread_step_files(files: Sequence[Path], max_step_files: int) -> tuple[list[Path], int]:
    """At most ``max_step_files`` of the training steps' files in ``files`` (page order, as from
    :func:`trajectory_files`), evenly spread from the first step to the last so that the page still shows the
    whole run; every other file (validation, SFT demos, evaluations) is kept. Returns the files kept, in order,
    and how many steps' files were left out.

    Raises:
        ValueError: ``max_step_files`` is below 1.
    """
    if max_step_files < 1:
        raise ValueError(f"max_step_files must be at least 1, got {max_step_files}")
    steps = [path for path in files if _STEP_FILE.fullmatch(path.name.removesuffix(".jsonl"))]
    if len(steps) <= max_step_files:
        return list(files), 0
    last = len(steps) - 1
    kept = {last} if max_step_files == 1 else {round(k * last / (max_step_files - 1)) for k in range(max_step_files)}
    dropped = {path for index, path in enumerate(steps) if index not in kept}
    return [path for path in files if path not in dropped], len(dropped)


def parse_metrics_line(line: str, keep_non_finite: bool = False) -> dict[str, float] | None:
    """One ``metrics.jsonl`` line as ``{name: value}`` with its integer ``step``; None for anything else.

    Non-numbers are left out, and so are null (how the log writes a non-finite value) and non-finite values,
    unless ``keep_non_finite``: then they are NaN, which a plot draws as a gap instead of a line across it.
    """
    try:
        record = parse_json(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(record, dict):
        return None
    step = record.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    values = {}
    for key, value in record.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value)):
            values[key] = float(value)
        elif keep_non_finite and (value is None or isinstance(value, float)):
            values[key] = math.nan
    values["step"] = float(step)
    return values


def read_metrics(path: Path, warnings: list[str] | None = None,
                 keep_non_finite: bool = False) -> list[dict[str, float]]:
    """The records of a ``metrics.jsonl`` (each with ``step``), unreadable lines left out; [] without the file.

    ``keep_non_finite``: see :func:`parse_metrics_line`.
    """
    if not path.is_file():
        return []
    records, bad = [], 0
    for _, line in _lines(path):
        record = parse_metrics_line(line, keep_non_finite)
        if record is None:
            bad += 1
        else:
            records.append(record)
    if bad and warnings is not None:
        warnings.append(f"{path.name}: {bad} line(s) could not be read")
    return records


# --------------------------------------------------------------------------- written by training
def token_advantage_records(
    input_ids: Sequence[Sequence[int]],
    loss_mask: Sequence[Sequence[float]],
    advantages: Sequence[Sequence[float]],
    turn_end_index: Sequence[Sequence[int]],
    episode: Sequence[int],
    turn: Sequence[int],
    decode: Callable[[int], str],
) -> list[dict[str, Any]]:
    """The ``.advantages.jsonl`` lines of one training batch (see the module docstring).

    Notation: b samples, s padded sequence length, t turns per sample. Pass the batch's tensors as
    nested lists (``tensor.tolist()``).

    Args:
        input_ids: Shape (b, s).
        loss_mask: Shape (b, s): 1 on sampled tokens.
        advantages: Shape (b, s): the advantage each token is trained with.
        turn_end_index: Shape (b, t): position of each turn's last sampled token, -1 for padding turns.
        episode: Shape (b,): the sample's line in the step's trajectories file.
        turn: Shape (b,): the turn of a one-turn sample, -1 for a whole trajectory.
        decode: token id -> its text (e.g. ``lambda i: tokenizer.decode([i])``).

    Returns:
        One dict per (episode, turn): sampled tokens up to and including each turn's end go to that turn.
    """
    records = []
    for row in range(len(input_ids)):
        ends = [e for e in turn_end_index[row] if e >= 0]
        first_turn = turn[row] if turn[row] >= 0 else 0
        start = 0
        for k, end in enumerate(ends):
            positions = [p for p in range(start, end + 1) if loss_mask[row][p] > 0]
            start = end + 1
            records.append({
                "episode": int(episode[row]),
                "turn": int(first_turn + k),
                "tokens": [decode(int(input_ids[row][p])) for p in positions],
                "advantages": [round(float(advantages[row][p]), 6) for p in positions],
            })
    return records


def write_token_advantages(path: Path, records: Iterable[dict[str, Any]]) -> Path:
    """Write ``records`` (from :func:`token_advantage_records`) as JSON lines to ``path``, whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in records))
    return path
