"""Token-exact multi-turn context: chat messages to token ids, incrementally.

The tokens trained on must be the tokens sampled. A multi-turn episode is
therefore kept as token segments, never as text:

    head(system, user_0) + response_0 + closing_0 + observation(user_1)
                         + response_1 + closing_1 + observation(user_2) + ...

- ``response_t`` are the ids the policy sampled, kept as they are. Decoding
  them and encoding the text again may give other ids (a word sampled as two
  tokens that the tokenizer would merge, a partial UTF-8 character); training
  on those other ids trains on tokens the model never produced.
- ``head``, ``closing_t`` and ``observation(user)`` are the chat template's
  pieces, read off the template by
  :class:`~turnrl.chat.template_deltas.ChatTemplateDeltas` (the template's
  rendering of the first messages, what it writes after a response, what it
  adds for one new user message).
- A reasoning format's response prefix (RAGEN's ``<think>``) ends the head
  and every observation, after the generation prompt: the prompt holds it
  (loss mask 0), the response continues it, and a full render of the chat
  holds it as the start of each assistant message. A thinking model's
  template opens ``<think>`` in the generation prompt itself: the format is
  then read under it (:func:`format_for_template`).

Where a full re-render differs from the incremental stream, the stream is the
right one to train on: it is what the model was conditioned on when it
sampled. Qwen3's template, for example, strips ``<think>`` reasoning from
earlier assistant turns in a re-render, but the model saw its own reasoning
in the context when it produced the later turns. The same holds where the
tokenizer would merge tokens across the boundary between a prompt and a
response (a response that starts with a newline after ChatML's
``assistant\\n``): a re-render tokenizes the joined text, the stream keeps
the two pieces the model saw and sampled.

Notation: L tokens in the stream, T turns, R_t sampled tokens in turn t.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from turnrl.agent.formats import ResponseFormat
from turnrl.chat.template_deltas import ChatTemplateDeltas, Message, as_message, expand_placeholders
from turnrl.config import ConfigError

HEAD_TURN = -1
"""``turn_index`` of the head tokens (system message, first user message, generation prompt)."""


def format_for_template(fmt: ResponseFormat, tokenizer: PreTrainedTokenizerBase) -> ResponseFormat:
    """``fmt`` as it reads the responses of a model prompted with ``tokenizer``'s chat template: under the text
    the template's generation prompt opens (:meth:`~turnrl.agent.formats.ResponseFormat.under_template`; a
    thinking model's ``<think>\\n``), ``fmt`` itself for most templates.

    Raises:
        ConfigError: the format cannot read responses that continue the template's opening (with why).
    """
    opening = ChatTemplateDeltas.for_tokenizer(tokenizer).template_opening
    try:
        return fmt.under_template(opening)
    except ValueError as error:
        raise ConfigError(f"agent.format={fmt.name}: {error}") from None


@dataclass
class TurnTokens:
    """The token segments of one turn ``t`` (an observation and the response to it)."""

    user_message: Message
    """The user message of this turn (kept to render a head when a window starts here)."""
    observation_ids: list[int]
    """Ids before the response, not sampled. (O_t,). Turn 0: the head; later: the observation delta."""
    image_token_counts: tuple[int, ...] = ()
    """Placeholder tokens per image of ``user_message`` (empty for text-only messages)."""
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """The model's extra inputs for this message (e.g. ``pixel_values``, ``image_grid_thw`` of its images)."""
    image_digests: tuple[int, ...] = ()
    """Each image's digest (:attr:`~turnrl.models.vision.EncodedImage.digest`), or empty when not made."""
    text_observation_ids: list[int] | None = None
    """Observation ids of the message without its images, once a prompt has dropped them (``max_images``)."""
    response_ids: list[int] | None = None
    """Sampled ids, untouched. (R_t,). None while the turn awaits its response."""
    logprobs: list[float] | None = None
    """Sampling logprob of each response id. (R_t,)."""
    closing_ids: list[int] = field(default_factory=list)
    """Template ids appended after the response, not sampled. (C_t,)."""
    stopped: bool = False
    """True when the response ended with the template's end-of-turn token or a tokenizer stop id; False when it
    was cut at max tokens, by a stop string, or ended by an end id the tokenizer does not list."""
    prompt_length: int = 0
    """Tokens in the prompt this response was sampled from."""
    window_start: int = 0
    """First turn whose observation that prompt held (0 unless a context window cut)."""


@dataclass(frozen=True)
class EpisodeStream:
    """An episode's whole token stream for training, aligned per token. L tokens, T turns."""

    input_ids: list[int]
    """Every token of the episode, in order. (L,)."""
    loss_mask: list[int]
    """1 exactly on sampled response tokens, 0 on head, observations and closings. (L,)."""
    turn_index: list[int]
    """Turn of each token: ``HEAD_TURN`` (-1) on the head; t on observation t (t >= 1), response t, closing t. (L,)."""
    logprobs: list[float]
    """Sampling logprob on response tokens, 0.0 elsewhere. (L,)."""
    turn_end_positions: list[int]
    """Index in the stream of each turn's last sampled token. (T,)."""
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """Every turn's extra model inputs, concatenated along dim 0 in turn order (views of the episode's buffers
    where they join: read them, never write them)."""


@dataclass(frozen=True)
class TurnSample:
    """One turn as a stand-alone sample (per-turn training mode)."""

    turn: int
    """Turn number t."""
    prompt_ids: list[int]
    """The prompt the response was sampled from. (P_t,)."""
    response_ids: list[int]
    """Sampled ids. (R_t,)."""
    logprobs: list[float]
    """Sampling logprobs. (R_t,)."""
    closing_ids: list[int]
    """Template ids after the response, not sampled. (C_t,)."""
    stopped: bool
    """Whether the model ended the turn itself."""
    model_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    """The extra model inputs of the turns in the prompt (the window), concatenated along dim 0."""


def without_images(message: Message) -> Message:
    """``message`` with its image parts left out (its text stays): how an observation reads once its
    image is no longer in the prompt."""
    content = message["content"]
    if isinstance(content, str):
        return message
    return {**message, "content": [part for part in content if part.get("type") not in ("image", "image_url")]}


def _checked_digests(digests: Sequence[int], counts: tuple[int, ...]) -> tuple[int, ...]:
    """``digests`` as a tuple: one an image of the message, or none."""
    if digests and len(digests) != len(counts):
        raise ValueError(f"{len(digests)} image digests for a message with {len(counts)} images: give one an image, "
                         "or none")
    return tuple(int(digest) for digest in digests)


def concat_model_inputs(turns: Sequence[TurnTokens]) -> dict[str, torch.Tensor]:
    """The turns' extra model inputs, each concatenated along dim 0 in turn order (Qwen-VL's layout)."""
    keys = sorted({key for turn in turns for key in turn.model_inputs})
    return {key: torch.cat([turn.model_inputs[key] for turn in turns if key in turn.model_inputs]) for key in keys}


class InputRows:
    """Turns' extra model inputs laid end to end, one buffer a key, so that the inputs of a run of consecutive
    turns are a slice of it (a view) rather than a new concatenation.

    Written here because a prompt that keeps every image (SkyRL's VisGym recipe: 15 turns, an image each) would
    otherwise copy its earlier images' pixel values again for every turn: 4.6 GB a step of 64 episodes at
    ``vlm-3b``'s 224 x 224 frames, host time while the device waits for the round's requests
    (``benchmarks/prompt_inputs.py``). A buffer's rows double when it is full, so each value is copied at most about
    twice over an episode, and the buffers hold at most twice the episode's inputs (or the expected turns' where
    that is more). The turns must agree in each key's dtype, device and row shape (one encoder made them); where a
    turn's do not, :meth:`append` lays nothing and clears :attr:`joined`, and the caller concatenates as before.

    Args:
        expected_turns: the turns the episode will likely have: a key's buffer is first sized for that many turns
            like the first, so that an episode of images of one size never doubles it (laying a VisGym step's
            prompt inputs 1.27-1.34x faster on a CPU than doubling from one turn's, ``benchmarks/prompt_inputs.py``);
            a shorter episode leaves the rest of it unused.
    """

    def __init__(self, expected_turns: int = 1) -> None:
        if expected_turns < 1:
            raise ValueError(f"expected_turns must be >= 1, got {expected_turns}")
        self.expected_turns = expected_turns
        self.turns: list[TurnTokens] = []
        """The turns appended, in order (the objects themselves: the owner checks its turns are still these)."""
        self._buffers: dict[str, torch.Tensor] = {}
        self._ends: list[dict[str, int]] = []
        """After each turn, the rows of each key used so far."""
        self.joined = True
        """False once a turn's inputs could not join the buffers (its owner then concatenates)."""

    def append(self, turn: TurnTokens) -> None:
        """Lay ``turn``'s inputs after the others'; if a value cannot join its buffer, nothing is laid and
        :attr:`joined` turns False."""
        used = dict(self._ends[-1]) if self._ends else {}
        for key, value in turn.model_inputs.items():
            buffer = self._buffers.get(key)
            if value.dim() == 0 or (buffer is not None and (buffer.dtype, buffer.device, buffer.shape[1:])
                                    != (value.dtype, value.device, value.shape[1:])):
                self.joined = False
                return
        for key, value in turn.model_inputs.items():
            start = used.get(key, 0)
            stop = start + len(value)
            buffer = self._buffers.get(key)
            if buffer is None or stop > len(buffer):
                rows = len(value) * self.expected_turns if buffer is None else 2 * len(buffer)
                grown = value.new_empty((max(stop, rows), *value.shape[1:]))
                if buffer is not None:
                    grown[:start] = buffer[:start]
                buffer = self._buffers[key] = grown
            buffer[start:stop] = value
            used[key] = stop
        self.turns.append(turn)
        self._ends.append(used)

    def span(self, first: int, last: int) -> dict[str, torch.Tensor]:
        """The inputs of turns ``first`` to ``last`` (inclusive), each concatenated along dim 0 in turn order, as
        views of the buffers: read them, never write them."""
        before = self._ends[first - 1] if first > 0 else {}
        after = self._ends[last]
        # a key with no rows still counts, as in concat_model_inputs
        keys = sorted({key for turn in self.turns[first : last + 1] for key in turn.model_inputs})
        return {key: self._buffers[key][before.get(key, 0) : after[key]] for key in keys}


class EpisodeTokens:
    """The token state of one episode.

    Call :meth:`start`, then alternate :meth:`prompt` / :meth:`add_response` /
    :meth:`add_observation`. With ``max_context_window=k`` the prompt holds
    the current observation and the ``k - 1`` turns before it:

        head(system, user_s) + sum_{j=s}^{t-1} [response_j + closing_j + observation(user_{j+1})],
        s = max(0, t - k + 1)

    built from the stored segments (responses are never re-tokenized). Only
    the head of the first kept turn is re-rendered, since it now carries the
    system message.

    Args:
        tokenizer: a tokenizer with a chat template, or a :class:`ChatTemplateDeltas`.
        max_context_window: turns kept in the prompt; None keeps all.
        image_token: the placeholder token that images render to (e.g.
            ``"<|image_pad|>"``), needed only when image token counts are given. With it, every message must
            render one placeholder per image and no response may hold one (ValueError otherwise).
        max_images: images kept in a prompt, the latest first; older observations in the window
            are rendered without their images. None keeps every image of the window.
        response_prefix: text every prompt ends with after the generation prompt, which the response
            continues (:attr:`~turnrl.agent.formats.ResponseFormat.response_prefix`); None: that of the
            given :class:`ChatTemplateDeltas` (none for a tokenizer).
        expected_turns: the turns the episode will likely have (its turn limit), which sizes the buffers of the
            prompts' model inputs (:class:`InputRows`); any number of turns works.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | ChatTemplateDeltas,
        max_context_window: int | None = None,
        image_token: str | None = None,
        max_images: int | None = None,
        response_prefix: str | None = None,
        expected_turns: int = 1,
    ) -> None:
        if max_context_window is not None and max_context_window < 1:
            raise ValueError("max_context_window must be >= 1 or None")
        if not isinstance(tokenizer, ChatTemplateDeltas):
            tokenizer = ChatTemplateDeltas.for_tokenizer(tokenizer, response_prefix=response_prefix or "")
        elif response_prefix is not None and response_prefix != tokenizer.response_prefix:
            raise ValueError(f"response_prefix {response_prefix!r} differs from the template pieces' "
                             f"{tokenizer.response_prefix!r}: make the ChatTemplateDeltas with it")
        self.deltas = tokenizer
        self.max_context_window = max_context_window
        if max_images is not None and max_images < 0:
            raise ValueError("max_images must be >= 0 or None")
        self.max_images = max_images
        self.expected_turns = expected_turns
        self._image_token = image_token
        # One token in, one id out (the tokenizer's typing also allows lists).
        self._image_token_id: int | None = (
            None if image_token is None else self.deltas.tokenizer.convert_tokens_to_ids(image_token)  # type: ignore[assignment]
        )
        self.system: Message | None = None
        self.turns: list[TurnTokens] = []
        self._heads: dict[int, list[int]] = {}
        self._rows: InputRows | None = None
        """The turns' model inputs end to end, for the prompts' views (:meth:`prompt_model_inputs`); None: not
        made yet. A turn's inputs are laid when a prompt first needs them: they are not to change after that."""

    def __getstate__(self) -> dict[str, object]:
        # The buffers repeat the turns' inputs: they stay behind (a process that reads the prompts makes its own).
        return {**self.__dict__, "_rows": None}

    # -- building ----------------------------------------------------------

    def start(
        self,
        system_message: str | Message | None,
        first_user_message: str | Message,
        image_token_counts: Sequence[int] = (),
        model_inputs: Mapping[str, torch.Tensor] | None = None,
        image_digests: Sequence[int] = (),
    ) -> None:
        """Begin (or restart) the episode with its system and first user message (and its images' model inputs
        and digests)."""
        self.system = None if system_message is None else as_message(system_message, "system")
        user = as_message(first_user_message)
        counts = tuple(image_token_counts)
        head = self._expand(self.deltas.head(self.system, user), counts)
        self.turns = [TurnTokens(user_message=user, observation_ids=head, image_token_counts=counts,
                                 model_inputs=dict(model_inputs or {}),
                                 image_digests=_checked_digests(image_digests, counts))]
        self._heads = {0: head}

    def add_response(self, ids: Sequence[int], logprobs: Sequence[float] | None = None) -> TurnTokens:
        """Record the ids sampled for the current turn and close the assistant message.

        ``logprobs`` (R,) are the sampling logprobs; None stores zeros (e.g.
        for expert demonstrations). Returns the completed turn record.
        """
        turn = self._current()
        if turn.response_ids is not None:
            raise RuntimeError("this turn already has a response; add an observation first")
        if len(ids) == 0:
            raise ValueError("a response must contain at least one sampled token")
        if logprobs is not None and len(logprobs) != len(ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(ids)} response ids")
        if self._image_token_id is not None and self._image_token_id in ids:
            raise ValueError(f"the response holds the image placeholder {self._image_token!r}, which the next prompt "
                             "would hold as an image slot with no image: the sampler must never emit the vision tokens")
        t = len(self.turns) - 1
        turn.prompt_length = len(self)
        turn.window_start = self._window_start(t)
        turn.response_ids = [int(i) for i in ids]
        turn.logprobs = [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]
        turn.closing_ids, turn.stopped = self.deltas.close(turn.response_ids)
        return turn

    def add_observation(
        self,
        user_message: str | Message,
        image_token_counts: Sequence[int] = (),
        model_inputs: Mapping[str, torch.Tensor] | None = None,
        image_digests: Sequence[int] = (),
    ) -> None:
        """Append the next user message (env observation) and its images' model inputs and digests; the prompt
        then awaits a response."""
        if self._current().response_ids is None:
            raise RuntimeError("the current turn has no response yet")
        user = as_message(user_message)
        counts = tuple(image_token_counts)
        ids = self._expand(self.deltas.observation(user), counts)
        self.turns.append(TurnTokens(user_message=user, observation_ids=ids, image_token_counts=counts,
                                     model_inputs=dict(model_inputs or {}),
                                     image_digests=_checked_digests(image_digests, counts)))

    # -- reading -----------------------------------------------------------

    @property
    def awaiting_response(self) -> bool:
        """True when the last turn has an observation but no response yet."""
        return bool(self.turns) and self.turns[-1].response_ids is None

    @property
    def window_cut(self) -> bool:
        """True once a prompt has left out earlier turns or images (the stream is then not what the model saw)."""
        k = self.max_context_window
        if k is not None and len(self.turns) > k:
            return True
        return any(self._dropped_images(t) for t in range(len(self.turns)))

    def _dropped_images(self, t: int) -> set[int]:
        """The turns of turn ``t``'s window whose images its prompt leaves out: all but the latest
        ``max_images`` images (a message's images are kept or dropped together)."""
        if self.max_images is None:
            return set()
        window = [j for j in range(self._window_start(t), t + 1) if self.turns[j].image_token_counts]
        room, dropped = self.max_images, set()
        for j in reversed(window):
            room -= len(self.turns[j].image_token_counts)
            if room < 0:
                dropped.add(j)
        return dropped

    def prompt(self) -> list[int]:
        """What the model sees now: the windowed context ending with the current observation. (P,)."""
        if not self.awaiting_response:
            raise RuntimeError("no turn awaits a response: add an observation (or call start()) first")
        return self.prompt_ids(len(self.turns) - 1)

    def prompt_model_inputs(self, t: int | None = None) -> dict[str, torch.Tensor]:
        """The extra model inputs of turn ``t``'s prompt (default: the current one), those of the turns
        in its window. Views of buffers the episode keeps where the turns allow (read them, never write them):
        a prompt is the latest run of turns, so its inputs are a slice of the episode's, not a new copy of them.
        """
        t = len(self._require_started()) - 1 if t is None else t
        held = self.image_turns(t)
        if not any(self.turns[j].model_inputs for j in held):
            return {}  # a text prompt: no buffers to make
        first, last = held[0], held[-1]
        if any(self.turns[j].model_inputs for j in range(first, last + 1) if j not in held):
            return concat_model_inputs([self.turns[j] for j in held])
        return self.turns_model_inputs(first, last)

    def turns_model_inputs(self, first: int, last: int) -> dict[str, torch.Tensor]:
        """The extra model inputs of turns ``first`` to ``last`` (inclusive), each concatenated along dim 0 in turn
        order: views of the buffers the episode keeps where its turns join them (read them, never write them),
        else a new concatenation."""
        turns = self._require_started()[first : last + 1]
        if not any(turn.model_inputs for turn in turns):
            return {}  # text turns: no buffers to make
        rows = self._input_rows()
        return concat_model_inputs(turns) if rows is None else rows.span(first, last)

    def prompt_image_digests(self, t: int | None = None) -> list[int] | None:
        """The digests of the images in turn ``t``'s prompt (default: the current one), in order, as
        :meth:`prompt_model_inputs` holds them; None when some were not made."""
        t = len(self._require_started()) - 1 if t is None else t
        turns = [self.turns[j] for j in self.image_turns(t)]
        if any(len(turn.image_digests) != len(turn.image_token_counts) for turn in turns):
            return None
        return [digest for turn in turns for digest in turn.image_digests]

    def image_turns(self, t: int) -> list[int]:
        """The turns, in order, whose observations' images turn ``t``'s prompt holds (its window, less the
        turns whose images ``max_images`` leaves out)."""
        dropped = self._dropped_images(t)
        return [j for j in range(self._window_start(t), t + 1) if j not in dropped]

    def prompt_ids(self, t: int) -> list[int]:
        """The prompt of turn ``t``, as it was (or is) given to the model. (P_t,).

        For a turn with a response this is the prompt it was sampled from; it
        ends with turn t's observation.
        """
        self._require_started()
        s = self._window_start(t)
        dropped = self._dropped_images(t)
        ids = list(self._head(s, with_images=s not in dropped))
        for j in range(s, t):
            turn = self.turns[j]
            assert turn.response_ids is not None
            ids += turn.response_ids + turn.closing_ids + self._observation(j + 1, with_images=j + 1 not in dropped)
        return ids

    def __len__(self) -> int:
        """Tokens in the current context (the prompt, plus the closed response when one was just added)."""
        if not self.turns:
            return 0
        last = self.turns[-1]
        answered = 0 if last.response_ids is None else len(last.response_ids) + len(last.closing_ids)
        return len(self.prompt_ids(len(self.turns) - 1)) + answered

    def stream(self) -> EpisodeStream:
        """The whole episode as one aligned token stream, for training.

        Valid only when no prompt left turns or images out (no window, or the window
        never cut): then every response was sampled from exactly the stream
        before it.

        Raises:
            RuntimeError: a prompt left turns or images out; the message names the setting that did and what to
                set instead (:meth:`turn_samples` is valid with any window).
        """
        self._require_started()
        if self.window_cut:
            raise RuntimeError(self._cut_message())
        ids: list[int] = []
        mask: list[int] = []
        turn_index: list[int] = []
        logprobs: list[float] = []
        ends: list[int] = []

        def extend(seg: Sequence[int], m: int, t: int, lp: Sequence[float] | None = None) -> None:
            ids.extend(seg)
            mask.extend([m] * len(seg))
            turn_index.extend([t] * len(seg))
            logprobs.extend(lp if lp is not None else [0.0] * len(seg))

        for t, turn in enumerate(self.turns):
            extend(turn.observation_ids, 0, HEAD_TURN if t == 0 else t)
            if turn.response_ids is None:
                break
            extend(turn.response_ids, 1, t, turn.logprobs)
            ends.append(len(ids) - 1)
            extend(turn.closing_ids, 0, t)
        return EpisodeStream(ids, mask, turn_index, logprobs, ends, self.turns_model_inputs(0, len(self.turns) - 1))

    def turn_samples(self) -> list[TurnSample]:
        """Each answered turn as (its own prompt, its response): valid with any window."""
        out = []
        for t, turn in enumerate(self.turns):
            if turn.response_ids is None:
                continue
            out.append(
                TurnSample(
                    turn=t,
                    prompt_ids=self.prompt_ids(t),
                    response_ids=list(turn.response_ids),
                    logprobs=list(turn.logprobs or []),
                    closing_ids=list(turn.closing_ids),
                    stopped=turn.stopped,
                    model_inputs=self.prompt_model_inputs(t),
                )
            )
        return out

    # -- helpers -----------------------------------------------------------

    def _cut_message(self) -> str:
        """Why :meth:`stream` is refused, in the config keys that a user sets (the rollout's ``agent.*``)."""
        k = self.max_context_window
        if k is not None and len(self.turns) > k:
            key, value, left_out = "agent.max_context_window", str(k), "earlier turns"
        else:
            key, value, left_out = "agent.max_images", str(self.max_images), "older images"
        return (f"{key}={value} left {left_out} out of later prompts, so the whole-episode stream is not what the "
                "model saw: train one sample per turn (algorithm.sample_mode=turn; turn_samples() here), or set "
                f"{key} to null or >= agent.max_turns")

    def _input_rows(self) -> InputRows | None:
        """The turns' inputs end to end, brought up to date with :attr:`turns` (made again if the turns laid are
        not the first of these, as after a restart or an unpickling); None where they cannot join."""
        rows = self._rows
        if rows is None or any(laid is not turn for laid, turn in zip(rows.turns, self.turns)):
            rows = self._rows = InputRows(self.expected_turns)
        while rows.joined and len(rows.turns) < len(self.turns):
            rows.append(self.turns[len(rows.turns)])
        return rows if rows.joined else None

    def _require_started(self) -> list[TurnTokens]:
        if not self.turns:
            raise RuntimeError("call start() first")
        return self.turns

    def _current(self) -> TurnTokens:
        return self._require_started()[-1]

    def _window_start(self, t: int) -> int:
        k = self.max_context_window
        return 0 if k is None else max(0, t - k + 1)

    def _head(self, s: int, with_images: bool = True) -> list[int]:
        """Head ids when the context starts at turn ``s`` (system + user_s + generation prompt), with
        user_s's images or without them (when the prompt no longer shows them)."""
        turn = self.turns[s]
        if not with_images and turn.image_token_counts:
            key = -1 - s  # heads without images are cached apart
            if key not in self._heads:
                self._heads[key] = self.deltas.head(self.system, without_images(turn.user_message))
            return self._heads[key]
        if s not in self._heads:
            self._heads[s] = self._expand(self.deltas.head(self.system, turn.user_message), turn.image_token_counts)
        return self._heads[s]

    def _observation(self, j: int, with_images: bool) -> list[int]:
        """Observation ids of turn ``j``, or those of its message without images (rendered once)."""
        turn = self.turns[j]
        if with_images or not turn.image_token_counts:
            return turn.observation_ids
        if turn.text_observation_ids is None:
            turn.text_observation_ids = self.deltas.observation(without_images(turn.user_message))
        return turn.text_observation_ids

    def _expand(self, ids: list[int], counts: tuple[int, ...]) -> list[int]:
        """A message's ids with each image's placeholder repeated to its count (:func:`expand_placeholders`).

        Raises:
            ValueError: the message renders another number of placeholders than it has images. Its text then
                holds the placeholder's text (an env's, or a response quoted back in a parse error), which the
                tokenizer reads as the placeholder token: the model would take it for an image slot with no image.
        """
        if self._image_token_id is None:
            if counts:
                raise ValueError("image token counts given but EpisodeTokens has no image_token")
            return ids
        found = ids.count(self._image_token_id)
        if found != len(counts):
            raise ValueError(f"the message renders {found} image placeholders {self._image_token!r} for its "
                             f"{len(counts)} images: its text holds the placeholder's text, which the model would "
                             "read as an image slot with no image; take it out of the message's text")
        return expand_placeholders(ids, self._image_token_id, counts) if counts else ids
