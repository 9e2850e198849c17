"""Files written whole: replaced whole or not at all, with a plain write's permissions, and a killed writer's
temporary files found and removed; JSON and YAML read with every failure the parser's own error."""

from __future__ import annotations

import errno
import json
import os

import pytest
import yaml
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.hostile_text import OPENINGS, too_deep
from turnrl import files
from turnrl.files import TOO_DEEP, atomic_write_text, parse_json, parse_yaml, remove_unfinished_writes


@pytest.mark.parametrize("umask", [0o022, 0o002])  # 0o077 would equal mkstemp's own 0o600
def test_a_file_replaced_whole_gets_the_permissions_a_plain_write_gives(tmp_path, umask):
    """config.yaml, summary.json and ``latest`` are written through a temporary file: they must be readable by
    whom a plain write lets read them (the group sharing a run directory), not by their owner alone."""
    before = os.umask(umask)
    try:
        (tmp_path / "plain").write_text("x")
        atomic_write_text(tmp_path / "config.yaml", "run: {}\n")
        atomic_write_text(tmp_path / "config.yaml", "run: {steps: 2}\n")  # replacing an existing file
    finally:
        os.umask(before)
    assert (tmp_path / "config.yaml").stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777
    assert (tmp_path / "config.yaml").stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_write_the_disk_refuses_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "step_000001.jsonl"
    atomic_write_text(path, '{"episode": 0}\n')

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        atomic_write_text(path, '{"episode": 0}\n{"episode": 1}\n')
    assert path.read_text() == '{"episode": 0}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_killed_writers_temporary_files_are_removed_and_nothing_else(tmp_path):
    left = [tmp_path / ".config.yaml.123.k2j3h4.tmp", tmp_path / ".step_000002.jsonl.9.abcdefgh.tmp"]
    kept = [tmp_path / "config.yaml", tmp_path / ".hidden", tmp_path / "notes.tmp", tmp_path / ".a.tmp"]
    for path in left + kept:
        path.write_text("x")
    (tmp_path / ".folder.1.x.tmp").mkdir()  # a folder is never a temporary file of this module
    assert sorted(remove_unfinished_writes(tmp_path)) == sorted(left)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([p.name for p in kept] + [".folder.1.x.tmp"])
    assert remove_unfinished_writes(tmp_path / "missing") == []


@settings(max_examples=100, deadline=None)
@given(text=st.text())
@example(text='{"step": 1, "a": ' + too_deep() + "]")
def test_any_text_is_json_or_a_json_error(text):
    """JSON's parser raises RecursionError past the recursion limit; ``parse_json`` raises its own error there, which
    every reader of a damaged file or a peer's answer catches."""
    try:
        parse_json(text)
    except json.JSONDecodeError:
        pass
    try:
        parse_json(text.encode("utf-8", "surrogatepass"))
    except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
        pass


@settings(max_examples=100, deadline=None)
@given(text=st.text())
@example(text="run:\n  a: " + too_deep("{a: "))
def test_any_text_is_yaml_or_a_yaml_error(text):
    try:
        parse_yaml(text)
    except yaml.YAMLError:
        pass


@pytest.mark.parametrize("opening", OPENINGS)
def test_nesting_too_deep_is_said_as_such(opening):
    with pytest.raises(yaml.YAMLError, match=TOO_DEEP):
        parse_yaml(too_deep(opening))
    if opening.startswith(("[", '{"')):
        with pytest.raises(json.JSONDecodeError, match=TOO_DEEP):
            parse_json(too_deep(opening))
