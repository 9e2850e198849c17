"""The multi-turn loop: prompts -> policy -> parse -> env steps -> next observation.

One call of :meth:`Rollout.run` plays a batch of episodes to the end. Each
round, the active episodes' prompts go to the policy as one batch; each
response (after the format's response prefix, which the prompts end with) is
parsed into at most ``max_actions_per_turn`` actions, stepped in
order (stopping at the first invalid action or at the end of the episode);
then the round's finished turns are scored together (the env's rewards, the
format reward and every added reward function, see :mod:`turnrl.rewards`), and
the next observations are built. An unparseable response, an invalid action,
a failing env or a failing reward function is data, recorded on the
trajectory, never an exception that stops the batch.

With ``agent.wait_for_turns=false`` and a streaming policy (the engine), there
are no rounds: each episode's next prompt is submitted as soon as its env step
returns, and its turn is scored alone.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from turnrl.agent.formats import ResponseFormat, turn_format_reward
from turnrl.agent.prompts import TurnFeedback, neutralized
from turnrl.config import AgentConfig, ConfigError, SamplingConfig
from turnrl.envs.contract import (
    MAX_TEXT_LENGTH,
    AgentEnv,
    StateFacts,
    TurnEnv,
    env_metrics,
    invalid_reason,
    max_text_length_of,
    reset_answer,
    state_key,
    step_answer_problems,
    text_problems,
)
from turnrl.models.vision import MessageImages, check_image
from turnrl.policy.interface import Completion, GenerationRequest, Policy
from turnrl.rewards import FinishedTurn, Rewards, TurnScores
from turnrl.rewards.state import check_fields_written
from turnrl.rollout.context import EpisodeTokens, format_for_template, without_images
from turnrl.rollout.conversation import Conversation
from turnrl.rollout.trajectory import DONE, ERROR, TRUNCATED, Trajectory, TurnRecord

TurnBoundary = Callable[[int, int], None]
"""Called before each round's generation with the number of turns it samples and the part of the rollout side
that plays them (0: a :class:`Rollout`, which is one part; rollout process ``j`` of a pool: ``j``): no sequence of
that part is generating then, so its policy may take new weights (the asynchronous backend's partial rollouts)."""


@dataclass
class EpisodeSlot:
    """An env and the seed it plays in this batch."""

    env: AgentEnv
    seed: int
    group: int = 0
    sample: int = 0
    options: dict[str, Any] | None = None
    """Passed to ``env.reset`` (e.g. a given level)."""


@dataclass
class RolloutTimings:
    generate_s: float = 0.0
    env_s: float = 0.0
    policy_work: dict[str, float] = field(default_factory=dict)
    """How much each of the policy's :meth:`~turnrl.policy.interface.Policy.counters` grew over the run (the
    engine's prefill tokens, decode steps, ...): where the generation's seconds went."""


def counters_grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each counter's growth from ``before`` to ``after``."""
    return {name: value - before.get(name, 0.0) for name, value in after.items()}


def latest_images(messages: list[dict[str, Any]], max_images: int) -> list[dict[str, Any]]:
    """``messages`` with the image parts of all but the latest ``max_images`` images left out (a message's
    images are kept or dropped together, as in the token context)."""
    out, room = [], max_images
    for message in reversed(messages):
        count = len(message_images([message]))
        if count:
            room -= count
            if room < 0:
                message = without_images(message)
        out.append(message)
    return out[::-1]


def message_images(messages: list[dict[str, Any]]) -> list[np.ndarray]:
    """The image arrays of ``messages``' image parts, in order."""
    return [
        part["image"]
        for message in messages
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") == "image" and "image" in part
    ]


def policy_failure(error: Exception) -> Completion:
    """The completion of a request the policy failed on: its episode ends with the error, the batch goes on."""
    return Completion(text="", finish_reason="error", error=f"policy failed: {type(error).__name__}: {error}")


MAX_ERROR_LENGTH = 500
"""Characters an episode's error may hold: an exception's message can be a whole page (a server's body)."""


def one_line(text: str, limit: int = MAX_ERROR_LENGTH) -> str:
    """``text`` on one line (each run of whitespace, line breaks included, as one space), cut to ``limit``
    characters: an episode's error is read in a summary, a log line and the viewer."""
    line = " ".join(text.split())
    return line if len(line) <= limit else f"{line[: limit - 3]}..."


def env_failure(call: str, turn: int, error: Exception) -> str:
    """Why an episode ended: its env's ``call`` raised ``error`` in ``turn`` (1-based, as the viewer counts), and
    where (:func:`raised_where`)."""
    return f"env {call} failed in turn {turn}: {type(error).__name__}: {error}{raised_where(error)}"


def raised_where(error: BaseException) -> str:
    """`` (raised in FUNCTION at FILE:LINE)``: the innermost frame of ``error``'s traceback (the env's code, or the
    check its answer failed); empty for an error never raised."""
    frames = traceback.extract_tb(error.__traceback__)
    return f" (raised in {frames[-1].name} at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


def plays_blind(observer: str, model: str, text_mode: bool) -> str:
    """The refusal of an env that observes images for a text-only model, in one line (the preflight says it
    from the run's settings before the model loads, the rollout from the envs and the policy it was given).

    Args:
        observer: what observes images (the env's settings, or its class).
        model: the model as the reader knows it (``model.builtin_preset=tiny``, ``the policy``).
        text_mode: whether the env has a text mode to offer instead.
    """
    instead = " or the env's text mode (env.settings.mode=text)" if text_mode else ""
    return (f"{observer} observes images, but {model} is a text-only model, which would play blind: use a "
            f"vision-language model (a vlm-* model.builtin_preset, or a Qwen2-VL, Qwen2.5-VL or Qwen3-VL "
            f"model.path){instead}")


def check_observation(obs: Any, max_text_length: int = MAX_TEXT_LENGTH) -> None:
    """Raise TypeError or ValueError unless ``obs`` is an observation the turn can read and the record can keep (a
    dict with a ``text`` string that :func:`~turnrl.envs.contract.text_problems` accepts: at most
    ``max_text_length`` characters, the env's bound, none a control character but ASCII whitespace nor a
    lone surrogate; and, where it has an ``image``, an ``HxWx3`` uint8 array): an env that returns another, from
    ``reset`` or ``step``, fails its own episode where it does so, not the batch, and its observation never
    reaches the trajectory (whose writer cannot save another image as a PNG, nor should write a megabyte of text
    each turn, and whose tokenizer cannot encode a lone surrogate). ``check_env`` refuses the same texts, in the
    same words."""
    if not isinstance(obs, dict) or not isinstance(obs.get("text"), str):
        raise TypeError(f"an observation must be a dict with a 'text' string, not {obs!r:.200}")
    problems = text_problems(obs["text"], max_text_length)
    if problems:
        raise ValueError("; ".join(map(str, problems)))
    if "image" in obs:
        check_image(obs["image"])


def action_names_of(env: AgentEnv) -> list[str] | None:
    """``env.action_names()``, checked: None (free-form actions) or a list of strings. Raises TypeError on another
    answer (a str would read as one action a character), so that the episode of the env that gave it fails there
    (its names feed the parser and the next observation, where they would fail the whole batch)."""
    names = env.action_names()
    if names is None:
        return None
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence) or not all(
            isinstance(name, str) for name in names):
        raise TypeError(f"action_names() must return a list of strings or None, not {names!r:.200}")
    return list(names)


def check_envs_apart(slots: Sequence[EpisodeSlot]) -> None:
    """Raise ValueError where two slots of one batch hold the same env object: their episodes would play on one
    simulator, each reset and step moving the other's state, and every record of both would be wrong."""
    first: dict[int, int] = {}
    for index, slot in enumerate(slots):
        other = first.setdefault(id(slot.env), index)
        if other != index:
            raise ValueError(
                f"slots {other} and {index} of one batch hold the same env object; give each episode of a batch "
                "its own env (EnvGroups.val_slots(..., envs=k) hands out batches of k slots to play one after another)"
            )


def rejected_actions(turn: TurnRecord) -> tuple[str, ...]:
    """The next observation's notes on the turn's actions the env rejected: which one, and why where the env said
    (``turn.invalid_reasons``), so that a listed action the env refused in this state is not read as a parse
    failure."""
    padded = [*turn.invalid_reasons, *[None] * (len(turn.actions) - len(turn.invalid_reasons))]
    return tuple(f"the env rejected {action!r}" + (f": {reason}" if reason else "")
                 for action, valid, reason in zip(turn.actions, turn.actions_valid, padded) if not valid)


def control_texts(tokenizer: Any) -> tuple[str, ...]:
    """The texts ``tokenizer`` reads as its control tokens (its named special tokens and the added tokens marked
    special: ``<|im_end|>``, ``<|image_pad|>``): what text quoted back to the model must not hold."""
    named = set(tokenizer.all_special_tokens)
    added = {token.content for token in tokenizer.added_tokens_decoder.values() if token.special}
    return tuple(sorted(named | added))


def turn_state_key(env: AgentEnv, obs: dict[str, Any]) -> str | None:
    """:func:`~turnrl.envs.contract.state_key` of the env's state, or None when it fails (the turn then joins no
    anchor group)."""
    try:
        return state_key(env, obs)
    except Exception:
        return None


@dataclass
class _Episode:
    """Mutable state of one episode during the loop."""

    slot: EpisodeSlot
    trajectory: Trajectory
    messages: list[dict[str, Any]] = field(default_factory=list)
    actions_left: int = 0
    finished: bool = False
    observation: str = ""
    """Text of the current user message."""
    image_at: int = 0
    """Where its images go in ``observation`` (:attr:`~turnrl.rollout.trajectory.TurnRecord.image_at`)."""
    images: list[np.ndarray] = field(default_factory=list)
    """Images of the current user message."""
    last_obs: dict[str, Any] = field(default_factory=dict)
    """The env's latest observation."""
    max_text_length: int = MAX_TEXT_LENGTH
    """Characters the env's observation texts may hold, as it said at this episode's reset."""

    def keep_final_observation(self) -> None:
        """Record the env's latest observation as where the episode ended (so far)."""
        self.trajectory.final_observation = self.last_obs["text"]
        self.trajectory.final_images = [self.last_obs["image"]] if "image" in self.last_obs else []

    def finish(self, status: str, reason: str | None = None, error: str | None = None) -> None:
        self.finished = True
        self.trajectory.status = status
        self.trajectory.truncation_reason = reason
        self.trajectory.error = None if error is None else one_line(error)
        if status == ERROR:  # an env may have said success before a later step or the policy failed: no success
            self.trajectory.success = False


class Rollout:
    """Plays batches of episodes with one policy, one format and one agent setting.

    Args:
        policy: samples responses (token ids when it has a tokenizer).
        fmt: the reasoning format (prompt text and parser).
        agent: turn limits, action budget, context budget, format rewards.
        env_id: recorded on every trajectory.
        executor: steps envs in parallel when given.
        rewards: the named rewards and their weights; None: the env's and the format's, weight 1.
    """

    def __init__(
        self,
        policy: Policy,
        fmt: ResponseFormat,
        agent: AgentConfig,
        env_id: str,
        executor: Executor | None = None,
        rewards: Rewards | None = None,
    ) -> None:
        self.policy = policy
        if policy.tokenizer is not None:
            fmt = format_for_template(fmt, policy.tokenizer)
        self.fmt = fmt
        """The format the responses are read in: ``fmt`` under the policy's chat template, which may open the
        assistant's message itself (:func:`~turnrl.rollout.context.format_for_template`)."""
        self.agent = agent
        self.env_id = env_id
        self.conversation = Conversation(agent, fmt, env_id)
        """The episodes' messages in ``agent.prompt_layout``'s words."""
        self.executor = executor
        self.rewards = rewards or Rewards()
        self.control_texts = control_texts(policy.tokenizer) if policy.tokenizer is not None else ()
        """The policy tokenizer's control tokens as text, kept out of what the next observation quotes."""
        neutralized("", self.control_texts)  # refuses here, not mid-rollout, a control text no space can break
        self.timings = RolloutTimings()
        self.turn_boundary: TurnBoundary | None = None
        """Called at each turn boundary of the rounds (``agent.wait_for_turns``; see :data:`TurnBoundary`)."""
        limits = [agent.max_context_tokens, policy.max_sequence_tokens]
        self.context_budget = min(limit for limit in limits if limit is not None)
        """Tokens an episode's prompt and next response may hold: the agent's budget, or less where the policy
        holds less a sequence (an engine row)."""
        if fmt.response_prefix and not policy.continues_response_prefix:
            raise ConfigError(
                f"agent.format={fmt.name} ends the prompt with {fmt.response_prefix!r} after the generation prompt "
                f"for the model to continue, which {type(policy).__name__} cannot take: a chat API cannot prefill an "
                "assistant turn; use a model policy (a model path or builtin), or a format without a response prefix"
            )
        check_fields_written(self.rewards.functions, fmt)
        if not agent.wait_for_turns and policy.streaming() is None:
            raise ValueError(
                f"agent.wait_for_turns=false needs a policy that streams completions (model.backend=engine); "
                f"{type(policy).__name__} completes a whole batch at once"
            )
        if agent.prefill_groups > 1 and policy.streaming() is None:
            raise ValueError(
                f"agent.prefill_groups={agent.prefill_groups} needs a policy that takes requests one at a time "
                f"(model.backend=engine); {type(policy).__name__} completes a whole batch at once: set it to 1"
            )

    # ------------------------------------------------------------------ the loop
    def run(
        self,
        slots: Sequence[EpisodeSlot],
        sampling: SamplingConfig,
        on_turn: Callable[[int, int], None] | None = None,
    ) -> list[Trajectory]:
        """Play every slot's episode to its end; ``on_turn(turn, active)`` reports progress (with
        ``agent.wait_for_turns=false``: the turns played so far, and the episodes still playing)."""
        self.timings = RolloutTimings()
        before = self.policy.counters()
        try:
            return self._play(slots, sampling, on_turn)
        finally:
            self.timings.policy_work = counters_grown(before, self.policy.counters())

    def _play(self, slots: Sequence[EpisodeSlot], sampling: SamplingConfig,
              on_turn: Callable[[int, int], None] | None) -> list[Trajectory]:
        check_envs_apart(slots)
        episodes = self._map(lambda slot: self._start(slot, sampling), list(slots))
        self._check_can_see(episodes)
        if not self.agent.wait_for_turns:
            self._run_streaming(episodes, sampling, on_turn)
            return [episode.trajectory for episode in episodes]
        if self.agent.prefill_groups > 1 and self.turn_boundary is None:
            self._run_rounds_in_parts(episodes, sampling, on_turn)
            return [episode.trajectory for episode in episodes]
        for turn in range(self.agent.max_turns):
            active = [episode for episode in episodes if not episode.finished]
            if not active:
                break
            if on_turn is not None:
                on_turn(turn, len(active))
            if self.turn_boundary is not None:
                self.turn_boundary(len(active), 0)
            completions = self._generate(active, sampling)
            finished = self._map(lambda pair: self._act(*pair), list(zip(active, completions)))
            self._score([(episode, done) for episode, done in zip(active, finished) if done is not None])
            self._map(lambda episode: self._next_observation(episode, sampling), [e for e in active if not e.finished])
        return [episode.trajectory for episode in episodes]

    def _run_streaming(
        self, episodes: list[_Episode], sampling: SamplingConfig, on_turn: Callable[[int, int], None] | None
    ) -> None:
        """Every episode at its own pace: its next turn is submitted as soon as its env step returns.

        Completions come back from the policy as they finish; each goes to the env (in the executor's
        threads when there is one, so env steps overlap decoding), then its turn is scored and the next
        prompt submitted. The records are the same as in rounds; only the order of work changes.
        """
        policy = self.policy.streaming()
        assert policy is not None  # __init__ refuses a policy that cannot stream without rounds
        pending: dict[int, _Episode] = {}
        stepping: dict[Future[FinishedTurn | None], _Episode] = {}
        refused: list[tuple[_Episode, Completion]] = []
        turns_done = 0

        def submit(episode: _Episode) -> None:
            try:
                pending[policy.submit(self._request(episode, sampling), sampling)] = episode
            except Exception as error:  # a request the policy refuses ends its episode, not the rollout
                refused.append((episode, policy_failure(error)))

        def after_step(episode: _Episode, done: FinishedTurn | None) -> None:
            nonlocal turns_done
            turns_done += 1
            if done is not None:
                self._score([(episode, done)])
            if not episode.finished:
                self._next_observation(episode, sampling)
            if not episode.finished:
                submit(episode)

        for episode in episodes:
            if not episode.finished:
                submit(episode)
        while pending or stepping or refused:
            while refused:
                episode, completion = refused.pop()
                after_step(episode, self._act(episode, completion))
            if pending:
                start = time.perf_counter()
                finished = policy.poll()
                self.timings.generate_s += time.perf_counter() - start
                for handle, completion in finished:
                    episode = pending.pop(handle)
                    if self.executor is not None:
                        stepping[self.executor.submit(self._act, episode, completion)] = episode
                    else:
                        start = time.perf_counter()
                        done = self._act(episode, completion)
                        self.timings.env_s += time.perf_counter() - start
                        after_step(episode, done)
            if stepping:
                start = time.perf_counter()
                # With nothing to decode, wait for an env; otherwise take the env steps that are done.
                ready = wait(stepping, return_when=FIRST_COMPLETED).done if not pending else [
                    future for future in stepping if future.done()]
                self.timings.env_s += time.perf_counter() - start
                for future in ready:
                    after_step(stepping.pop(future), future.result())
            if on_turn is not None:
                on_turn(turns_done, len(pending) + len(stepping))

    def _run_rounds_in_parts(
        self, episodes: list[_Episode], sampling: SamplingConfig, on_turn: Callable[[int, int], None] | None
    ) -> None:
        """Rounds, each round's next requests handed to the policy in ``agent.prefill_groups`` parts.

        After a round's completions are all in, the episodes are split in order into parts; each part's envs
        step, its turns are scored, its next requests are queued and the policy starts prefilling them (without
        waiting for the device) before the next part's envs step. The round's decode starts when every part is
        queued, so it runs the whole round's batch as rounds do. Rounds' records, the work in another order.
        """
        policy = self.policy.streaming()
        assert policy is not None  # __init__ refuses a policy that cannot stream with prefill_groups > 1
        order = {id(episode): index for index, episode in enumerate(episodes)}
        pending: dict[int, _Episode] = {}
        failed: list[tuple[_Episode, Completion]] = []

        def submit(part: list[_Episode]) -> None:
            start = time.perf_counter()
            for episode in part:
                try:
                    pending[policy.submit(self._request(episode, sampling), sampling)] = episode
                except Exception as error:  # a request the policy refuses ends its episode, not the round
                    failed.append((episode, policy_failure(error)))
            policy.prefill()
            self.timings.generate_s += time.perf_counter() - start

        submit([episode for episode in episodes if not episode.finished])
        turn = 0
        while pending or failed:
            if on_turn is not None:
                on_turn(turn, len(pending) + len(failed))
            turn += 1
            start = time.perf_counter()
            answered = list(failed)  # requests the policy refused at submission: answered already
            failed.clear()
            while pending:
                answered.extend((pending.pop(handle), completion) for handle, completion in policy.poll())
            self.timings.generate_s += time.perf_counter() - start
            answered.sort(key=lambda pair: order[id(pair[0])])
            for part in np.array_split(np.arange(len(answered)), min(self.agent.prefill_groups, len(answered))):
                round_part = [answered[index] for index in part]
                finished = self._map(lambda pair: self._act(*pair), round_part)
                self._score([(episode, done) for (episode, _), done in zip(round_part, finished) if done is not None])
                playing = [episode for episode, _ in round_part if not episode.finished]
                self._map(lambda episode: self._next_observation(episode, sampling), playing)
                submit([episode for episode in playing if not episode.finished])

    def _check_can_see(self, episodes: list[_Episode]) -> None:
        """Refuse image observations for a token policy that cannot take pixels: it would play blind (a
        ConfigError: the run's or evaluation's settings do not go together, said in one line)."""
        if self.policy.accepts_images:
            return
        seeing = [episode.slot.env for episode in episodes if "image" in episode.last_obs]
        if seeing:
            names = ", ".join(sorted({type(env).__name__ for env in seeing}))
            text_mode = all(isinstance(env, TurnEnv) and "text" in env.modes for env in seeing)
            raise ConfigError(plays_blind(names, "the policy", text_mode))

    def _map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        start = time.perf_counter()
        results = list(self.executor.map(fn, items)) if self.executor is not None else [fn(item) for item in items]
        self.timings.env_s += time.perf_counter() - start
        return results

    def _generate(self, active: list[_Episode], sampling: SamplingConfig) -> list[Completion]:
        completions: list[Completion | None] = [None] * len(active)
        requests, asked = [], []
        for index, episode in enumerate(active):
            try:
                requests.append(self._request(episode, sampling))
                asked.append(index)
            except Exception as error:  # a request that cannot be made ends its episode, not the round
                completions[index] = policy_failure(error)
        start = time.perf_counter()
        try:
            answers = self.policy.generate(requests, sampling) if requests else []
            if len(answers) != len(requests):
                raise RuntimeError(f"policy returned {len(answers)} completions for {len(requests)} prompts")
        except Exception as error:  # a failing policy call ends these episodes, not the run
            answers = [policy_failure(error) for _ in requests]
        self.timings.generate_s += time.perf_counter() - start
        for index, answer in zip(asked, answers):
            completions[index] = answer
        answered = [completion for completion in completions if completion is not None]
        assert len(answered) == len(active)  # each request answered, or failed where it was made
        return answered

    def _request(self, episode: _Episode, sampling: SamplingConfig) -> GenerationRequest:
        tokens = episode.trajectory.tokens
        window = self.agent.max_context_window
        messages = list(episode.messages)  # a snapshot: the episode's list grows after this turn
        if window is not None:
            # system + the last `window` turns: user, assistant, ..., user
            messages = messages[:1] + messages[1:][-(2 * window - 1) :]
        if self.agent.max_images is not None:
            messages = latest_images(messages, self.agent.max_images)
        return GenerationRequest(
            prompt_ids=tokens.prompt() if tokens is not None else None,
            messages=messages,
            env=episode.slot.env,
            images=message_images(messages) or None,
            model_inputs=tokens.prompt_model_inputs() if tokens is not None else None,
            image_digests=tokens.prompt_image_digests() if tokens is not None else None,
        )

    # ------------------------------------------------------------------ one episode
    def _start(self, slot: EpisodeSlot, sampling: SamplingConfig) -> _Episode:
        trajectory = Trajectory(env_id=self.env_id, seed=slot.seed, group=slot.group, sample=slot.sample)
        episode = _Episode(slot=slot, trajectory=trajectory, actions_left=self.agent.max_actions_per_episode)
        call = "reset"
        try:
            # Unpacked unchecked, a bare observation failed as "not enough values to unpack".
            obs, _ = reset_answer(slot.env.reset(seed=slot.seed, options=slot.options))
            call = "max_text_length()"  # asked once an episode: a bad answer ends this episode, named so
            episode.max_text_length = max_text_length_of(slot.env)
            call = "reset"
            check_observation(obs, episode.max_text_length)
            trajectory.system_prompt = self.conversation.system(slot.env, action_names_of(slot.env))
        except Exception as error:
            episode.finish(ERROR, error=env_failure(call, 1, error))
            return episode
        episode.messages = [{"role": "system", "content": trajectory.system_prompt}]
        self._observe(episode, obs)
        tokenizer = self.policy.tokenizer
        if tokenizer is not None:
            encoder = self.policy.image_encoder
            trajectory.tokens = EpisodeTokens(
                tokenizer, max_context_window=self.agent.max_context_window, max_images=self.agent.max_images,
                image_token=encoder.image_token if encoder is not None else None,
                response_prefix=self.fmt.response_prefix, expected_turns=self.agent.max_turns,
            )
            try:
                trajectory.tokens.start(episode.messages[0], episode.messages[1], *self._encode(episode.images))
            except Exception as error:  # an image the processor cannot take ends this episode, not the run
                episode.finish(ERROR, error=f"the first observation cannot be encoded: {type(error).__name__}: {error}")
                return episode
            # The same rule as for later turns: a response of max_new_tokens must fit.
            if len(trajectory.tokens.prompt()) + sampling.max_new_tokens > self.context_budget:
                episode.finish(TRUNCATED, "context_budget")
        return episode

    def _encode(self, images: list[np.ndarray]) -> MessageImages:
        """Placeholder counts, model inputs and digests of an observation's images, encoded once, as it arrives
        (nothing without an image encoder: a text model is refused image observations in ``run``)."""
        encoder = self.policy.image_encoder
        if encoder is None or not images:
            return MessageImages([], {}, [])
        return encoder.message_inputs(images)

    def _observe(self, episode: _Episode, obs: dict[str, Any], feedback: TurnFeedback | None = None,
                 names: list[str] | None = None, last: TurnRecord | None = None) -> dict[str, Any]:
        """Make ``obs`` the current observation; returns its user message, in the words of
        ``agent.prompt_layout`` (``feedback`` and ``last`` tell of the turn before, None before the first)."""
        episode.last_obs = obs
        episode.images = [obs["image"]] if "image" in obs else []
        episode.trajectory.images.extend(episode.images)
        user = self.conversation.user(obs["text"], episode.images[0] if episode.images else None,
                                      turn=len(episode.trajectory.turns) + 1, actions_left=episode.actions_left,
                                      feedback=feedback, names=names, last=last)
        episode.observation, episode.image_at = user.text, user.image_at
        episode.messages.append(user.message)
        return user.message

    def _act(self, episode: _Episode, completion: Completion) -> FinishedTurn | None:
        """Parse one response and step the env; returns the finished turn for scoring (None on an error, or
        when the episode no longer fits the model's context: a server's answer, cut as a local context budget)."""
        if completion.finish_reason == "context":
            episode.finish(TRUNCATED, "context_budget")
            return None
        env, trajectory = episode.slot.env, episode.trajectory
        try:
            names, listing_failure = action_names_of(env), None
        except Exception as error:  # an env that cannot list its actions ends its own episode, not the batch
            names, listing_failure = None, env_failure("action_names()", len(trajectory.turns) + 1, error)
        # The prompt ended with the message's start (the format's response prefix, a template's opening): the
        # assistant message is that start, then the response.
        message = self.fmt.assistant_text(completion.text)
        parsed = self.fmt.parse(message, names)
        turn = TurnRecord(
            index=len(trajectory.turns),
            observation=episode.observation,
            image_at=episode.image_at,
            response=message,
            response_prefix=self.fmt.message_start,
            response_ids=list(completion.token_ids),
            response_logprobs=list(completion.logprobs),
            finish_reason=completion.finish_reason,
            parsed=parsed,
            images=episode.images,
            state_key=turn_state_key(env, episode.last_obs),
            expert_actions=list(completion.expert_actions),
            # The policy takes new weights between generations only: the version now is the one that sampled.
            weights_version=self.policy.weights_version,
        )
        trajectory.turns.append(turn)
        episode.messages.append({"role": "assistant", "content": message})
        if completion.finish_reason == "error":
            self._fail(episode, turn, 0.0, completion.error or "policy error")
            return None
        if listing_failure is not None:
            self._fail(episode, turn, 0.0, listing_failure)
            return None
        if trajectory.tokens is not None:
            if not turn.response_ids:
                self._fail(episode, turn, 0.0, "the policy returned no tokens")
                return None
            try:
                trajectory.tokens.add_response(turn.response_ids, turn.response_logprobs)
            except ValueError as error:  # a completion that contradicts itself (ids and logprobs apart)
                self._fail(episode, turn, 0.0, f"the policy's response cannot be recorded: {error}")
                return None

        facts_before = self._facts(env, turn)
        terminated = truncated = False
        env_reward = 0.0
        for action in parsed.actions[: min(self.agent.max_actions_per_turn, episode.actions_left)]:
            try:  # the step and what it returned: a result the turn cannot read is the env's failure too
                obs, reward, terminated, truncated, info = env.step(action)
                problems = step_answer_problems(reward, terminated, truncated, info)
                if problems:  # read with bool() and float() below, the str "False" would end the episode
                    raise TypeError("; ".join(problems))
                figures = env_metrics(info)
                valid = bool(info.get("action_is_valid", True))
                reason = None if valid else invalid_reason(info)
                effective = valid and bool(info.get("action_is_effective", True))
                step_reward, success = float(reward), bool(info.get("success", False))
                check_observation(obs, episode.max_text_length)
            except Exception as error:
                self._fail(episode, turn, env_reward, env_failure("step", turn.index + 1, error))
                return None
            turn.actions.append(action)
            turn.actions_valid.append(valid)
            turn.actions_effective.append(effective)
            turn.invalid_reasons.append(reason)
            if figures is not None:
                trajectory.env_metrics = figures
            env_reward += step_reward
            trajectory.success = success
            episode.actions_left -= 1
            episode.last_obs = obs
            if not valid or terminated or truncated:
                break
        episode.keep_final_observation()

        if terminated:
            episode.finish(DONE)
        elif truncated:
            episode.finish(TRUNCATED, "env_steps")
        elif episode.actions_left <= 0:
            episode.finish(TRUNCATED, "action_budget")
        elif len(trajectory.turns) >= self.agent.max_turns:
            episode.finish(TRUNCATED, "max_turns")
        return FinishedTurn(
            env_id=self.env_id,
            seed=episode.slot.seed,
            turn=turn.index,
            observation=turn.observation,
            response=turn.response,
            response_tokens=len(turn.response_ids),
            finish_reason=turn.finish_reason,
            parsed=parsed,
            actions=tuple(turn.actions),
            actions_valid=tuple(turn.actions_valid),
            env_reward=env_reward,
            format_reward=turn_format_reward(
                parsed, format_reward=self.agent.format_reward, no_action_penalty=self.agent.no_action_penalty,
                penalize_any_invalid=self.fmt.ragen_reading,
            ),
            terminated=bool(terminated),
            success=trajectory.success,
            facts_before=facts_before,
            facts_after=self._facts(env, turn),
        )

    def _facts(self, env: AgentEnv, turn: TurnRecord) -> StateFacts | None:
        """The env's state facts when a reward function needs them; a failure is a reward error of the turn."""
        if not self.rewards.needs_state_facts:
            return None
        try:
            return env.state_facts()
        except Exception as error:
            turn.reward_errors.append(f"state_facts: {type(error).__name__}: {error}")
            return None

    def _fail(self, episode: _Episode, turn: TurnRecord, env_reward: float, error: str) -> None:
        """End an episode whose policy or env failed; the turn keeps the env reward it had, nothing else, and the
        record the env's last observation (after the turn's steps that returned)."""
        self._record(turn, self.rewards.base_scores(env_reward, 0.0))
        episode.keep_final_observation()
        episode.finish(ERROR, error=error)

    def _score(self, finished: list[tuple[_Episode, FinishedTurn]]) -> None:
        """Score a round's finished turns together (one call per reward function)."""
        scores = self.rewards.score([done for _, done in finished])
        for (episode, _), turn_scores in zip(finished, scores):
            self._record(episode.trajectory.turns[-1], turn_scores)

    @staticmethod
    def _record(turn: TurnRecord, scores: TurnScores) -> None:
        turn.rewards = scores.rewards
        turn.reward = scores.reward
        turn.reward_errors.extend(scores.errors)

    def _next_observation(self, episode: _Episode, sampling: SamplingConfig) -> None:
        env, turn = episode.slot.env, episode.trajectory.turns[-1]
        try:
            names = action_names_of(env)
        except Exception as error:  # as in _act: this episode ends, the batch goes on
            episode.finish(ERROR, error=env_failure("action_names()", turn.index + 2, error))
            return
        # The notes quote the response (an unknown action, a rejected one): its text must not reach the template's
        # tokenizer as control tokens.
        rejected = tuple(neutralized(note, self.control_texts)
                         for note in rejected_actions(turn))
        feedback = TurnFeedback(
            reward=turn.reward,
            no_valid_action=self.agent.feedback_on_invalid and not turn.has_valid_action,
            problems=(*rejected, *(neutralized(error, self.control_texts) for error in turn.parsed.errors)),
            rejected=rejected if self.agent.feedback_on_invalid and turn.has_valid_action else (),
        )
        message = self._observe(episode, episode.last_obs, feedback, names, turn)
        tokens = episode.trajectory.tokens
        if tokens is None:
            return
        try:
            tokens.add_observation(message, *self._encode(episode.images))
        except Exception as error:  # an image the processor cannot take ends this episode, not the run
            episode.finish(ERROR, error=f"the observation after turn {turn.index + 1} cannot be encoded: "
                                        f"{type(error).__name__}: {error}")
            return
        if len(tokens.prompt()) + sampling.max_new_tokens > self.context_budget:
            episode.finish(TRUNCATED, "context_budget")
