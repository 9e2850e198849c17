"""Supervised fine-tuning: demos and JSONL chats to samples with the loss on assistant tokens, and it learns."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from turnrl.agent.formats import get_format
from turnrl.config import AgentConfig, ConfigError, load_config
from turnrl.envs import make
from turnrl.training.batch import collate
from turnrl.training.commands import sft_only
from turnrl.training.train_config import SFTConfig, TrainConfig
from turnrl.training.model_passes import token_logprobs
from turnrl.training.sft import (
    PARALLEL_CHATS,
    ChatError,
    SoftTargets,
    action_tokens,
    chat_picture_samples,
    chat_samples,
    conversation_samples,
    data_workers,
    demo_target_positions,
    expert_demos,
    read_chat_jsonl,
    sft_train,
    trajectory_messages,
    with_pixels,
)

CHAT = [
    {"role": "system", "content": "You play a game."},
    {"role": "user", "content": "board 1"},
    {"role": "assistant", "content": "<answer>Left</answer>"},
    {"role": "user", "content": "board 2"},
    {"role": "assistant", "content": "<answer>Down</answer>"},
    {"role": "user", "content": "board 3"},
    {"role": "assistant", "content": "<answer>Right</answer>"},
]


def assistant_ids(tokenizer, messages):
    return [tokenizer.encode(m["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
            for m in messages if m["role"] == "assistant"]


# --------------------------------------------------------------------------- samples
def test_chat_sample_trains_on_assistant_tokens_and_eos_only(tiny_tokenizer):
    (sample,) = conversation_samples(CHAT, tiny_tokenizer, window=None)
    targets = assistant_ids(tiny_tokenizer, CHAT)
    trained = [t for t, m in zip(sample.input_ids, sample.loss_mask) if m]
    assert trained == [i for ids in targets for i in ids]
    assert sample.turn_ends == [i for i, (m, nxt) in enumerate(zip(sample.loss_mask, sample.loss_mask[1:] + [0]))
                                if m and not nxt]
    assert [sample.input_ids[e] for e in sample.turn_ends] == [tiny_tokenizer.eos_token_id] * 3
    context = tiny_tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if not m])
    assert all(text in context for text in ("You play a game.", "board 1", "board 2", "board 3"))
    assert "<answer>" not in context


def test_chat_sample_is_the_chat_templates_rendering(tiny_tokenizer):
    (sample,) = conversation_samples(CHAT, tiny_tokenizer, window=None)
    rendered = tiny_tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert tiny_tokenizer.decode(sample.input_ids) == rendered


def test_chat_ending_with_a_user_message_drops_the_unanswered_tail(tiny_tokenizer):
    (sample,) = conversation_samples(CHAT + [{"role": "user", "content": "board 4"}], tiny_tokenizer, window=None)
    assert sample.input_ids == conversation_samples(CHAT, tiny_tokenizer, window=None)[0].input_ids


def test_chat_without_system_message_works(tiny_tokenizer):
    (sample,) = conversation_samples(CHAT[1:], tiny_tokenizer, window=None)
    assert sum(sample.loss_mask) == sum(len(ids) for ids in assistant_ids(tiny_tokenizer, CHAT))


@pytest.mark.parametrize("window", [1, 2])
def test_windowed_chat_gives_one_sample_per_assistant_turn(tiny_tokenizer, window):
    samples = conversation_samples(CHAT, tiny_tokenizer, window=window)
    targets = assistant_ids(tiny_tokenizer, CHAT)
    assert [s.turn for s in samples] == [0, 1, 2]
    for sample, target in zip(samples, targets):
        n = len(target)
        assert sample.input_ids[-n:] == target and sample.loss_mask == [0] * (len(sample.input_ids) - n) + [1] * n
        assert sample.turn_ends == [len(sample.input_ids) - 1]
    last_prompt = tiny_tokenizer.decode(samples[2].input_ids[: -len(targets[2])])
    assert "board 3" in last_prompt and "You play a game." in last_prompt
    assert ("board 1" in last_prompt) == (window > 2) and ("board 2" in last_prompt) == (window > 1)


@pytest.mark.parametrize(
    "messages, match",
    [
        ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}], "start with a user"),
        ([{"role": "user", "content": "x"}], "reply"),
        ([{"role": "user", "content": "x"}, {"role": "user", "content": "y"}], "expected 'assistant'"),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": "x"}, {"role": "assistant", "content": "a"},
          {"role": "assistant", "content": "b"}], "message 3 has role 'assistant', expected 'user'"),
    ],
)
def test_malformed_chats_are_rejected(tiny_tokenizer, messages, match):
    with pytest.raises(ValueError, match=match):
        conversation_samples(messages, tiny_tokenizer, window=None)


# --------------------------------------------------------------------------- JSONL chats
def test_jsonl_chats_parse_and_skip_blank_lines(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n\n" + json.dumps({"messages": CHAT[1:3], "id": 7}) + "\n")
    assert read_chat_jsonl(path) == [CHAT, CHAT[1:3]]


@pytest.mark.parametrize("bad_line", ['{"messages": [', '{"msgs": []}', "[1, 2]", '"text"',
                                      pytest.param('{"messages": ' + "[" * 100_000, id="nested too deep")])
def test_malformed_jsonl_line_is_named_by_its_line_number(tmp_path, bad_line):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": CHAT}) + "\n" + bad_line + "\n")
    with pytest.raises(ValueError, match=r"chats\.jsonl:3: expected a JSON object with a 'messages' list"):
        read_chat_jsonl(path)


@pytest.mark.parametrize(("content", "said"), [
    (["a string where a part goes"], "content part 0 is a str, not an object"),
    ([{"type": "text", "text": "x"}, {"type": "image_url"}], "content part 1 is an image_url part without its url"),
    ([{"type": "image_url", "image_url": {}}], "content part 0 is an image_url part without its url"),
])
def test_a_malformed_content_part_is_named_by_its_line(tmp_path, content, said):
    path = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]}
    path.write_text("\n" + json.dumps(chat) + "\n")
    with pytest.raises(ValueError, match=f"chats.jsonl:2: a user message's {said}"):
        read_chat_jsonl(path)


def test_jsonl_without_chats_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n  \n")
    with pytest.raises(ValueError, match="holds no chats"):
        read_chat_jsonl(path)


def test_jsonl_line_whose_messages_are_not_a_list_is_named_by_its_line_number(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n" + json.dumps({"messages": "hello"}) + "\n")
    with pytest.raises(ValueError, match=r"chats\.jsonl:2"):
        read_chat_jsonl(path)


# --------------------------------------------------------------------------- expert demos
def demo_setup(**sft):
    agent = AgentConfig(format="no_think", max_turns=6, max_actions_per_episode=6, env_instructions=False,
                        format_instructions=False, system_prompt="FrozenLake: reach G.")
    config = SFTConfig(**{"episodes": 8, "random_action_share": 0.0, **sft})
    fmt = get_format("no_think")
    return agent, config, fmt


def test_expert_demos_play_the_solver_on_their_own_seeds():
    agent, config, fmt = demo_setup(episodes=6, seed_start=500)
    demos = expert_demos(lambda: make("FrozenLake"), fmt, agent, config, "FrozenLake", batch_size=4)
    assert [d.seed for d in demos] == list(range(500, 506))
    assert all(d.turns and d.tokens is None for d in demos)  # text-only: tokenized later by the SFT context
    assert sum(d.success for d in demos) >= 5  # the solver (no random actions) solves the solvable maps


def test_demo_samples_mask_only_the_experts_responses(tiny_tokenizer):
    agent, config, fmt = demo_setup(episodes=4)
    demos = expert_demos(lambda: make("FrozenLake"), fmt, agent, config, "FrozenLake")
    for demo in demos:
        (sample,) = conversation_samples(trajectory_messages(demo), tiny_tokenizer, window=None)
        responses = [tiny_tokenizer.encode(t.response, add_special_tokens=False) + [tiny_tokenizer.eos_token_id]
                     for t in demo.turns]
        assert [t for t, m in zip(sample.input_ids, sample.loss_mask) if m] == [i for r in responses for i in r]
        assert len(sample.turn_ends) == len(demo.turns)


def test_chats_tokenized_in_several_processes_are_the_samples_of_one(tiny_tokenizer, monkeypatch):
    import multiprocessing
    from types import SimpleNamespace

    from turnrl.training import sft

    window = 1  # a sample per turn, each prompt its own window (the Sokoban and FrozenLake recipes)
    agent, config, fmt = demo_setup(episodes=10, random_action_share=0.3)
    chats = [trajectory_messages(d) for d in expert_demos(lambda: make("FrozenLake"), fmt, agent, config,
                                                          "FrozenLake")]
    one = chat_samples(chats, tiny_tokenizer, window)
    assert len(one) >= len(chats)
    # The processes sft asks for are fresh ones (spawned: no copy of this process's threads). Here they are forked
    # from a server that imported sft's modules once, rather than each importing torch and transformers (seconds of
    # a core each); they unpickle the tokenizer and the chunks as spawned ones do.
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload([sft.__name__])
    asked = []
    monkeypatch.setattr(sft, "multiprocessing",
                        SimpleNamespace(get_context=lambda method: asked.append(method) or forkserver))
    assert chat_samples(chats, tiny_tokenizer, window, workers=2) == one  # chunks in order
    assert asked == ["spawn"]
    unanswered = [message for message in chats[7] if message["role"] != "assistant"]
    with pytest.raises(ChatError, match=r"^chat 8: a chat must .* have a reply$"):  # numbered among all, not its chunk
        chat_samples([*chats[:7], unanswered, *chats[8:]], tiny_tokenizer, window, workers=2)


def test_a_vlms_chats_are_tokenized_in_the_training_process_whatever_the_workers(tiny_vlm_dir, monkeypatch):
    # Their samples carry pixel tensors, which torch passes between processes as file descriptors: thousands
    # of them ran a spawned pool out of descriptors. Asking for workers must still give every sample.
    from turnrl.models.loading import load_processor, load_tokenizer
    from turnrl.models.vision import ImageEncoder

    agent, config, fmt = demo_setup(episodes=6, random_action_share=0.3)
    chats = [trajectory_messages(d) for d in expert_demos(lambda: make("FrozenLake", mode="image"), fmt, agent,
                                                          config, "FrozenLake")]
    tokenizer, encoder = load_tokenizer(tiny_vlm_dir), ImageEncoder(load_processor(tiny_vlm_dir))
    one = chat_samples(chats, tokenizer, 1, encoder)
    monkeypatch.setattr("turnrl.training.sft.ProcessPoolExecutor", None)  # a pool would fail calling it
    asked = chat_samples(chats, tokenizer, 1, encoder, workers=2)
    assert len(asked) == len(one) >= len(chats)
    for a, b in zip(asked, one, strict=True):
        assert a.input_ids == b.input_ids and a.loss_mask == b.loss_mask
        assert a.model_inputs.keys() == b.model_inputs.keys() and "pixel_values" in a.model_inputs
        assert all(torch.equal(a.model_inputs[k], b.model_inputs[k]) for k in a.model_inputs)


def image_demo_chats(episodes: int) -> list:
    agent, config, fmt = demo_setup(episodes=episodes, random_action_share=0.3)
    return [trajectory_messages(d) for d in expert_demos(lambda: make("FrozenLake", mode="image"), fmt, agent, config,
                                                        "FrozenLake")]


@pytest.mark.parametrize(("window", "max_images"), [(1, None), (None, None), (3, 2)])
def test_sft_keeps_pictures_that_make_each_samples_model_inputs_again(tiny_vlm_dir, window, max_images):
    # (3, 2): a window of three turns whose prompts hold the latest two images only.
    from turnrl.models.loading import load_processor, load_tokenizer
    from turnrl.models.vision import ImageEncoder

    chats = image_demo_chats(6)
    tokenizer, encoder = load_tokenizer(tiny_vlm_dir), ImageEncoder(load_processor(tiny_vlm_dir))
    full = chat_samples(chats, tokenizer, window, encoder, max_images)
    samples, pictures = chat_picture_samples(chats, tokenizer, window, encoder, max_images)
    assert len(samples) == len(pictures) == len(full) >= len(chats)
    counts = {len(p) for p in pictures}
    if window == 1:
        assert counts == {1}
    elif max_images == 2:
        assert counts == {1, 2}
    else:  # whole chats: every turn's picture
        assert max(counts) > 2
    for sample, its_pictures, expected in zip(samples, pictures, full, strict=True):
        assert sample.model_inputs == {}  # pictures, not pixels, until batched
        made = with_pixels(sample, its_pictures, encoder)
        assert made.input_ids == expected.input_ids and made.loss_mask == expected.loss_mask
        assert made.model_inputs.keys() == expected.model_inputs.keys() == {"pixel_values", "image_grid_thw"}
        assert all(torch.equal(made.model_inputs[k], expected.model_inputs[k]) for k in made.model_inputs)
        assert made.input_ids.count(encoder.image_token_id) == int(
            made.model_inputs["image_grid_thw"].prod(-1).sum()) // encoder.merge_size**2


def test_sft_on_pictures_trains_as_on_pixels(tiny_vlm_dir):
    from turnrl.models.loading import load_model, load_processor, load_tokenizer
    from turnrl.models.vision import ImageEncoder

    chats = image_demo_chats(3)
    tokenizer, encoder = load_tokenizer(tiny_vlm_dir), ImageEncoder(load_processor(tiny_vlm_dir))
    config = SFTConfig(epochs=1, lr=1e-3, warmup_steps=0, batch_size=4, micro_batch_size=2)
    full = chat_samples(chats, tokenizer, 1, encoder)
    samples, pictures = chat_picture_samples(chats, tokenizer, 1, encoder)
    runs = []
    for kwargs in ({"samples": full}, {"samples": samples, "pictures": pictures, "encoder": encoder}):
        model = load_model(tiny_vlm_dir, device=torch.device("cpu"))
        logged: list = []
        sft_train(model, tokenizer.pad_token_id, config=config, log=lambda step, m: logged.append(m["sft/loss"]),
                  **kwargs)
        runs.append((logged, [p.detach().clone() for p in model.parameters()]))
    (losses, weights), (picture_losses, picture_weights) = runs
    assert len(losses) > 1 and losses == pytest.approx(picture_losses, rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(weights, picture_weights, strict=True))
    with pytest.raises(ValueError, match="image encoder"):
        sft_train(load_model(tiny_vlm_dir, device=torch.device("cpu")), 0, samples, config, pictures=pictures)


def test_the_tokenizing_processes_are_counted_from_the_cores_for_many_chats(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert data_workers(0, PARALLEL_CHATS) == 8 and data_workers(0, PARALLEL_CHATS - 1) == 1
    assert data_workers(3, 10) == 3
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert data_workers(0, 20_000) == 1


def mean_nll(model, samples, pad_id) -> float:
    batch = collate(samples, pad_id)
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.loss_mask)
    return float(-(logprobs * batch.loss_mask).sum() / batch.loss_mask.sum())


def demo_samples(tokenizer, seed_start, episodes):
    agent, config, fmt = demo_setup(episodes=episodes, seed_start=seed_start, random_action_share=0.2)
    demos = expert_demos(lambda: make("FrozenLake"), fmt, agent, config, "FrozenLake")
    return [s for d in demos for s in conversation_samples(trajectory_messages(d), tokenizer, window=None)]


def test_short_sft_on_expert_demos_lowers_the_loss_on_held_out_demos(tiny_model_dir, tiny_tokenizer):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    train = demo_samples(tiny_tokenizer, seed_start=1_000, episodes=48)
    held_out = demo_samples(tiny_tokenizer, seed_start=5_000, episodes=16)
    pad = tiny_tokenizer.pad_token_id
    before = mean_nll(model, held_out, pad)
    logged = []
    config = SFTConfig(epochs=2, lr=1e-2, warmup_steps=2, batch_size=8, micro_batch_size=8)
    metrics = sft_train(model, pad, train, config, log=lambda step, m: logged.append((step, m)))
    after = mean_nll(model, held_out, pad)
    assert after < 0.5 * before, (before, after)
    assert metrics["sft/steps"] == 2 * -(-len(train) // 8) == len(logged)
    assert [step for step, _ in logged] == list(range(len(logged)))
    assert logged[-1][1]["sft/loss"] < logged[0][1]["sft/loss"]
    assert not model.training


def test_sft_logs_every_step_in_order_however_seldom_it_reads_the_device(tiny_model_dir, tiny_tokenizer):
    train = demo_samples(tiny_tokenizer, seed_start=1_000, episodes=12)
    config = SFTConfig(epochs=2, lr=1e-2, warmup_steps=2, batch_size=4, micro_batch_size=2)
    runs = []
    for read_every in (1, 5):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        logged: list = []
        metrics = sft_train(model, tiny_tokenizer.pad_token_id, train, config, read_every=read_every,
                            log=lambda step, m, logged=logged: logged.append((step, m)))
        runs.append((logged, metrics))
    (every, metrics_every), (seldom, metrics_seldom) = runs
    assert len(every) == metrics_every["sft/steps"] > 5 and [s for s, _ in seldom] == list(range(len(every)))
    assert seldom == every and metrics_seldom == metrics_every


def test_sft_under_bf16_autocast_learns_like_float32(tiny_model_dir, tiny_tokenizer):
    # Autocast's cache of weight casts outlives optimizer steps taken inside one region: with it, every
    # forward kept seeing the first batch's weights and bf16 training went nowhere (a 0.5B VLM into garbage).
    from turnrl.training.precision import autocast

    train = demo_samples(tiny_tokenizer, seed_start=1_000, episodes=48)
    held_out = demo_samples(tiny_tokenizer, seed_start=5_000, episodes=16)
    pad = tiny_tokenizer.pad_token_id
    config = SFTConfig(epochs=2, lr=1e-2, warmup_steps=2, batch_size=8, micro_batch_size=8)
    losses = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        before = mean_nll(model, held_out, pad)
        with autocast(torch.device("cpu"), dtype):
            sft_train(model, pad, train, config)
        losses[dtype] = mean_nll(model, held_out, pad)
        assert losses[dtype] < 0.5 * before, (dtype, before, losses[dtype])
    assert losses[torch.bfloat16] < 1.5 * losses[torch.float32], losses


def test_sft_micro_batches_accumulate_to_the_same_update(tiny_model_dir, tiny_tokenizer):
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    samples = conversation_samples(CHAT, tiny_tokenizer, window=1)
    samples += conversation_samples(CHAT[:3], tiny_tokenizer, window=None)
    results = []
    for micro in (1, 4):
        model = copy.deepcopy(base)
        sft_train(model, tiny_tokenizer.pad_token_id, samples, SFTConfig(epochs=1, lr=1e-3, warmup_steps=0,
                                                                         batch_size=4, micro_batch_size=micro))
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name, p in results[1].items():
        delta = p - base.state_dict()[name]
        assert float((results[0][name] - p).abs().max()) <= 1e-3 * float(delta.abs().max()) + 1e-6, name


TORCH_OOM = ("CUDA out of memory. Tried to allocate 102.00 MiB. GPU 0 has a total capacity of 139.80 GiB of which "
             "116.74 GiB is free. 22.37 GiB allowed; Of the allocated memory 22.26 GiB is allocated by PyTorch")


def test_sft_out_of_gpu_memory_says_what_to_change(tiny_model_dir, tiny_tokenizer, monkeypatch):
    """An out-of-memory error in a micro-batch or in the optimizer's first step becomes the run's error: where,
    what to set, and torch's first line; nothing else is caught."""
    import turnrl.training.sft as sft

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    samples = conversation_samples(CHAT, tiny_tokenizer, window=1)
    config = SFTConfig(epochs=1, lr=1e-3, warmup_steps=0, batch_size=4, micro_batch_size=2)
    first = torch.randperm(len(samples), generator=torch.Generator().manual_seed(0)).tolist()[:2]  # seed 0's order
    longest = max(len(samples[i].input_ids) for i in first)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError(TORCH_OOM)

    monkeypatch.setattr(sft, "token_logprobs", out_of_memory)
    with pytest.raises(ConfigError) as error:
        sft_train(model, tiny_tokenizer.pad_token_id, samples, config)
    assert str(error.value).startswith(f"SFT ran out of GPU memory in a micro-batch of 2 samples of {longest} tokens "
                                       "(padded to the longest): ")
    assert "set sft.micro_batch_size=1 (sft.batch_size=4 stays" in str(error.value)
    assert "model.gradient_checkpointing=true" in str(error.value)
    assert str(error.value).endswith(f"torch: {TORCH_OOM}")
    assert isinstance(error.value.__cause__, torch.OutOfMemoryError)

    monkeypatch.undo()
    monkeypatch.setattr(torch.optim.AdamW, "step", out_of_memory)
    with pytest.raises(ConfigError, match=r"in the optimizer's step \(AdamW's moments\): give the run more of the "
                                          r"card \(run.gpu_share\) if it shares one; or use a GPU with more memory"):
        sft_train(model, tiny_tokenizer.pad_token_id, samples, config)

    monkeypatch.setattr(torch.optim.AdamW, "step", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("x")))
    with pytest.raises(RuntimeError, match="^x$"):  # any other error is left as it is
        sft_train(model, tiny_tokenizer.pad_token_id, samples, config)


def test_sft_command_trains_on_a_jsonl_of_chats_and_saves_the_model(tiny_model_dir, tiny_tokenizer, tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": CHAT}) for _ in range(8)) + "\n")
    config = load_config(TrainConfig, None, [
        f"model.path={tiny_model_dir}", "model.device=cpu", f"run.output_dir={tmp_path}", "run.name=sft",
        "run.tensorboard=false", "sft.epochs=3", "sft.lr=1e-2", "sft.warmup_steps=0", "sft.batch_size=4",
        "sft.micro_batch_size=2", "agent.max_context_window=2", "algorithm.sample_mode=turn", "agent.max_turns=3"])
    path = sft_only(config, data=str(data))
    assert path == tmp_path / "sft" / "sft" / "model"
    lines = (tmp_path / "sft" / "sft" / "metrics.jsonl").read_text().splitlines()
    losses = [json.loads(line)["sft/loss"] for line in lines]
    assert len(losses) == 3 * (8 * 3 // 4)  # 8 chats x 3 windowed turn samples, batches of 4, 3 epochs
    assert losses[-1] < 0.5 * losses[0]
    (sample,) = conversation_samples(CHAT, tiny_tokenizer, window=None)
    trained = mean_nll(AutoModelForCausalLM.from_pretrained(path), [sample], tiny_tokenizer.pad_token_id)
    base = mean_nll(AutoModelForCausalLM.from_pretrained(tiny_model_dir), [sample], tiny_tokenizer.pad_token_id)
    assert trained < 0.5 * base


def test_the_sft_stage_checks_its_memory_with_the_longest_sample_before_the_model_loads(tiny_model_dir, tiny_tokenizer,
                                                                                       tmp_path, monkeypatch):
    import turnrl.training.sft as sft

    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": CHAT}) for _ in range(3)) + "\n")
    config = load_config(TrainConfig, None, [
        f"model.path={tiny_model_dir}", "model.device=cpu", f"run.output_dir={tmp_path}", "run.name=sft",
        "run.tensorboard=false", "sft.batch_size=4", "sft.micro_batch_size=2", "agent.max_context_window=2",
        "algorithm.sample_mode=turn"])
    checked = []

    def too_large(config, path, longest, samples, device):
        checked.append((path, longest, samples, device.type))
        raise ConfigError("SFT needs about ...")

    monkeypatch.setattr(sft, "check_sft_memory", too_large)
    monkeypatch.setattr(sft, "load_model", lambda *args, **kwargs: pytest.fail("the model loaded before the check"))
    with pytest.raises(ConfigError, match="SFT needs about"):
        sft_only(config, data=str(data))
    samples = [s for _ in range(3) for s in conversation_samples(CHAT, tiny_tokenizer, window=2)]
    assert checked == [(str(tiny_model_dir), max(len(s.input_ids) for s in samples), len(samples), "cpu")]


# --------------------------------------------------------------------------- chats with images
def image_chat(image_value) -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_value}},
                                                       {"type": "text", "text": "Where now?"}]},
                         {"role": "assistant", "content": "<answer>Right</answer>"}]}


def test_jsonl_images_are_read_from_data_urls_and_paths_beside_the_file(tmp_path, tiny_vlm_dir):
    import numpy as np
    from PIL import Image

    from turnrl.models.loading import load_processor, load_tokenizer
    from turnrl.models.vision import ImageEncoder
    from turnrl.policy.openai_http import image_data_url

    frame = np.full((56, 56, 3), 200, dtype=np.uint8)
    (tmp_path / "frames").mkdir()
    Image.fromarray(frame).save(tmp_path / "frames" / "a.png")
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(image_chat(image_data_url(frame))) + "\n" + json.dumps(image_chat("frames/a.png")) + "\n")
    chats = read_chat_jsonl(data)
    for chat in chats:
        assert np.array_equal(chat[0]["content"][0]["image"], frame)
    encoder = ImageEncoder(load_processor(tiny_vlm_dir))
    (sample,) = conversation_samples(chats[1], load_tokenizer(tiny_vlm_dir), None, encoder)
    assert sample.input_ids.count(encoder.image_token_id) == int(sample.model_inputs["image_grid_thw"].prod()) // 4


@pytest.mark.parametrize(
    ("value", "match"),
    [("data:image/png;base64,AAAA", "cannot be read"), ("data:image/png;base64,!!!!", "cannot be read"),
     ("frames/missing.png", "cannot be read"), ("https://example.com/a.png", "nothing is fetched")],
)
def test_a_bad_jsonl_image_is_named_by_its_line(tmp_path, value, match):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(CHAT_RECORD) + "\n" + json.dumps(image_chat(value)) + "\n")
    with pytest.raises(ValueError, match=rf"chats.jsonl:2: .*{match}"):
        read_chat_jsonl(data)


CHAT_RECORD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def test_sft_on_an_env_without_a_solver_is_refused(tiny_model_dir, tmp_path):
    from turnrl.config import ConfigError

    config = load_config(TrainConfig, None, [f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path}",
                                             "env.id=gym:FrozenLake-v1", "env.settings.is_slippery=true",
                                             "model.device=cpu"])
    with pytest.raises(ConfigError, match="no solver"):
        sft_only(config)


# --------------------------------------------------------------------------- a response prefix
def ragen_demos(episodes=3):
    agent = AgentConfig(format="ragen", max_turns=4, max_actions_per_turn=2, max_actions_per_episode=8)
    fmt = get_format("ragen", max_actions_per_turn=2)
    config = SFTConfig(episodes=episodes, random_action_share=0.3)
    return fmt, expert_demos(lambda: make("Sokoban"), fmt, agent, config, "Sokoban")


@pytest.mark.parametrize("window", [None, 1])
def test_demo_prompts_end_with_the_response_prefix_and_the_targets_are_what_follows(tiny_tokenizer, window):
    # RAGEN's prompts end with <think>: a demo's prompt does too, and the model learns to continue it.
    fmt, demos = ragen_demos()
    prefix = tiny_tokenizer.encode("<think>", add_special_tokens=False)
    for demo in demos:
        chat = trajectory_messages(demo)
        assert all(m["content"].startswith("<think>") for m in chat if m["role"] == "assistant")
        samples = conversation_samples(chat, tiny_tokenizer, window=window, response_prefix="<think>")
        targets = [tiny_tokenizer.encode(fmt.continuation(t.response), add_special_tokens=False)
                   + [tiny_tokenizer.eos_token_id] for t in demo.turns]
        assert [i for s in samples for i, m in zip(s.input_ids, s.loss_mask) if m] == [i for t in targets for i in t]
        for s in samples:  # each target follows a prompt that ends with the prefix, which takes no loss
            for k in range(1, len(s.input_ids)):
                if s.loss_mask[k] and not s.loss_mask[k - 1]:
                    assert s.input_ids[k - len(prefix) : k] == prefix
        if window is None:
            (sample,) = samples
            assert tiny_tokenizer.decode(sample.input_ids) == tiny_tokenizer.apply_chat_template(chat, tokenize=False)


def test_an_assistant_message_without_the_response_prefix_is_refused(tiny_tokenizer):
    with pytest.raises(ValueError, match=r"message 2: the prompts end with '<think>'"):
        conversation_samples(CHAT, tiny_tokenizer, window=None, response_prefix="<think>")


def test_sft_data_with_a_chat_it_cannot_learn_from_names_the_chat_before_the_model_loads(tiny_model_dir, tmp_path,
                                                                                        monkeypatch):
    """Found once the tokenizer reads the chats (the format's response prefix): it was a ValueError traceback."""
    from turnrl.training import sft

    prefixed = [{**m, "content": "<think>" + m["content"]} if m["role"] == "assistant" else m for m in CHAT]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps({"messages": chat}) for chat in [prefixed] * 4 + [CHAT] + [prefixed])
                    + "\n")
    config = load_config(TrainConfig, None, [
        f"model.path={tiny_model_dir}", "model.device=cpu", f"run.output_dir={tmp_path}", "run.name=sft",
        "run.tensorboard=false", "agent.format=ragen"])
    monkeypatch.setattr(sft, "load_model", lambda *args, **kwargs: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError) as info:
        sft_only(config, data=str(data))
    assert str(info.value) == f"sft.data={str(data)!r}, chat 5: message 2: the prompts end with '<think>' (the " \
                              "chat template's opening, then the format's response prefix), so an assistant " \
                              "message must be a text that starts with it, got '<answer>Left</answer>'; fix that " \
                              "chat or take it out of the file"


def ragen_sft_samples(model_dir, tmp_path, monkeypatch) -> list:
    """The samples the SFT stage of a short RAGEN-format run on Sokoban would train on (it stops before training)."""
    from turnrl.training import sft

    config = load_config(TrainConfig, None, [
        f"model.path={model_dir}", "model.device=cpu", f"run.output_dir={tmp_path}", "run.name=sft",
        "run.tensorboard=false", "env.id=Sokoban", "agent.format=ragen", "agent.max_turns=3", "sft.episodes=2"])
    trained = []

    class Trained(Exception):
        pass

    def keep(model, pad_id, samples, *args, **kwargs):
        trained.extend(samples)
        raise Trained

    monkeypatch.setattr(sft, "sft_train", keep)
    with pytest.raises(Trained):
        sft_only(config)
    assert trained
    return trained


def test_the_sft_stage_tokenizes_demos_with_the_formats_response_prefix(tiny_model_dir, tiny_tokenizer, tmp_path,
                                                                          monkeypatch):
    trained = ragen_sft_samples(tiny_model_dir, tmp_path, monkeypatch)
    prefix = tiny_tokenizer.encode("<think>", add_special_tokens=False)
    for sample in trained:
        first = sample.loss_mask.index(1)
        assert sample.input_ids[first - len(prefix) : first] == prefix


def test_the_sft_stage_of_a_thinking_template_teaches_what_follows_the_think_it_opens(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    """Qwen3-Thinking-2507's prompts end with <think>\\n: RAGEN's own <think> moves there (not written twice),
    and each demo's target is its reasoning on, not a second <think>."""
    import shutil

    from transformers import AutoTokenizer

    from turnrl.chat.templates import QWEN3_THINKING

    model_dir = tmp_path / "thinking"
    shutil.copytree(tiny_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = QWEN3_THINKING
    tokenizer.save_pretrained(model_dir)
    trained = ragen_sft_samples(model_dir, tmp_path, monkeypatch)
    starts = [(sample, k) for sample in trained for k in range(1, len(sample.input_ids))
              if sample.loss_mask[k] and not sample.loss_mask[k - 1]]
    assert starts
    for sample, k in starts:  # each target follows the template's <think>, written once, and does not repeat it
        assert tokenizer.decode(sample.input_ids[:k]).endswith("<|im_start|>assistant\n<think>\n")
        assert not tokenizer.decode(sample.input_ids[:k]).endswith("<think>\n<think>")
        assert not tokenizer.decode(sample.input_ids[k:]).lstrip().startswith("<think>")


# --------------------------------------------------------------------------- soft action targets
def soft_demo_samples(tokenizer, window, fmt_name="no_think", random_action_share=0.5, episodes=6):
    agent, config, _ = demo_setup(episodes=episodes, random_action_share=random_action_share)
    fmt = get_format(fmt_name)
    agent.format = fmt_name
    demos = expert_demos(lambda: make("FrozenLake"), fmt, agent, config, "FrozenLake")
    samples = chat_samples([trajectory_messages(d) for d in demos], tokenizer, window)
    return demos, samples, action_tokens(tokenizer, fmt, make("FrozenLake").action_names(), 1)


def test_each_action_of_frozenlake_is_one_token_of_the_answer(tiny_tokenizer):
    fmt = get_format("no_think")
    actions = action_tokens(tiny_tokenizer, fmt, ["Left", "Down", "Right", "Up"], 1)
    for name, token, answer in zip(actions.names, actions.tokens, actions.answers, strict=True):
        assert answer == tiny_tokenizer.encode(f"<answer>{name}</answer>", add_special_tokens=False) + [
            tiny_tokenizer.eos_token_id]
        assert answer[actions.offset] == token == tiny_tokenizer.encode(name, add_special_tokens=False)[0]
    assert len(set(actions.tokens)) == 4


@pytest.mark.parametrize(("names", "per_turn", "match"), [
    (None, 1, "named actions"),
    (["Left", "Right"], 2, "one action a turn"),
    (["Left", "Leftmost"], 1, "one token"),  # a name of two tokens
    (["Left", "Left"], 1, "one token"),  # two actions that read alike
])
def test_actions_that_cannot_take_a_soft_target_are_refused(tiny_tokenizer, names, per_turn, match):
    with pytest.raises(ConfigError, match=match):
        action_tokens(tiny_tokenizer, get_format("no_think"), names, per_turn)


@pytest.mark.parametrize("window", [None, 1])
def test_soft_targets_sit_on_each_demo_turns_action_token_with_the_solvers_action(tiny_tokenizer, window):
    demos, samples, actions = soft_demo_samples(tiny_tokenizer, window)
    positions = demo_target_positions(demos, samples, actions)
    assert len(positions) == len(samples)
    turns = [turn for demo in demos for turn in demo.turns]
    found = [(sample, position, expert) for sample, pairs in zip(samples, positions) for position, expert in pairs]
    assert len(found) == len(turns)
    replaced = 0
    for (sample, position, expert), turn in zip(found, turns, strict=True):
        assert sample.loss_mask[position] == 1
        assert sample.input_ids[position] == actions.tokens[actions.names.index(turn.actions[0])]  # the played one
        assert actions.names[expert] == turn.expert_actions[0]
        replaced += turn.actions[0] != turn.expert_actions[0]
    assert replaced > 0  # some turns played another action than the solver's


def test_demos_with_reasoning_fields_cannot_take_soft_targets(tiny_tokenizer):
    demos, samples, actions = soft_demo_samples(tiny_tokenizer, 1, fmt_name="free_think")
    with pytest.raises(ValueError, match="not the format's answer alone"):
        demo_target_positions(demos, samples, actions)


def test_soft_targets_of_share_zero_on_clean_demos_train_as_one_hot_targets(tiny_model_dir, tiny_tokenizer):
    demos, samples, actions = soft_demo_samples(tiny_tokenizer, 1, random_action_share=0.0)
    soft = SoftTargets(actions, 0.0, demo_target_positions(demos, samples, actions))
    config = SFTConfig(epochs=1, lr=1e-2, warmup_steps=0, batch_size=8, micro_batch_size=4)
    trained = []
    for targets in (None, soft):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        sft_train(model, tiny_tokenizer.pad_token_id, samples, config, soft_targets=targets)
        trained.append(model.state_dict())
    for name, value in trained[0].items():
        assert torch.allclose(value, trained[1][name], atol=1e-5), name


def test_the_soft_loss_is_the_cross_entropy_against_the_noisy_experts_distribution(tiny_model_dir, tiny_tokenizer):
    demos, samples, actions = soft_demo_samples(tiny_tokenizer, 1, episodes=3)
    share = 0.8
    soft = SoftTargets(actions, share, demo_target_positions(demos, samples, actions))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = collate(samples, tiny_tokenizer.pad_token_id)
    with torch.no_grad():  # the plain reference: full logits, the target as a distribution over the vocabulary
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        log_probs = torch.log_softmax(logits.float(), -1)
    total = 0.0
    for row, sample in enumerate(samples):
        targets = {col: {sample.input_ids[col]: 1.0} for col, m in enumerate(sample.loss_mask) if m}
        for col, expert in soft.positions[row]:
            targets[col] = {token: share / 4 + (1 - share) * (i == expert) for i, token in enumerate(actions.tokens)}
        total -= sum(p * float(log_probs[row, col - 1, token])
                     for col, target in targets.items() for token, p in target.items())
    expected = total / float(batch.loss_mask.sum())
    logged = []
    config = SFTConfig(epochs=1, lr=1e-3, warmup_steps=0, batch_size=len(samples), micro_batch_size=5)
    sft_train(model, tiny_tokenizer.pad_token_id, samples, config, soft_targets=soft,
              log=lambda step, metrics: logged.append(metrics["sft/loss"]))
    assert logged[0] == pytest.approx(expected, rel=1e-5)


def test_the_sft_stage_trains_soft_targets_on_every_demo_turn(tiny_model_dir, tmp_path, monkeypatch):
    from turnrl.training import sft

    config = load_config(TrainConfig, None, [
        f"model.path={tiny_model_dir}", "model.device=cpu", f"run.output_dir={tmp_path}", "run.name=sft",
        "run.tensorboard=false", "agent.format=no_think", "sft.episodes=3", "sft.target_random_share=0.8"])
    seen = []

    class Trained(Exception):
        pass

    def keep(model, pad_id, samples, *args, soft_targets=None, **kwargs):
        seen.append((samples, soft_targets))
        raise Trained

    monkeypatch.setattr(sft, "sft_train", keep)
    with pytest.raises(Trained):
        sft_only(config)
    ((samples, soft),) = seen
    assert soft.share == 0.8 and len(soft.positions) == len(samples)
    # Each chat is one sample (no window): a soft target at each of its turns' action tokens.
    assert [len(pairs) for pairs in soft.positions] == [len(sample.turn_ends) for sample in samples]


def test_soft_targets_from_chats_of_a_file_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="sft.target_random_share"):
        load_config(TrainConfig, None, ["sft.target_random_share=0.5", f"sft.data={tmp_path / 'chats.jsonl'}"])
