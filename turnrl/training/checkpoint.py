"""Checkpoints: HF-format model and tokenizer plus the trainer state for exact resume.

Layout of ``RUN_DIR/checkpoints/step_000100/`` (the run after its 100th step: steps count from 1, as in
``metrics.jsonl``):

    actor/               save_pretrained of the policy (LoRA: the adapters) and its tokenizer
    critic/              the critic's backbone and value head (PPO only)
    trainer_state.pt     optimizers, schedulers, RNG states, steps done

    config.yaml          the run's config.yaml as it was at this step (to restore a damaged one from)
    contents.json        every other file's size as saved, to tell a file deleted or cut short later

A checkpoint is written into ``step_N.tmp-PID-RANDOM`` (a name no other writer
uses), flushed to the disk and renamed when complete, and the ``latest`` pointer is
replaced atomically, so a crash or a power loss mid-save never leaves a half
checkpoint that resume would pick up; an earlier save of the same step (a resumed run saving the step it went
on from) is renamed aside, and deleted only once the new one is in place; a save
that fails part-way (a full disk, a file-size limit) stops with what to do and
leaves the previous checkpoint as it was. A checkpoint damaged
later (a file deleted or cut short) is found by :func:`checkpoint_problem`, and
:func:`resume_point` then falls back to the newest complete one.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import resource
import secrets
import shutil
import zipfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from turnrl.config import ConfigError, turnrl_command
from turnrl.files import atomic_write_text, fsync_path, parse_json, remove_unfinished_writes


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # One state a GPU the saving process saw; a run resumed where fewer are visible (another machine, or
        # CUDA_VISIBLE_DEVICES) restores the ones it has, where torch's set_rng_state_all fails on the first it lacks.
        for index, device_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(device_state, index)


def unique_tmp_name(step: int) -> str:
    """The folder checkpoint ``step`` is written into before it is renamed: ``step_000040.tmp-PID-RANDOM``, so
    that no two writers (a process and one left from an earlier session) ever share one."""
    return f"step_{step:06d}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


_DISK_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)

_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")
"""How the writers written in Rust word the errno of the write that failed: safetensors' (a ``SafetensorError``)
and tokenizers' (a fast tokenizer's ``tokenizer.json``: a plain ``Exception``). Neither keeps an ``errno``
attribute, so the message is all that says it was the disk."""


def _rust_errno(error: BaseException) -> int | None:
    """The errno in the message of a Rust writer's error (:data:`_RUST_OS_ERROR`), None for any other error: an
    ``Exception`` of no subclass is what tokenizers raises, where Python's own errors are of a subclass."""
    if not isinstance(error, SafetensorError) and type(error) is not Exception:
        return None
    found = _RUST_OS_ERROR.search(str(error))
    return int(found.group(1)) if found is not None else None


def disk_error_cause(error: BaseException) -> str | None:
    """``No space left on device (...)``, ``File too large (...)`` (a file-size limit) or the quota's, when
    ``error`` or an error it was raised from carries that errno; None otherwise."""
    chained: BaseException | None = error
    while chained is not None:
        number = chained.errno if isinstance(chained, OSError) else _rust_errno(chained)
        if number is not None and number in _DISK_ERRNOS:
            return _disk_errno_text(number)
        chained = chained.__cause__ or chained.__context__
    return None


def _disk_errno_text(number: int) -> str:
    """The errno's words, with this process's file-size limit where that is what "file too large" means."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if number == errno.EFBIG and limit != resource.RLIM_INFINITY:
        return _limit_text(limit)
    return os.strerror(number)


def _limit_text(limit: int) -> str:
    size = f"{limit / 1e6:.1f} MB" if limit >= 100_000 else f"{limit:,} bytes"
    return f"this process may write files of at most {size} (its file-size limit, `ulimit -f`)"


def write_failure_cause(error: BaseException, folder: Path) -> str | None:
    """Why a write into ``folder`` failed, when the disk is the cause: the error's own errno (no space, file
    too large, quota), this process's file-size limit (``ulimit -f``) where a file in ``folder`` reached it, or a
    disk with (almost) no space left; None when none of these holds (a fault of another kind, whose traceback
    should be seen).

    torch's and safetensors' writers turn the disk's error into one of their own, without its errno, so the
    limit and the free space are looked at as well."""
    cause = disk_error_cause(error)
    if cause is not None:
        return cause
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and folder.is_dir() and any(
            path.is_file() and path.stat().st_size >= limit for path in folder.rglob("*")):
        return _limit_text(limit)
    existing = folder
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < 64 * 2**20:
        return f"{existing} has {free / 1e6:.1f} MB free"
    return None


def save_checkpoint(
    run_dir: Path,
    step: int,
    actor: Any,
    tokenizer: Any,
    trainer_state: dict[str, Any],
    critic: Any | None = None,
    before_publish: Callable[[Path], None] | None = None,
    config_yaml: str | None = None,
    tmp_name: str | None = None,
) -> Path:
    """Write checkpoint ``step`` (the run after ``step`` steps) atomically and point ``latest`` at it.

    ``before_publish(tmp_dir)`` writes more into the checkpoint before it is renamed into place (the
    optimizers' shards of a distributed run, whose processes all write into ``tmp_name``); ``config_yaml``,
    the run's settings, is kept with it as ``config.yaml``. The caller is the run directory's one writer
    (:class:`~turnrl.training.run_dir.RunLock`), so unfinished folders of earlier sessions are its to delete.

    A save that fails part-way, for whatever reason, deletes its unfinished folder (on a full disk it may hold
    the weights, gigabytes) and leaves ``latest`` on the previous checkpoint.

    Raises:
        ConfigError: the disk or a file-size limit stopped the write part-way (:func:`write_failure_cause`).
    """
    root = run_dir / "checkpoints"
    final = root / f"step_{step:06d}"
    root.mkdir(parents=True, exist_ok=True)
    restore_replaced(root)
    remove_unfinished_saves(root)
    remove_unfinished_writes(root)  # a ``latest`` being replaced when its session was killed
    tmp = root / (tmp_name or unique_tmp_name(step))
    with _written_whole(tmp, lambda cause: _save_failed(run_dir, step, cause)):
        tmp.mkdir()
        actor.save_pretrained(tmp / "actor")
        tokenizer.save_pretrained(tmp / "actor")
        if critic is not None:
            critic.save_pretrained(tmp / "critic")
        torch.save({**trainer_state, "steps_done": step, "rng": rng_state()}, tmp / "trainer_state.pt")
        if config_yaml is not None:
            (tmp / "config.yaml").write_text(config_yaml)
        if before_publish is not None:
            before_publish(tmp)
    replaced = _set_aside(final)
    try:
        _publish(tmp, final)
    except Exception as error:
        # The new checkpoint goes and the one it replaced comes back: ``latest`` still names the last checkpoint
        # it named, and no folder is left that it does not name (a full disk's space is freed).
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)
        if replaced is not None:
            os.replace(replaced, final)
        cause = disk_error_cause(error)
        if cause is None:
            raise
        raise _save_failed(run_dir, step, cause) from error
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return final


def remove_unfinished_saves(root: Path) -> list[Path]:
    """Delete the folders of checkpoints whose save was killed before it renamed them into place
    (``step_000040.tmp-PID-RANDOM`` in ``root``, ``RUN_DIR/checkpoints``): never complete, they are read by
    nothing, and may hold gigabytes of weights. The caller is the run directory's one writer.

    Returns:
        The deleted folders.
    """
    left = sorted(path for path in root.glob("step_*.tmp*") if path.is_dir()) if root.is_dir() else []
    for path in left:
        shutil.rmtree(path, ignore_errors=True)
    return left


@contextmanager
def _written_whole(tmp: Path, refused: Callable[[str], ConfigError]) -> Iterator[None]:
    """The block writes a folder into ``tmp``; then its list of files (:data:`CONTENTS_FILE`) is written and
    everything flushed to the disk (:func:`_sync_tree`), ready to be renamed into place. A write that fails, for
    whatever reason, deletes ``tmp`` (on a full disk it may hold gigabytes); one the disk or a limit stopped
    (:func:`write_failure_cause`) raises ``refused(cause)``, the one line of what to do, any other its own error."""
    try:
        yield
        write_contents(tmp)
        _sync_tree(tmp)
    except Exception as error:  # any writer's: torch's zip writer says "unexpected pos", tokenizers' a plain one
        cause = write_failure_cause(error, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if cause is None:
            raise
        raise refused(cause) from error


def _publish(tmp: Path, final: Path) -> None:
    """Rename the written checkpoint ``tmp`` to ``final`` and point ``latest`` at it."""
    root = final.parent
    os.replace(tmp, final)
    fsync_path(root)  # its new name on the disk before ``latest`` names it and older checkpoints are pruned
    pointer = root / "latest"
    if pointer.is_dir() and not pointer.is_symlink():  # made by hand: a file cannot be renamed over it
        shutil.rmtree(pointer)
    atomic_write_text(pointer, final.name)


def _save_failed(run_dir: Path, step: int, cause: str) -> ConfigError:
    """The one line a checkpoint that the disk (``cause``) stopped ends the run with: what to do, and the
    checkpoint to go on from."""
    latest = latest_checkpoint(run_dir)
    then = (f", then continue from {latest.name} (intact) with `{turnrl_command()} train resume={run_dir}`"
            if latest is not None else " (no earlier checkpoint was saved)")
    return ConfigError(f"checkpoint after step {step} could not be written: {cause}. Free some space, raise the "
                       f"limit, or put run.output_dir on a larger disk{then}")


def save_reference(reference: Any, path: Path) -> None:
    """Write the KL term's frozen reference model to ``path`` (``RUN_DIR/reference``) as a checkpoint is written:
    into a folder of its own name, with its list of files (:data:`CONTENTS_FILE`), flushed to the disk and then
    renamed, so that a run killed or cut off by the disk mid-write leaves no reference a resume would read half of.

    Raises:
        ConfigError: the disk or a file-size limit stopped the write (:func:`write_failure_cause`).
    """
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    for leftover in path.parent.glob(f"{path.name}.tmp-*"):  # runs killed mid-write
        shutil.rmtree(leftover, ignore_errors=True)
    with _written_whole(tmp, lambda cause: ConfigError(
            f"the KL reference model could not be written to {path}: {cause}. Free some space, raise the limit, or "
            "put run.output_dir on a larger disk, then start the run again")):
        reference.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)  # a fresh start's: what an earlier start left there
    os.replace(tmp, path)
    fsync_path(path.parent)


def reference_problem(path: Path) -> str | None:
    """What keeps the reference model saved at ``path`` (:func:`save_reference`) from loading, in a few words; None
    if nothing."""
    return _model_problem(path, path.name) or _contents_problem(path, lambda name: True)


def _sync_tree(folder: Path) -> None:
    """Flush every file under ``folder`` and the folders themselves to the disk (``fsync``).

    A checkpoint is renamed into place and named by ``latest`` once written, and older ones are then pruned; the
    disk keeps the files' bytes only some seconds later (ext4 allocates them up to 30 s after the write), so a
    power loss in between would leave ``latest`` naming a checkpoint of empty files, and no older one to go back
    to. A disk that fails to store them (full, as some only say when flushing) raises here, before the rename."""
    for path in sorted(folder.rglob("*"), reverse=True):  # files before the folders that name them
        if path.is_file() or path.is_dir():
            fsync_path(path)
    fsync_path(folder)



_REPLACED = ".replaced-"
"""In the name of a checkpoint set aside while a new save of its step takes its place:
``step_000040.replaced-PID-RANDOM``."""


def _set_aside(final: Path) -> Path | None:
    """Rename an earlier save of ``final``'s step (a resumed run saving the step it resumed from) out of the way,
    in one step; returns its new name, None where there was none.

    Deleting it first would leave no whole checkpoint of the step for as long as the deletion takes (seconds for
    large weights, more on a network filesystem, or for good where a file held open refuses it), and it may be
    the run's only checkpoint: a kill meanwhile loses it. Renamed, it stays whole until the new one is in
    place and ``latest`` names it (:func:`restore_replaced` puts it back after a kill in between)."""
    if not final.exists():
        return None
    aside = final.with_name(f"{final.name}{_REPLACED}{os.getpid()}-{secrets.token_hex(4)}")
    os.replace(final, aside)
    return aside


def restore_replaced(root: Path) -> list[Path]:
    """Settle the checkpoints that a save killed while it replaced them left set aside (:func:`_set_aside`) in
    ``root`` (``RUN_DIR/checkpoints``): one whose step has no checkpoint (the kill came before the new one took
    its name) gets its name back, the others are deleted. The caller is the run directory's one writer.

    Returns:
        The checkpoints given their names back.
    """
    restored = []
    for aside in sorted(root.glob(f"step_*{_REPLACED}*")) if root.is_dir() else []:
        final = aside.with_name(aside.name.split(_REPLACED, 1)[0])
        if aside.is_dir() and not final.exists():
            os.replace(aside, final)
            restored.append(final)
        else:
            shutil.rmtree(aside, ignore_errors=True)
    return restored


def checkpoint_bytes(models: Sequence[torch.nn.Module]) -> int:
    """About the bytes a checkpoint of ``models`` takes: each model's saved weights in their dtype (a LoRA
    model saves its adapters alone) and AdamW's two float32 moments for each trained parameter. At 7B with a
    critic that is some 180 GB (float32 weights of both, 16 bytes a parameter of optimizer states)."""
    from peft import PeftModel

    total = 0
    for model in models:
        saved_only_trained = isinstance(model, PeftModel)
        for param in model.parameters():
            if param.requires_grad or not saved_only_trained:
                total += param.numel() * param.element_size()
            if param.requires_grad:
                total += 2 * 4 * param.numel()
    return total


def disk_space_problem(root: Path, needed: int, margin: float = 1.05) -> str | None:
    """Why a checkpoint of ``needed`` bytes would not fit under ``root`` (the disk's free space, with a margin
    for tokenizer and trainer files), or None when it fits. A save that runs out of space mid-way fails after
    minutes of writing and leaves a partial ``.tmp`` folder, so a run checks first."""
    existing = root
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free >= needed * margin:
        return None
    return (f"a checkpoint needs about {needed / 1e9:.1f} GB and {existing} has {free / 1e9:.1f} GB free: free "
            "some space, put run.output_dir on a larger disk, keep fewer checkpoints (run.keep_checkpoints), or "
            "set run.save_at_end=false where the weights are not needed")


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Steps of the complete checkpoints of a run, oldest first (unfinished ``.tmp`` saves left out)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        name = path.name
        if path.is_dir() and name.startswith("step_") and name[5:].isdigit():
            steps.append(int(name[5:]))
    return sorted(steps)


def prune_checkpoints(run_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints (0 keeps all); the one ``latest`` names always stays.

    Returns:
        The deleted checkpoint directories.
    """
    if keep <= 0:
        return []
    latest = latest_checkpoint(run_dir)
    deleted = []
    for step in checkpoint_steps(run_dir)[:-keep]:
        path = run_dir / "checkpoints" / f"step_{step:06d}"
        if latest is not None and path == latest:
            continue
        shutil.rmtree(path, ignore_errors=True)
        deleted.append(path)
    return deleted


def checkpoint_step(checkpoint: Path) -> int:
    """The step of a checkpoint directory: ``step_000040`` (40, the run after its 40th step)."""
    return int(checkpoint.name.removeprefix("step_"))


_CHECKPOINT_NAME = re.compile(r"step_\d+")


def latest_name(run_dir: Path) -> str | None:
    """The checkpoint name ``checkpoints/latest`` holds (``step_000040``); None when there is no such file or it
    holds no checkpoint's name (empty, not text, anything else: a pointer damaged by hand or by the disk)."""
    try:
        name = (run_dir / "checkpoints" / "latest").read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):  # no file, a directory, bytes that are not text
        return None
    return name if _CHECKPOINT_NAME.fullmatch(name) else None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names (the last one saved), None without one."""
    name = latest_name(run_dir)
    if name is None:
        return None
    path = run_dir / "checkpoints" / name
    return path if path.is_dir() else None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    # Our own file: optimizer states and RNG states need full unpickling.
    return torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False)


def steps_done(trainer_state: dict[str, Any]) -> int:
    """How many steps the run had finished when it saved ``trainer_state``."""
    if "steps_done" in trainer_state:
        return int(trainer_state["steps_done"])
    # Saved before checkpoints were named by steps done: "step" is the last step's index, counted from 0.
    return int(trainer_state["step"]) + 1


def _torch_file_problem(path: Path, name: str) -> str | None:
    """What is wrong with a ``torch.save`` file (a zip archive whose index is at its end), None if nothing."""
    if not path.is_file():
        return f"no {name}"
    try:
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError) as error:
        return f"{name} is damaged: {error}"


def _json_object_problem(path: Path, name: str) -> str | None:
    """What keeps ``path`` from being read as a JSON object (a settings file of a saved model), None if nothing:
    transformers stops with its own traceback on a config or tokenizer file cut short."""
    if not path.is_file():
        return f"no {name}"
    try:
        content = parse_json(path.read_bytes())
    except (OSError, ValueError) as error:  # ValueError: not JSON, not UTF-8
        return f"{name} is damaged: {' '.join(str(error).split())[:120]}"
    return None if isinstance(content, dict) else f"{name} is damaged: not a JSON object"


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""What a saved tokenizer's vocabulary is in (a fast tokenizer, sentencepiece, a BPE vocabulary): one is there."""

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json")
"""Where a saved processor keeps its settings beside the tokenizer's (a VLM's image processor), as transformers
releases name them. Each one there must read: ``load_processor`` takes a damaged one for a model without a
processor, so the resumed run would go on without images and save its next checkpoints without them."""


def _model_problem(directory: Path, name: str, tokenizer: bool = False) -> str | None:
    """What keeps a ``save_pretrained`` directory (a model, or LoRA adapters) from loading, None if nothing.

    Its config (a JSON object) and every weights file must be there, each with a safetensors header that covers
    the whole file (a file cut short fails that); with ``tokenizer``, a full model's tokenizer too, and its
    processor's settings where it has a processor (a resumed run loads them from there; LoRA adapters resume with
    the tokenizer and processor of the model under them).
    """
    if not directory.is_dir():
        return f"no {name}/"
    adapters = (directory / "adapter_config.json").is_file()
    settings = ["adapter_config.json" if adapters else "config.json"]
    if tokenizer and not adapters:
        settings.append("tokenizer_config.json")
        if not any((directory / file).is_file() for file in TOKENIZER_FILES):
            return f"no {name}/tokenizer.json"
        if (directory / "tokenizer.json").is_file():
            settings.append("tokenizer.json")
    if tokenizer and not adapters:  # a processor is optional (a text model has none): read where it is there
        settings += [file for file in PROCESSOR_FILES if (directory / file).exists()]
    for file in settings:
        problem = _json_object_problem(directory / file, f"{name}/{file}")
        if problem is not None:
            return problem
    if tokenizer and not adapters:
        problem = _chat_template_problem(directory, name)
        if problem is not None:
            return problem
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(parse_json(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            return f"{name}/{index.name} is damaged: {error}"
    else:
        files = ["adapter_model.safetensors" if adapters else "model.safetensors"]
    for file in files:
        path = directory / file
        if not path.is_file():
            return f"no {name}/{file}"
        try:
            with safe_open(path, framework="pt"):
                pass
        except (SafetensorError, OSError) as error:
            return f"{name}/{file} is damaged: {error}"
    return None


def _chat_template_problem(directory: Path, name: str) -> str | None:
    """What keeps a saved tokenizer's chat template from being read, None if nothing: every prompt of a run is
    rendered with it, and transformers saves it beside the tokenizer (``chat_template.jinja``), in its settings
    (``tokenizer_config.json``, older releases) or as ``chat_template.json``."""
    settings = parse_json((directory / "tokenizer_config.json").read_bytes())
    if isinstance(settings.get("chat_template"), (str, list)):
        return None
    jinja, legacy = directory / "chat_template.jinja", directory / "chat_template.json"
    if jinja.is_file():
        try:
            text = jinja.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError) as error:
            return f"{name}/{jinja.name} is damaged: {error}"
        return None if text.strip() else f"{name}/{jinja.name} is damaged: empty"
    if legacy.is_file():
        return _json_object_problem(legacy, f"{name}/{legacy.name}")
    return f"no {name}/{jinja.name} (the tokenizer's chat template)"


CONTENTS_FILE = "contents.json"
"""A checkpoint's list of its files and their sizes as saved (``{"actor/model.safetensors": 1234, ...}``): a file
deleted later (a processor's settings, which a model without a processor lacks anyway) or cut short (a chat
template, whose every prefix is text) is told by it, where reading the file alone cannot tell it."""

_UNLISTED = {CONTENTS_FILE, "config.yaml", "trainer_state.pt"}
"""Left out of the list: the list itself; the copy of the run's settings, a spare that is read only where it
reads (:func:`~turnrl.training.run_dir.saved_config`) and that a user may mend; and the trainer's state, whose
archive tells a cut itself (its index is at its end) and whose contents the resume checks, naming the file."""


def write_contents(folder: Path) -> None:
    """Write :data:`CONTENTS_FILE` into a checkpoint ``folder`` whose files are all written."""
    sizes = {path.relative_to(folder).as_posix(): path.stat().st_size
             for path in sorted(folder.rglob("*")) if path.is_file() and path.name not in _UNLISTED}
    (folder / CONTENTS_FILE).write_text(json.dumps(sizes, indent=1))


def _contents_problem(checkpoint: Path, parts: Callable[[str], bool]) -> str | None:
    """The first file :data:`CONTENTS_FILE` lists, of those ``parts`` takes (by the path it lists), that is not
    there or not of the size saved, in a few words (``no actor/processor_config.json``); None where all are, or
    where the checkpoint keeps no list (saved before it did: its other checks are all there is)."""
    listed = checkpoint / CONTENTS_FILE
    if not listed.exists():
        return None
    problem = _json_object_problem(listed, CONTENTS_FILE)
    if problem is not None:
        return problem
    sizes = parse_json(listed.read_bytes())
    for name, size in sizes.items():
        if not parts(name):
            continue
        if not name.isprintable() or isinstance(size, bool) or not isinstance(size, int):
            return f"{CONTENTS_FILE} is damaged: it lists {name!r} of size {size!r}"[:200]
        path = checkpoint / name
        if not path.is_file():
            return f"no {name}"
        now = path.stat().st_size
        if now != size:
            return f"{name} is damaged: {now:,} bytes, saved as {size:,}"
    return None


def checkpoint_problem(checkpoint: Path, critic: bool = False) -> str | None:
    """What keeps ``checkpoint`` from being resumed, in a few words (``no trainer_state.pt``); None if nothing.

    A complete checkpoint holds ``trainer_state.pt`` (a readable ``torch.save`` archive), ``actor/`` (and
    ``critic/`` with its ``value_head.pt`` when the run has a critic) with its config and whole weights files,
    and the actor's tokenizer with its chat template (and its processor's settings, where it has a processor);
    and every file :data:`CONTENTS_FILE` lists, of the size it lists.
    Cheap: only file names and sizes, the settings files (JSON), the archive's index and the safetensors headers
    are read, no tensor.
    """
    if not checkpoint.is_dir():
        return "not there"
    problem = _torch_file_problem(checkpoint / "trainer_state.pt", "trainer_state.pt")
    problem = problem or _model_problem(checkpoint / "actor", "actor", tokenizer=True)
    if critic:
        problem = problem or _model_problem(checkpoint / "critic", "critic")
        problem = problem or _torch_file_problem(checkpoint / "critic" / "value_head.pt", "critic/value_head.pt")
    # A run without a critic (resumed with another estimator) needs none of the critic's files.
    return problem or _contents_problem(checkpoint, lambda name: critic or not name.startswith("critic/"))


def _actor_problem(checkpoint: Path) -> str | None:
    """What keeps ``checkpoint``'s actor (its weights, tokenizer and processor) from loading, None if nothing."""
    return (_model_problem(checkpoint / "actor", "actor", tokenizer=True)
            or _contents_problem(checkpoint, lambda name: name.startswith("actor/")))


def newest_whole_actor(run_dir: Path) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names, else the newest one by step, whose actor is whole (its config,
    weights and tokenizer, as :func:`checkpoint_problem` checks them): what an evaluation of the run plays, which
    needs no more of a checkpoint. None when no checkpoint's actor is."""
    root = run_dir / "checkpoints"
    names = [latest_name(run_dir), *(f"step_{step:06d}" for step in reversed(checkpoint_steps(run_dir)))]
    return next((root / name for name in names if name is not None and _actor_problem(root / name) is None), None)


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run continues: the checkpoint ``latest`` names when complete, else the newest complete one."""

    checkpoint: Path | None
    """The checkpoint to load; None when the run holds no complete one."""
    note: str | None
    """One line: why ``checkpoint`` is not the one ``latest`` names, or (``checkpoint`` None) what is broken."""


def resume_point(run_dir: Path, critic: bool = False) -> ResumePoint:
    """The checkpoint a resumed run loads (see :class:`ResumePoint`; ``critic``: the run has one).

    A checkpoint ``latest`` names is the run's last save; when that pointer is missing, names a checkpoint that
    is not there, or names a damaged one, the newest complete checkpoint (by step) is as good a place to go on
    from: the resumed run repeats the steps after it exactly.
    """
    root = run_dir / "checkpoints"
    pointer = root / "latest"
    named = latest_name(run_dir) or ""
    steps = [f"step_{step:06d}" for step in reversed(checkpoint_steps(run_dir))]
    if not named and not steps:
        return ResumePoint(None, f"{root} holds no checkpoint" if root.is_dir() else f"there is no {root}")
    if named:
        problem = checkpoint_problem(root / named, critic)
        if problem is None:
            return ResumePoint(root / named, None)
        why = (f"checkpoints/latest names {named}, which is not there" if problem == "not there" else
               f"{named}, the checkpoint checkpoints/latest names, is incomplete ({problem})")
    else:
        why = ("checkpoints/latest holds no checkpoint's name (damaged)" if pointer.exists() or pointer.is_symlink()
               else "there is no checkpoints/latest")
    broken = []
    for name in steps:
        if name == named:
            continue
        problem = checkpoint_problem(root / name, critic)
        if problem is None:
            return ResumePoint(root / name, f"{why}; resuming from {name}, the newest complete checkpoint")
        broken.append(f"{name} is incomplete ({problem})")
    return ResumePoint(None, "; ".join([why, *broken]))
