"""A chat template's pieces as token ids: a context grows by appending them, never by re-rendering text.

A multi-turn context (:mod:`turnrl.rollout.context` in a rollout; the policy
server folds a system message and expands image placeholders the same way)
is built from these pieces:

    head(system, user_0) + response_0 + closing_0 + observation(user_1)
                         + response_1 + closing_1 + observation(user_2) + ...

- ``head`` is the chat template's rendering of ``[system, user_0]`` with the
  generation prompt. A template without a system role (Gemma 2 raises on
  one) gets the system text folded into the first user message instead
  (:func:`fold_system`).
- ``closing_t`` is what the template writes after an assistant message
  (``<|im_end|>\\n`` for ChatML, ``<|eot_id|>`` for Llama-3), minus the part
  the model already sampled: its end-of-turn token stands in for the closing
  up to and including that token (see :meth:`ChatTemplateDeltas.close`).
- ``observation(user)`` is what the template adds for one new user message,
  generation prompt included: the text difference between rendering a fixed
  conversation with and without that message.
- A ``response_prefix`` (a reasoning format's, e.g. RAGEN's ``<think>``) ends
  the head and every observation after the generation prompt: the response
  continues it, and a full render holds it as the start of the assistant
  message's content.
- A template may itself open the assistant's content in its generation prompt
  and leave it open: Qwen3-Thinking-2507 and the DeepSeek-R1 distills end it
  with ``<think>\\n``, and the model continues inside the think block.
  :attr:`ChatTemplateDeltas.template_opening` is that text, which the
  response's reader must put before it (:meth:`~turnrl.agent.formats.ResponseFormat.under_template`).

Nothing here knows any special token: all of it is read off the tokenizer's
chat template, so any template whose messages render independently of the
ones that follow works, and the construction is checked against a full
render when a :class:`ChatTemplateDeltas` is made.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from turnrl.chat.templates import open_tags

Message = dict[str, Any]
"""A chat message: ``{"role": str, "content": str | list[part]}`` (OpenAI style parts)."""

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
    if not isinstance(message, dict):
        raise ValueError(f"a message is a string or a dict with 'role' and 'content', got a {type(message).__name__}")
    if "role" not in message or "content" not in message:
        raise ValueError(f"a message needs 'role' and 'content', got keys {sorted(map(str, message))}")
    if not isinstance(message["role"], str):
        raise ValueError(f"a message's 'role' is a string such as 'user', got a {type(message['role']).__name__}")
    return message


def fold_system(system: Message, user: Message) -> Message:
    """``user`` with the system message's content in front, separated by a blank line.

    How a template without a system role takes a system prompt: Gemma 3's
    template folds it this way itself, and Gemma 2's raises on a system
    message. Contents may be strings or lists of OpenAI-style parts.
    """
    sys_content, user_content = system["content"], user["content"]
    if isinstance(sys_content, str) and isinstance(user_content, str):
        return {**user, "content": f"{sys_content}\n\n{user_content}"}
    # Parts are concatenated by the template: a text part of two newlines keeps the same text.
    parts = [*_as_parts(sys_content), {"type": "text", "text": "\n\n"}, *_as_parts(user_content)]
    return {**user, "content": parts}


def _as_parts(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


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


TEXT_MEMO_SIZE = 8192
"""Heads and observations whose ids a :class:`ChatTemplateDeltas` remembers (the least recently used go)."""

MemoKey = tuple[tuple[str, "str | tuple[str, ...]"], ...]
"""Messages as a memo keys them: ``(role, text)``, or ``(role, parts)`` with each part its text or
:data:`IMAGE_PART` for an image."""

IMAGE_PART = "\0image"
"""An image part in a :data:`MemoKey` (a text part is its text: a NUL never starts one a template renders)."""

_PROBE_PICTURES = (np.zeros((2, 3, 3), dtype=np.uint8), np.full((5, 4, 3), 255, dtype=np.uint8))
"""Two pictures of other sizes and contents: a template that renders them alike renders any picture alike; the
first stands in for the pictures of remembered messages."""


def _memo_key(messages: Sequence[Message], images: bool) -> MemoKey | None:
    """What a memo of the messages' rendering may be keyed on, or None (not remembered): each message exactly a
    role and a content, the content a text or, with ``images``, a list of text parts (``{"type": "text",
    "text": str}``) and image parts (``{"type": "image", "image": array}``: the picture itself is left out, for
    a template that renders its placeholder alike for any picture; a URL or a path stays out of the memo)."""
    key: list[tuple[str, str | tuple[str, ...]]] = []
    for message in messages:
        if set(message) != {"role", "content"}:
            return None
        content = message["content"]
        if isinstance(content, str):
            key.append((message["role"], content))
            continue
        if not images or not isinstance(content, list):
            return None
        parts = []
        for part in content:
            if not isinstance(part, dict):
                return None
            if set(part) == {"type", "text"} and part["type"] == "text" and isinstance(part["text"], str) \
                    and not part["text"].startswith("\0"):
                parts.append(part["text"])
            elif set(part) == {"type", "image"} and part["type"] == "image" and isinstance(part["image"], np.ndarray):
                parts.append(IMAGE_PART)
            else:
                return None
        key.append((message["role"], tuple(parts)))
    return tuple(key)


class ChatTemplateDeltas:
    """Token pieces of a chat template, for building contexts incrementally.

    Stateless once made but for a memo of the ids of heads and observations
    of texts and pictures (a pure function of the messages, pictures left out
    where the template renders any picture alike: a rollout's episodes of a
    group start from the same message and revisit states, a picture's caption
    repeats, and validation replays its levels); :meth:`for_tokenizer` caches one per tokenizer and
    template arguments. ``template_kwargs`` go to every render (e.g.
    ``enable_thinking=False`` for Qwen3 templates). A template without a
    system role (:attr:`system_role` False) gets the system message folded
    into the first user message of every head.

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template.
        chat_template: a template to use instead of the tokenizer's.
        stop_ids: ids that end a response besides the template's end-of-turn
            token (default: the tokenizer's ``eos_token_id``); see :meth:`close`.
        verify: check at construction that ``head + response + closing +
            observation`` agrees with the full render of a probe
            conversation (see :meth:`verify`); raise :class:`TemplateDeltaError` if not.
        memo_size: heads and observations whose ids are remembered (0: none).
        response_prefix: text every head and observation ends with after the generation prompt, which the
            response continues (:attr:`~turnrl.agent.formats.ResponseFormat.response_prefix`); encoded with the
            generation prompt, as a full render of the chat with the assistant message ``response_prefix +
            response`` tokenizes it.
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
        memo_size: int = TEXT_MEMO_SIZE,
        response_prefix: str = "",
        **template_kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.response_prefix = response_prefix
        """Text after the generation prompt of every head and observation, which the response continues."""
        self.chat_template = chat_template
        self.template_kwargs = template_kwargs
        if stop_ids is None:
            stop_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
        self.stop_ids = frozenset(stop_ids)
        self.system_role = self._find_system_role()
        """False when the template rejects or drops a system message: it is folded into the first user message."""
        self.observation_base, self._base_text = self._find_base()
        self._closing_text = self._find_closing()
        self.closing: tuple[int, ...] = tuple(self.encode(self._closing_text))
        """Ids the template puts after an assistant message's content."""
        self.end_of_turn_index = self._find_end_of_turn()
        """Position in ``closing`` of the token a model samples to end its turn (0 for most templates)."""
        self._closing_lead_text = self._split_closing()
        self.template_opening = self._find_template_opening()
        """Text the generation prompt writes at the start of the assistant's content and leaves open, which the
        response continues (a thinking model's ``<think>\\n``); "" for most templates, and for a block the
        generation prompt also closes (Qwen3's empty think block under ``enable_thinking=False``)."""
        self._images_in_memo = self._renders_any_picture_alike()
        self._memo_ids: Callable[[str, MemoKey], tuple[int, ...]] = lru_cache(maxsize=memo_size)(
            lambda piece, key: tuple(self._rendered_ids(piece, self._memo_messages(key))))
        self.matches_full_render: bool | None = None
        """True when the probe's incremental ids equal its full render; None if not verified."""
        if verify:
            self.verify()

    @classmethod
    def for_tokenizer(cls, tokenizer: PreTrainedTokenizerBase, **kwargs: Any) -> ChatTemplateDeltas:
        """A cached instance for ``tokenizer`` and these arguments."""
        if kwargs.get("response_prefix") == "":
            del kwargs["response_prefix"]  # the default: the same instance as without it
        try:
            key = tuple(sorted((k, v if not isinstance(v, list) else tuple(v)) for k, v in kwargs.items()))
            hash(key)
        except TypeError:
            return cls(tokenizer, **kwargs)
        per_tok = cls._cache.setdefault(tokenizer, {})
        # The tokenizer's template may be replaced after caching: key on it too.
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        if (template, key) not in per_tok:
            per_tok[template, key] = cls(tokenizer, **kwargs)
        return per_tok[template, key]

    # -- rendering ---------------------------------------------------------

    def render(self, messages: Sequence[Message], add_generation_prompt: bool) -> str:
        """The template's text for ``messages``."""
        return self.tokenizer.apply_chat_template(  # type: ignore[return-value]  # tokenize=False: a str
            list(messages),
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def encode(self, text: str) -> list[int]:
        """Ids of template text, control tokens atomic, no BOS/EOS added (templates write their own).

        A lone surrogate, which no tokenizer encodes, is read as its escape (``"\\udfff"``): an env's text may
        hold one (a program's output read with ``errors="surrogateescape"``, JSON's ``"\\udfff"`` through the env
        service), and one character must not stop the rollout.
        """
        return self.tokenizer(_encodable(text), add_special_tokens=False)["input_ids"]

    def _find_system_role(self) -> bool:
        """Whether the template renders a system message given before the first user message.

        Gemma 2's template raises on one (``System role not supported``); a
        template may also drop it without a word, which would lose the task
        instructions. Either way the system text is then folded into the first
        user message (:func:`fold_system`). Decided by probing the template,
        not by model name.
        """
        user = {"role": "user", "content": _BASE_USER}
        try:
            text = self.render([{"role": "system", "content": _BASE_SYSTEM}, user], add_generation_prompt=True)
        except Exception:  # the template rejects a system message; it must still take a user message alone
            try:
                self.render([user], add_generation_prompt=True)
            except Exception as err:
                raise TemplateDeltaError(
                    f"the chat template cannot render a single user message: {type(err).__name__}: {err}"
                ) from err
            return False
        return _BASE_SYSTEM in text

    def _open_renders(self, messages: Sequence[Message]) -> list[str]:
        """Renderings of ``messages`` as they may stand when more messages follow, most literal first.

        The rendering without the generation prompt, and the same without a
        trailing control token: Phi-3.5-mini and Phi-4-mini write
        ``eos_token`` after a chat that ends without a generation prompt,
        which is not there once another message follows.
        """
        text = self.render(messages, add_generation_prompt=False)
        ends = [t for t in _control_tokens(self.tokenizer).values() if t and text.endswith(t)]
        return [text] if not ends else [text, text[: -len(max(ends, key=len))]]

    def _find_base(self) -> tuple[list[Message], str]:
        """Choose the dummy conversation that observation deltas are taken against.

        A candidate works when its rendering (see :meth:`_open_renders`) is a
        string prefix of the rendering with one more user message and the
        generation prompt. ``[user, assistant]`` comes first: it is what an
        episode looks like when an observation arrives, and templates that
        demand alternating roles accept it. Templates that render the last
        assistant message differently (Qwen3 wraps it in a think block) fail
        it, and a conversation ending with a user message is used instead.

        Renderings with a trailing control token taken off are tried only when
        no literal one works, and those of bases ending with a user message
        first: the token taken off could otherwise be the last assistant
        message's own closing, which a template may write differently at the
        end of a chat.
        """
        user = {"role": "user", "content": _BASE_USER}
        candidates = [[user, {"role": "assistant", "content": _BASE_ANSWER}]]
        if self.system_role:
            candidates.append([{"role": "system", "content": _BASE_SYSTEM}, user])
        candidates.append([user])
        failures = []
        for stripped, bases in ((False, candidates), (True, [*candidates[1:], candidates[0]])):
            for base in bases:
                roles = [m["role"] for m in base]
                try:
                    renders = self._open_renders(base)
                    extended = self.render([*base, {"role": "user", "content": "x"}], add_generation_prompt=True)
                except Exception as err:  # a template may reject a conversation shape; try the next one
                    if not stripped:
                        failures.append(f"{roles}: {type(err).__name__}: {err}")
                    continue
                for base_text in renders[1:] if stripped else renders[:1]:
                    if extended.startswith(base_text):
                        return base, base_text
                    how = " less its last control token" if stripped else ""
                    failures.append(f"{roles}{how}: its rendering changes when a user message follows")
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

    def _find_end_of_turn(self) -> int:
        """Position in the closing of the token that a model samples to end its turn.

        The first stop id or control token in the closing: 0 for most
        templates (``<|im_end|>``, ``<|eot_id|>``, and Gemma's
        ``<end_of_turn>`` although only ``<eos>`` is its tokenizer's stop id),
        1 for Llama-2's ``' ' + eos_token``. A closing of plain text has none:
        0 then, and a response can only match it as text.
        """
        ends = self.stop_ids | set(_control_tokens(self.tokenizer))
        return next((i for i, tok in enumerate(self.closing) if tok in ends), 0)

    def _split_closing(self) -> str:
        """The closing's text before its end-of-turn token ("" for most templates).

        Needed to write the stream's text when the sampled end-of-turn token
        stands in for it (see :meth:`close`). The closing must tokenize as its
        two parts do one by one.
        """
        e = self.end_of_turn_index
        if e == 0:
            return ""
        text = self._closing_text
        for i in range(len(text) + 1):
            if self.encode(text[:i]) == list(self.closing[:e]) and self.encode(text[i:]) == list(self.closing[e:]):
                return text[:i]
        raise TemplateDeltaError(
            f"the closing {text!r} does not split into the text before its end-of-turn token and the rest"
        )

    def _find_template_opening(self) -> str:
        """What the generation prompt writes after the assistant's header, when it leaves a tag open.

        The header is what a past assistant message's content follows in ``[user, assistant, user]`` (a past
        one: templates render the last assistant message of a chat with extras, as Qwen3 its think block); the
        generation prompt of ``[user]`` is what its rendering with the prompt adds to its rendering without.
        Where the prompt is the header and more, the more is the opening, kept when it leaves a tag open.
        """
        user = {"role": "user", "content": _BASE_USER}
        chat = [user, {"role": "assistant", "content": _PLACEHOLDER}, {"role": "user", "content": _BASE_FOLLOW_UP}]
        prompted = self.render([user], add_generation_prompt=True)
        before_content = self.render(chat, add_generation_prompt=False).split(_PLACEHOLDER, 1)[0]
        for user_text in self._open_renders([user]):
            if prompted.startswith(user_text) and before_content.startswith(user_text):
                prompt, header = prompted[len(user_text) :], before_content[len(user_text) :]
                if prompt.startswith(header) and open_tags(prompt[len(header) :]):
                    return prompt[len(header) :]
        return ""

    # -- pieces ------------------------------------------------------------

    def opening(self, system: str | Message | None, user: str | Message) -> list[Message]:
        """The messages a head renders: ``[system?, user]``, or the system folded into the user message
        when the template has no system role (see :func:`fold_system`)."""
        user = as_message(user)
        if system is None:
            return [user]
        system = as_message(system, "system")
        return [system, user] if self.system_role else [fold_system(system, user)]

    def head(self, system: str | Message | None, user: str | Message) -> list[int]:
        """Ids of ``render(opening(system, user), add_generation_prompt=True) + response_prefix``. Shape (H,)."""
        return self._ids("head", self.opening(system, user))

    def observation(self, user: str | Message) -> list[int]:
        """Ids a new user message adds after a closed assistant turn, generation prompt and response prefix
        included. Shape (O,)."""
        return self._ids("observation", [as_message(user)])

    def _ids(self, piece: str, messages: list[Message]) -> list[int]:
        """The ids of a ``head`` (of ``messages``) or an ``observation`` (of its one message): remembered for
        messages of texts and pictures (:func:`_memo_key`), a list of the caller's own."""
        key = _memo_key(messages, self._images_in_memo)
        return list(self._memo_ids(piece, key)) if key is not None else self._rendered_ids(piece, messages)

    def _memo_messages(self, key: MemoKey) -> list[Message]:
        """Messages that render as the ones ``key`` was made from (each picture a stand-in)."""
        picture = _PROBE_PICTURES[0]
        return [{"role": role, "content": content if isinstance(content, str) else [
            {"type": "image", "image": picture} if part == IMAGE_PART else {"type": "text", "text": part}
            for part in content]} for role, content in key]

    def _renders_any_picture_alike(self) -> bool:
        """Whether pictures may be left out of the memo's keys: a user message renders alike with each of
        :data:`_PROBE_PICTURES` (Qwen-VL's templates write one placeholder for any picture). A template that
        rejects or prints them keeps messages with pictures out of the memo."""
        try:
            texts = {self.render([{"role": "user", "content": [{"type": "image", "image": picture},
                                                               {"type": "text", "text": _BASE_USER}]}],
                                 add_generation_prompt=True) for picture in _PROBE_PICTURES}
        except Exception:  # a template for text alone may raise on a list of parts: nothing to remember then
            return False
        return len(texts) == 1

    def _rendered_ids(self, piece: str, messages: list[Message]) -> list[int]:
        text = self.render(messages, add_generation_prompt=True) if piece == "head" else \
            self._observation_text(messages[0])
        return self.encode(text + self.response_prefix)

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

        Let ``e`` be the closing's end-of-turn position (``end_of_turn_index``).

        - The response ends with the first ``k > e`` ids of the closing (the
          model sampled its end-of-turn token, and whatever text the template
          writes before it): the rest of the closing is appended.
        - The response ends with the end-of-turn token alone (Llama-2 style
          ``' ' + content + ' ' + eos_token``, the model sampled
          ``content + eos``): it stands in for the closing up to and
          including that token, and only what follows it is appended.
        - Otherwise the response was cut (max tokens) or stopped on another
          stop id, and the whole closing is appended so that the next
          observation follows a well-formed assistant message.

        Appended ids were not sampled: they take no loss.
        """
        closing, e = self.closing, self.end_of_turn_index
        for k in range(min(len(closing), len(response_ids)), e, -1):
            if tuple(response_ids[-k:]) == closing[:k]:
                return list(closing[k:]), True
        if e > 0 and response_ids and response_ids[-1] == closing[e]:
            # The template's text before the end-of-turn token (Llama-2's space) is not
            # written in. It would have to go between the last sampled content token and
            # the sampled end-of-turn token, which was sampled without it: the stream would
            # no longer be what the model saw, and that token's stored logprob would belong
            # to another context. Refusing the template instead would lose Llama-2-style
            # models over one space. So the stream lacks that text where a re-render has it
            # (verify() sets matches_full_render to False), as with Qwen3's reasoning.
            return list(closing[e + 1 :]), True
        stopped = bool(response_ids) and response_ids[-1] in self.stop_ids
        return list(closing), stopped

    # -- self-check --------------------------------------------------------

    def verify(self) -> None:
        """Check the pieces against full renders of a probe conversation.

        The probe is ``[system?, question, answer, follow-up]`` with the
        generation prompt, with and without a system message (folded into the
        question for a template without a system role). The answer is sampled
        as a model samples it: its ids, then the end-of-turn token, so that
        :meth:`close` is checked on what it meets in a rollout; the full render's
        assistant message is the answer after the template's opening
        (:attr:`template_opening`, which the prompt ends with). Two checks:

        1. The pieces tokenize as their joined text does (no token would
           straddle a boundary between pieces, and no closing token is
           written twice).
        2. The joined text equals the template's full render. Where it does
           not, the difference must lie only in how the template re-renders
           the past assistant turn before its content (Qwen3 strips reasoning
           and the empty think block that ``enable_thinking=False`` puts in
           the generation prompt; a template may write ``"assistant: "`` for
           a past message but prompt with ``"assistant:"``), and in the
           closing's text before its end-of-turn token, which the sampled
           token stands in for (Llama-2's space, see :meth:`close`): the full
           render must still start like the head without its generation
           prompt and end with ``answer + closing + observation``. The
           incremental context is then still the one to train on (it is what
           the model saw), and ``matches_full_render`` is set to False.

        Anything else raises :class:`TemplateDeltaError`.
        """
        system, question, answer, follow_up = _PROBE
        end_of_turn = [self.closing[self.end_of_turn_index]] if self.closing else []
        answer_ids = self.encode(answer) + end_of_turn
        closing, _ = self.close(answer_ids)
        observation_text = self._observation_text(as_message(follow_up))
        # What the stream holds after the answer, and what a render writes there.
        stream_tail = answer + self._closing_text[len(self._closing_lead_text) :] + observation_text
        render_tail = answer + self._closing_text + observation_text
        self.matches_full_render = True
        for sys_msg in (system, None):
            opening = self.opening(sys_msg, question)
            head_text = self.render(opening, add_generation_prompt=True)
            # The template's own pieces: the response prefix is the caller's text, and where it meets a
            # response is a property of the tokenizer, not of the template.
            got = self.encode(head_text) + answer_ids + closing + self.encode(observation_text)
            joined = self.encode(head_text + stream_tail)
            if got != joined:
                raise TemplateDeltaError(
                    "the template's pieces tokenize differently one by one than joined, at token "
                    f"{_first_difference(got, joined)} of {self.tokenizer.decode(joined)!r} (pieces: "
                    f"{self.tokenizer.decode(got)!r})"
                )
            # The assistant message as a rollout keeps it: what the generation prompt opened it with, then the answer.
            message = {"role": "assistant", "content": self.template_opening + answer}
            chat = [*opening, message, {"role": "user", "content": follow_up}]
            full_text = self.render(chat, add_generation_prompt=True)
            if self.encode(full_text) == got:
                continue
            self.matches_full_render = False
            if not (
                any(full_text.startswith(text) for text in self._open_renders(opening))
                and full_text.endswith(render_tail)
            ):
                raise TemplateDeltaError(
                    "incremental rendering differs from a full render of the same chat beyond the past assistant "
                    f"turn:\n  incremental: {head_text + stream_tail!r}\n  full render: {full_text!r}\n"
                    "Pass verify=False to use the template anyway (the incremental context is still what the "
                    "model sees, but it will not match a re-render of the chat)."
                )


def _encodable(text: str) -> str:
    """``text`` with each lone surrogate written as its escape (``"\\udfff"``); other text unchanged."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def _control_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[int, str]:
    """Id -> text of the tokenizer's control tokens: its named special tokens and added tokens marked special."""
    tokens = dict(zip(tokenizer.all_special_ids, tokenizer.all_special_tokens))
    tokens.update({i: t.content for i, t in tokenizer.added_tokens_decoder.items() if t.special})
    return tokens


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
