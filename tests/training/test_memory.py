"""The memory estimate: parameter counts against the presets' and peft's own, and the parts a run holds."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from turnrl.config import ConfigError, ModelConfig, load_config
from turnrl.engine.cache import PAGE_TOKENS, pages_for
from turnrl.models.builtin import builtin_model_config
from turnrl.models.tiny import build_tokenizer, count_parameters, preset_config
from turnrl.models.vlm import count_vlm_parameters, vlm_config
from turnrl.training.allocator import CUDA_CONTEXT_BYTES, allocator_margin, run_margin
from turnrl.training.kept_bytes import (
    MIXED,
    activation_bytes,
    kept_layer_cast_bytes,
    kept_token_bytes,
    layer_token_bytes,
    scoring_activation_bytes,
)
from turnrl.training.memory import (
    GIB,
    SFT_ELSEWHERE,
    cache_full_note,
    check_memory,
    check_sft_memory,
    count_model,
    estimate_memory,
    fewest_checkpointed_layers,
    fit_advice,
    fit_report,
    full_length_sequences,
    half_full_passes_note,
    require_fit,
    rollout_in_waves,
    rows_shorter_than_episodes,
    sft_estimate,
    sft_fit_advice,
)
from turnrl.training.train_config import TrainConfig

H100 = 79.1 * GIB


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(["the agent moves the box onto the goal"] * 8, vocab_size=300)


def _saved_config(tmp_path: Path, config) -> Path:
    config.save_pretrained(tmp_path)
    return tmp_path


def test_the_counts_of_the_real_shape_presets_are_their_published_sizes(tmp_path, tokenizer):
    counts = count_model(_saved_config(tmp_path / "3b", preset_config("3b", tokenizer)))
    assert counts.total == count_parameters("3b") == 3_085_938_688  # Qwen2.5-3B
    assert counts.trained == counts.total and counts.head == 0  # tied embedding and head
    assert (counts.layers, counts.hidden, counts.intermediate, counts.vocab) == (36, 2048, 11008, 151936)
    # q, k, v (2048 + 2 x 256 outputs) and gate, up (2 x 11008) in each of 36 layers
    assert counts.stacked == 36 * 2048 * (2048 + 2 * 256 + 2 * 11008)
    # a layer: q/k/v with their biases, o, gate, up and down, and two norms
    assert counts.layer_params == 2048 * (2048 + 2 * 256) + (2048 + 2 * 256) + 2048 * 2048 + 3 * 2048 * 11008 + \
        2 * 2048


def test_a_vlm_trains_its_decoder_and_not_its_frozen_tower(tmp_path, tokenizer):
    counts = count_model(_saved_config(tmp_path / "vlm", vlm_config("vlm-3b", tokenizer)))
    assert counts.total == count_vlm_parameters("vlm-3b")
    assert counts.trained == count_parameters("3b")  # the decoder of Qwen2.5-VL-3B is Qwen2.5-3B's shape
    with_tower = count_model(tmp_path / "vlm", train_vision=True)
    assert with_tower.trained == with_tower.total


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj"])
def test_lora_trained_parameters_are_peft_s_count(tmp_path, tokenizer, targets):
    path = _saved_config(tmp_path / "tiny", preset_config("tiny", tokenizer))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=8, target_modules=targets if targets == "all-linear"
                                            else targets.split(",")))
    trainable = sum(p.numel() for p in peft.parameters() if p.requires_grad)
    assert count_model(path, lora_rank=8, lora_targets=targets).trained == trainable


def _counts(tmp_path: Path, tokenizer, preset: str):
    return count_model(_saved_config(tmp_path / preset, preset_config(preset, tokenizer)))


def test_ppo_with_a_critic_at_3b_does_not_fit_one_h100_and_fits_four(tmp_path, tokenizer):
    """One H100 ran out of memory on the 3B recipe (docs/benchmarks.md: 94 GB of float32 training states)."""
    counts = _counts(tmp_path, tokenizer, "3b")
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", [])
    one = estimate_memory(config, counts, 1, H100)
    assert one.parts["actor"] == 16 * counts.total
    assert one.parts["critic"] == 16 * (counts.total + counts.hidden)  # keeps the tied embedding; a value head
    assert not one.fits()
    four = estimate_memory(config, counts, 4, H100)
    assert four.fits()
    assert four.parts["actor"] == pytest.approx(one.parts["actor"] / 4)
    assert four.parts["rollout weights"] == 2 * counts.total + 2 * counts.stacked  # unsharded copy + stacked
    # The engine's default cache (30% of what is free when it starts, before the optimizer's states exist),
    # capped so that the update's peak stays within 95% of the GPU.
    others = sum(value for name, value in four.parts.items() if name != "key/value cache")
    weights = others - four.parts["activations"] - four.parts["gathered layers"] - \
        0.75 * (four.parts["actor"] + four.parts["critic"])  # no pass runs yet: no layer gathered
    assert four.parts["key/value cache"] == pytest.approx(min(0.3 * (H100 - weights), 0.95 * H100 - others))
    assert four.total <= 0.95 * H100 + 1


def test_the_default_cache_never_takes_what_the_optimizer_needs(tmp_path, tokenizer):
    """8B GRPO + reference on 4 GPUs: 30% of what is free at the engine's start would leave the first optimizer
    step short by several GiB; the estimate's cache is what the update leaves."""
    path = _saved_config(tmp_path / "vlm-8b", vlm_config("vlm-8b", tokenizer))
    config = load_config(TrainConfig, "configs/visgym_maze.yaml", ["algorithm.micro_batch_tokens=8192"])
    estimate = require_fit(config, count_model(path), 4, H100)
    assert estimate.total == pytest.approx(0.95 * H100)
    assert 2 * GIB < estimate.parts["key/value cache"] < 0.3 * (H100 - 40 * GIB)


def test_offload_takes_the_training_states_off_the_gpu(tmp_path, tokenizer):
    counts = _counts(tmp_path, tokenizer, "7b")
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", ["model.engine.kv_cache_gb=8"])
    with pytest.raises(ConfigError, match=r"distributed.cpu_offload=true \(moves \d+ GiB") as error:
        require_fit(config, counts, 4, H100)
    assert "GiB of the GPU's 79.1 GiB" in str(error.value) and "run.check_memory=false" in str(error.value)
    config.distributed.cpu_offload = True
    estimate = require_fit(config, counts, 4, H100)
    assert "actor" in estimate.parts and estimate.parts["actor"] == estimate.parts["critic"] == 0.0
    assert estimate.parts["key/value cache"] == 8 * GIB


def test_freeing_the_rollout_during_the_update_fits_7b_ppo_on_four_h100s(tmp_path, tokenizer):
    """7B PPO + critic on 4 x 80 GB: the states (55 GiB) and the rollout copy (22 GiB) leave no room for the
    update; with the rollout copy and the cache freed during the update, the peak is the larger phase."""
    counts = _counts(tmp_path, tokenizer, "7b")
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", [])
    with pytest.raises(ConfigError, match=r"model.engine.free_during_update=true \(frees the rollout's \d+ GiB"):
        require_fit(config, counts, 4, H100)
    config.model.engine.free_during_update = True
    estimate = require_fit(config, counts, 4, H100)
    parts = estimate.parts
    gradients = 4 * (counts.total + counts.total - counts.head + counts.hidden) / 4  # actor and critic, float32
    assert estimate.gradients == pytest.approx(gradients)
    kept = parts["actor"] + parts["critic"] - gradients  # weights and AdamW's moments stay through the rollout
    rollout = parts["rollout weights"] + parts["key/value cache"]
    update = parts["gathered layers"] + parts["activations"] + gradients
    assert estimate.total == pytest.approx(kept + max(rollout, update))
    assert sum(parts.values()) > H100 >= estimate.total  # every part at once would not fit
    assert parts["key/value cache"] > 8 * GIB  # what the rollout leaves, not what the update leaves (nothing)
    assert "max(rollout weights" in estimate.table() and f"= {estimate.total / GIB:.1f} GiB" in estimate.table()


@pytest.mark.parametrize("ahead", [False, True], ids=["synchronous", "one-update-behind"])
def test_the_trainers_beside_rollout_processes_count_their_rollout_copy_apart_from_the_update(tmp_path, tokenizer,
                                                                                             ahead):
    """Two trainers beside two rollout processes: the trainers sample only to validate and free their unsharded copy
    and its cache after each validation, so their peak counts the larger phase, as under free_during_update;
    FSDP2 processes that roll out themselves hold both through the update."""
    counts = _counts(tmp_path, tokenizer, "7b")
    pool = ["distributed.nproc_per_node=4", "distributed.rollout_processes=2"]
    if ahead:
        pool += ["distributed.async_rollout=true", "distributed.max_staleness=1"]
    estimate = estimate_memory(load_config(TrainConfig, "configs/ragen_sokoban.yaml", pool), counts, 2, H100)
    rollout, update = estimate.groups()
    assert estimate.apart and rollout == estimate.parts["rollout weights"] + estimate.parts["key/value cache"] > 0
    assert estimate.total == pytest.approx(sum(estimate.parts.values()) - min(rollout, update))
    sharded = estimate_memory(load_config(TrainConfig, "configs/ragen_sokoban.yaml", []), counts, 4, H100)
    assert not sharded.apart and sharded.total == pytest.approx(sum(sharded.parts.values()))


H200 = 139.8 * GIB


def test_one_process_without_checkpointing_counts_the_weight_casts_and_compiled_layers_keep_less(tmp_path, tokenizer):
    """PPO + critic at 3B on one H200 without checkpointing (docs/benchmarks.md): eager ran out of memory in
    its first update, compiled peaked at 134.3 GiB; the estimate without the casts had said 134.2 for both."""
    counts = _counts(tmp_path, tokenizer, "3b")
    overrides = ["model.gradient_checkpointing=false", "algorithm.micro_batch_tokens=8192",
                 "model.engine.free_during_update=true", "model.engine.kv_cache_gb=12"]
    eager = load_config(TrainConfig, "configs/ragen_sokoban.yaml", overrides)
    one = estimate_memory(eager, counts, 1, H200)
    assert one.parts["weight casts"] == 2 * (counts.total + counts.hidden)  # the critic's: tied embedding + value head
    assert not one.fits()
    assert "model.compile=true (its layers keep 9 GiB fewer activations)" in fit_advice(eager, counts, one, 1)
    compiled = load_config(TrainConfig, "configs/ragen_sokoban.yaml", [*overrides, "model.compile=true"])
    one_compiled = estimate_memory(compiled, counts, 1, H200)
    assert one.parts["activations"] - one_compiled.parts["activations"] == 36 * 2 * 8192 * 8 * 2048
    assert one_compiled.fits() and abs(one_compiled.total / GIB - 134.3) < 5
    # FSDP gathers the layers in bf16 and frees them after their forward; checkpointing recomputes the casts.
    assert "weight casts" not in estimate_memory(eager, counts, 4, H100).parts
    checkpointing = load_config(TrainConfig, "configs/ragen_sokoban.yaml", [])
    assert "weight casts" not in estimate_memory(checkpointing, counts, 1, H200).parts
    assert activation_bytes(counts, 8192, True, compiled=True) == activation_bytes(counts, 8192, True)


def test_an_asynchronous_rollout_on_the_trainers_gpu_counts_its_bf16_copy_and_the_staged_weights(tmp_path, tokenizer):
    """The VisGym vlm-3b step with the rollout one update ahead on the same H200 ran out of memory at 138.4 GiB
    holding a float32 copy of the actor and float32 staging buffers, which the estimate did not count."""
    counts = count_model(_saved_config(tmp_path / "vlm", vlm_config("vlm-3b", tokenizer)))
    step = ["model.gradient_checkpointing=false", "model.compile=true", "algorithm.micro_batch_tokens=8192",
            "model.engine.kv_cache_gb=8"]
    synchronous = estimate_memory(load_config(TrainConfig, "configs/visgym_maze.yaml", step), counts, 1, H200)
    ahead = [*step, "distributed.async_rollout=true", "algorithm.old_logprobs=sampler"]
    same_gpu = estimate_memory(load_config(TrainConfig, "configs/visgym_maze.yaml", ahead), counts, 1, H200)
    assert same_gpu.parts["staging"] == 2 * counts.trained
    # The engine reads the bf16 copy in place and keeps only its stacked projections besides.
    assert same_gpu.parts["rollout weights"] - synchronous.parts["rollout weights"] == 2 * counts.stacked
    assert same_gpu.total - synchronous.total == 2 * counts.trained + 2 * counts.stacked
    elsewhere = estimate_memory(load_config(TrainConfig, "configs/visgym_maze.yaml",
                                            [*ahead, "distributed.rollout_device=cuda:1"]), counts, 1, H200)
    assert "rollout weights" not in elsewhere.parts and "key/value cache" not in elsewhere.parts
    assert elsewhere.parts["staging"] == 2 * counts.trained
    # A LoRA copy keeps float32 (the engine merges before its cast); its staging holds the adapters alone.
    adapters = count_model(tmp_path / "vlm", lora_rank=64)
    lora = estimate_memory(load_config(TrainConfig, "configs/visgym_maze.yaml", [*ahead, "lora.enabled=true"]),
                           adapters, 1, H200)
    assert lora.parts["staging"] == 4 * adapters.trained < 2 * counts.trained
    assert lora.parts["rollout weights"] == 6 * adapters.total


def test_scoring_passes_count_when_their_token_budget_outgrows_the_updates_micro_batch(tmp_path, tokenizer):
    counts = _counts(tmp_path, tokenizer, "3b")
    update = load_config(TrainConfig, "configs/ragen_sokoban.yaml", ["algorithm.micro_batch_tokens=8192"])
    base = estimate_memory(update, counts, 1, H200).parts["activations"]
    assert base == activation_bytes(counts, 8192, update.model.gradient_checkpointing)
    for tokens in (32768, 1 << 20):
        scoring = load_config(TrainConfig, "configs/ragen_sokoban.yaml",
                              ["algorithm.micro_batch_tokens=8192", f"algorithm.score_micro_batch_tokens={tokens}"])
        held = estimate_memory(scoring, counts, 1, H200).parts["activations"]
        assert held == max(base, scoring_activation_bytes(counts, tokens))
    # A scoring pass of the update's tokens holds less than the update's pass (one layer, no backward).
    assert scoring_activation_bytes(counts, 8192) < base < scoring_activation_bytes(counts, 1 << 20)


def test_what_to_turn_on_for_the_activations_is_what_makes_the_largest_pass_smaller(tmp_path, tokenizer):
    """vlm-3b with scoring passes of 65,536 tokens, which hold more than the update's checkpointed passes of 16,384:
    half the update's tokens saves nothing, half the scoring budget does; each saving is the estimate's own."""
    counts = _vlm_counts(tmp_path, tokenizer, "vlm-3b")
    scoring = load_config(TrainConfig, "configs/visgym_maze.yaml", ["algorithm.score_micro_batch_tokens=65536"])
    estimate = estimate_memory(scoring, counts, 1, 40 * GIB)
    assert estimate.parts["activations"] == scoring_activation_bytes(counts, 65536)
    advice = fit_advice(scoring, counts, estimate, 1)
    assert not any(text.startswith("algorithm.micro_batch_tokens=") for text in advice)
    assert "algorithm.score_micro_batch_tokens=32768 (the scoring passes' own budget)" in advice
    # Without checkpointing: it takes off all but the checkpointed activations, and the weight casts with them.
    eager = load_config(TrainConfig, "configs/visgym_maze.yaml", ["model.gradient_checkpointing=false"])
    eager_estimate = estimate_memory(eager, counts, 1, 40 * GIB)
    checkpointed = estimate_memory(load_config(TrainConfig, "configs/visgym_maze.yaml", []), counts, 1, 40 * GIB)
    saved = sum(eager_estimate.parts[name] - checkpointed.parts.get(name, 0.0) for name in ("activations",
                                                                                            "weight casts"))
    assert saved > eager_estimate.parts["activations"] / 2
    assert fit_advice(eager, counts, eager_estimate, 1)[0] == "model.gradient_checkpointing=true"


def test_what_to_turn_on_saves_from_the_peak_and_never_names_what_saves_nothing_or_is_refused(tmp_path, tokenizer):
    """7B PPO + critic on 2 GPUs with the rollout freed during the update: the update's group is the larger, so a
    smaller cache (in the rollout's group) lowers no peak; a rollout thread refuses free_during_update."""
    counts = _counts(tmp_path, tokenizer, "7b")
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml",
                         ["model.engine.free_during_update=true", "model.engine.kv_cache_gb=12"])
    estimate = estimate_memory(config, counts, 2, H100)
    rollout, update = estimate.groups()
    assert estimate.apart and rollout < update and not estimate.fits()
    advice = fit_advice(config, counts, estimate, 2)
    assert "a smaller model.engine.kv_cache_gb" not in advice
    assert advice[:2] == ["distributed.cpu_offload=true (moves 109 GiB of training states to host memory)",
                          "distributed.nproc_per_node=4 (training states are divided among the GPUs)"]
    thread = load_config(TrainConfig, "configs/visgym_maze.yaml",
                         ["distributed.async_rollout=true", "algorithm.old_logprobs=sampler"])
    vlm = _vlm_counts(tmp_path, tokenizer, "vlm-3b")
    small = estimate_memory(thread, vlm, 1, 40 * GIB)
    assert not small.fits() and not any("free_during_update" in text for text in fit_advice(thread, vlm, small, 1))
    thread.model.gradient_checkpointing = False  # a cache that the update leaves too small for the step's episodes
    waves = rollout_in_waves(thread, vlm, estimate_memory(thread, vlm, 1, H100), 1)
    assert waves is not None and "model.gradient_checkpointing=true" in waves and "free_during_update" not in waves


def test_one_process_is_told_to_shard_to_offload(tmp_path, tokenizer):
    counts = _counts(tmp_path, tokenizer, "3b")
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", [])
    with pytest.raises(ConfigError, match="distributed.backend=fsdp distributed.cpu_offload=true"):
        require_fit(config, counts, 1, H100)


def test_lora_and_no_reference_shrink_the_estimate(tmp_path, tokenizer):
    path = _saved_config(tmp_path / "3b", preset_config("3b", tokenizer))
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", ["lora.enabled=true", "algorithm.advantage=grpo"])
    estimate = estimate_memory(config, count_model(path, lora_rank=64), 1, H100)
    assert "critic" not in estimate.parts and "reference" not in estimate.parts
    assert estimate.parts["actor"] < 14 * GIB and estimate.fits()  # float32 base 12.3 GB + adapters


def test_under_lora_the_critic_trains_all_its_weights_and_the_actor_holds_its_whole_base(tmp_path, tokenizer):
    """PPO + critic at 3B with LoRA and a 12 GB cache on one H100: the adapters go on the actor alone, so the
    critic's float32 states (46 GiB) leave no room for the cache; counted as adapters, the critic had 12.8 GiB
    and the run fit with 20 GiB to spare."""
    path = _saved_config(tmp_path / "3b", preset_config("3b", tokenizer))
    counts = count_model(path, lora_rank=64)
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml",
                         ["lora.enabled=true", "model.engine.kv_cache_gb=12"])
    estimate = estimate_memory(config, counts, 1, H100)
    assert estimate.parts["actor"] == 4 * counts.total + 16 * counts.trained  # the base beside its adapters
    assert estimate.parts["critic"] == 16 * (counts.total + counts.hidden)
    assert estimate.gradients == 4 * (counts.trained + counts.total + counts.hidden)
    assert not estimate.fits()
    # Told so where LoRA is offered: it leaves the critic's states as they are.
    full = estimate_memory(load_config(TrainConfig, "configs/ragen_sokoban.yaml", []), count_model(path), 1, H100)
    advice = fit_advice(load_config(TrainConfig, "configs/ragen_sokoban.yaml", []), count_model(path), full, 1)
    assert "lora.enabled=true (the actor trains adapters only; the critic still trains all its weights; the " \
           "reference is the base)" in advice
    assert advice.index("distributed.nproc_per_node=2 (training states are divided among the GPUs)") < \
        next(index for index, text in enumerate(advice) if text.startswith("lora.enabled=true"))


def test_the_estimate_counts_the_trained_and_frozen_weights_the_trainer_holds_under_lora(tiny_model_dir, tmp_path):
    """The estimate's actor and critic against the parameters of a trainer built with LoRA and a critic."""
    from tests.training.trainer_runs import config as trainer_config
    from turnrl.training.trainer import Trainer

    trainer = Trainer(trainer_config(tiny_model_dir, tmp_path, "lora.enabled=true", "lora.r=8"))
    try:
        assert trainer.critic is not None

        def states(model: torch.nn.Module) -> int:
            return sum((16 if p.requires_grad else 4) * p.numel() for p in model.parameters())

        estimate = estimate_memory(trainer.config, count_model(tiny_model_dir, lora_rank=8), 1, H100)
        assert estimate.parts["actor"] == states(trainer.actor)
        assert estimate.parts["critic"] == pytest.approx(states(trainer.critic), abs=16)  # the value head's bias
    finally:
        trainer.close()


def test_activations_grow_with_the_micro_batch_and_shrink_with_checkpointing(tmp_path, tokenizer):
    counts = _counts(tmp_path, tokenizer, "3b")
    assert activation_bytes(counts, 16384, True) < activation_bytes(counts, 8192, False)
    head_backward = 6 * 151936 * 2048  # the float32 sum of the head's gradient and one chunk's bf16 product
    # One process: 30 h + 4 kv + 8 i bytes a token a layer (kv: 2 key heads of 128), 12 h and two int64 indices
    # outside the layers.
    assert activation_bytes(counts, 8192, False) == pytest.approx(
        8192 * (36 * (30 * 2048 + 4 * 256 + 8 * 11008) + 12 * 2048 + 16) + 8 * 2048 * 151936 + 2 * 151936 * 2048
        + head_backward)
    assert activation_bytes(counts, 8192, False) - activation_bytes(counts, 8192, False, trains_head=False) == \
        pytest.approx(head_backward)




def test_a_model_that_cannot_be_counted_starts_unchecked(tmp_path):
    """The estimate never stops a run by failing itself: a config transformers cannot build is skipped (a GPU
    run's check, reached here without a GPU since the count fails first); a CPU run is never checked."""
    (tmp_path / "config.json").write_text('{"model_type": "no_such_architecture"}')
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", [])
    assert check_memory(config, tmp_path, torch.device("cuda"), 4) is None
    assert check_memory(config, tmp_path, torch.device("cpu"), 1) is None


@pytest.mark.parametrize("fixture, preset", [("tiny_model_dir", "tiny"), ("tiny_vlm_dir", "vlm-tiny")])
def test_a_built_in_model_is_counted_from_its_config_alone_as_its_build(fixture, preset, builtin_dir, tmp_path,
                                                                       request):
    built = count_model(request.getfixturevalue(fixture))
    config = builtin_model_config(ModelConfig(builtin_preset=preset, builtin_dir=str(builtin_dir)))
    assert count_model(_saved_config(tmp_path, config)) == built


def test_the_fit_report_names_the_parts_and_what_to_turn_on(tmp_path, tokenizer):
    counts = _counts(tmp_path, tokenizer, "7b")
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", [])
    fits, line = fit_report(config, counts, 4, H100)
    assert not fits and line.startswith("4 GPUs: does not fit (actor ")
    assert "model.engine.free_during_update=true" in line and "distributed.cpu_offload=true" in line
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml",
                         ["model.engine.free_during_update=true", "model.engine.kv_cache_gb=12"])
    fits, line = fit_report(config, counts, 4, H100)
    assert fits and line.startswith("4 GPUs: fits (actor ") and "turn on" not in line
    assert fit_report(config, counts, 1, H100)[1].startswith("1 GPU: does not fit")


def test_a_rollback_bound_counts_its_copy_of_the_trained_weights_and_moments_while_updating(tmp_path, tokenizer):
    """``algorithm.rollback_kl`` copies the actor's float32 weights and AdamW's two moments before each optimizer
    step (each process its shards): held only while updating; none offloaded to the host."""
    counts = _counts(tmp_path, tokenizer, "3b")
    grpo = ["algorithm.advantage=grpo", "algorithm.kl_coef=0", "model.engine.free_during_update=true"]
    off = estimate_memory(load_config(TrainConfig, "configs/ragen_sokoban.yaml", grpo), counts, 2, H100)
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", [*grpo, "algorithm.rollback_kl=0.5"])
    on = estimate_memory(config, counts, 2, H100)
    assert "rollback copy" not in off.parts and on.parts["rollback copy"] == 12 * counts.trained / 2
    assert on.groups()[1] == pytest.approx(off.groups()[1] + 12 * counts.trained / 2)
    offload = load_config(TrainConfig, "configs/ragen_sokoban.yaml",
                          [*grpo, "algorithm.rollback_kl=0.5", "distributed.cpu_offload=true"])
    assert "rollback copy" not in estimate_memory(offload, counts, 2, H100).parts


def test_a_run_sharing_the_card_is_checked_against_its_share(tmp_path, tokenizer, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB))
    path = _saved_config(tmp_path / "3b", preset_config("3b", tokenizer))
    grpo = ["algorithm.advantage=grpo", "algorithm.kl_coef=0", "model.engine.kv_cache_gb=1"]
    whole = check_memory(load_config(TrainConfig, "configs/ragen_sokoban.yaml", grpo), path, torch.device("cuda"), 4)
    assert whole is not None and whole.estimate.device_bytes == 80 * GIB and whole.estimate.fits()
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", [*grpo, "run.gpu_share=0.25"])
    with pytest.raises(ConfigError, match=r"GPU's 20.0 GiB.*run.gpu_share=0.25 of a 80.0 GiB GPU: run fewer"):
        check_memory(config, path, torch.device("cuda"), 4)
    config.run.gpu_share = 0.5
    assert check_memory(config, path, torch.device("cuda"), 4).estimate.device_bytes == 40 * GIB


def test_an_sft_start_is_not_checked_for_the_update_it_never_runs(tmp_path, tokenizer, monkeypatch):
    """``run.steps=0`` (an SFT start) has no RL update: the RL estimate (here the 3B recipe on a fifth of an
    80 GB card, which does not fit) does not stop it; its SFT stage checks its own micro-batches."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB))
    path = _saved_config(tmp_path / "3b", preset_config("3b", tokenizer))
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", ["run.gpu_share=0.2"])
    with pytest.raises(ConfigError, match="does not fit|needs about"):
        check_memory(config, path, torch.device("cuda"), 1)
    config.run.steps = 0
    assert check_memory(config, path, torch.device("cuda"), 1) is None


def test_a_cache_that_holds_fewer_sequences_than_a_step_plays_is_named_with_what_gives_it_room(tmp_path, tokenizer):
    """The 3B recipe without checkpointing at 8k-token micro-batches on 4 H100s: the update left the cache
    0.5 GiB, 3 rows of 4,096 tokens, and 32 episodes a process rolled out 3 at a time (docs/benchmarks.md); the
    estimate leaves it less (the head's backward counted), and the engine still plays one at a time."""
    shape = preset_config("3b", tokenizer)
    counts = _counts(tmp_path, tokenizer, "3b")
    assert counts.key_width == shape.num_hidden_layers * shape.num_key_value_heads * \
        (shape.hidden_size // shape.num_attention_heads)
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml",
                         ["model.gradient_checkpointing=false", "algorithm.micro_batch_tokens=8192"])
    estimate = require_fit(config, counts, 4, H100)
    cache = estimate.parts["key/value cache"]
    page = 2 * 2 * counts.key_width * PAGE_TOKENS  # keys and values in bf16
    sequences = max(1, (int(cache // page) - 1) // pages_for(4096))  # at full length, beside the scratch page
    assert full_length_sequences(config, counts, cache) == sequences < 32
    note = rollout_in_waves(config, counts, estimate, 4)
    assert note is not None and f"holds {sequences} sequence" in note and "plays 32 episodes" in note
    assert "model.engine.free_during_update=true" in note and "model.gradient_checkpointing=true" in note
    fits, line = fit_report(config, counts, 4, H100)
    assert fits and line.endswith(f"; but {note}")
    config.model.engine.free_during_update = True  # the cache no longer shares the update's memory
    assert rollout_in_waves(config, counts, require_fit(config, counts, 4, H100), 4) is None
    config.model.engine.kv_cache_gb = 0.25  # a cache set by hand: make it larger
    note = rollout_in_waves(config, counts, require_fit(config, counts, 4, H100), 4)
    assert note is not None and "a larger model.engine.kv_cache_gb" in note


def test_rows_shorter_than_a_whole_history_episode_may_grow_are_named():
    short = ["model.engine.max_seq_len=4096"]
    visgym = load_config(TrainConfig, "configs/visgym_maze.yaml", short)  # 16,384 tokens an episode, rows of 4,096
    note = rows_shorter_than_episodes(visgym)
    assert note is not None and "model.engine.max_seq_len=4096" in note and "max_seq_len=16384 to give" in note
    assert rows_shorter_than_episodes(load_config(TrainConfig, "configs/visgym_maze.yaml", [])) is None
    assert rows_shorter_than_episodes(load_config(TrainConfig, "configs/visgym_maze.yaml",
                                                  [*short, "model.backend=hf"])) is None
    # A one-turn window bounds every prompt, whatever the agent's budget: the Sokoban recipe's 512-token rows
    assert rows_shorter_than_episodes(load_config(TrainConfig, "configs/sokoban_quickstart.yaml", [])) is None


def test_passes_that_hold_one_sequence_each_are_named_with_the_budget_that_pairs_them():
    """4.1k-token sequences in 8,192-token passes (the VisGym vlm-3b step at 15 turns): one a pass, 51% full; the
    note names twice the longest, rounded up to 128 tokens. Passes that pair their rows, a budget far over what a
    step's few rows need, or passes of rows (no budget) say nothing."""
    half = {"actor/pass_fill": 0.51, "batch/sequence_length_max": 4227.0}
    note = half_full_passes_note(half, 8192)
    assert note is not None and note.startswith("the update's passes ran 51% full: sequences of up to 4,227 tokens")
    assert "algorithm.micro_batch_tokens=8192" in note and "algorithm.micro_batch_tokens=8576 lets two" in note
    assert half_full_passes_note({**half, "actor/pass_fill": 0.8}, 8192) is None
    assert half_full_passes_note({"actor/pass_fill": 0.2, "batch/sequence_length_max": 900.0}, 8192) is None
    assert half_full_passes_note(half, 0) is None and half_full_passes_note({}, 8192) is None


def test_a_full_key_value_cache_is_named_with_what_happened_and_the_setting_to_raise():
    """Idle rows given up for pages, or turns that waited for them: the note says which and how many, and names the
    setting (a size set by hand, or the default's). A new episode taking over a finished one's row (``evictions``
    alone: the validation's rows at the first step, the last batch's) is no shortage."""
    assert cache_full_note({"generation/evictions": 64.0, "generation/prefill_tokens": 1e5}, 8.0) is None
    assert cache_full_note({}, 0.0) is None
    both = cache_full_note({"generation/page_evictions": 35.0, "generation/page_waits": 12.0}, 8.0)
    assert both is not None and both.startswith("the engine's key/value cache (model.engine.kv_cache_gb=8) was full")
    assert "dropped 35 idle conversations for their pages" in both and "made 12 turns wait for pages" in both
    assert "a larger model.engine.kv_cache_gb (or 0, the default" in both
    one = cache_full_note({"generation/page_evictions": 1.0}, 0.0)
    assert one is not None and "(its default size)" in one and "1 idle conversation for its pages" in one
    assert "wait for pages" not in one and "larger than the default" in one
    waits = cache_full_note({"generation/page_waits": 1.0}, 2.5)
    assert waits is not None and "made 1 turn wait for pages" in waits and "dropped" not in waits


def test_rows_counted_at_max_seq_len_are_named_among_what_to_turn_on(tmp_path, tokenizer):
    counts = _counts(tmp_path, tokenizer, "small")
    config = load_config(TrainConfig, "configs/quickstart.yaml", ["model.engine.max_seq_len=4096"])
    fits, line = fit_report(config, counts, 1, 8 * GIB)
    assert not fits and "a smaller model.engine.max_seq_len, the longest sample (the estimate counts 64 samples " \
                        "of 4096 tokens a micro-batch)" in line
    assert fit_report(load_config(TrainConfig, "configs/quickstart.yaml", []), counts, 1, 8 * GIB)[0]


def _vlm_counts(tmp_path: Path, tokenizer, preset: str = "vlm-0.5b"):
    return count_model(_saved_config(tmp_path / preset, vlm_config(preset, tokenizer)))


def test_under_fsdp_each_process_holds_the_frozen_towers_whole(tmp_path, tokenizer):
    """VAGEN-Full's PPO with a critic and a reference: each model's frozen tower counts whole, in bf16, on every
    process; the rest of its weights are divided among the processes; one process holds everything."""
    counts = _vlm_counts(tmp_path, tokenizer)
    tower = counts.frozen_tower
    assert 0 < tower == counts.total - counts.trained
    config = load_config(TrainConfig, "configs/vagen_full_frozenlake.yaml", ["algorithm.kl_coef=0.01"])
    four = estimate_memory(config, counts, 4, H200).parts
    assert four["actor"] == pytest.approx(16 * counts.trained / 4 + 2 * tower)
    critic_trained = counts.total - counts.head + counts.hidden - tower
    assert four["critic"] == pytest.approx(16 * critic_trained / 4 + 2 * tower)
    assert four["reference"] == pytest.approx(2 * (counts.total - tower) / 4 + 2 * tower)
    one = estimate_memory(config, counts, 1, H200).parts
    assert one["actor"] == 16 * counts.trained + 4 * tower and one["reference"] == 2 * counts.total


def test_sft_holds_the_whole_model_s_states_one_micro_batch_and_the_weight_casts(tmp_path, tokenizer):
    counts = _vlm_counts(tmp_path, tokenizer)
    config = load_config(TrainConfig, "configs/vagen_full_frozenlake.yaml", ["model.builtin_preset=vlm-0.5b"])
    estimate = sft_estimate(config, counts, 32 * 300, H200)
    assert estimate.parts == {
        "model": 16 * counts.trained + 4 * (counts.total - counts.trained),  # the tower frozen: weights only
        "activations": activation_bytes(counts, 32 * 300, False),
        "weight casts": 2 * (counts.total - counts.frozen_tower),  # a frozen tower's casts are not kept
    }
    checkpointed = load_config(TrainConfig, "configs/vagen_full_frozenlake.yaml",
                               ["model.gradient_checkpointing=true"])
    assert set(sft_estimate(checkpointed, counts, 9600, H200).parts) == {"model", "activations"}


def test_sft_that_cannot_fit_its_share_is_told_the_micro_batch_that_does(tmp_path, tokenizer, monkeypatch):
    """vlm-0.5b's SFT on a sixth of an H200 (several runs on the card), 32 samples a micro-batch: long samples
    (600 tokens) are stopped before the model loads, with the micro-batch that fits; the whole card fits them."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=H200))
    path = _saved_config(tmp_path / "vlm", vlm_config("vlm-0.5b", tokenizer))
    counts = count_model(path)
    overrides = ["sft.batch_size=32", "sft.micro_batch_size=32"]
    whole = load_config(TrainConfig, "configs/vagen_full_frozenlake.yaml", overrides)
    assert check_sft_memory(whole, path, 600, 10_000, torch.device("cuda")).fits()
    shared = load_config(TrainConfig, "configs/vagen_full_frozenlake.yaml", [*overrides, "run.gpu_share=0.16"])
    budget, margin = 0.16 * H200, run_margin(shared, 0.16 * H200)  # the margin of the check's environment
    fitting = max(m for m in range(1, 33) if sft_estimate(shared, counts, m * 600, budget, margin).fits())
    assert 1 < fitting < 32 and not sft_estimate(shared, counts, (fitting + 1) * 600, budget, margin).fits()
    with pytest.raises(ConfigError) as error:
        check_sft_memory(shared, path, 600, 10_000, torch.device("cuda"))
    message = str(error.value)
    assert "micro-batches of 32 samples of up to 600 tokens" in message
    assert f"sft.micro_batch_size={fitting} (sft.batch_size=32 stays" in message
    assert "model.gradient_checkpointing=true" in message and "run.gpu_share=0.16 of a 139.8 GiB GPU" in message
    # Fewer samples than a micro-batch: the micro-batch is the samples, and the advice stays below them.
    assert check_sft_memory(shared, path, 600, fitting, torch.device("cuda")).fits()
    with pytest.raises(ConfigError, match=f"micro-batches of {fitting + 1} samples .* sft.micro_batch_size={fitting} "):
        check_sft_memory(shared, path, 600, fitting + 1, torch.device("cuda"))
    # SFT trains the whole model, LoRA or not: it is counted without adapters.
    lora = load_config(TrainConfig, "configs/vagen_full_frozenlake.yaml", [*overrides, "lora.enabled=true"])
    assert check_sft_memory(lora, path, 600, 10_000, torch.device("cuda")).parts["model"] == \
        16 * counts.trained + 4 * (counts.total - counts.trained)
    shared.run.check_memory = False
    assert check_sft_memory(shared, path, 600, 10_000, torch.device("cuda")) is None
    assert check_sft_memory(whole, path, 600, 10_000, torch.device("cpu")) is None


def test_sft_of_a_model_whose_states_alone_outgrow_the_gpu_is_told_it_runs_in_one_process(tmp_path, tokenizer,
                                                                                         monkeypatch):
    """SFT runs in one process (rank 0 under torchrun): 7B's float32 training states alone (122 GB) exceed an
    H100, whatever the micro-batch."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=H100))
    path = _saved_config(tmp_path / "7b", preset_config("7b", tokenizer))
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", ["distributed.nproc_per_node=4"])
    with pytest.raises(ConfigError, match=r"SFT needs about model 1\d\d\.\d .* a GPU with more memory .* "
                                          r"sft.enabled=false model.path=DIR"):
        check_sft_memory(config, path, 256, 10_000, torch.device("cuda"))


def test_sft_that_fits_only_with_checkpointing_and_a_smaller_micro_batch_is_told_both(tmp_path, tokenizer):
    counts = _vlm_counts(tmp_path, tokenizer)
    config = load_config(TrainConfig, "configs/vagen_full_frozenlake.yaml", ["sft.micro_batch_size=32"])
    states = sft_estimate(config, counts, 0, H200).parts["model"]
    checkpointed = replace(config, model=replace(config.model, gradient_checkpointing=True))
    # Room for the states and 4 checkpointed rows of 2,000 tokens, not for one row without checkpointing.
    budget = states + sft_estimate(checkpointed, counts, 4 * 2000, H200).parts["activations"] + GIB / 100
    assert not sft_estimate(config, counts, 2000, budget).fits()
    assert sft_fit_advice(config, counts, 32, 2000, budget) == [
        "set model.gradient_checkpointing=true sft.micro_batch_size=4"]
    assert sft_fit_advice(config, counts, 4, 2000, budget) == ["set model.gradient_checkpointing=true"]
    assert sft_fit_advice(config, counts, 32, 2000, states / 2) == [SFT_ELSEWHERE]


# --------------------------------------------------------------------------- the allocator and its margin
def test_the_documented_one_h200_row_fits_with_expandable_segments_and_is_flagged_without_them(tmp_path, tokenizer):
    """3B PPO + critic (StarPO-S), compiled, one process on an H200 (docs/benchmarks.md): without expandable
    segments it ran out of memory with 7.15 GiB reserved but unallocated; with them it peaked at 132.1 GiB."""
    counts = _counts(tmp_path, tokenizer, "3b")
    config = load_config(TrainConfig, "configs/ragen_sokoban.yaml", [
        "model.gradient_checkpointing=false", "algorithm.micro_batch_tokens=8192", "model.compile=true",
        "model.engine.free_during_update=true", "model.engine.kv_cache_gb=12"])
    without = allocator_margin(H200, expandable=False)
    assert without - CUDA_CONTEXT_BYTES >= 7.15 * GIB and allocator_margin(H200, expandable=True) < 1.1 * GIB
    assert estimate_memory(config, counts, 1, H200).fits()  # the estimate alone fits: only the margin tells
    estimate = require_fit(config, counts, 1, H200, allocator_margin(H200, expandable=True))
    assert 132.1 * GIB <= estimate.total <= 136 * GIB  # measured 132.1 here, 134.1-134.3 in earlier runs
    with pytest.raises(ConfigError) as error:
        require_fit(config, counts, 1, H200, without)
    message = str(error.value)
    assert ("of the GPU's 139.8 GiB less a 8.3 GiB allocator margin, which keeps room for the CUDA context and what "
            "an allocator without expandable segments cannot reuse (estimated per GPU, 1 process): turn on") in message
    assert "turn on expandable segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the allocator margin " \
           "then leaves 7.3 GiB more)" in message
    fits, line = fit_report(config, counts, 1, H200, without)
    assert not fits and "allocator margin" in line


def test_a_default_cache_leaves_the_margin_free_where_it_is_larger_than_the_usual_five_percent(tmp_path, tokenizer):
    """8B GRPO + reference on 4 GPUs, whose default cache is what the update leaves."""
    counts = count_model(_saved_config(tmp_path / "vlm-8b", vlm_config("vlm-8b", tokenizer)))
    config = load_config(TrainConfig, "configs/visgym_maze.yaml", ["algorithm.micro_batch_tokens=8192"])
    margin = allocator_margin(H100, expandable=False)
    assert margin > 0.05 * H100
    estimate = require_fit(config, counts, 4, H100, margin)  # the default cache takes what the margin leaves
    assert estimate.total + margin == pytest.approx(H100) and estimate.fits()
    usual = require_fit(config, counts, 4, H100, allocator_margin(H100, expandable=True))
    assert usual.total == pytest.approx(0.95 * H100)


# --------------------------------------------------------------------------- partial checkpointing
H100_FORM = ["model.gradient_checkpointing=true", "model.engine.free_during_update=true", "model.engine.kv_cache_gb=10",
             "model.compile=true", "algorithm.micro_batch_tokens=16384", "sft.enabled=false"]
"""VisGym's maze at vlm-3b as it fits one H100 (docs/benchmarks.md, "VLM steps")."""


def test_layers_left_out_of_checkpointing_cost_their_activations_and_casts(tmp_path, tokenizer):
    """Each layer that keeps its activations adds its set for the pass's tokens and its weights' bf16 casts; none
    kept is checkpointing whole, all kept is about no checkpointing."""
    counts = _vlm_counts(tmp_path, tokenizer, "vlm-3b")

    def estimate(*overrides: str):
        return estimate_memory(load_config(TrainConfig, "configs/visgym_maze.yaml", [*H100_FORM, *overrides]),
                               counts, 1, H100)

    whole, none_kept = estimate(), estimate(f"model.checkpointed_layers={counts.layers}")
    assert none_kept.parts == whole.parts and "weight casts" not in whole.parts
    five = estimate(f"model.checkpointed_layers={counts.layers - 5}")
    assert five.parts["weight casts"] == kept_layer_cast_bytes(counts, 5) == 10 * counts.layer_params
    # A kept layer's set (compiled: without its norms' copies) in place of its input, for each of 16,384 tokens;
    # the one layer's set recomputed at a time comes after five kept sets are freed, which are larger: none on top.
    each = (kept_token_bytes(counts, False, compiled=True) - kept_token_bytes(counts, True, compiled=True)) / 36
    recomputed_set = layer_token_bytes(counts, MIXED)
    assert 5 * (each + 4 * counts.hidden) > recomputed_set
    assert five.parts["activations"] - whole.parts["activations"] == 16384 * (5 * each - recomputed_set)
    # Every layer kept: no layer recomputes, so no recomputed set on top; as without checkpointing, less its casts.
    all_kept, without = estimate("model.checkpointed_layers=0"), estimate("model.gradient_checkpointing=false")
    assert all_kept.parts["activations"] == without.parts["activations"]
    assert all_kept.parts["weight casts"] == 72 * counts.layer_params < without.parts["weight casts"]
    # Each layer more recomputed holds less, all the way.
    totals = [estimate(f"model.checkpointed_layers={n}").total for n in range(counts.layers + 1)]
    assert all(fewer > more for fewer, more in zip(totals, totals[1:]))


def test_the_fewest_recomputed_layers_that_fit_are_said_where_a_run_fits_or_does_not(tmp_path, tokenizer):
    """On an H100 the 16k-token passes leave room for some layers' activations: `turnrl memory` says how few layers
    may recompute; a run that keeps more than fit is told the fewest; one without checkpointing that does not fit
    is told to checkpoint, and how few layers suffice."""
    counts = _vlm_counts(tmp_path, tokenizer, "vlm-3b")
    config = load_config(TrainConfig, "configs/visgym_maze.yaml", H100_FORM)
    margin = allocator_margin(H100, expandable=True)
    fewest = fewest_checkpointed_layers(config, counts, 1, H100, margin)
    assert fewest is not None and 0 < fewest < counts.layers

    def with_layers(layers: int | None):
        return replace(config, model=replace(config.model, checkpointed_layers=layers))

    assert estimate_memory(with_layers(fewest), counts, 1, H100, margin).fits()
    assert not estimate_memory(with_layers(fewest - 1), counts, 1, H100, margin).fits()
    fits, line = fit_report(config, counts, 1, H100, margin)
    assert fits and f"model.checkpointed_layers={fewest} would fit too: the last {counts.layers - fewest} of the " \
        f"{counts.layers} decoder layers keep their activations" in line
    assert "would fit too" not in fit_report(with_layers(fewest), counts, 1, H100, margin)[1]
    too_many = with_layers(fewest - 2)
    advice = fit_advice(too_many, counts, estimate_memory(too_many, counts, 1, H100, margin), 1)
    assert f"model.checkpointed_layers={fewest} (the fewest recomputed layers that fit)" in advice
    eager = replace(config, model=replace(config.model, gradient_checkpointing=False))
    advice = fit_advice(eager, counts, estimate_memory(eager, counts, 1, H100, margin), 1)
    assert f"model.gradient_checkpointing=true model.checkpointed_layers={fewest} (the fewest recomputed layers " \
        "that fit)" in advice
    # Where nothing fits even with every layer recomputed, there is no fewest.
    assert fewest_checkpointed_layers(config, counts, 1, 40 * GIB, margin) is None


def test_a_run_that_recomputes_more_layers_than_it_must_is_told_the_fewest_at_its_start(tmp_path, tokenizer,
                                                                                        monkeypatch):
    """`turnrl train` prints what `turnrl memory` says beside its estimate: on an 80 GB card the H100 form fits
    with fewer layers recomputed; a run that names its layers is not told."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=H100))
    path = _saved_config(tmp_path / "vlm-3b", vlm_config("vlm-3b", tokenizer))
    config = load_config(TrainConfig, "configs/visgym_maze.yaml", H100_FORM)
    checked = check_memory(config, path, torch.device("cuda"), 1)
    margin = run_margin(config, H100)
    fewest = fewest_checkpointed_layers(config, count_model(path), 1, H100, margin)
    assert checked is not None and checked.estimate == estimate_memory(config, count_model(path), 1, H100, margin)
    assert checked.faster is not None and checked.faster.startswith(f"model.checkpointed_layers={fewest} would fit")
    named = load_config(TrainConfig, "configs/visgym_maze.yaml", [*H100_FORM, f"model.checkpointed_layers={fewest}"])
    assert check_memory(named, path, torch.device("cuda"), 1).faster is None


def test_the_fewest_recomputed_layers_leave_a_default_cache_its_size(tmp_path, tokenizer):
    """A default cache (``kv_cache_gb=0``) held beside the update is sized into what the update leaves: layers kept
    beyond that room would fit only by shrinking the cache, so the fewest that keep it whole are named."""
    counts = _vlm_counts(tmp_path, tokenizer, "vlm-3b")
    config = load_config(TrainConfig, "configs/visgym_maze.yaml",
                         [*H100_FORM, "model.engine.kv_cache_gb=0", "model.engine.free_during_update=false"])
    margin = allocator_margin(H100, expandable=True)
    cache = estimate_memory(config, counts, 1, H100, margin).parts["key/value cache"]
    assert cache > 0
    fewest = fewest_checkpointed_layers(config, counts, 1, H100, margin)
    assert fewest is not None
    named = estimate_memory(replace(config, model=replace(config.model, checkpointed_layers=fewest)), counts, 1,
                            H100, margin)
    assert named.fits() and named.parts["key/value cache"] >= cache
    if fewest > 0:
        one_less = estimate_memory(replace(config, model=replace(config.model, checkpointed_layers=fewest - 1)),
                                   counts, 1, H100, margin)
        assert one_less.parts["key/value cache"] < cache


def test_a_count_past_the_models_layers_is_refused_before_the_model_loads(tmp_path, tokenizer):
    counts = _vlm_counts(tmp_path, tokenizer, "vlm-3b")
    config = load_config(TrainConfig, "configs/visgym_maze.yaml", [*H100_FORM, "model.checkpointed_layers=37"])
    with pytest.raises(ConfigError, match="model.checkpointed_layers=37 exceeds the model's 36 decoder layers"):
        estimate_memory(config, counts, 1, H100)


def test_sft_counts_the_kept_layers_and_is_told_to_recompute_them_all(tmp_path, tokenizer):
    """SFT keeps the layers ``model.checkpointed_layers`` leaves out, with their weights' casts; where that does not
    fit and every layer recomputed does, it is told so."""
    counts = _vlm_counts(tmp_path, tokenizer, "vlm-3b")
    every = load_config(TrainConfig, "configs/visgym_maze.yaml", H100_FORM)
    kept = replace(every, model=replace(every.model, checkpointed_layers=6))
    whole, partial = (sft_estimate(config, counts, 16384, H100) for config in (every, kept))
    assert "weight casts" not in whole.parts and partial.parts["weight casts"] == kept_layer_cast_bytes(counts, 30)
    assert partial.parts["activations"] > whole.parts["activations"]
    budget = (whole.total + partial.total) / 2
    assert sft_fit_advice(kept, counts, 1, 16384, budget)[-1] == "set model.checkpointed_layers=null"


def test_checkpointed_layers_need_checkpointing_and_a_count_of_none_or_more():
    with pytest.raises(ConfigError, match="set model.gradient_checkpointing=true too"):
        load_config(TrainConfig, "configs/visgym_maze.yaml", ["model.gradient_checkpointing=false",
                                                              "model.checkpointed_layers=30"])
    with pytest.raises(ConfigError, match=r"model.checkpointed_layers=-1 is out of range"):
        load_config(TrainConfig, "configs/visgym_maze.yaml", ["model.gradient_checkpointing=true",
                                                              "model.checkpointed_layers=-1"])
