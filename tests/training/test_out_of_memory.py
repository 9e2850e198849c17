"""What a run says and does when its GPU runs out of memory: the errors that name what to change, and the one
retry an RL step gets when no optimizer step began."""

from __future__ import annotations

import sys

import torch

from turnrl.config import load_config
from turnrl.training.memory import SFT_ELSEWHERE
from turnrl.training.out_of_memory import (
    OptimizerSteps,
    halved_micro_batches,
    rl_out_of_memory,
    sft_out_of_memory,
    torch_said,
)
from turnrl.training.train_config import SFTConfig, TrainConfig

REAL_OOM = ("CUDA out of memory. Tried to allocate 102.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
            "116.74 GiB is free. 22.37 GiB allowed; Of the allocated memory 22.26 GiB is allocated by PyTorch, and "
            "58.40 MiB is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try "
            "setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation")


def test_torch_s_message_is_kept_without_its_general_advice():
    said = torch_said(torch.OutOfMemoryError(REAL_OOM))
    assert said.startswith("CUDA out of memory. Tried to allocate 102.00 MiB.") and said.endswith("but unallocated.")
    assert torch_said(torch.OutOfMemoryError("")) == "OutOfMemoryError"


def test_sft_out_of_memory_halves_the_rows_that_failed_not_the_setting():
    config = SFTConfig(batch_size=64, micro_batch_size=64)
    few = str(sft_out_of_memory(torch.OutOfMemoryError(REAL_OOM), config, (5, 300)))
    assert few.startswith("SFT ran out of GPU memory in a micro-batch of 5 samples of 300 tokens (padded to the "
                          "longest): set sft.micro_batch_size=2 (sft.batch_size=64 stays")
    assert few.endswith("torch: " + torch_said(torch.OutOfMemoryError(REAL_OOM)))
    one = str(sft_out_of_memory(torch.OutOfMemoryError(REAL_OOM), config, (1, 9000)))
    assert "sft.micro_batch_size" not in one
    assert (": set model.gradient_checkpointing=true (if off; if on, a larger model.checkpointed_layers or none); "
            "or give") in one
    optimizer = str(sft_out_of_memory(torch.OutOfMemoryError(REAL_OOM), config, None))
    assert "micro_batch" not in optimizer and "checkpointing" not in optimizer and SFT_ELSEWHERE in optimizer


def test_rl_out_of_memory_names_only_what_the_run_can_change():
    def said(*overrides: str) -> str:
        config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", list(overrides))
        return str(rl_out_of_memory(torch.OutOfMemoryError(REAL_OOM), config, 7, None))

    engine = said("algorithm.micro_batch_tokens=8192", "model.gradient_checkpointing=false")
    assert engine.startswith("RL step 7 ran out of GPU memory: set algorithm.micro_batch_tokens=4096; or "
                             "model.gradient_checkpointing=true; or model.engine.free_during_update=true; "
                             "no checkpoint")
    assert "run.overwrite=true" in engine and "gpu_share" not in engine and "kv_cache" not in engine
    assert "free_during_update" not in said("model.backend=hf")
    assert "free_during_update" not in said("distributed.async_rollout=true", "distributed.max_staleness=0")
    assert said("run.gpu_share=0.25").count("run.gpu_share above 0.25") == 1
    nothing = said("algorithm.micro_batch_tokens=0", "algorithm.micro_batch_size=1",
                   "model.gradient_checkpointing=true", "model.engine.free_during_update=true")
    assert nothing.startswith("RL step 7 ran out of GPU memory: use a GPU with more memory (see `turnrl memory`);")
    partial = said("algorithm.micro_batch_tokens=0", "algorithm.micro_batch_size=1", "model.gradient_checkpointing=true",
                   "model.checkpointed_layers=20", "model.engine.free_during_update=true")
    assert partial.startswith("RL step 7 ran out of GPU memory: set model.checkpointed_layers above 20 (more layers "
                              "recomputed; unset: all);")


def test_halving_the_micro_batches_halves_the_tokens_or_else_the_rows():
    config = load_config(TrainConfig, None, ["algorithm.micro_batch_tokens=8192"])
    assert halved_micro_batches(config.algorithm) == "algorithm.micro_batch_tokens=4096"
    assert config.algorithm.micro_batch_tokens == 4096
    rows = load_config(TrainConfig, None, ["algorithm.micro_batch_size=3"]).algorithm
    assert halved_micro_batches(rows) == "algorithm.micro_batch_size=1" and rows.micro_batch_size == 1
    assert halved_micro_batches(rows) is None and rows.micro_batch_size == 1


def test_optimizer_steps_are_seen_from_their_start_and_only_while_watched():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1)
    with OptimizerSteps([optimizer, None]) as watch:
        (weight * 2).sum().backward()
        assert not watch.began
        optimizer.step()
        assert watch.began
    with OptimizerSteps([optimizer]) as again:
        assert not again.began
    optimizer.step()
    assert not again.began and not optimizer._optimizer_step_pre_hooks  # the hooks are gone


def test_halving_takes_the_scoring_passes_own_budget_down_with_the_update_s():
    """``score_micro_batch_tokens`` packs the scoring passes apart from the update's: an error in them (several
    times the update's tokens) would come again on a retry that halved only the update's passes."""
    config = load_config(TrainConfig, None, ["algorithm.micro_batch_tokens=8192",
                                             "algorithm.score_micro_batch_tokens=32768"])
    assert halved_micro_batches(config.algorithm) == \
        "algorithm.micro_batch_tokens=4096 algorithm.score_micro_batch_tokens=16384"
    assert (config.algorithm.micro_batch_tokens, config.algorithm.score_micro_batch_tokens) == (4096, 16384)
    rows = load_config(TrainConfig, None, ["algorithm.micro_batch_size=1",
                                           "algorithm.score_micro_batch_tokens=4096"]).algorithm
    assert halved_micro_batches(rows) == "algorithm.score_micro_batch_tokens=2048" and rows.micro_batch_size == 1
    told = str(rl_out_of_memory(torch.OutOfMemoryError(REAL_OOM), load_config(TrainConfig, None, [
        "algorithm.micro_batch_tokens=4096", "algorithm.score_micro_batch_tokens=16384"]), 3, None))
    assert told.startswith("RL step 3 ran out of GPU memory: set algorithm.micro_batch_tokens=2048; or "
                           "algorithm.score_micro_batch_tokens=8192; or ")


def test_rl_out_of_memory_names_only_settings_that_would_change_the_step():
    def said(*overrides: str) -> str:
        config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", list(overrides))
        return str(rl_out_of_memory(torch.OutOfMemoryError(REAL_OOM), config, 7, None))

    # A one-token budget halves to 0, which means passes counted in rows: not a smaller pass.
    assert "micro_batch_tokens=0" not in said("algorithm.micro_batch_tokens=1")
    # Trainers beside rollout processes free their rollout after each validation already.
    pool = said("distributed.nproc_per_node=3", "distributed.rollout_processes=1")
    assert "free_during_update" not in pool and "distributed.cpu_offload=true" in pool
    assert "cpu_offload" not in said("distributed.nproc_per_node=2", "distributed.rollout_processes=1")
    assert "cpu_offload" not in said() and "cpu_offload" not in said("distributed.nproc_per_node=4",
                                                                       "distributed.cpu_offload=true")
    assert "; or distributed.cpu_offload=true" in said("distributed.nproc_per_node=4")


def test_a_budget_no_two_sequences_share_is_neither_advised_nor_halved():
    """Where the step's two shortest sequences together are over a pass's token budget, no two sequences share a
    pass: each pass holds one at this budget and at half of it, so halving cannot help. The VisGym maze at
    ``vlm-3b`` without checkpointing on an 80 GB card (sequences of about 3,930 tokens) ran out of memory at 4,096
    tokens and again at the 2,048 the error named, at the same 77.5 GiB."""
    config = load_config(TrainConfig, None, ["algorithm.micro_batch_tokens=4096",
                                             "algorithm.score_micro_batch_tokens=16384",
                                             "model.gradient_checkpointing=false"])

    def told(shortest_pair: int) -> str:
        return str(rl_out_of_memory(torch.OutOfMemoryError(REAL_OOM), config, 1, None, shortest_pair=shortest_pair))

    apart = told(7800)
    assert apart.startswith("RL step 1 ran out of GPU memory: set algorithm.score_micro_batch_tokens=8192; or "
                            "model.gradient_checkpointing=true; ")
    assert "micro_batch_tokens=2048" not in apart
    assert ("(smaller passes cannot help: at algorithm.micro_batch_tokens=4096 no two of the step's sequences share "
            "a pass, its two shortest holding 7,800 tokens together)") in apart
    both = told(20000)
    assert "score_micro_batch_tokens=8192" not in both
    assert "at algorithm.micro_batch_tokens=4096 and algorithm.score_micro_batch_tokens=16384 no two" in both
    assert "no two of the step's sequences share a pass)" in told(sys.maxsize)  # a step of one sequence
    assert told(4096).startswith("RL step 1 ran out of GPU memory: set algorithm.micro_batch_tokens=2048; or ")
    assert told(0) == told(100) and "cannot help" not in told(0)  # unknown (no batch yet): as before

    assert halved_micro_batches(config.algorithm, shortest_pair=7800) == "algorithm.score_micro_batch_tokens=8192"
    assert config.algorithm.micro_batch_tokens == 4096
    assert halved_micro_batches(config.algorithm, shortest_pair=9000) is None  # nothing left that two could share
    assert (config.algorithm.micro_batch_tokens, config.algorithm.score_micro_batch_tokens) == (4096, 8192)
