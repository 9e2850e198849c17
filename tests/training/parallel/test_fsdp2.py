"""Data-parallel training with FSDP2 on CPU processes (gloo): the same run as one process, within float error."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.training.reference_run import (
    ARGS,
    assert_same_metrics,
    failure_output,
    run_config,
    run_train,
    step_records,
    train_in_process,
)
from turnrl.config import ConfigError, load_config
from turnrl.models.loading import load_model
from turnrl.training.commands import train
from turnrl.training.run_dir import OWNER_FILE
from turnrl.training.parallel.fsdp2 import allocate, copy_full_weights, process_rows, structure_of
from turnrl.training.ppo import MicroBatching, Shard, shard_micro_batches, shard_rows
from turnrl.training.train_config import TrainConfig


# --------------------------------------------------------------------------- rows of a process
@given(st.integers(1, 60), st.integers(1, 5))
def test_process_rows_cover_the_batch_once_and_are_equal_in_count(n, world):
    parts = [process_rows(n, rank, world) for rank in range(world)]
    assert len({len(part) for part in parts}) == 1  # every process runs as many forward passes
    real = [part[: len(range(rank, n, world))] for rank, part in enumerate(parts)]
    assert sorted(torch.cat(real).tolist()) == list(range(n))


@given(st.integers(1, 40), st.integers(1, 4), st.integers(1, 6))
def test_micro_batches_of_the_processes_split_each_mini_batch(n, world, micro):
    mini = torch.randperm(n)
    lengths = torch.randint(1, 50, (n,))
    batching = MicroBatching(micro)
    shards = [Shard(rank, world, reduce=lambda d: d) for rank in range(world)]
    per_process = [shard_micro_batches(mini, lengths, batching, shard) for shard in shards]
    assert len({len(parts) for parts in per_process}) == 1  # the same passes everywhere (FSDP collectives)
    rows = [row for parts in per_process for part in parts if part is not None for row in part.tolist()]
    assert sorted(rows) == sorted(mini.tolist())
    assert all(part is None or len(part) <= micro for parts in per_process for part in parts)
    assert [p.tolist() for p in shard_micro_batches(mini, lengths, batching, None)] == [
        mini[i : i + micro].tolist() for i in range(0, n, micro)]


@given(st.integers(1, 40), st.integers(1, 4), st.integers(20, 200))
def test_packed_micro_batches_fit_the_token_budget_and_balance_the_processes(n, world, budget):
    mini = torch.randperm(n)
    lengths = torch.randint(1, 60, (n,))
    batching = MicroBatching(rows=1, tokens=budget)

    def count(rank: int) -> int:
        mine = shard_rows(mini, lengths, Shard(rank, world, reduce=lambda d: d), by_tokens=True)
        return len(batching.split(mine, lengths)) if len(mine) else 0

    most = max(count(rank) for rank in range(world))
    shards = [Shard(rank, world, reduce=lambda d: d, most=lambda _: most) for rank in range(world)]
    per_process = [shard_micro_batches(mini, lengths, batching, shard) for shard in shards]
    assert all(len(parts) == most for parts in per_process)
    rows = [row for parts in per_process for part in parts if part is not None for row in part.tolist()]
    assert sorted(rows) == sorted(mini.tolist())
    for part in (part for parts in per_process for part in parts if part is not None):
        assert len(part) == 1 or int(lengths[part].sum()) <= budget  # only a row over the budget runs alone
    tokens = [sum(int(lengths[p].sum()) for p in parts if p is not None) for parts in per_process]
    assert max(tokens) - min(tokens) <= int(lengths.max())  # dealt longest first: within one row's tokens


# --------------------------------------------------------------------------- the rollout copy
def test_a_copy_allocated_from_the_structure_and_filled_is_the_model(tiny_model_dir):
    """The rollout copy a sharded trainer makes: the actor's structure (no parameter memory), allocated in the
    compute dtype, filled parameter by parameter; its LM head stays tied and its rotary frequencies stay the
    model's float32 ones, so it computes what the model loaded in that dtype does, thousands of positions in."""
    model = load_model(tiny_model_dir).eval()
    structure = structure_of(model)
    assert all(p.is_meta for p in structure.parameters()) and not any(p.is_meta for p in model.parameters())
    copied = allocate(structure, torch.device("cpu"), torch.bfloat16)
    copy_full_weights(model, copied, every_parameter=True)
    assert copied.lm_head.weight is copied.model.embed_tokens.weight
    assert all(p.dtype == torch.bfloat16 for p in copied.parameters())
    for name, buffer in model.named_buffers():
        assert torch.equal(dict(copied.named_buffers())[name], buffer), name
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    positions = torch.arange(3000, 3006)[None]
    with torch.no_grad():
        expected = load_model(tiny_model_dir, dtype=torch.bfloat16)(input_ids=ids, position_ids=positions).logits
        torch.testing.assert_close(copied(input_ids=ids, position_ids=positions).logits, expected, rtol=0, atol=0)


def test_two_processes_train_as_one(tiny_model_dir, tmp_path, single):
    """Two gloo processes (started by ``distributed.nproc_per_node``) and one process: the same advantages,
    losses, gradient norms and weights after two PPO steps; the checkpoint is a transformers model."""
    double = run_train(tiny_model_dir, tmp_path, "double", "run.steps=2", "distributed.nproc_per_node=2")
    assert double.returncode == 0, double.stdout[-2000:] + double.stderr[-3000:]
    assert "2 processes (FSDP)" in " ".join(double.stdout.split())
    assert "did not run forward before backward" not in double.stderr  # the units FSDP wraps run together
    one, two = step_records(single), step_records(tmp_path / "double")
    assert sorted(one) == sorted(two) == [1, 2]
    for step in one:
        assert_same_metrics(one[step], two[step])
    assert one[2]["actor/advantage_abs_mean"] > 0 and one[2]["actor/grad_norm"] > 0  # a real update
    # Rank 0 alone writes: one metrics line per step, one trajectories file per step.
    assert len((tmp_path / "double" / "trajectories" / "step_000002.jsonl").read_text().splitlines()) == 8

    checkpoint = tmp_path / "double" / "checkpoints" / "step_000002"
    weights = load_file(checkpoint / "actor" / "model.safetensors")
    reference = load_file(single / "checkpoints" / "step_000002" / "actor" / "model.safetensors")
    assert weights.keys() == reference.keys()
    for name in weights:
        torch.testing.assert_close(weights[name], reference[name], rtol=1e-4, atol=1e-5)
    AutoModelForCausalLM.from_pretrained(checkpoint / "actor")  # a plain transformers model
    assert (checkpoint / "optimizer" / ".metadata").is_file()  # the optimizers' shards
    critic = load_file(checkpoint / "critic" / "model.safetensors")
    assert critic.keys() == load_file(single / "checkpoints" / "step_000002" / "critic" / "model.safetensors").keys()


def trained_as_one(model_dir: Path, tmp_path: Path, settings: Sequence[str], *only_two: str
                   ) -> tuple[dict[int, dict], dict[int, dict]]:
    """One process and two (with ``only_two`` as well) on ``settings``: both ran, logged the same steps and the
    same compared metrics at each; their step records."""
    single = train_in_process(model_dir, tmp_path, "single", *settings)
    double = run_train(model_dir, tmp_path, "double", *settings, *only_two, "distributed.nproc_per_node=2")
    assert double.returncode == 0, double.stdout[-2000:] + double.stderr[-3000:]
    one, two = step_records(single), step_records(tmp_path / "double")
    assert sorted(one) == sorted(two) and one
    for step in one:
        assert_same_metrics(one[step], two[step])
    return one, two


def test_two_processes_train_a_vlm_as_one_with_its_frozen_tower_whole_and_its_images_encoded_once(
        tiny_vlm_dir, tmp_path):
    """A VLM on image observations, with a critic and a reference (three frozen towers): under FSDP each process
    holds the frozen towers whole, so the step's image features are stored per process and every pass after the
    first reads them; the run equals one process's, which stores them too. The towers' weights are those of the
    start in the checkpoint (never trained; in float32 here, where the whole tower's cast changes nothing)."""
    one, two = trained_as_one(tiny_vlm_dir, tmp_path, ("env.settings.mode=image", "algorithm.kl_coef=0.05",
                                                      "run.steps=2"))
    assert sorted(one) == [1, 2]
    for step in one:
        # Each process stores its own rows' images: more encodings than one process makes, never fewer.
        assert two[step]["vision/images_reused"] > 0
        assert two[step]["vision/images_encoded"] >= one[step]["vision/images_encoded"] > 0
    assert one[2]["actor/grad_norm"] > 0 and one[2]["critic/grad_norm"] > 0
    start = {k: v for k, v in load_file(tiny_vlm_dir / "model.safetensors").items() if "visual" in k}
    saved = load_file(tmp_path / "double" / "checkpoints" / "step_000002" / "actor" / "model.safetensors")
    tower = {k: v for k, v in saved.items() if "visual" in k}
    assert tower.keys() == start.keys() and all(torch.equal(tower[k], start[k]) for k in start)


# --------------------------------------------------------------------------- checks in two processes
# Each check below is a script that two gloo processes run as torchrun starts them (argv: a model directory and a
# folder for what it writes). The three run in turn in one launch, once for the test run: a launch is mostly its two
# interpreters importing torch and transformers, which each check paid for on its own.
TWO_PROCESS_CHECKS = """
import sys, traceback
from pathlib import Path
import torch
from turnrl.training import ranks

ranks.init_process_group("cpu", timeout_s=120)
checks = sys.argv[1:]
for script, model_dir, out in zip(checks[0::3], checks[1::3], checks[2::3]):
    sys.argv = [script, model_dir, out]  # as if torchrun had started the script itself
    try:
        exec(compile(Path(script).read_text(), script, "exec"), {"__name__": "__main__"})
    except Exception:  # that check's failure, said in its folder: the checks after it still run
        Path(out, f"failed{ranks.rank()}").write_text(traceback.format_exc())
    ranks.barrier()
torch.distributed.destroy_process_group()
ranks.end_process(0)
"""


@pytest.fixture(scope="module")
def two_process_check(tiny_model_dir, tiny_vlm_dir, once_per_run) -> Callable[[str], Path]:
    """``check(name) -> folder``: the folder that the script ``name`` of :data:`CHECKS` wrote into, in the launch
    that ran them all; fails with what the processes said when the launch failed or the check raised in one."""
    models = {"tiny": tiny_model_dir, "vlm-tiny": tiny_vlm_dir}

    def launch(folder: Path) -> None:
        args = []
        for name, (script, model) in CHECKS.items():
            (folder / name).mkdir()
            (folder / f"{name}.py").write_text(script)
            args += [str(folder / f"{name}.py"), str(models[model]), str(folder / name)]
        (folder / "checks.py").write_text(TWO_PROCESS_CHECKS)
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--standalone", str(folder / "checks.py"), *args], capture_output=True, text=True,
                                timeout=540, env={**os.environ, "OMP_NUM_THREADS": "1"})
        (folder / "said.txt").write_text(f"exit status {result.returncode}\n{failure_output(result)}")

    folder = once_per_run("fsdp2_two_process_checks", launch)

    def check(name: str) -> Path:
        said = (folder / "said.txt").read_text()
        assert said.startswith("exit status 0\n"), said
        failed = [path.read_text() for path in sorted((folder / name).glob("failed*"))]
        assert not failed, "\n".join(failed) + said
        return folder / name

    return check


SHARDED_VLM = """
import sys, torch
from pathlib import Path
from torch.distributed.tensor import DTensor
from turnrl.models.loading import load_model, vision_tower
from turnrl.training import ranks
from turnrl.training.head import install_scoring_head
from turnrl.training.parallel.fsdp2 import shard_model, structure_of

for trained in (False, True):
    model = load_model(sys.argv[1])
    install_scoring_head(model, None)
    vision_tower(model).requires_grad_(trained)
    sharded = structure_of(model)
    shard_model(sharded, torch.bfloat16, model.state_dict() if ranks.is_main() else {})
    tower = dict(vision_tower(sharded).named_parameters())
    start = dict(vision_tower(model).named_parameters())
    if trained:  # a trained tower is sharded as the decoder is
        assert all(isinstance(p, DTensor) for p in tower.values())
    else:  # frozen: whole on every process, in the compute dtype; its rotary frequencies float32
        assert not any(isinstance(p, DTensor) for p in tower.values())
        assert all(p.dtype == torch.bfloat16 and torch.equal(p, start[n].to(torch.bfloat16)) for n, p in tower.items())
        assert all(b.dtype == torch.float32 for b in vision_tower(sharded).buffers())
    assert isinstance(sharded.get_output_embeddings().weight, DTensor)
    assert all(isinstance(p, DTensor) for n, p in sharded.named_parameters() if "visual" not in n)
Path(sys.argv[2], f"checked{ranks.rank()}").write_text("ok")
"""


def test_a_frozen_vision_tower_is_held_whole_by_each_process_and_a_trained_one_sharded(two_process_check):
    checked = two_process_check("sharded_vlm")
    assert sorted(path.name for path in checked.glob("checked*")) == ["checked0", "checked1"]


SAVED_OPTIMIZERS = """
import copy, sys, torch
from pathlib import Path
from torch.distributed.tensor import distribute_tensor
from transformers import AutoTokenizer
from turnrl.models.loading import load_model
from turnrl.training import ranks
from turnrl.training.checkpoint import load_trainer_state
from turnrl.training.head import install_scoring_head
from turnrl.training.parallel.fsdp2 import FSDP2
from turnrl.training.parallel.strategy import CheckpointFiles, Models, Optimizers

model = load_model(sys.argv[1])
install_scoring_head(model, None)
plain = copy.deepcopy(model)  # one process's model and optimizer, unsharded
strategy = FSDP2(cpu_offload=False)
models = strategy.place(Models(model, None, None), torch.device("cpu"), torch.float32)
sharded = dict(models.actor.named_parameters())
whole = dict(plain.named_parameters())
adam = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
optimizer, plain_optimizer = adam(list(sharded.values())), adam(list(whole.values()))
files = lambda step: CheckpointFiles(Path(sys.argv[2]), step, AutoTokenizer.from_pretrained(sys.argv[1]), {}, "", 3)


def step(scale):
    for name, param in sharded.items():  # the same gradient for both: a pattern of each weight's shape
        grad = torch.sin(torch.arange(param.numel(), dtype=torch.float32) * scale).reshape(param.shape)
        param.grad = distribute_tensor(grad, param.device_mesh, param.placements)
        whole[name].grad = grad.clone()
    optimizer.step()
    plain_optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    plain_optimizer.zero_grad(set_to_none=True)


def assert_as_one_process(optimizer):
    for name, param in sharded.items():
        torch.testing.assert_close(ranks.whole(param), whole[name], rtol=0, atol=1e-6)
        state, expected = optimizer.state[param], plain_optimizer.state[whole[name]]
        assert float(state["step"]) == float(expected["step"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ranks.whole(state[key]), expected[key], rtol=0, atol=1e-7)


# Saved before its first step (the actor during the critic's warm-up): it stays without state, saved and resumed.
first = strategy.save(files(1), models, Optimizers(optimizer, None))
assert not optimizer.state, "saving stepped the optimizer"
strategy.restore_optimizers(first, load_trainer_state(first), models, Optimizers(optimizer, None))
assert not optimizer.state, "resuming stepped the optimizer"
step(0.3)
assert_as_one_process(optimizer)
# Saved after steps: a fresh optimizer resumes with the unsharded one's state, and steps as it does.
step(0.7)
second = strategy.save(files(2), models, Optimizers(optimizer, None))
resumed = adam(list(sharded.values()))
strategy.restore_optimizers(second, load_trainer_state(second), models, Optimizers(resumed, None))
assert_as_one_process(resumed)
optimizer = resumed
step(1.1)
assert_as_one_process(resumed)
# A shard cut short: every process stops with what to do (torch's own error is a BaseException of many lines).
ranks.barrier()
if ranks.is_main():
    shard = second / "optimizer" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
ranks.barrier()
try:
    fresh = Optimizers(adam(list(sharded.values())), None)
    strategy.restore_optimizers(second, load_trainer_state(second), models, fresh)
    raise AssertionError("a shard cut short was read")
except RuntimeError as error:
    assert "optimizer cannot be read (process " in str(error), error
    assert str(error).endswith("move step_000002 away to resume from an earlier checkpoint"), error
Path(sys.argv[2], f"checked{ranks.rank()}").write_text("ok")
"""


def test_sharded_optimizer_states_save_and_resume_as_one_process_steps_them(two_process_check):
    """Two processes' AdamW over FSDP2 shards, saved and resumed, against one process's AdamW on the whole model
    with the same gradients: the same weights, moments and step counts. An optimizer saved before its first step
    (the actor during ``algorithm.critic_warmup_steps``) stays without state: reading its state dict made one up
    by a step on zero gradients, which left its first real step about a quarter smaller than one process's. A shard
    file cut short stops the resume on every process with what to do."""
    checked = two_process_check("saved_optimizers")
    assert sorted(path.name for path in checked.glob("checked*")) == ["checked0", "checked1"]


FULL_DISK = """
import errno, sys, torch
from pathlib import Path
from transformers import AutoTokenizer
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from turnrl.config import ConfigError
from turnrl.models.loading import load_model
from turnrl.training import ranks
from turnrl.training.head import install_scoring_head
from turnrl.training.parallel.fsdp2 import FSDP2
from turnrl.training.parallel.strategy import CheckpointFiles, Models, Optimizers

model = load_model(sys.argv[1])
install_scoring_head(model, None)
strategy = FSDP2(cpu_offload=False)
models = strategy.place(Models(model, None, None), torch.device("cpu"), torch.float32)
optimizers = Optimizers(torch.optim.AdamW(list(models.actor.parameters())), None)
if ranks.rank() == 1:  # its disk is full
    def write_data(self, plan, planner):
        raise OSError(errno.ENOSPC, "No space left on device")
    FileSystemWriter.write_data = write_data
run_dir = Path(sys.argv[2])
try:
    strategy.save(CheckpointFiles(run_dir, 1, AutoTokenizer.from_pretrained(sys.argv[1]), {}, "", 2), models,
                  optimizers)
except ConfigError as error:  # rank 0: the checkpoint's own message
    said = str(error)
except Exception as error:  # the other ranks: which process failed, and why
    said = str(error)
ranks.barrier()
Path(run_dir, f"said{ranks.rank()}").write_text(said)
"""


def test_a_full_disk_on_one_process_fails_the_checkpoint_on_every_process_as_a_full_disk(two_process_check):
    """One process's optimizer shards do not fit on its disk: every process stops the save with an error (torch's
    own is a ``BaseException``, which the checkpoint's handler of write failures never saw); rank 0 says that the
    disk is full and how to go on, and deletes the unfinished checkpoint folder."""
    run_dir = two_process_check("full_disk")
    assert re.match(r"checkpoint after step 1 could not be written: No space left on device\. Free some space",
                    (run_dir / "said0").read_text())
    assert (run_dir / "said1").read_text().startswith("process 1 could not write its optimizer shards: OSError")
    assert list((run_dir / "checkpoints").iterdir()) == []  # no unfinished folder, no ``latest``


CHECKS = {"sharded_vlm": (SHARDED_VLM, "vlm-tiny"), "saved_optimizers": (SAVED_OPTIMIZERS, "tiny"),
          "full_disk": (FULL_DISK, "tiny")}
"""The scripts :func:`two_process_check` runs, in this order, with the model each loads: the full disk last, since
it leaves the checkpoint writer of process 1 failing."""


@pytest.mark.slow  # 21 s; two processes train as one by default (test_two_processes_train_as_one)
def test_two_processes_that_free_the_rollout_during_the_update_train_as_one(tiny_model_dir, tmp_path):
    """``model.engine.free_during_update``: the engine's cache and computed weights and the unsharded rollout copy
    are freed before each update and rebuilt (gathered from the shards) before the next rollout; the run is the
    one-process run that keeps them, step for step."""
    one, two = trained_as_one(tiny_model_dir, tmp_path, ("model.backend=engine", "run.steps=3"),
                              "model.engine.free_during_update=true")
    assert sorted(one) == [1, 2, 3]
    for step in one:
        # Each process's engine generated its groups' tokens: together, the one process's.
        assert two[step]["generation/generated_tokens"] == one[step]["generation/generated_tokens"] > 0
    assert one[3]["actor/grad_norm"] > 0


@pytest.mark.slow  # 38 s on two cores, most of it compiling; two eager processes train as one by default
def test_two_processes_with_compiled_layer_parts_train_as_one_eager_process(tiny_model_dir, tmp_path, single):
    """``model.compile``: each shard's layers run compiled norms and MLPs (actor, critic and the rollout copy
    made from them); two steps give the eager single-process run's metrics and weights."""
    double = run_train(tiny_model_dir, tmp_path, "double", "run.steps=2", "distributed.nproc_per_node=2",
                       "model.compile=true")
    assert double.returncode == 0, double.stdout[-2000:] + double.stderr[-3000:]
    assert re.search(r"[1-9]\d* layer parts compiled", " ".join(double.stdout.split()))
    one, two = step_records(single), step_records(tmp_path / "double")
    assert sorted(one) == sorted(two) == [1, 2]
    for step in one:
        assert_same_metrics(one[step], two[step])
    weights = load_file(tmp_path / "double" / "checkpoints" / "step_000002" / "actor" / "model.safetensors")
    reference = load_file(single / "checkpoints" / "step_000002" / "actor" / "model.safetensors")
    for name in weights:
        # Compiled norms and MLPs sum in another order: where a gradient is near 0, Adam's division by its
        # running scale makes that rounding a few percent of a step (lr 1e-3); seen: 4.4e-5 on 1 weight of 12,288.
        torch.testing.assert_close(weights[name], reference[name], rtol=1e-4, atol=5e-5)


@pytest.mark.slow  # 18 s; the stop itself is checked in one process by default (tests/training/test_ppo.py)
def test_two_processes_stop_at_the_target_kl_together_as_one(tiny_model_dir, tmp_path):
    """``algorithm.target_kl``: each process holds part of a mini-batch, and the mini-batch's KL (summed over
    the processes) stops the actor on both at the mini-batch where one process stops."""
    one, _ = trained_as_one(tiny_model_dir, tmp_path, ("run.steps=2", "algorithm.ppo_epochs=2",
                                                       "algorithm.target_kl=1e-5"))
    assert sorted(one) == [1, 2]
    assert any(record["actor/kl_stopped"] == 1 and record["actor/optimizer_steps"] >= 1 for record in one.values())


@pytest.mark.slow  # 18 s; the rollback itself is checked in one process by default (tests/training/test_ppo.py)
def test_two_processes_undo_a_step_past_the_rollback_bound_together_as_one(tiny_model_dir, tmp_path):
    """``algorithm.rollback_kl``: the mini-batch KL summed over the processes undoes the same optimizer step on
    both, each putting back its own shards and their optimizer state; the next step starts from the same actor."""
    one, _ = trained_as_one(tiny_model_dir, tmp_path, ("run.steps=2", "algorithm.ppo_epochs=2",
                                                       "algorithm.rollback_kl=1e-5"))
    assert sorted(one) == [1, 2]
    assert any(record["actor/rolled_back"] == 1 for record in one.values())


PACKED_WITH_REFERENCE = ("algorithm.micro_batch_tokens=160", "algorithm.kl_coef=0.05")


@pytest.mark.slow
def test_four_processes_train_as_one_with_packed_micro_batches_and_a_reference(tiny_model_dir, tmp_path):
    """Four gloo processes and one: micro-batches by tokens (rows dealt to processes by tokens, packed) and a
    KL reference; the same metrics and weights after two steps."""
    single = run_train(tiny_model_dir, tmp_path, "single", "run.steps=2", *PACKED_WITH_REFERENCE)
    assert single.returncode == 0, single.stderr[-3000:]
    quad = run_train(tiny_model_dir, tmp_path, "quad", "run.steps=2", "distributed.nproc_per_node=4",
                     *PACKED_WITH_REFERENCE, timeout=900)
    assert quad.returncode == 0, quad.stdout[-2000:] + quad.stderr[-3000:]
    assert "did not run forward before backward" not in quad.stderr
    one, four = step_records(tmp_path / "single"), step_records(tmp_path / "quad")
    for step in one:
        assert_same_metrics(one[step], four[step])
    assert one[2]["actor/kl_ref"] != 0
    weights = load_file(tmp_path / "quad" / "checkpoints" / "step_000002" / "actor" / "model.safetensors")
    reference = load_file(tmp_path / "single" / "checkpoints" / "step_000002" / "actor" / "model.safetensors")
    for name in weights:
        # Adam divides by the gradient's running scale: where a gradient is near 0, the rounding of a four-way
        # sum moves a weight by up to a few percent of the step (lr 1e-3); seen: 2.6e-5 on 1 weight of 12,288.
        torch.testing.assert_close(weights[name], reference[name], rtol=1e-4, atol=5e-5)


@pytest.mark.slow  # 43 s of four torchrun processes; the build lock itself: tests/models/test_tiny.py
def test_four_processes_start_cleanly_from_an_empty_model_cache(tmp_path):
    """The built-in model is built once (on rank 0, which transformers lets write) while the others wait,
    and every process loads the complete build: no half-written cache entry is read."""
    cache = tmp_path / "cache"
    command = [sys.executable, "-m", "turnrl.cli", "train", "model.builtin_preset=tiny", f"model.builtin_dir={cache}",
               f"run.output_dir={tmp_path}", "run.name=quad", *ARGS, "run.steps=1", "distributed.nproc_per_node=4"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert sorted(step_records(tmp_path / "quad")) == [1]
    builds = [path for path in cache.iterdir() if not path.name.startswith(".")]
    assert len(builds) == 1 and (builds[0] / "config.json").is_file()
    assert not [path for path in cache.iterdir() if ".build-" in path.name or ".stale-" in path.name]


@pytest.mark.slow  # 21 s with two; LoRA trains in one process by default (tests/training/test_trainer.py)
@pytest.mark.parametrize("processes", [2, 4])
def test_lora_on_several_processes_trains_as_on_one(tiny_model_dir, tmp_path, processes):
    """LoRA under FSDP2 (the base frozen in the shards, the adapters trained, the reference the adapters
    switched off): the metrics and the adapters after two steps equal one process's."""
    lora = ("lora.enabled=true", "lora.r=4", "lora.alpha=8", "algorithm.kl_coef=0.05", "algorithm.advantage=grpo")
    single = train_in_process(tiny_model_dir, tmp_path, "single", "run.steps=2", *lora)
    several = run_train(tiny_model_dir, tmp_path, "several", "run.steps=2", f"distributed.nproc_per_node={processes}",
                        *lora, timeout=900)
    assert several.returncode == 0, failure_output(several)
    one, many = step_records(single), step_records(tmp_path / "several")
    for step in one:
        assert_same_metrics(one[step], many[step])
    assert one[2]["actor/grad_norm"] > 0 and one[2]["actor/kl_ref"] != 0
    adapters = [load_file(tmp_path / name / "checkpoints" / "step_000002" / "actor" / "adapter_model.safetensors")
                for name in ("several", "single")]
    assert adapters[0].keys() == adapters[1].keys() and adapters[0]
    for name in adapters[0]:
        torch.testing.assert_close(adapters[0][name], adapters[1][name], rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # 15 s; two processes under torchrun train as one by default (test_two_processes_train_as_one)
def test_fsdp_on_one_process_runs_under_torchrun_and_train_outside_it_says_how_to_start(tiny_model_dir, tmp_path):
    """``distributed.backend=fsdp`` from the command line starts one FSDP process (CPU offload then lets a
    model larger than its GPU train); ``train()`` called outside torchrun with fsdp says how to start it."""
    result = run_train(tiny_model_dir, tmp_path, "r", "run.steps=1", "distributed.backend=fsdp")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "1 process (FSDP)" in " ".join(result.stdout.split())
    config = load_config(TrainConfig, None, [f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path}",
                                             "run.name=s", *ARGS, "distributed.backend=fsdp"])
    with pytest.raises(ConfigError, match="torchrun --nproc-per-node"):
        train(config)


@pytest.mark.slow
def test_a_dead_process_stops_the_run_and_it_resumes_exactly(tiny_model_dir, tmp_path):
    """Kill one of two processes mid-run: the run stops with an error (no hang), its last checkpoint resumes
    on two processes, and the resumed steps equal an uninterrupted single-process run."""
    reference = run_train(tiny_model_dir, tmp_path, "single", "run.steps=4")
    assert reference.returncode == 0, reference.stderr[-3000:]
    command = [sys.executable, "-m", "turnrl.cli", "train", f"model.path={tiny_model_dir}",
               f"run.output_dir={tmp_path}", "run.name=double", *ARGS, "run.steps=4", "run.save_every=1",
               "distributed.nproc_per_node=2", "distributed.timeout_s=60"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    first = tmp_path / "double" / "checkpoints" / "step_000001"
    deadline = time.time() + 300
    while not first.is_dir() and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.5)
    assert first.is_dir(), "no checkpoint after the first step"
    workers = subprocess.run(["pgrep", "-f", f"run.output_dir={tmp_path}.*run.name=double"], capture_output=True,
                             text=True).stdout.split()
    trainers = [int(pid) for pid in workers if int(pid) != launcher.pid]
    os.kill(max(trainers), signal.SIGKILL)  # the youngest: a training process, not the launcher
    start = time.time()
    output, _ = launcher.communicate(timeout=240)
    assert launcher.returncode != 0, output[-2000:]
    assert time.time() - start < 200  # the others stop instead of waiting forever
    resumed = run_train(tiny_model_dir, tmp_path, "double", "run.steps=4", "distributed.nproc_per_node=2",
                        f"resume={tmp_path / 'double'}")
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    one, two = step_records(tmp_path / "single"), step_records(tmp_path / "double")
    assert sorted(two) == [1, 2, 3, 4]
    for step in (3, 4):
        assert_same_metrics(one[step], two[step])


@pytest.mark.slow
def test_the_stop_file_stops_every_process_after_the_same_step_with_a_checkpoint(tiny_model_dir, tmp_path):
    """``touch RUN_DIR/stop`` under two processes: both stop after the step in progress, the checkpoint is
    saved, the file is gone, and ``turnrl train resume=RUN_DIR`` (config.yaml says two processes) finishes."""
    run_dir = tmp_path / "double"
    command = [sys.executable, "-m", "turnrl.cli", "train", f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path}",
               "run.name=double", *ARGS, "run.steps=3", "distributed.nproc_per_node=2"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}) as process:
        # Touched once the run holds its folder (a stop file there before it is an earlier run's, and removed)
        # and before its first step ends (the models load first): the run stops after that step.
        deadline = time.monotonic() + 300
        while not (run_dir / OWNER_FILE).is_file() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not (run_dir / "metrics.jsonl").is_file()
        (run_dir / "stop").touch()
        out, errors = process.communicate(timeout=600)
    assert process.returncode == 0, out[-2000:] + errors[-3000:]  # torchrun: 0 or a failure
    assert "interrupted after step 1 of 3" in " ".join(out.split())
    assert sorted(step_records(run_dir)) == [1] and not (run_dir / "stop").exists()
    resumed = subprocess.run([sys.executable, "-m", "turnrl.cli", "train", f"resume={run_dir}"], capture_output=True,
                             text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "2 processes (FSDP)" in " ".join(resumed.stdout.split())
    assert sorted(step_records(run_dir)) == [1, 2, 3]


def test_a_sigterm_to_the_command_stops_every_process_after_the_step_in_progress_with_a_checkpoint(
        tiny_model_dir, tmp_path):
    """``kill PID`` of ``turnrl train distributed.nproc_per_node=2`` (the command, not torchrun): it passes the
    SIGTERM on, torchrun passes it on to both processes (more than once: each is one request), they save the
    step in progress, and the command exits with 143."""
    run_dir = tmp_path / "double"
    command = [sys.executable, "-m", "turnrl.cli", "train", f"model.path={tiny_model_dir}",
               f"run.output_dir={tmp_path}", "run.name=double", *ARGS, "run.steps=500", "run.save_every=0",
               "distributed.nproc_per_node=2"]
    with (tmp_path / "out.txt").open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "OMP_NUM_THREADS": "1"})
        deadline = time.monotonic() + 300
        while not (run_dir / "metrics.jsonl").exists() or len(step_records(run_dir)) < 1:
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()[-3000:]
            time.sleep(0.05)
        os.kill(process.pid, signal.SIGTERM)
        assert process.wait(timeout=300) == 128 + signal.SIGTERM
    said = " ".join((tmp_path / "out.txt").read_text().split())
    assert "SIGTERM: stopping after this step" in said, said[-3000:]
    steps = sorted(step_records(run_dir))
    assert steps and f"interrupted after step {steps[-1]} of 500" in said, said[-3000:]
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step_{steps[-1]:06d}"


# --------------------------------------------------------------------------- resuming across strategies
def as_one_torchrun_process(monkeypatch) -> None:
    """This process as torchrun would start it alone: ``train`` then joins a gloo group of one and trains with
    FSDP2 (the process group is closed when it returns)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "test"}.items():
        monkeypatch.setenv(name, value)


def test_a_checkpoint_resumes_only_with_the_optimizer_layout_it_was_saved_in(tiny_model_dir, tmp_path, monkeypatch):
    """One FSDP process saves its optimizer states as shards and one plain process inside the trainer state,
    both with ``world_size`` 1: a resume with the other strategy stops with how to resume it."""
    plain = train_in_process(tiny_model_dir, tmp_path, "plain", "run.steps=1", "validation.episodes=1")
    with monkeypatch.context() as torchrun:
        as_one_torchrun_process(torchrun)
        with pytest.raises(ConfigError, match=r"one process without FSDP.* resume it without torchrun"):
            train(run_config(tiny_model_dir, tmp_path, "plain", "run.steps=2", f"resume={plain}",
                             "distributed.backend=fsdp"))
        sharded = train_in_process(tiny_model_dir, tmp_path, "sharded", "run.steps=1", "validation.episodes=1",
                                   "distributed.backend=fsdp")
    assert (sharded / "checkpoints" / "step_000001" / "optimizer").is_dir()
    with pytest.raises(ConfigError, match=r"1 FSDP process.* under torchrun with distributed.backend=fsdp and "
                                          r"distributed.nproc_per_node=1"):
        train(run_config(tiny_model_dir, tmp_path, "sharded", "run.steps=2", f"resume={sharded}"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cpu_offload_on_gpus_trains_as_the_shards_on_the_gpus(tiny_vlm_dir, tmp_path):
    """FSDP2 with ``distributed.cpu_offload`` keeps the shards and their gradients in host memory; gathering
    them whole (the rollout copy, the gradient norm) is a collective on host tensors, which NCCL alone
    refuses. The offloaded run trains the tiny VLM as the same processes with the shards on their GPUs."""
    processes = min(2, torch.cuda.device_count())
    on_gpu = ["model.device=cuda", "run.steps=2", f"distributed.nproc_per_node={processes}",
              "distributed.backend=fsdp", "env.settings.mode=image", "algorithm.kl_coef=0.05"]
    kept = run_train(tiny_vlm_dir, tmp_path, "kept", *on_gpu)
    offloaded = run_train(tiny_vlm_dir, tmp_path, "offloaded", *on_gpu, "distributed.cpu_offload=true")
    for result in (kept, offloaded):
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    one, two = step_records(tmp_path / "kept"), step_records(tmp_path / "offloaded")
    assert sorted(one) == sorted(two) == [1, 2]
    for step in one:
        assert_same_metrics(one[step], two[step])
