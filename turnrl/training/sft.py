"""Supervised fine-tuning, the stage before RL: expert demos from env solvers, or a JSONL of chats.

Demos are episodes of the expert policy (the env's solver, re-planned every
turn) written in the run's reasoning format, with a configurable share of
random actions so the demos are imperfect. They are tokenized with the same
token-exact context the RL rollouts use, so SFT trains on exactly the prompts
the policy will later see. The loss covers assistant tokens only.

:func:`sft_stage` runs the stage: base model in, ``RUN_DIR/sft/model`` out.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.markup import escape

from turnrl.agent.formats import ResponseFormat, continuation_after, get_format
from turnrl.config import AgentConfig, ConfigError, SamplingConfig, turnrl_command
from turnrl.envs import AgentEnv
from turnrl.envservice.placement import env_factory
from turnrl.files import parse_json
from turnrl.models.devices import resolve_device, resolve_dtype
from turnrl.models.loading import (
    base_model_path,
    compile_layer_parts,
    enable_checkpointing,
    freeze_vision_tower,
    load_model,
    load_processor,
    load_tokenizer,
)
from turnrl.models.vision import ImageEncoder, MessageImages, load_image, part_images
from turnrl.policy.scripted import ExpertPolicy
from turnrl.rollout.context import EpisodeTokens, format_for_template
from turnrl.rollout.conversation import user_message
from turnrl.rollout.metrics import errored_note, first_errors
from turnrl.rollout.runner import EpisodeSlot, Rollout
from turnrl.rollout.trajectory import ERROR, Trajectory, write_trajectories
from turnrl.training.batch import Sample, collate
from turnrl.training.head import install_scoring_head
from turnrl.training.logger import MetricsLogger, RunConsole, RunProgress
from turnrl.training.memory import check_sft_memory
from turnrl.training.model_passes import token_and_candidate_logprobs, token_logprobs
from turnrl.training.out_of_memory import sft_out_of_memory
from turnrl.training.packed_attention import run_attention
from turnrl.training.precision import autocast, skip_cudnn_attention
from turnrl.training.schedules import lr_factor
from turnrl.training.train_config import SFTConfig, TrainConfig

console = RunConsole()
Message = dict[str, Any]


# --------------------------------------------------------------------------- data
def expert_episodes(
    make_env: Callable[[], AgentEnv], fmt: ResponseFormat, agent: AgentConfig, sft: SFTConfig, env_id: str,
    seed: int = 0, batch_size: int = 256, on_turn: Callable[[int, int], None] | None = None,
) -> list[Trajectory]:
    """Play ``sft.episodes`` expert episodes on seeds from ``sft.seed_start`` (never validation seeds): every one,
    those that errored included (:func:`demos_of` keeps those SFT learns from). ``on_turn``: the rollout's
    progress (:meth:`~turnrl.rollout.runner.Rollout.run`)."""
    policy = ExpertPolicy(fmt, agent.max_actions_per_turn, seed=seed, random_action_share=sft.random_action_share)
    rollout = Rollout(policy, fmt, agent, env_id=env_id)
    envs = [make_env() for _ in range(min(batch_size, sft.episodes))]
    played: list[Trajectory] = []
    for start in range(0, sft.episodes, len(envs)):
        seeds = range(sft.seed_start + start, sft.seed_start + min(start + len(envs), sft.episodes))
        slots = [EpisodeSlot(env=env, seed=s, group=i) for i, (env, s) in enumerate(zip(envs, seeds))]
        played.extend(rollout.run(slots, SamplingConfig(), on_turn))
    return played


def demos_of(played: list[Trajectory]) -> list[Trajectory]:
    """The expert episodes SFT learns from: those that did not error and played a turn."""
    return [t for t in played if t.status != ERROR and t.turns]


def expert_demos(
    make_env: Callable[[], AgentEnv], fmt: ResponseFormat, agent: AgentConfig, sft: SFTConfig, env_id: str,
    seed: int = 0, batch_size: int = 256,
) -> list[Trajectory]:
    """The demos (:func:`demos_of`) of :func:`expert_episodes`."""
    return demos_of(expert_episodes(make_env, fmt, agent, sft, env_id, seed=seed, batch_size=batch_size))


def trajectory_messages(trajectory: Trajectory) -> list[Message]:
    """The chat of a trajectory: system, then user/assistant per turn (a user message carries its
    observation's images as image parts, as the rollout sent them)."""
    messages: list[Message] = [{"role": "system", "content": trajectory.system_prompt}]
    for turn in trajectory.turns:
        messages.append(user_message(turn.observation, turn.images, turn.image_at))
        messages.append({"role": "assistant", "content": turn.response})
    return messages


def conversation_samples(
    messages: list[Message],
    tokenizer: Any,
    window: int | None,
    encoder: ImageEncoder | None = None,
    max_images: int | None = None,
    response_prefix: str = "",
) -> list[Sample]:
    """Token samples of one chat with the loss on assistant tokens (each ended by the eos token).

    With a format's ``response_prefix`` (RAGEN's ``<think>``) every prompt ends with it, as the rollout's do,
    and each assistant message must start with it: the target is what follows. A thinking model's template
    ends each prompt with the ``<think>`` it opens (its ``template_opening``): an assistant message starts
    with that too, and the target is what follows it (the format's prefix then moves to the template's, as
    :func:`~turnrl.rollout.context.format_for_template` makes it).

    Without a window (of turns or of images) the whole chat is one sample;
    with one, every assistant turn is a sample with the windowed prompt it
    would be sampled from. Images of user messages (arrays, file paths or
    data URLs in image parts) go through ``encoder``, as in the rollout.
    """
    return [sample for sample, _ in _samples_and_pictures(messages, tokenizer, window, encoder, max_images,
                                                          response_prefix, pixels=True)]


def conversation_picture_samples(
    messages: list[Message],
    tokenizer: Any,
    window: int | None,
    encoder: ImageEncoder,
    max_images: int | None = None,
    response_prefix: str = "",
) -> list[tuple[Sample, list[np.ndarray]]]:
    """:func:`conversation_samples` of a VLM's chat with each sample's pictures in place of its model inputs
    (:func:`with_pixels` makes them again): a picture is a fraction of its pixel tensors (Qwen-VL's are
    float32 and hold each patch twice), so an SFT set of image chats keeps its pictures, not its pixels."""
    return _samples_and_pictures(messages, tokenizer, window, encoder, max_images, response_prefix, pixels=False)


def chat_roles_problem(messages: list[Message]) -> str | None:
    """Why SFT cannot learn from a chat's roles, or None: it takes an optional system message, then user and
    assistant messages in turn, from a user's, with at least one reply (a last user message is dropped)."""
    rest = messages[1:] if messages and messages[0]["role"] == "system" else messages
    if len(rest) < 2 or rest[0]["role"] != "user":
        return "a chat must start with a user message (after an optional system message) and have a reply"
    for index, message in enumerate(rest[1:], start=1):
        expected = "assistant" if index % 2 == 1 else "user"
        if message["role"] != expected:
            return f"message {index + len(messages) - len(rest)} has role {message['role']!r}, expected {expected!r}"
    return None


def with_pixels(sample: Sample, pictures: list[np.ndarray], encoder: ImageEncoder) -> Sample:
    """``sample`` with the model inputs of its prompt's ``pictures``, made now."""
    return replace(sample, model_inputs=encoder.message_inputs(pictures).model_inputs)


def _samples_and_pictures(
    messages: list[Message],
    tokenizer: Any,
    window: int | None,
    encoder: ImageEncoder | None,
    max_images: int | None,
    response_prefix: str,
    pixels: bool,
) -> list[tuple[Sample, list[np.ndarray]]]:
    """The chat's samples (see :func:`conversation_samples`), each with the pictures of its prompt, in the
    order of its model inputs; without ``pixels`` the samples have no model inputs (their images' placeholders
    are counted from the pictures' sizes)."""
    if tokenizer.eos_token_id is None:
        raise ValueError("SFT needs a tokenizer with an eos token to end assistant turns")
    problem = chat_roles_problem(messages)
    if problem is not None:
        raise ValueError(problem)
    system = messages[0] if messages and messages[0]["role"] == "system" else None
    rest = messages[1:] if system is not None else messages
    turn_pictures: list[list[np.ndarray]] = []  # each turn's observation's pictures

    def images_of(message: Message) -> MessageImages:
        images = part_images(message["content"])
        if images and encoder is None:
            raise ValueError("a chat has images but the model has no image processor: train a VLM on it")
        turn_pictures.append([load_image(image) for image in images])
        if encoder is None or not images:
            return MessageImages([], {}, [])
        if not pixels:
            return MessageImages(encoder.placeholder_counts(turn_pictures[-1]), {}, [])
        return encoder.message_inputs(turn_pictures[-1])

    tokens = EpisodeTokens(tokenizer, max_context_window=window, max_images=max_images,
                           image_token=encoder.image_token if encoder is not None else None,
                           response_prefix=response_prefix)
    tokens.start(system, rest[0], *images_of(rest[0]))
    for index, message in enumerate(rest[1:], start=1):
        if message["role"] == "assistant":  # the roles alternate (chat_roles_problem)
            content = message["content"]
            start = tokens.deltas.template_opening + response_prefix
            target = continuation_after(content, start) if isinstance(content, str) else None
            if target is None:
                number = index + (system is not None)
                raise ValueError(f"message {number}: the prompts end with {start!r} (the chat template's opening, "
                                 "then the format's response prefix), so an assistant message must be a text that "
                                 f"starts with it, got {str(content)[:60]!r}")
            tokens.add_response(tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id])
        else:
            tokens.add_observation(message, *images_of(message))
    if tokens.awaiting_response:  # a chat that ends with a user message: nothing to learn from the tail
        tokens.turns.pop()
        turn_pictures.pop()
    if window is None and max_images is None:
        stream = tokens.stream()
        whole = Sample(stream.input_ids, stream.loss_mask, [0.0] * len(stream.input_ids), stream.turn_end_positions,
                       [0.0] * len(stream.turn_end_positions), episode=0, group=0, model_inputs=stream.model_inputs)
        return [(whole, [picture for pictures in turn_pictures for picture in pictures])]
    return [
        (Sample(s.prompt_ids + s.response_ids, [0] * len(s.prompt_ids) + [1] * len(s.response_ids),
                [0.0] * (len(s.prompt_ids) + len(s.response_ids)), [len(s.prompt_ids) + len(s.response_ids) - 1],
                [0.0], episode=0, group=0, turn=s.turn, model_inputs=s.model_inputs),
         [picture for j in tokens.image_turns(s.turn) for picture in turn_pictures[j]])
        for s in tokens.turn_samples()
    ]


PARALLEL_CHATS = 2000
"""Chats from which ``sft.data_workers=0`` tokenizes in several processes (below, starting them costs more)."""


def data_workers(configured: int, chats: int) -> int:
    """Processes to tokenize ``chats`` chats: ``configured``, or (0) half the cores, at most 8, for many chats."""
    if configured > 0:
        return configured
    return max(1, min(8, (os.cpu_count() or 1) // 2)) if chats >= PARALLEL_CHATS else 1


_worker_settings: tuple[Any, int | None, ImageEncoder | None, int | None, str] | None = None
"""A tokenizing process's tokenizer, window, image encoder, image limit and response prefix (set once by its
initializer)."""


def _start_worker(tokenizer: Any, window: int | None, encoder: ImageEncoder | None, max_images: int | None,
                  response_prefix: str) -> None:
    global _worker_settings
    _worker_settings = (tokenizer, window, encoder, max_images, response_prefix)


def _samples_of(chats: Sequence[list[Message]], tokenizer: Any, window: int | None, encoder: ImageEncoder | None,
                max_images: int | None, response_prefix: str, first: int = 1) -> list[Sample]:
    """The chats' samples; ``first``: the number of the first chat among all, for :class:`ChatError`."""
    samples: list[Sample] = []
    for number, chat in enumerate(chats, start=first):
        with _numbered(number):
            samples += conversation_samples(chat, tokenizer, window, encoder, max_images, response_prefix)
    return samples


class ChatError(ValueError):
    """A chat that SFT cannot make samples of; the message starts with its number among the chats (1-based, as
    :func:`read_chat_jsonl` reads a file: blank lines skipped)."""


@contextlib.contextmanager
def _numbered(number: int) -> Iterator[None]:
    try:
        yield
    except ValueError as error:
        raise ChatError(f"chat {number}: {error}") from None


def _worker_samples(chats: list[list[Message]], first: int) -> list[Sample]:
    assert _worker_settings is not None, "a tokenizing process runs only after its initializer"
    return _samples_of(chats, *_worker_settings, first=first)


def chat_samples(
    chats: Sequence[list[Message]],
    tokenizer: Any,
    window: int | None,
    encoder: ImageEncoder | None = None,
    max_images: int | None = None,
    workers: int = 1,
    response_prefix: str = "",
) -> list[Sample]:
    """Every chat's :func:`conversation_samples`, in the chats' order.

    With ``workers`` above 1 the chats are tokenized in that many processes, in contiguous chunks (each
    process gets the tokenizer once); the samples are those of one process. Processes are spawned, not forked:
    the caller may hold a GPU and threads (the tokenizer's, torch's) that a fork would copy mid-flight.

    A VLM's chats (``encoder`` given) are always made here: their samples carry pixel tensors, and torch
    sends each tensor between processes as a shared-memory file descriptor, so the thousands of samples of
    a VAGEN SFT set ran a pool out of descriptors ("received 0 items of ancdata") or hung it; sent as bytes
    instead, 3,000 Sokoban image chats took longer in two processes than in one (68 s against 39 s on two
    cores: their 8.6 GB of pixels cost more to move than to make). SFT itself keeps pictures
    (:func:`chat_picture_samples`).

    Raises:
        ChatError: a chat SFT cannot learn from, named by its number among ``chats``.
    """
    if workers <= 1 or len(chats) < 2 * workers or encoder is not None:
        return _samples_of(chats, tokenizer, window, encoder, max_images, response_prefix)
    size = math.ceil(len(chats) / (4 * workers))  # a few chunks a process, so that none waits long for the last
    starts = range(0, len(chats), size)
    chunks = [list(chats[start : start + size]) for start in starts]
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_start_worker,
                             initargs=(tokenizer, window, encoder, max_images, response_prefix)) as pool:
        return [sample for part in pool.map(_worker_samples, chunks, [start + 1 for start in starts])
                for sample in part]


def chat_picture_samples(
    chats: Sequence[list[Message]],
    tokenizer: Any,
    window: int | None,
    encoder: ImageEncoder,
    max_images: int | None = None,
    response_prefix: str = "",
) -> tuple[list[Sample], list[list[np.ndarray]]]:
    """Every VLM chat's :func:`conversation_picture_samples`, in the chats' order: the samples (no model
    inputs) and, for each, its prompt's pictures. Raises :class:`ChatError` as :func:`chat_samples` does."""
    pairs: list[tuple[Sample, list[np.ndarray]]] = []
    for number, chat in enumerate(chats, start=1):
        with _numbered(number):
            pairs += conversation_picture_samples(chat, tokenizer, window, encoder, max_images, response_prefix)
    return [sample for sample, _ in pairs], [pictures for _, pictures in pairs]


def read_chat_jsonl(path: str | Path) -> list[list[Message]]:
    """Chats from a JSONL file: one ``{"messages": [...]}`` object per line.

    Image parts (``{"type": "image", "image": ...}`` or OpenAI's ``image_url``) may hold a data URL or a
    file path, relative to the JSONL's folder; each is read here, so a bad image is named by its line.
    """
    chats, numbers = [], []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = parse_json(line)
            messages = record["messages"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(f"{path}:{number}: expected a JSON object with a 'messages' list ({error})") from error
        well_formed = isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in messages
        )
        if not well_formed:
            raise ValueError(f"{path}:{number}: 'messages' must be a list of objects with 'role' and 'content'")
        chats.append([_with_images_read(message, Path(path).parent, f"{path}:{number}") for message in messages])
        numbers.append(number)
    if not chats:
        raise ValueError(f"{path} holds no chats")
    # Once the whole file reads, and here, where each chat's line is known: SFT finds them once the model has loaded.
    for number, messages in zip(numbers, chats):
        problem = chat_roles_problem(messages)
        if problem is not None:
            raise ValueError(f"{path}: line {number} has the roles {[m['role'] for m in messages]}; a chat takes an "
                             "optional system message, then user and assistant messages in turn, from a user's, "
                             f"with at least one reply ({problem})")
    return chats


def _with_images_read(message: Message, folder: Path, where: str) -> Message:
    """``message`` with each image part's image read into an array (see :func:`read_chat_jsonl`)."""
    try:
        if not part_images(message["content"]):
            return message
    except ValueError as error:  # a part that is no object, an image_url without its url
        raise ValueError(f"{where}: a {message['role']} message's {error}") from None
    parts = []
    for part in message["content"]:
        (source,) = part_images([part]) or [None]
        if source is None:
            parts.append(part)
            continue
        if isinstance(source, str) and not source.startswith("data:"):
            if "://" in source:
                raise ValueError(f"{where}: image {source!r}: give a file path or a data URL (nothing is fetched)")
            source = str(folder / source)
        try:
            parts.append({"type": "image", "image": load_image(source)})
        except Exception as error:
            raise ValueError(f"{where}: an image of a {message['role']} message cannot be read: {error}") from error
    return {**message, "content": parts}


# --------------------------------------------------------------------------- soft action targets
@dataclass(frozen=True)
class ActionTokens:
    """How an env's actions read in a format's answer: the answers differ in one token, the action's own."""

    names: list[str]
    """The env's actions, in its order."""
    tokens: list[int]
    """Each action's token id, in the order of :attr:`names`."""
    answers: list[list[int]]
    """Each action's answer as the demos' responses are tokenized (the format's answer alone, then the eos)."""
    offset: int
    """The action token's index in an answer."""


@dataclass(frozen=True)
class SoftTargets:
    """Soft targets at the demos' action tokens (``sft.target_random_share``): at a demo turn's action token,
    ``1 - share`` on the solver's action and ``share`` spread evenly over the env's actions.

    The target is the expected one-hot target of demos that play a random action in ``share`` of their turns,
    so the model learns the policy such demos teach, without the sampling noise of which turns were random:
    every turn teaches the solver's move.
    """

    actions: ActionTokens
    share: float
    positions: list[list[tuple[int, int]]]
    """For each sample, ``(position, action index)`` of each soft target in it (:func:`demo_target_positions`)."""

    def of(self, sample_ids: Sequence[int], device: torch.device) -> tuple[torch.Tensor, ...]:
        """The soft targets of the samples ``sample_ids`` batched in this order: their rows, columns,
        Shape (m,) each, the candidate tokens Shape (m, k) and their probabilities Shape (m, k)."""
        found = [(row, col, expert) for row, i in enumerate(sample_ids) for col, expert in self.positions[i]]
        rows, cols, experts = (torch.tensor([entry[part] for entry in found], dtype=torch.long, device=device)
                               for part in range(3))
        k = len(self.actions.tokens)
        candidates = torch.tensor(self.actions.tokens, device=device).expand(len(found), k)
        probs = torch.full((len(found), k), self.share / k, device=device)
        probs[torch.arange(len(found), device=device), experts] += 1.0 - self.share
        return rows, cols, candidates, probs


def action_tokens(tokenizer: Any, fmt: ResponseFormat, names: Sequence[str] | None,
                  max_actions_per_turn: int) -> ActionTokens:
    """The :class:`ActionTokens` of an env's ``names`` in ``fmt``: every action's answer must be the same
    tokens but for one, where each action has a token of its own (else a :class:`ConfigError`)."""
    if not names:
        raise ConfigError("sft.target_random_share needs an env with named actions (action_names()): the soft "
                          "target spreads over them")
    if max_actions_per_turn != 1:
        raise ConfigError("sft.target_random_share needs one action a turn (agent.max_actions_per_turn=1): a soft "
                          "target is over the env's actions, not over sequences of them")
    answers = []
    for name in names:
        message = fmt.render([name], {})
        answers.append(tokenizer.encode(fmt.continuation(message), add_special_tokens=False)
                       + [tokenizer.eos_token_id])
    differing = {i for answer in answers[1:] for i, (a, b) in enumerate(zip(answer, answers[0])) if a != b}
    tokens = [answer[min(differing)] for answer in answers] if len(differing) == 1 else []
    if len({len(a) for a in answers}) != 1 or len(differing) != 1 or len(set(tokens)) != len(names):
        raise ConfigError(f"sft.target_random_share needs each of the env's actions {list(names)} to be one token "
                          f"of its own in format {fmt.name!r}'s answer (the rest alike); here they are not: use "
                          "one-hot targets (leave sft.target_random_share unset)")
    return ActionTokens(list(names), tokens, answers, min(differing))


def demo_target_positions(demos: Sequence[Trajectory], samples: Sequence[Sample],
                          actions: ActionTokens) -> list[list[tuple[int, int]]]:
    """For each sample of the demos' chats (in :func:`chat_samples`' order), ``(position, action index)`` of
    each demo turn in it that has a solver's action: where its action token is and which action the solver
    chose. A turn without one (the solver had no plan) keeps its one-hot target."""
    per_turn = bool(samples) and samples[0].turn >= 0  # else each chat is one sample
    remaining = iter(samples)
    positions: list[list[tuple[int, int]]] = []
    for demo in demos:
        for sample in [next(remaining) for _ in demo.turns] if per_turn else [next(remaining)]:
            turns = [demo.turns[sample.turn]] if per_turn else demo.turns
            found = []
            for turn, end in zip(turns, sample.turn_ends, strict=True):
                if not turn.expert_actions:
                    continue
                start = end + 1 - len(actions.answers[0])
                if sample.input_ids[start : end + 1] not in actions.answers:
                    raise ValueError(f"demo turn {turn.index} of seed {demo.seed} answered {turn.response!r}, not "
                                     "the format's answer alone: soft targets need answers without reasoning "
                                     "fields (a format like no_think), or leave sft.target_random_share unset")
                if turn.expert_actions[0] not in actions.names:
                    raise ValueError(f"the solver's action {turn.expert_actions[0]!r} is none of the env's actions "
                                     f"{actions.names}")
                found.append((start + actions.offset, actions.names.index(turn.expert_actions[0])))
            positions.append(found)
    if next(remaining, None) is not None:
        raise ValueError("more samples than the demos' turns: the samples are not those of these demos")
    return positions


# --------------------------------------------------------------------------- training
def sft_train(
    model: torch.nn.Module,
    pad_id: int,
    samples: list[Sample],
    config: SFTConfig,
    seed: int = 0,
    log: Callable[[int, dict[str, float]], None] | None = None,
    read_every: int = 32,
    pictures: Sequence[list[np.ndarray]] | None = None,
    encoder: ImageEncoder | None = None,
    soft_targets: SoftTargets | None = None,
) -> dict[str, float]:
    """Cross-entropy on the loss-masked tokens, AdamW with warm-up and cosine decay.

    With ``soft_targets`` the tokens they name are trained toward their distributions instead of the token
    there (the cross-entropy against the soft target); each still counts as one token.

    With ``pictures`` (a VLM's samples from :func:`chat_picture_samples`) each micro-batch's model inputs
    are made from its samples' pictures by ``encoder`` when it is batched.

    Each step's loss and gradient norm stay on the device and are read (then logged, in step order) every
    ``read_every`` steps and at the end: a read waits for the device, and a small model's step is bound by
    the host queuing its kernels, so reading every step would leave host and device taking turns.

    Returns the final metrics (mean loss of the last epoch, token accuracy).
    """
    if pictures is not None and (encoder is None or len(pictures) != len(samples)):
        raise ValueError("pictures need an image encoder and a list of pictures for each sample")
    device = next(model.parameters()).device
    params = [p for p in model.parameters() if p.requires_grad]
    # beta2 = 0.95: the first steps learn the response format with large gradients; with 0.999 the
    # second moment would remember them for ~1000 steps and shrink every later update.
    optimizer = torch.optim.AdamW(params, lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0,
                                  fused=device.type == "cuda")
    steps_per_epoch = math.ceil(len(samples) / config.batch_size)
    total = steps_per_epoch * config.epochs
    schedule = lambda s: lr_factor(s, config.warmup_steps, total, config.schedule, floor=0.1)  # noqa: E731
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    generator = torch.Generator().manual_seed(seed)
    model.train()
    step, epoch_loss, epoch_tokens, last_loss = 0, torch.zeros((), device=device), 0, float("nan")
    unread: list[tuple[int, dict[str, float], torch.Tensor]] = []  # (step, host metrics, [loss, grad norm])

    def read() -> None:
        nonlocal last_loss
        if not unread:
            return
        values = torch.stack([pair for _, _, pair in unread]).tolist()
        for (logged_step, metrics, _), (loss, grad_norm) in zip(unread, values, strict=True):
            if log is not None:
                log(logged_step, {"sft/loss": loss, "sft/grad_norm": grad_norm, **metrics})
            last_loss = loss
        unread.clear()

    with RunProgress(console, "sft", total) as progress:
        for epoch in range(config.epochs):
            order = torch.randperm(len(samples), generator=generator).tolist()
            epoch_loss, epoch_tokens = torch.zeros((), device=device), 0
            for start in range(0, len(order), config.batch_size):
                batch_ids = order[start : start + config.batch_size]
                n_tokens = sum(sum(samples[i].loss_mask) for i in batch_ids)
                optimizer.zero_grad(set_to_none=True)
                batch_loss = torch.zeros((), device=device)
                for micro in range(0, len(batch_ids), config.micro_batch_size):
                    micro_ids = batch_ids[micro : micro + config.micro_batch_size]
                    if pictures is None or encoder is None:
                        batch = collate([samples[i] for i in micro_ids], pad_id)
                    else:
                        batch = collate([with_pixels(samples[i], pictures[i], encoder) for i in micro_ids], pad_id)
                    try:
                        batch = batch.to(device)
                        if soft_targets is None:
                            logprobs, _ = token_logprobs(model, batch.input_ids, batch.attention_mask,
                                                         batch.loss_mask, model_inputs=batch.model_inputs)
                            log_likelihood = (logprobs * batch.loss_mask).sum()
                        else:
                            soft_rows, soft_cols, candidates, probs = soft_targets.of(micro_ids, device)
                            logprobs, candidate_logprobs = token_and_candidate_logprobs(
                                model, batch.input_ids, batch.attention_mask, batch.loss_mask, soft_rows, soft_cols,
                                candidates, model_inputs=batch.model_inputs)
                            soft = torch.zeros(len(soft_rows), dtype=batch.loss_mask.dtype, device=device)
                            one_hot = batch.loss_mask.index_put((soft_rows, soft_cols), soft)
                            log_likelihood = (logprobs * one_hot).sum() + (candidate_logprobs * probs).sum()
                        loss = -log_likelihood / max(n_tokens, 1)
                        loss.backward()
                    except torch.OutOfMemoryError as error:
                        rows, length = batch.input_ids.shape
                        raise sft_out_of_memory(error, config, (rows, length)) from error
                    batch_loss += loss.detach().float()
                try:
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
                    optimizer.step()  # its first step makes AdamW's moments
                except torch.OutOfMemoryError as error:
                    raise sft_out_of_memory(error, config, None) from error
                scheduler.step()
                epoch_loss += batch_loss * n_tokens
                epoch_tokens += n_tokens
                unread.append((step, {"sft/lr": float(scheduler.get_last_lr()[0]), "sft/epoch": epoch},
                               torch.stack([batch_loss, grad_norm.detach().float().to(device)])))
                step += 1
                if len(unread) >= read_every:
                    read()
                read_loss = f" loss {last_loss:.3f}" if not math.isnan(last_loss) else ""
                progress.update(1, f"epoch {epoch + 1}/{config.epochs}{read_loss}")
            read()
    model.eval()
    return {"sft/final_epoch_loss": float(epoch_loss) / max(epoch_tokens, 1), "sft/steps": float(step)}


# --------------------------------------------------------------------------- the stage
@dataclass
class SFTResult:
    model_path: Path
    """Where the fine-tuned model (and its tokenizer) was saved: ``RUN_DIR/sft/model``."""
    metrics: dict[str, float]
    """Final loss and step count."""
    seconds: float
    """Wall time of the stage."""


def sft_stage(config: TrainConfig, run_dir: Path, progressed: Callable[[], None] = lambda: None) -> SFTResult:
    """Fine-tune the run's base model on expert demos (or ``sft.data``) and save it under ``run_dir/sft``;
    ``progressed`` is called at each turn of the demos and each logged SFT step (a stall watch's clock)."""
    start = time.time()
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    skip_cudnn_attention(device)
    path = base_model_path(config.model)
    tokenizer = load_tokenizer(path)
    processor = load_processor(path, config.model.min_pixels, config.model.max_pixels)
    # The responses the model learns continue its template's opening, as the rollout reads them.
    fmt = format_for_template(get_format(config.agent.format, action_separator=config.agent.action_separator,
                                         max_actions_per_turn=config.agent.max_actions_per_turn), tokenizer)
    out = run_dir / "sft"
    demos: list[Trajectory] = []
    actions: ActionTokens | None = None
    if config.sft.data:
        chats = read_chat_jsonl(config.sft.data)
    else:
        make_env = env_factory(config.env.id, dict(config.env.settings), config.env.remote)
        try:  # the demos' sessions on env.remote close once they are played
            probe = make_env()
            probe.reset(seed=config.sft.seed_start)
            if probe.solve() is None:  # the expert would only play random actions
                raise ConfigError(f"env.id={config.env.id!r} has no solver here (solve() is None), so it has no "
                                  "expert demos; give SFT chats with sft.data=chats.jsonl, or set sft.enabled=false")
            if config.sft.target_random_share is not None:
                actions = action_tokens(tokenizer, fmt, probe.action_names(), config.agent.max_actions_per_turn)
            played = expert_episodes(make_env, fmt, config.agent, config.sft, config.env.id, seed=config.seeds.seed,
                                     on_turn=lambda *_: progressed())
        finally:
            make_env.close()
        demos = demos_of(played)
        errored = errored_note(played, "left out of the SFT data")
        if errored is not None:  # an env that fails on some levels would bias the demos to the others, unsaid
            console.print(f"[bold red]SFT demos:[/bold red] {escape(errored)}", soft_wrap=True)
        if not demos:
            why = f"the commonest error: {first_errors(played, 1)[0]}" if errored else "each ended before a turn"
            raise ConfigError(f"env.id={config.env.id!r}: none of the {len(played)} expert episodes gave a demo "
                              f"({why}); check the env with `{turnrl_command()} check-env {config.env.id}`, or give "
                              "SFT chats with sft.data")
        chats = [trajectory_messages(t) for t in demos]
    window = config.agent.max_context_window
    encoder = ImageEncoder(processor) if processor is not None else None
    console.print(f"SFT data: {len(chats)} chats after {time.time() - start:.0f} s; tokenizing them")
    tokenizing = time.time()
    pictures: list[list[np.ndarray]] | None = None
    try:
        if encoder is None:
            samples = chat_samples(chats, tokenizer, window, max_images=config.agent.max_images,
                                   workers=data_workers(config.sft.data_workers, len(chats)),
                                   response_prefix=fmt.response_prefix)
        else:
            samples, pictures = chat_picture_samples(chats, tokenizer, window, encoder, config.agent.max_images,
                                                     fmt.response_prefix)
    except ChatError as error:
        if not config.sft.data:  # the expert's own demos: a defect here, not the user's data
            raise
        raise ConfigError(f"sft.data={config.sft.data!r}, {error}; fix that chat or take it out of the file") \
            from error
    targets = sum(sum(s.loss_mask) for s in samples)
    soft_targets: SoftTargets | None = None
    if actions is not None and config.sft.target_random_share is not None:
        soft_targets = SoftTargets(actions, config.sft.target_random_share,
                                   demo_target_positions(demos, samples, actions))
        soft = sum(len(found) for found in soft_targets.positions)
        console.print(f"soft targets at {soft} action tokens ({config.sft.target_random_share:g} of each spread "
                      f"over the {len(actions.names)} actions)")
    console.print(f"[bold]SFT[/bold] on {len(samples)} samples ({targets} target tokens; tokenized in "
                  f"{time.time() - tokenizing:.0f} s)")
    # Checked once the samples' lengths are known and before the model is on the GPU: a micro-batch too large
    # for the card is said in seconds, with the micro-batch that fits, not as an out-of-memory traceback.
    longest = max((len(s.input_ids) for s in samples), default=0)
    memory = check_sft_memory(config, path, longest, len(samples), device) if samples else None
    if memory is not None:
        console.print(f"SFT memory, estimated: {memory.table()}")
    if demos:  # written once SFT will run: a run stopped by the check leaves no SFT folder behind
        write_trajectories(demos[:50], out, name="demos_sample.jsonl")
    attention = run_attention(config.model, device)
    model = load_model(path, device=device, attention=attention)
    install_scoring_head(model, len(tokenizer), compiled=config.model.compile)
    if not config.model.train_vision:
        freeze_vision_tower(model)
    if config.model.gradient_checkpointing:
        enable_checkpointing(model, config.model.checkpointed_layers)
    if config.model.compile:
        compile_layer_parts(model)
    logger = MetricsLogger(out, tensorboard=config.run.tensorboard)

    def log(step: int, step_metrics: dict[str, float]) -> None:
        logger.log(step, step_metrics)
        progressed()

    with autocast(device, dtype):
        metrics = sft_train(model, tokenizer.pad_token_id, samples, config.sft, seed=config.seeds.seed, log=log,
                            pictures=pictures, encoder=encoder, soft_targets=soft_targets)
    logger.close()
    model_path = out / "model"
    model.save_pretrained(model_path)
    (processor or tokenizer).save_pretrained(model_path)
    return SFTResult(model_path, metrics, time.time() - start)
