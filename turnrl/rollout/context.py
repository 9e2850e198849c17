"""Token-exact multi-turn context: chat messages to token ids, incrementally.

The tokens trained on must be the tokens sampled. A multi-turn episode is
therefore kept as token segments, never as text:

    head(system, user_0) + response_0 + closing_0 + observation(user_1)
                         + response_1 + closing_1 + observation(user_2) + ...

- ``head`` is the chat template's rendering of ``[system, user_0]`` with the
  generation prompt.
- ``response_t`` are the ids the policy sampled, kept as they are. Decoding
  them and encoding the text again may give other ids (a word sampled as two
  tokens that the tokenizer would merge, a partial UTF-8 character); training
  on those other ids trains on tokens the model never produced.
- ``closing_t`` is what the template writes after an assistant message
  (``<|im_end|>\\n`` for ChatML, ``<|eot_id|>`` for Llama-3), minus the part
  the model already sampled (its end-of-turn token).
- ``observation(user)`` is what the template adds for one new user message,
  generation prompt included: the text difference between rendering a fixed
  conversation with and without that message.

Nothing here knows any special token: all of it is read off the tokenizer's
chat template, so any template whose messages render independently of the
ones that follow works, and the construction is checked against a full
render when a :class:`ChatTemplateDeltas` is made.

Where a full re-render differs from the incremental stream, the stream is the
right one to train on: it is what the model was conditioned on when it
sampled. Qwen3's template, for example, strips ``<think>`` reasoning from
earlier assistant turns in a re-render, but the model saw its own reasoning
in the context when it produced the later turns.

Notation: L tokens in the stream, T turns, R_t sampled tokens in turn t.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
"""A chat message: ``{"role": str, "content": str | list[part]}`` (OpenAI style parts)."""

HEAD_TURN = -1
"""``turn_index`` of the head tokens (system message, first user message, generation prompt)."""

# Dummy texts used to probe the template. The response placeholder must come
# back verbatim in the rendering (no surrounding whitespace that a template
# could trim) and must not occur elsewhere in it.
_PLACEHOLDER = "TURNRL_RESPONSE_PLACEHOLDER"
_BASE_SYSTEM = "base system message"
_BASE_USER = "base user message"
_BASE_ANSWER = "base answer"
_BASE_FOLLOW_UP = "base follow-up"
_PROBE = ("probe system message", "probe question", "probe answer", "probe follow-up")


class TemplateDeltaError(ValueError):
    """The chat template cannot be rendered incrementally (see the message for why)."""


def as_message(message: str | Message, role: str = "user") -> Message:
    """``message`` as a message dict; a plain string becomes ``{"role": role, "content": s}``."""
    if isinstance(message, str):
        return {"role": role, "content": message}
    if "role" not in message or "content" not in message:
        raise ValueError(f"a message needs 'role' and 'content', got keys {sorted(message)}")
    return message


def expand_placeholders(ids: Sequence[int], placeholder_id: int, counts: Sequence[int]) -> list[int]:
    """Repeat the i-th ``placeholder_id`` in ``ids`` ``counts[i]`` times.

    Vision templates write one placeholder per image (``<|image_pad|>``); the
    model needs one per visual token group of that image (for Qwen-VL,
    ``t*h*w / merge_size**2`` from ``image_grid_thw``). Shapes: ids (n,) ->
    (n - len(counts) + sum(counts),).
    """
    positions = [i for i, tok in enumerate(ids) if tok == placeholder_id]
    if len(positions) != len(counts):
        raise ValueError(f"{len(positions)} image placeholders in the message but {len(counts)} image token counts")
    out: list[int] = []
    last = 0
    for pos, count in zip(positions, counts):
        out.extend(ids[last:pos])
        out.extend([placeholder_id] * count)
        last = pos + 1
    out.extend(ids[last:])
    return out


class ChatTemplateDeltas:
    """Token pieces of a chat template, for building contexts incrementally.

    Stateless once made; :meth:`for_tokenizer` caches one per tokenizer and
    template arguments. ``template_kwargs`` go to every render (e.g.
    ``enable_thinking=False`` for Qwen3 templates).

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template.
        chat_template: a template to use instead of the tokenizer's.
        stop_ids: ids that end a response besides the template's end-of-turn
            token (default: the tokenizer's ``eos_token_id``); see :meth:`close`.
        verify: check at construction that ``head + response + closing +
            observation`` agrees with the full render of a probe
            conversation (see :meth:`verify`); raise :class:`TemplateDeltaError` if not.
    """

    # Tokenizer -> {(template, arguments): instance}. The instances refer to
    # their tokenizer, so entries live as long as the process; tokenizers are
    # few and long-lived, so this is fine.
    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        *,
        chat_template: str | None = None,
        stop_ids: Sequence[int] | None = None,
        verify: bool = True,
        **template_kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.template_kwargs = template_kwargs
        self.observation_base, self._base_text = self._find_base()
        self._closing_text = self._find_closing()
        self.closing: tuple[int, ...] = tuple(self.encode(self._closing_text))
        """Ids the template puts after an assistant message's content."""
        if stop_ids is None:
            stop_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self.stop_ids = frozenset(stop_ids)
        self.matches_full_render: bool | None = None
        """True when the probe's incremental ids equal its full render; None if not verified."""
        if verify:
            self.verify()

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, **kwargs: Any) -> ChatTemplateDeltas:
        """A cached instance for ``tokenizer`` and these arguments."""
        try:
            key = tuple(sorted((k, v if not isinstance(v, list) else tuple(v)) for k, v in kwargs.items()))
            hash(key)
        except TypeError:
            return cls(tokenizer, **kwargs)
        per_tok = cls._cache.setdefault(tokenizer, {})
        # The tokenizer's template may be replaced after caching: key on it too.
        key = (tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None, key)
        if key not in per_tok:
            per_tok[key] = cls(tokenizer, **kwargs)
        return per_tok[key]

    # -- rendering ---------------------------------------------------------

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        """The template's text for ``messages``."""
        return self.tokenizer.apply_chat_template(
            list(messages),
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Ids of template text, control tokens atomic, no BOS/EOS added (templates write their own)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _find_base(self) -> tuple[list[Message], str]:
        """Choose the dummy conversation that observation deltas are taken against.

        A candidate works when its rendering is a string prefix of the
        rendering with one more user message and the generation prompt.
        ``[user, assistant]`` comes first: it is what an episode looks like
        when an observation arrives, and templates that demand alternating
        roles accept it. Templates that render the last assistant message
        differently (Qwen3 wraps it in a think block) fail it, and a
        conversation ending with a user message is used instead.
        """
        user = {"role": "user", "content": _BASE_USER}
        candidates = [
            [user, {"role": "assistant", "content": _BASE_ANSWER}],
            [{"role": "system", "content": _BASE_SYSTEM}, user],
            [user],
        ]
        failures = []
        for base in candidates:
            try:
                base_text = self.render(base, add_generation_prompt=False)
                extended = self.render([*base, {"role": "user", "content": "x"}], add_generation_prompt=True)
            except Exception as err:  # a template may reject a conversation shape; try the next one
                failures.append(f"{[m['role'] for m in base]}: {type(err).__name__}: {err}")
                continue
            if extended.startswith(base_text):
                return base, base_text
            failures.append(f"{[m['role'] for m in base]}: its rendering changes when a user message follows")
        raise TemplateDeltaError(
            "this chat template cannot be rendered incrementally: no base conversation renders as a prefix of "
            "itself plus one more user message. Tried: " + "; ".join(failures)
        )

    def _find_closing(self) -> str:
        """The text between an assistant message's content and the next user message.

        Read off ``[user, assistant(placeholder), user]``: what follows the
        placeholder, minus the observation delta of the last user message.
        Taking it from a non-final assistant message matters: some templates
        end the final message of a chat differently.
        """
        follow_up = {"role": "user", "content": _BASE_FOLLOW_UP}
        chat = [{"role": "user", "content": _BASE_USER}, {"role": "assistant", "content": _PLACEHOLDER}, follow_up]
        text = self.render(chat, add_generation_prompt=True)
        delta = self._observation_text(follow_up)
        if text.count(_PLACEHOLDER) != 1:
            raise TemplateDeltaError("the chat template does not render an assistant message's content verbatim")
        after = text.split(_PLACEHOLDER, 1)[1]
        if not after.endswith(delta):
            raise TemplateDeltaError(
                "the chat template renders a user message after an assistant message differently from the "
                f"observation delta: expected the chat to end with {delta!r}, got {after!r}"
            )
        return after[: len(after) - len(delta)]

    # -- pieces ------------------------------------------------------------

    def head(self, system: str | Message | None, user: str | Message) -> list[int]:
        """Ids of ``render([system?, user], add_generation_prompt=True)``. Shape (H,)."""
        messages = [] if system is None else [as_message(system, "system")]
        return self.encode(self.render([*messages, as_message(user)], add_generation_prompt=True))

    def observation(self, user: str | Message) -> list[int]:
        """Ids a new user message adds after a closed assistant turn, generation prompt included. Shape (O,)."""
        return self.encode(self._observation_text(as_message(user)))

    def _observation_text(self, user: Message) -> str:
        text = self.render([*self.observation_base, user], add_generation_prompt=True)
        if not text.startswith(self._base_text):
            raise TemplateDeltaError(
                "the chat template renders earlier messages differently when this user message follows them; "
                f"the message cannot be appended incrementally: {user!r}"
            )
        return text[len(self._base_text) :]

    def response_closing(self) -> list[int]:
        """Ids the template puts after an assistant message's content. Shape (C,)."""
        return list(self.closing)

    def close(self, response_ids: Sequence[int]) -> tuple[list[int], bool]:
        """Ids to append after a sampled response, and whether the model ended its turn.

        If the response ends with the first ``k`` ids of the closing (the model
        sampled its end-of-turn token), only the rest of the closing is
        appended. Otherwise the response was cut (max tokens) or stopped on
        another stop id, and the whole closing is appended so that the next
        observation follows a well-formed assistant message. Appended ids were
        not sampled: they take no loss.
        """
        closing = self.closing
        for k in range(min(len(closing), len(response_ids)), 0, -1):
            if tuple(response_ids[-k:]) == closing[:k]:
                return list(closing[k:]), True
        stopped = bool(response_ids) and response_ids[-1] in self.stop_ids
        return list(closing), stopped

    # -- self-check --------------------------------------------------------

    def verify(self) -> None:
        """Check the pieces against full renders of a probe conversation.

        The probe is ``[system?, question, answer, follow-up]`` with the
        generation prompt, with and without a system message. Two checks:

        1. The pieces tokenize as their joined text does (no token would
           straddle a boundary between pieces).
        2. The joined text equals the template's full render. Where it does
           not, the difference must lie only in how the template re-renders
           the past assistant turn before its content (Qwen3 strips reasoning
           and the empty think block that ``enable_thinking=False`` puts in
           the generation prompt; a template may write ``"assistant: "`` for
           a past message but prompt with ``"assistant:"``): the full render
           must still start like the head without its generation prompt and
           end with ``answer + closing + observation``. The incremental
           context is then still the one to train on (it is what the model
           saw), and ``matches_full_render`` is set to False.

        Anything else raises :class:`TemplateDeltaError`.
        """
        system, question, answer, follow_up = _PROBE
        answer_ids = self.encode(answer)
        closing, _ = self.close(answer_ids)
        self.matches_full_render = True
        for sys_msg in (system, None):
            opening = [] if sys_msg is None else [{"role": "system", "content": sys_msg}]
            opening.append({"role": "user", "content": question})
            head_text = self.render(opening, add_generation_prompt=True)
            tail_text = answer + self._closing_text + self._observation_text(as_message(follow_up))
            got = self.head(sys_msg, question) + answer_ids + closing + self.observation(follow_up)
            joined = self.encode(head_text + tail_text)
            if got != joined:
                raise TemplateDeltaError(
                    "the template's pieces tokenize differently one by one than joined, at token "
                    f"{_first_difference(got, joined)} of {self.tokenizer.decode(joined)!r}"
                )
            chat = [*opening, {"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
            full_text = self.render(chat, add_generation_prompt=True)
            if self.encode(full_text) == got:
                continue
            self.matches_full_render = False
            if not (
                full_text.startswith(self.render(opening, add_generation_prompt=False))
                and full_text.endswith(tail_text)
            ):
                raise TemplateDeltaError(
                    "incremental rendering differs from a full render of the same chat beyond the past assistant "
                    f"turn:\n  incremental: {head_text + tail_text!r}\n  full render: {full_text!r}\n"
                    "Pass verify=False to use the template anyway (the incremental context is still what the "
                    "model sees, but it will not match a re-render of the chat)."
                )


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


# -- one episode -------------------------------------------------------------


@dataclass
class TurnTokens:
    """The token segments of one turn ``t`` (an observation and the response to it)."""

    user_message: Message
    """The user message of this turn (kept to render a head when a window starts here)."""
    observation_ids: list[int]
    """Ids before the response, not sampled. (O_t,). Turn 0: the head; later: the observation delta."""
    image_token_counts: tuple[int, ...] = ()
    """Placeholder tokens per image of ``user_message`` (empty for text-only messages)."""
    response_ids: list[int] | None = None
    """Sampled ids, untouched. (R_t,). None while the turn awaits its response."""
    logprobs: list[float] | None = None
    """Sampling logprob of each response id. (R_t,)."""
    closing_ids: list[int] = field(default_factory=list)
    """Template ids appended after the response, not sampled. (C_t,)."""
    stopped: bool = False
    """True when the model ended its turn itself; False when it was cut at max tokens."""
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
            ``"<|image_pad|>"``), needed only when image token counts are given.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | ChatTemplateDeltas,
        max_context_window: int | None = None,
        image_token: str | None = None,
    ) -> None:
        if max_context_window is not None and max_context_window < 1:
            raise ValueError("max_context_window must be >= 1 or None")
        if not isinstance(tokenizer, ChatTemplateDeltas):
            tokenizer = ChatTemplateDeltas.for_tokenizer(tokenizer)
        self.deltas = tokenizer
        self.max_context_window = max_context_window
        self._image_token_id = (
            None if image_token is None else self.deltas.tokenizer.convert_tokens_to_ids(image_token)
        )
        self.system: Message | None = None
        self.turns: list[TurnTokens] = []
        self._heads: dict[int, list[int]] = {}

    # -- building ----------------------------------------------------------

    def start(
        self,
        system_message: str | Message | None,
        first_user_message: str | Message,
        image_token_counts: Sequence[int] = (),
    ) -> None:
        """Begin (or restart) the episode with its system and first user message."""
        self.system = None if system_message is None else as_message(system_message, "system")
        user = as_message(first_user_message)
        counts = tuple(image_token_counts)
        head = self._expand(self.deltas.head(self.system, user), counts)
        self.turns = [TurnTokens(user_message=user, observation_ids=head, image_token_counts=counts)]
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
        t = len(self.turns) - 1
        turn.prompt_length = len(self)
        turn.window_start = self._window_start(t)
        turn.response_ids = [int(i) for i in ids]
        turn.logprobs = [0.0] * len(ids) if logprobs is None else [float(x) for x in logprobs]
        turn.closing_ids, turn.stopped = self.deltas.close(turn.response_ids)
        return turn

    def add_observation(self, user_message: str | Message, image_token_counts: Sequence[int] = ()) -> None:
        """Append the next user message (env observation); the prompt then awaits a response."""
        if self._current().response_ids is None:
            raise RuntimeError("the current turn has no response yet")
        user = as_message(user_message)
        counts = tuple(image_token_counts)
        ids = self._expand(self.deltas.observation(user), counts)
        self.turns.append(TurnTokens(user_message=user, observation_ids=ids, image_token_counts=counts))

    # -- reading -----------------------------------------------------------

    @property
    def num_turns(self) -> int:
        """Turns started (observations added, the first included)."""
        return len(self.turns)

    @property
    def awaiting_response(self) -> bool:
        """True when the last turn has an observation but no response yet."""
        return bool(self.turns) and self.turns[-1].response_ids is None

    @property
    def window_cut(self) -> bool:
        """True once a prompt has left out earlier turns (the stream is then not what the model saw)."""
        k = self.max_context_window
        return k is not None and len(self.turns) > k

    def prompt(self) -> list[int]:
        """What the model sees now: the windowed context ending with the current observation. (P,)."""
        if not self.awaiting_response:
            raise RuntimeError("no turn awaits a response: add an observation (or call start()) first")
        return self.prompt_ids(len(self.turns) - 1)

    def prompt_ids(self, t: int) -> list[int]:
        """The prompt of turn ``t``, as it was (or is) given to the model. (P_t,).

        For a turn with a response this is the prompt it was sampled from; it
        ends with turn t's observation.
        """
        self._require_started()
        s = self._window_start(t)
        ids = list(self._head(s))
        for j in range(s, t):
            turn = self.turns[j]
            assert turn.response_ids is not None
            ids += turn.response_ids + turn.closing_ids + self.turns[j + 1].observation_ids
        return ids

    def __len__(self) -> int:
        """Tokens in the current context (the prompt, plus the closed response when one was just added)."""
        if not self.turns:
            return 0
        t = len(self.turns) - 1
        s = self._window_start(t)
        n = len(self._head(s)) + sum(len(turn.observation_ids) for turn in self.turns[s + 1 :])
        for turn in self.turns[s:]:
            if turn.response_ids is not None:
                n += len(turn.response_ids) + len(turn.closing_ids)
        return n

    def stream(self) -> EpisodeStream:
        """The whole episode as one aligned token stream, for training.

        Valid only when no prompt left turns out (no window, or the window
        never cut): then every response was sampled from exactly the stream
        before it. Raises otherwise; use :meth:`turn_samples` instead.
        """
        self._require_started()
        if self.window_cut:
            raise RuntimeError(
                "the context window cut earlier turns, so the whole-episode stream is not what the model saw; "
                "train on turn_samples() instead"
            )
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
        return EpisodeStream(ids, mask, turn_index, logprobs, ends)

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
                )
            )
        return out

    # -- helpers -----------------------------------------------------------

    def _require_started(self) -> list[TurnTokens]:
        if not self.turns:
            raise RuntimeError("call start() first")
        return self.turns

    def _current(self) -> TurnTokens:
        return self._require_started()[-1]

    def _window_start(self, t: int) -> int:
        k = self.max_context_window
        return 0 if k is None else max(0, t - k + 1)

    def _head(self, s: int) -> list[int]:
        """Head ids when the context starts at turn ``s`` (system + user_s + generation prompt)."""
        if s not in self._heads:
            turn = self.turns[s]
            self._heads[s] = self._expand(self.deltas.head(self.system, turn.user_message), turn.image_token_counts)
        return self._heads[s]

    def _expand(self, ids: list[int], counts: tuple[int, ...]) -> list[int]:
        if not counts:
            return ids
        if self._image_token_id is None:
            raise ValueError("image token counts given but EpisodeTokens has no image_token")
        return expand_placeholders(ids, self._image_token_id, counts)
