"""Checkpoints: an atomic layout with a ``latest`` pointer, HF-format weights, and RNG states that resume exactly."""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.hostile_text import too_deep
from turnrl.config import ConfigError
from turnrl.training import checkpoint
from turnrl.training.checkpoint import (
    ResumePoint,
    checkpoint_bytes,
    checkpoint_problem,
    checkpoint_step,
    checkpoint_steps,
    disk_space_problem,
    latest_checkpoint,
    load_trainer_state,
    prune_checkpoints,
    resume_point,
    rng_state,
    save_checkpoint,
    set_rng_state,
    steps_done,
)
from turnrl.training.model_passes import ValueModel
from turnrl.training.run_dir import RunLock


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def leftovers(root):
    return sorted(p.name for p in root.rglob("*") if p.name.endswith(".tmp"))


def test_checkpoint_layout_and_latest_pointer(actor, tiny_tokenizer, tmp_path):
    critic = ValueModel(copy.deepcopy(actor.base_model))
    path = save_checkpoint(tmp_path, 3, actor, tiny_tokenizer, {"note": "x"}, critic=critic)
    assert path == tmp_path / "checkpoints" / "step_000003"
    assert (path / "actor" / "config.json").exists() and (path / "actor" / "tokenizer_config.json").exists()
    assert (path / "critic" / "value_head.pt").exists() and (path / "trainer_state.pt").exists()
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000003"
    assert latest_checkpoint(tmp_path) == path
    assert leftovers(tmp_path) == []
    state = load_trainer_state(path)
    assert state["steps_done"] == 3 and state["note"] == "x" and set(state["rng"]) >= {"python", "numpy", "torch"}


def test_checkpoint_actor_and_tokenizer_load_with_plain_transformers(actor, tiny_tokenizer, tmp_path):
    path = save_checkpoint(tmp_path, 0, actor, tiny_tokenizer, {})
    loaded = AutoModelForCausalLM.from_pretrained(path / "actor", dtype=torch.float32)
    assert all(torch.equal(p, actor.state_dict()[k]) for k, p in loaded.state_dict().items())
    tokenizer = AutoTokenizer.from_pretrained(path / "actor")
    text = "<answer>Left</answer>"
    assert tokenizer.encode(text) == tiny_tokenizer.encode(text)
    assert tokenizer.chat_template == tiny_tokenizer.chat_template
    assert not (path / "critic").exists()


def test_latest_moves_to_the_newest_save_and_a_resave_replaces_the_step(actor, tiny_tokenizer, tmp_path):
    save_checkpoint(tmp_path, 1, actor, tiny_tokenizer, {"version": 1})
    save_checkpoint(tmp_path, 2, actor, tiny_tokenizer, {"version": 2})
    assert latest_checkpoint(tmp_path).name == "step_000002"
    save_checkpoint(tmp_path, 1, actor, tiny_tokenizer, {"version": 3})
    assert latest_checkpoint(tmp_path).name == "step_000001"  # latest is the last save, not the largest step
    assert load_trainer_state(tmp_path / "checkpoints" / "step_000001")["version"] == 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000001", "step_000002"]


class Killed(BaseException):
    """A kill landing at a chosen point of a save: nothing after it runs."""


def test_a_resave_killed_while_the_old_copy_goes_leaves_the_step_whole(actor, tiny_tokenizer, tmp_path,
                                                                          monkeypatch):
    """A resumed run saves the step it resumed from again (it stops before its first step ends, or its run.steps is
    that step). That checkpoint may be the run's only one: a kill while its old copy is deleted must not lose it."""
    save_checkpoint(tmp_path, 1, actor, tiny_tokenizer, {"version": 1})
    delete = shutil.rmtree

    def killed_midway(path, *args, **kwargs):
        weights = Path(path) / "actor" / "model.safetensors"
        if weights.is_file():  # a checkpoint's: its weights go, then the kill comes
            weights.unlink()
            raise Killed
        delete(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_midway)
    with pytest.raises(Killed):
        save_checkpoint(tmp_path, 1, actor, tiny_tokenizer, {"version": 2})
    monkeypatch.undo()
    point = resume_point(tmp_path)
    assert point == ResumePoint(tmp_path / "checkpoints" / "step_000001", None)
    assert load_trainer_state(point.checkpoint)["version"] == 2
    save_checkpoint(tmp_path, 2, actor, tiny_tokenizer, {})  # the next save deletes what the kill left
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000001", "step_000002"]


def test_a_resave_killed_before_the_new_copy_took_the_name_gets_the_old_one_back(actor, tiny_tokenizer, tmp_path,
                                                                                  monkeypatch):
    save_checkpoint(tmp_path, 1, actor, tiny_tokenizer, {"version": 1})
    rename = os.replace

    def killed_between(source, target):
        if ".tmp-" in Path(source).name and Path(target).name == "step_000001":
            raise Killed
        rename(source, target)

    monkeypatch.setattr(checkpoint.os, "replace", killed_between)
    with pytest.raises(Killed):
        save_checkpoint(tmp_path, 1, actor, tiny_tokenizer, {"version": 2})
    monkeypatch.undo()
    with RunLock(tmp_path):  # the writer that comes next (a resume) puts the old copy back first
        point = resume_point(tmp_path)
    assert point == ResumePoint(tmp_path / "checkpoints" / "step_000001", None)
    assert load_trainer_state(point.checkpoint)["version"] == 1


def test_a_save_that_fails_midway_leaves_latest_on_the_previous_checkpoint(actor, tiny_tokenizer, tmp_path,
                                                                          monkeypatch):
    save_checkpoint(tmp_path, 1, actor, tiny_tokenizer, {})

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 2, actor, tiny_tokenizer, {})
    assert latest_checkpoint(tmp_path).name == "step_000001"
    assert not (tmp_path / "checkpoints" / "step_000002").exists()
    monkeypatch.undo()
    save_checkpoint(tmp_path, 2, actor, tiny_tokenizer, {})  # the retry cleans the half-written copy
    assert latest_checkpoint(tmp_path).name == "step_000002" and leftovers(tmp_path) == []


def test_no_checkpoint_or_a_dangling_pointer_gives_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000009\n")
    assert latest_checkpoint(tmp_path) is None


def draws():
    return random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist(), torch.randint(0, 1000, (4,)).tolist()


def test_restored_rng_state_reproduces_the_random_draws(actor, tiny_tokenizer, tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    draws()
    path = save_checkpoint(tmp_path, 0, actor, tiny_tokenizer, {})
    expected = draws()
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    assert draws() != expected
    set_rng_state(load_trainer_state(path)["rng"])
    assert draws() == expected


def test_rng_state_round_trip_in_memory():
    state = rng_state()
    first = draws()
    set_rng_state(state)
    assert draws() == first


def test_a_run_saved_with_more_gpus_than_it_resumes_on_restores_the_gpus_it_has(monkeypatch):
    """A trainer state saved where two GPUs were visible, resumed where one is: GPU 0 takes its state, and the
    second state, for a GPU this process does not have, is left (torch's ``set_rng_state_all`` fails on it)."""
    restored: list[tuple[torch.Tensor, int]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((state, device)))
    saved = {**rng_state(), "cuda": [torch.full((8,), 1, dtype=torch.uint8), torch.full((8,), 2, dtype=torch.uint8)]}
    first = draws()
    set_rng_state(saved)
    assert draws() == first  # the host's generators as saved
    assert len(restored) == 1 and restored[0][1] == 0 and torch.equal(restored[0][0], saved["cuda"][0])


def test_keep_last_n_deletes_the_oldest_checkpoints_but_never_latest(actor, tiny_tokenizer, tmp_path):
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, actor, tiny_tokenizer, {})
    (tmp_path / "checkpoints" / "step_000009.tmp").mkdir()  # an unfinished save is not a checkpoint
    assert checkpoint_steps(tmp_path) == [1, 2, 3, 4]
    assert prune_checkpoints(tmp_path, 0) == []
    deleted = prune_checkpoints(tmp_path, 2)
    assert [p.name for p in deleted] == ["step_000001", "step_000002"]
    assert checkpoint_steps(tmp_path) == [3, 4] and latest_checkpoint(tmp_path).name == "step_000004"
    # A resumed run that re-saved an older step keeps it while ``latest`` names it.
    save_checkpoint(tmp_path, 2, actor, tiny_tokenizer, {})
    assert prune_checkpoints(tmp_path, 1) == [tmp_path / "checkpoints" / "step_000003"]
    assert checkpoint_steps(tmp_path) == [2, 4] and latest_checkpoint(tmp_path).name == "step_000002"
    assert checkpoint_steps(tmp_path / "nothing") == []
    assert checkpoint_step(latest_checkpoint(tmp_path)) == 2


def cut(path, keep=None):
    """Cut ``path`` short: to ``keep`` bytes, else by one."""
    os.truncate(path, os.path.getsize(path) - 1 if keep is None else keep)


def test_a_checkpoint_is_complete_with_its_state_config_and_whole_weights(actor, tiny_tokenizer, tmp_path):
    critic = ValueModel(copy.deepcopy(actor.base_model))
    path = save_checkpoint(tmp_path, 2, actor, tiny_tokenizer, {}, critic=critic)
    assert checkpoint_problem(path, critic=True) is None
    damage = [
        (lambda: (path / "trainer_state.pt").unlink(), "no trainer_state.pt"),
        (lambda: cut(path / "trainer_state.pt"), "trainer_state.pt is damaged"),
        (lambda: (path / "actor" / "model.safetensors").unlink(), "no actor/model.safetensors"),
        (lambda: cut(path / "actor" / "model.safetensors"), "actor/model.safetensors is damaged"),
        (lambda: cut(path / "actor" / "model.safetensors", keep=1000), "actor/model.safetensors is damaged"),
        (lambda: (path / "actor" / "config.json").unlink(), "no actor/config.json"),
        (lambda: (path / "actor" / "tokenizer.json").unlink(), "no actor/tokenizer.json"),
        (lambda: (path / "actor" / "tokenizer_config.json").unlink(), "no actor/tokenizer_config.json"),
        (lambda: shutil.rmtree(path / "critic"), "no critic/"),
        (lambda: (path / "critic" / "value_head.pt").unlink(), "no critic/value_head.pt"),
    ]
    for harm, problem in damage:
        shutil.copytree(path, tmp_path / "intact")
        harm()
        assert checkpoint_problem(path, critic=True).startswith(problem), problem
        shutil.rmtree(path)
        os.replace(tmp_path / "intact", path)
    shutil.rmtree(path / "critic")
    assert checkpoint_problem(path) is None  # a run without a critic saves none
    assert checkpoint_problem(tmp_path / "nowhere") == "not there"


def test_a_sharded_model_needs_every_shard_its_index_names(actor, tiny_tokenizer, tmp_path):
    path = save_checkpoint(tmp_path, 1, actor, tiny_tokenizer, {})
    shutil.rmtree(path / "actor")
    actor.save_pretrained(path / "actor", max_shard_size="200KB")
    tiny_tokenizer.save_pretrained(path / "actor")
    (path / checkpoint.CONTENTS_FILE).unlink()  # the checks of the files themselves, as for a checkpoint listing none
    shards = sorted((path / "actor").glob("model-*.safetensors"))
    assert len(shards) > 1 and checkpoint_problem(path) is None
    shards[-1].unlink()
    assert checkpoint_problem(path) == f"no actor/{shards[-1].name}"
    (path / "actor" / "model.safetensors.index.json").write_text("{")
    assert checkpoint_problem(path).startswith("actor/model.safetensors.index.json is damaged")


def test_resume_falls_back_to_the_newest_complete_checkpoint_and_says_why(actor, tiny_tokenizer, tmp_path):
    assert resume_point(tmp_path).note == f"there is no {tmp_path / 'checkpoints'}"
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, actor, tiny_tokenizer, {})
    root = tmp_path / "checkpoints"
    assert resume_point(tmp_path) == resume_point(tmp_path, critic=False)
    assert resume_point(tmp_path).checkpoint == root / "step_000003" and resume_point(tmp_path).note is None
    (root / "step_000003" / "trainer_state.pt").unlink()
    point = resume_point(tmp_path)
    assert point.checkpoint == root / "step_000002"
    assert point.note == ("step_000003, the checkpoint checkpoints/latest names, is incomplete (no trainer_state.pt); "
                          "resuming from step_000002, the newest complete checkpoint")
    (root / "latest").unlink()
    point = resume_point(tmp_path)
    assert point.checkpoint == root / "step_000002"
    assert point.note == "there is no checkpoints/latest; resuming from step_000002, the newest complete checkpoint"
    (root / "latest").write_text("step_000009\n")
    assert resume_point(tmp_path).note.startswith("checkpoints/latest names step_000009, which is not there; "
                                                  "resuming from step_000002")
    cut(root / "step_000002" / "actor" / "model.safetensors")
    shutil.rmtree(root / "step_000001" / "actor")
    point = resume_point(tmp_path)
    assert point.checkpoint is None
    assert point.note.startswith("checkpoints/latest names step_000009, which is not there; step_000003 is "
                                 "incomplete (no trainer_state.pt); step_000002 is incomplete "
                                 "(actor/model.safetensors is damaged: ")
    assert point.note.endswith("; step_000001 is incomplete (no actor/)") and "\n" not in point.note
    shutil.rmtree(root)
    root.mkdir()
    assert resume_point(tmp_path).note == f"{root} holds no checkpoint"


def test_steps_done_reads_checkpoints_named_by_their_last_step_index_too(actor, tiny_tokenizer, tmp_path):
    assert steps_done(load_trainer_state(save_checkpoint(tmp_path, 4, actor, tiny_tokenizer, {}))) == 4
    assert steps_done({"step": 39, "rng": {}}) == 40  # saved as step_000039 after 40 steps


def test_a_checkpoints_size_counts_saved_weights_and_adams_moments(actor, tiny_tokenizer, tmp_path):
    """Weights in their dtype for every parameter, AdamW's two float32 moments for each trained one; a LoRA
    model saves its adapters alone. The estimate is within 10% of what a save writes (its optimizer states
    stand in for a real AdamW's)."""
    from peft import LoraConfig, get_peft_model

    actor = copy.deepcopy(actor)  # the module's fixture stays untrained
    critic = ValueModel(copy.deepcopy(actor.base_model))
    weights = sum(p.numel() * 4 for p in actor.parameters()) + sum(p.numel() * 4 for p in critic.parameters())
    assert checkpoint_bytes([actor, critic]) == 3 * weights  # all trained, float32
    lora = get_peft_model(copy.deepcopy(actor), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    adapters = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert checkpoint_bytes([lora]) == 3 * 4 * adapters
    optimizers = [torch.optim.AdamW(m.parameters()) for m in (actor, critic)]
    for model, optimizer in zip((actor, critic), optimizers):
        model.zero_grad()
        sum(p.sum() for p in model.parameters()).backward()
        optimizer.step()
    path = save_checkpoint(tmp_path, 1, actor, tiny_tokenizer,
                           {"optimizers": [o.state_dict() for o in optimizers]}, critic=critic)
    written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert 0.9 < checkpoint_bytes([actor, critic]) / written < 1.1


def test_a_checkpoint_that_would_not_fit_is_refused_with_what_to_do(tmp_path, monkeypatch):
    free = {"bytes": 10 * 10**9}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - free["bytes"],
                                                                                 free["bytes"]))
    root = tmp_path / "run" / "checkpoints"  # not made yet: its nearest existing folder's disk is asked
    assert disk_space_problem(root, 9 * 10**9) is None
    problem = disk_space_problem(root, 180 * 10**9)
    assert problem is not None
    assert "180.0 GB" in problem and "10.0 GB free" in problem and str(tmp_path) in problem
    assert "run.save_at_end=false" in problem and "run.output_dir" in problem


def test_a_file_size_limit_is_blamed_only_where_a_file_reached_it(tmp_path, monkeypatch):
    """A finite ``ulimit -f`` is the cause of a failed checkpoint write only where a file of it reached the
    limit; another fault (a pickling error, say) keeps its own traceback."""
    import resource

    monkeypatch.setattr(checkpoint.resource, "getrlimit", lambda kind: (1000, resource.RLIM_INFINITY))
    folder = tmp_path / "step_000001.tmp"
    folder.mkdir()
    (folder / "small.bin").write_bytes(b"x" * 10)
    assert checkpoint.write_failure_cause(RuntimeError("cannot pickle"), folder) is None
    (folder / "trainer_state.pt").write_bytes(b"x" * 1000)  # cut at the limit
    assert "file-size limit" in checkpoint.write_failure_cause(RuntimeError("unexpected pos"), folder)


def test_a_tokenizer_the_disk_refuses_is_named_as_the_disk_and_leaves_no_folder(actor, tiny_tokenizer, tmp_path):
    """A fast tokenizer's ``tokenizer.json`` is written by tokenizers (Rust), whose error for a full disk or a file-size
    limit is a plain ``Exception`` ("File too large (os error 27)"): the save stops with the one line naming the
    limit, and its unfinished folder (the weights written before it: gigabytes on a full disk) is deleted."""
    import resource

    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(copy.deepcopy(actor), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    first = save_checkpoint(tmp_path, 1, lora, tiny_tokenizer, {})
    adapters = (first / "actor" / "adapter_model.safetensors").stat().st_size
    vocabulary = (first / "actor" / "tokenizer.json").stat().st_size
    assert adapters * 2 < vocabulary  # a limit between them stops the tokenizer, the first file over it
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, ((adapters + vocabulary) // 2, hard))
    try:
        with pytest.raises(ConfigError) as refused:
            save_checkpoint(tmp_path, 2, lora, tiny_tokenizer, {})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(refused.value).startswith("checkpoint after step 2 could not be written: this process may write "
                                         "files of at most ")
    assert "then continue from step_000001 (intact)" in str(refused.value)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert latest_checkpoint(tmp_path) == first and checkpoint_problem(first) is None


def test_only_a_rust_writers_error_is_read_for_its_errno():
    """Rust writers say the errno in their message alone; an error of Python's own that quotes one is not the disk."""
    from safetensors import SafetensorError

    full = "No space left on device (os error 28)"
    assert checkpoint.disk_error_cause(Exception(full)) == os.strerror(28)
    assert checkpoint.disk_error_cause(SafetensorError(f"Error while serializing: {full}")) == os.strerror(28)
    assert checkpoint.disk_error_cause(ValueError(full)) is None
    assert checkpoint.disk_error_cause(Exception("Permission denied (os error 13)")) is None
    try:
        try:
            raise Exception(full)
        except Exception as error:
            raise RuntimeError("could not save the tokenizer") from error
    except RuntimeError as chained:
        assert checkpoint.disk_error_cause(chained) == os.strerror(28)


@pytest.mark.parametrize("damage", ["emptied", "cut short"])
def test_a_vlm_checkpoint_whose_processor_settings_are_damaged_is_passed_over(tiny_vlm_dir, tmp_path, damage):
    """A VLM's checkpoint keeps its processor's settings (``processor_config.json``). Damaged (emptied, as a power
    loss leaves a file; cut short), ``load_processor`` reads no processor at all: the resumed run would go on
    without images and save its next checkpoints without them. The resume goes on from the intact one before."""
    from turnrl.models.loading import load_model, load_processor

    processor = load_processor(tiny_vlm_dir)
    assert processor is not None
    vlm = load_model(tiny_vlm_dir, device="cpu")
    for step in (1, 2):
        save_checkpoint(tmp_path, step, vlm, processor, {})
    root = tmp_path / "checkpoints"
    settings = root / "step_000002" / "actor" / "processor_config.json"
    assert resume_point(tmp_path).checkpoint == root / "step_000002"
    cut(settings, keep=0 if damage == "emptied" else settings.stat().st_size // 2)
    assert load_processor(settings.parent) is None  # what a resume from it would get
    assert checkpoint_problem(root / "step_000002").startswith("actor/processor_config.json is damaged: ")
    point = resume_point(tmp_path)
    assert point.checkpoint == root / "step_000001" and load_processor(point.checkpoint / "actor") is not None
    assert point.note.startswith("step_000002, the checkpoint checkpoints/latest names, is incomplete "
                                 "(actor/processor_config.json is damaged: ")


def test_a_checkpoint_is_on_the_disk_before_latest_names_it(actor, tiny_tokenizer, tmp_path, monkeypatch):
    """A power loss in the seconds after a save (ext4 stores the files' bytes up to 30 s after they are written)
    left ``latest`` naming a checkpoint of empty files, and the older ones pruned: no checkpoint to resume (seen
    on a copy of an ext4 disk taken 8 s after a save with run.keep_checkpoints=1). Every file and folder of the
    checkpoint is flushed before it takes its name, and its new name before ``latest`` names it."""
    save_checkpoint(tmp_path, 1, actor, tiny_tokenizer, {})
    flush, rename, events = os.fsync, os.replace, []

    def flushed(fd):
        events.append(("flushed", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        flush(fd)

    def renamed(source, target):
        events.append(("renamed", Path(source), Path(target)))
        rename(source, target)

    monkeypatch.setattr(os, "fsync", flushed)
    monkeypatch.setattr(os, "replace", renamed)
    final = save_checkpoint(tmp_path, 2, actor, tiny_tokenizer, {}, config_yaml="run: {steps: 2}\n")
    monkeypatch.undo()
    root = tmp_path / "checkpoints"
    into_place = next(i for i, event in enumerate(events) if event[0] == "renamed" and event[2] == final)
    tmp = events[into_place][1]
    before = {event[1] for event in events[:into_place] if event[0] == "flushed"}
    assert {tmp / path.relative_to(final) for path in final.rglob("*")} | {tmp} <= before
    pointer = next(i for i, event in enumerate(events) if event[0] == "renamed" and event[2] == root / "latest")
    assert ("flushed", root) in events[into_place:pointer]


@pytest.mark.parametrize("resaved", [False, True])
def test_a_full_disk_at_the_latest_pointer_stops_with_the_disk_line_and_leaves_latest_as_it_was(
        actor, tiny_tokenizer, tmp_path, monkeypatch, resaved):
    """The last write of a save is ``latest``'s, after the checkpoint took its name. A file-size limit that starts
    right there (a real ``RLIMIT_FSIZE``, lowered once the checkpoint's folder is renamed and flushed) stops the
    save with the one line the other writes give; the new checkpoint goes (a resave's earlier copy comes back),
    and ``latest`` names the checkpoint it named before."""
    import resource

    save_checkpoint(tmp_path, 1, actor, tiny_tokenizer, {"version": 1})
    root = tmp_path / "checkpoints"
    flush, limits = checkpoint.fsync_path, resource.getrlimit(resource.RLIMIT_FSIZE)

    def then_limited(path):
        flush(path)
        if path == root:  # the renamed checkpoint's name is on the disk: ``latest`` comes next
            resource.setrlimit(resource.RLIMIT_FSIZE, (4, limits[1]))

    monkeypatch.setattr(checkpoint, "fsync_path", then_limited)
    try:
        with pytest.raises(ConfigError) as refused:
            save_checkpoint(tmp_path, 1 if resaved else 2, actor, tiny_tokenizer, {"version": 2})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    monkeypatch.undo()
    assert str(refused.value).startswith(f"checkpoint after step {1 if resaved else 2} could not be written: this "
                                         "process may write files of at most 4 bytes")
    assert "then continue from step_000001 (intact)" in str(refused.value)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"] and leftovers(tmp_path) == []
    assert resume_point(tmp_path) == ResumePoint(root / "step_000001", None)
    assert load_trainer_state(root / "step_000001")["version"] == 1
    save_checkpoint(tmp_path, 2, actor, tiny_tokenizer, {})  # with room again, the run saves as before
    assert latest_checkpoint(tmp_path) == root / "step_000002"


def test_a_deleted_processor_or_a_cut_chat_template_makes_a_checkpoint_incomplete(tiny_vlm_dir, tmp_path):
    """A VLM's processor settings may be missing on a model that has none, and every prefix of a chat template is
    text: neither a deleted ``processor_config.json`` nor a template cut short can be told from the file alone
    (a resume went on without images, or rendered every prompt with half a template). The checkpoint's list of
    its files tells them, and the resume goes on from the intact checkpoint before, saying why."""
    from turnrl.models.loading import load_model, load_processor

    processor = load_processor(tiny_vlm_dir)
    vlm = load_model(tiny_vlm_dir, device="cpu")
    for step in (1, 2):
        save_checkpoint(tmp_path, step, vlm, processor, {})
    root = tmp_path / "checkpoints"
    newest = root / "step_000002"
    template = newest / "actor" / "chat_template.jinja"
    saved = template.stat().st_size
    damage = [
        (lambda: (newest / "actor" / "processor_config.json").unlink(), "no actor/processor_config.json"),
        (lambda: cut(template, keep=saved // 2), f"actor/chat_template.jinja is damaged: {saved // 2:,} bytes, "
                                                 f"saved as {saved:,}"),
        (lambda: cut(template), f"actor/chat_template.jinja is damaged: {saved - 1:,} bytes, saved as {saved:,}"),
    ]
    for harm, problem in damage:
        shutil.copytree(newest, tmp_path / "intact")
        harm()
        assert checkpoint_problem(newest) == problem
        point = resume_point(tmp_path)
        assert point.checkpoint == root / "step_000001"
        assert point.note == (f"step_000002, the checkpoint checkpoints/latest names, is incomplete ({problem}); "
                              "resuming from step_000001, the newest complete checkpoint")
        assert checkpoint.newest_whole_actor(tmp_path) == root / "step_000001"  # what an evaluation plays
        shutil.rmtree(newest)
        os.replace(tmp_path / "intact", newest)
    assert checkpoint_problem(newest) is None


def test_the_list_of_a_checkpoints_files_leaves_out_what_a_resume_does_not_need(actor, tiny_tokenizer, tmp_path):
    """The copy of the run's settings may be mended by hand; the trainer's state has checks of its own; a critic is
    needed only by a run that has one; a checkpoint saved before checkpoints listed their files is checked as
    before."""
    critic = ValueModel(copy.deepcopy(actor.base_model))
    path = save_checkpoint(tmp_path, 1, actor, tiny_tokenizer, {}, critic=critic, config_yaml="run: {steps: 1}\n")
    listed = json.loads((path / checkpoint.CONTENTS_FILE).read_text())
    assert "actor/model.safetensors" in listed and "critic/value_head.pt" in listed
    assert "config.yaml" not in listed and "trainer_state.pt" not in listed
    (path / "config.yaml").write_text("run: {steps: 10}\n")
    (path / "critic" / "config.json").unlink()
    assert checkpoint_problem(path) is None
    assert checkpoint_problem(path, critic=True) == "no critic/config.json"
    (path / checkpoint.CONTENTS_FILE).unlink()
    assert checkpoint_problem(path) is None
    (path / checkpoint.CONTENTS_FILE).write_text('{"trainer_state.pt": 1')
    assert checkpoint_problem(path).startswith("contents.json is damaged: ")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.one_of(st.binary(max_size=60), st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=12), inner, max_size=3),
    max_leaves=8).map(lambda value: json.dumps(value).encode())))
@example(content=too_deep().encode())
def test_a_damaged_list_of_files_is_told_never_raised(tmp_path, content):
    """Whatever ``contents.json`` holds (bytes a disk left, JSON of any shape, JSON nested deeper than its
    parser follows), the check says what is wrong in words, or nothing, and never stops with a traceback."""
    (tmp_path / "trainer_state.pt").write_bytes(b"x")
    (tmp_path / checkpoint.CONTENTS_FILE).write_bytes(content)
    problem = checkpoint._contents_problem(tmp_path, lambda name: True)
    assert problem is None or (isinstance(problem, str) and "\n" not in problem)


def test_the_reference_is_written_whole_or_not_at_all(actor, tmp_path, monkeypatch):
    """The KL term's reference is written as a checkpoint is: a folder of its own name renamed into place once it
    is whole and on the disk, with its list of files. A write the disk stops part-way (a file-size limit) is the one
    line of a full disk and leaves no folder, a reference cut or deleted later is told by its check, and a fresh
    start replaces what an earlier start left."""
    import errno

    path = tmp_path / "reference"
    real_save = type(actor).save_pretrained

    def then_full(self, folder, **kwargs):
        real_save(self, folder, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(type(actor), "save_pretrained", then_full)
    with pytest.raises(ConfigError) as refused:
        checkpoint.save_reference(actor, path)
    monkeypatch.undo()
    assert str(refused.value).startswith(f"the KL reference model could not be written to {path}: No space left "
                                         "on device. Free some space")
    assert "\n" not in str(refused.value) and list(tmp_path.iterdir()) == []

    (tmp_path / "reference.tmp-1-dead").mkdir()  # a run killed mid-write
    path.mkdir()
    (path / "config.json").write_text("{}")  # an earlier start's, replaced
    checkpoint.save_reference(actor, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["reference"]
    assert checkpoint.reference_problem(path) is None
    assert json.loads((path / checkpoint.CONTENTS_FILE).read_text()).keys() >= {"config.json", "model.safetensors"}
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), actor.state_dict().values()))
    weights = path / "model.safetensors"
    (path / "generation_config.json").unlink()  # no check of its own reads it: the list tells it
    assert checkpoint.reference_problem(path) == "no generation_config.json"
    size = weights.stat().st_size
    cut(weights, keep=size - 8)
    assert checkpoint.reference_problem(path).startswith("reference/model.safetensors is damaged: ")
    (path / "config.json").unlink()
    assert checkpoint.reference_problem(path) == "no reference/config.json"
