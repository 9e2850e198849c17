"""Token-exact multi-turn contexts: the incremental stream against full renders."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from tests.chat.test_template_deltas import LLAMA2_STYLE, NAMES, SYSTEM, encode, template_tokenizers
from turnrl.chat.template_deltas import ChatTemplateDeltas
from turnrl.rollout.context import HEAD_TURN, EpisodeTokens, InputRows


@pytest.fixture(scope="module")
def toks():
    return template_tokenizers()


def full_render_ids(tok, messages, gen=True, **kwargs):
    """The template's render of ``messages``, each assistant message as a turn holds it: after what the
    generation prompt opens it with (a thinking template's ``<think>\\n``, which the response continues)."""
    opening = "" if "chat_template" in kwargs else ChatTemplateDeltas.for_tokenizer(tok).template_opening
    messages = [{**m, "content": opening + m["content"]} if m["role"] == "assistant" else m for m in messages]
    return tok.apply_chat_template(messages, add_generation_prompt=gen, return_dict=False, **kwargs)


def continued_render_ids(tok, messages):
    """Full render of ``messages`` plus one more user message: a chat that ends with a closed answer is a prefix."""
    return full_render_ids(tok, [*messages, {"role": "user", "content": "next"}])


def sampled(tok, text, end_of_turn=None):
    """What a sampler returns for ``text``: its canonical ids, then the end-of-turn token (default: eos)."""
    return encode(tok, text) + [tok.eos_token_id if end_of_turn is None else end_of_turn]


def with_control_tokens(tok, *tokens):
    """A copy of ``tok`` with more control tokens (special, atomic), e.g. another family's turn markers."""
    tok = copy.deepcopy(tok)
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in tokens], special_tokens=True)
    return tok


def play(tok, system, users, answers, *, window=None, responses=None, response_prefix=None):
    """Run an episode: users[0], then (answer, user) pairs. Returns the EpisodeTokens.

    ``tok`` is a tokenizer or a :class:`ChatTemplateDeltas` (for a template other than the tokenizer's).
    """
    ep = EpisodeTokens(tok, max_context_window=window, response_prefix=response_prefix)
    ep.start(system, users[0])
    for t, answer in enumerate(answers):
        ids = responses[t] if responses is not None else sampled(tok, answer)
        ep.add_response(ids, [-0.5 - t] * len(ids))
        if t + 1 < len(users):
            ep.add_observation(users[t + 1])
    return ep


def messages(system, users, answers):
    out = [] if system is None else [{"role": "system", "content": system}]
    for t, user in enumerate(users):
        out.append({"role": "user", "content": user})
        if t < len(answers):
            out.append({"role": "assistant", "content": answers[t]})
    return out


USERS = ["#####\n#_OX#\n#_P_#\n#####\nYour move?", "Reward: -0.1. #_X_#", "Reward: 1.0. Solved?"]
ANSWERS = ["<answer>Left</answer>", "Up || Left"]


# -- incremental stream == full render ------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("system", [SYSTEM, None])
def test_stream_equals_full_render(toks, name, system):
    tok = toks[name]
    ep = play(tok, system, USERS, ANSWERS)
    expected = full_render_ids(tok, messages(system, USERS, ANSWERS))
    assert ep.prompt() == expected
    assert len(ep) == len(expected)

    s = ep.stream()
    assert s.input_ids == expected
    assert len(s.loss_mask) == len(s.turn_index) == len(s.logprobs) == len(expected)
    # loss_mask is 1 exactly on the sampled ids, which carry their logprobs.
    responses = [sampled(tok, a) for a in ANSWERS]
    assert [i for i, m in zip(s.input_ids, s.loss_mask) if m] == responses[0] + responses[1]
    assert [lp for lp, m in zip(s.logprobs, s.loss_mask) if m] == [-0.5] * len(responses[0]) + [-1.5] * len(
        responses[1]
    )
    assert all(lp == 0.0 for lp, m in zip(s.logprobs, s.loss_mask) if not m)
    # Each turn ends on its sampled end-of-turn token.
    assert len(s.turn_end_positions) == 2
    for t, pos in enumerate(s.turn_end_positions):
        assert s.input_ids[pos] == tok.eos_token_id and s.loss_mask[pos] == 1 and s.turn_index[pos] == t
        assert pos + 1 == len(s.input_ids) or s.loss_mask[pos + 1] == 0
    # Turn indices: head, then turn 0, then the tokens of turns 1 and 2 in order.
    head_len = len(ChatTemplateDeltas.for_tokenizer(tok).head(system, USERS[0]))
    assert s.turn_index[:head_len] == [HEAD_TURN] * head_len
    assert s.turn_index[head_len:] == sorted(s.turn_index[head_len:])
    assert set(s.turn_index) == {HEAD_TURN, 0, 1, 2}


def test_turn_index_is_minus_one_on_the_head_and_the_turns_number_on_its_response_closing_and_observation(toks):
    tok = toks["chatml"]
    deltas = ChatTemplateDeltas.for_tokenizer(tok)
    responses = [sampled(tok, "Left"), encode(tok, "Up and")]  # the second cut: its whole closing is appended
    s = play(tok, SYSTEM, USERS[:2], ["Left", "Up and"], responses=responses).stream()
    head, observation = deltas.head(SYSTEM, USERS[0]), deltas.observation(USERS[1])
    closings = [deltas.close(ids)[0] for ids in responses]
    assert s.input_ids == head + responses[0] + closings[0] + observation + responses[1] + closings[1]
    assert s.turn_index == ([-1] * len(head) + [0] * (len(responses[0]) + len(closings[0]))
                            + [1] * (len(observation) + len(responses[1]) + len(closings[1])))
    assert s.loss_mask == ([0] * len(head) + [1] * len(responses[0]) + [0] * (len(closings[0]) + len(observation))
                           + [1] * len(responses[1]) + [0] * len(closings[1]))


@pytest.mark.parametrize("name", NAMES)
def test_per_turn_prompts_are_full_renders_of_the_prefix(toks, name):
    tok = toks[name]
    ep = play(tok, SYSTEM, USERS, ANSWERS + ["Down"])
    samples = ep.turn_samples()
    assert [x.turn for x in samples] == [0, 1, 2]
    for t, x in enumerate(samples):
        assert x.prompt_ids == full_render_ids(tok, messages(SYSTEM, USERS[: t + 1], ANSWERS[:t]))
        assert x.response_ids == sampled(tok, (ANSWERS + ["Down"])[t]) and x.stopped
        assert ep.turns[t].prompt_length == len(x.prompt_ids)
    # The episode ended on a response: the stream closes it and adds nothing after. (Compared
    # with a continued chat because Qwen3 renders a final assistant message differently.)
    stream = ep.stream().input_ids
    assert continued_render_ids(tok, messages(SYSTEM, USERS, ANSWERS + ["Down"]))[: len(stream)] == stream


def test_qwen3_keeps_sampled_reasoning(toks):
    """A re-render strips earlier reasoning; the stream keeps what was sampled.

    Keeping it is right: when the model produced turn 2 its context held its
    own reasoning from turns 0 and 1, so those are the tokens its later
    actions were conditioned on (and the logprobs were computed against).
    Training on the stripped re-render would score the later responses under
    a context the model never saw.
    """
    tok = toks["qwen3"]
    thoughts = ["<think>\nThe box is left.\n</think>\n\n", "<think>\nNow go up.\n</think>\n\n"]
    answers = [thoughts[0] + "<answer>Left</answer>", thoughts[1] + "<answer>Up</answer>"]
    ep = play(tok, SYSTEM, USERS, answers)
    stream = ep.stream().input_ids
    rerender = full_render_ids(tok, messages(SYSTEM, USERS, answers))
    assert stream != rerender
    # Removing exactly the sampled think blocks from the stream gives the re-render.
    stripped = list(stream)
    for thought in thoughts:
        span = encode(tok, thought)
        start = next(i for i in range(len(stripped)) if stripped[i : i + len(span)] == span)
        del stripped[start : start + len(span)]
    assert stripped == rerender
    # The response tokens in the stream are the sampled ones, reasoning included.
    s = ep.stream()
    assert [i for i, m in zip(s.input_ids, s.loss_mask) if m] == sampled(tok, answers[0]) + sampled(tok, answers[1])


def test_qwen3_thinking_disabled(toks):
    tok = toks["qwen3"]
    deltas = ChatTemplateDeltas.for_tokenizer(tok, enable_thinking=False)
    ep = EpisodeTokens(deltas)
    ep.start(SYSTEM, USERS[0])
    assert tok.decode(ep.prompt()).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ep.add_response(sampled(tok, "Left"))
    ep.add_observation(USERS[1])
    assert tok.decode(ep.prompt()).endswith(
        "Left<|im_end|>\n<|im_start|>user\nReward: -0.1. #_X_#<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


# -- closing -------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_closing_after_stop_and_after_cut(toks, name):
    tok = toks[name]
    deltas = ChatTemplateDeltas.for_tokenizer(tok)
    closing = deltas.response_closing()
    assert closing[0] == tok.eos_token_id

    stopped_ids = sampled(tok, "Left")
    cut_ids = encode(tok, "Left and then")  # max tokens reached: no end-of-turn token
    assert deltas.close(stopped_ids) == (closing[1:], True)
    assert deltas.close(cut_ids) == (closing, False)

    ep = play(tok, SYSTEM, USERS, ["Left", "x"], responses=[stopped_ids, cut_ids])
    s = ep.stream()
    for t, ids in enumerate([stopped_ids, cut_ids]):
        end = s.turn_end_positions[t]
        appended = closing[1:] if t == 0 else closing
        assert s.input_ids[end - len(ids) + 1 : end + 1] == ids
        assert s.input_ids[end + 1 : end + 1 + len(appended)] == appended
        assert s.loss_mask[end + 1 : end + 1 + len(appended)] == [0] * len(appended)
        assert s.turn_index[end + 1 : end + 1 + len(appended)] == [t] * len(appended)
    assert [t.stopped for t in ep.turns[:2]] == [True, False]
    # A cut response still yields a well-formed chat: the same as the full render of its text.
    expected = full_render_ids(tok, messages(SYSTEM, USERS, ["Left", "Left and then"]))
    assert s.input_ids == expected


# Llama-2-chat's own template: the system message goes into the first user message, BOS before each.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)


def test_end_of_turn_token_after_text_is_not_written_twice(tiny_tokenizer):
    """The sampled end-of-turn token stands in for the closing ``' ' + eos``; nothing of it is appended again."""
    tok = tiny_tokenizer
    eos = tok.eos_token_id
    deltas = ChatTemplateDeltas(tok, chat_template=LLAMA2_STYLE)
    space, hello = encode(tok, " "), encode(tok, "hello")
    assert deltas.response_closing() == space + [eos] and deltas.end_of_turn_index == 1

    ep = EpisodeTokens(deltas)
    ep.start(None, "hi")
    ep.add_response(hello + [eos])
    ep.add_observation("next")
    assert tok.decode(ep.prompt()) == f"[INST] hi [/INST]hello{tok.eos_token}[INST] next [/INST]"
    assert ep.turns[0].closing_ids == [] and ep.turns[0].stopped

    assert deltas.close(hello + space + [eos]) == ([], True)  # the model wrote the space as well
    # Cut at max tokens, after a space or not: the whole closing, and not a stop.
    assert deltas.close(hello + space) == (space + [eos], False)
    assert deltas.close(hello) == (space + [eos], False)
    # The stream lacks the space before eos that a re-render writes: verify() accepts exactly that.
    assert deltas.matches_full_render is False


@pytest.mark.parametrize("template, system", [(LLAMA2_STYLE, None), (LLAMA2, SYSTEM)])
def test_closing_with_text_before_end_of_turn_against_full_render(toks, template, system):
    tok = toks["llama3"]
    eos = tok.eos_token_id
    deltas = ChatTemplateDeltas(tok, chat_template=template)
    chat = messages(system, USERS, ANSWERS)
    # A model that writes the template's spaces, then eos: the stream is the full render, token for token.
    spaced = [encode(tok, f" {a} ") + [eos] for a in ANSWERS]
    s = play(deltas, system, USERS, ANSWERS, responses=spaced).stream()
    assert s.input_ids == full_render_ids(tok, chat, chat_template=template)
    # A model that ends right after its answer: the render less the space before each eos, one eos per answer.
    bare = [encode(tok, f" {a}") + [eos] for a in ANSWERS]
    s = play(deltas, system, USERS, ANSWERS, responses=bare).stream()
    render = tok.apply_chat_template(chat, chat_template=template, add_generation_prompt=True, tokenize=False)
    assert tok.decode(s.input_ids) == render.replace(f" {tok.eos_token}", tok.eos_token)
    assert s.input_ids.count(eos) == 2
    assert [i for i, m in zip(s.input_ids, s.loss_mask) if m] == bare[0] + bare[1]
    assert [s.input_ids[i] for i in s.turn_end_positions] == [eos, eos]


# -- token exactness -----------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_non_canonical_ids_survive(toks, name):
    tok = toks[name]
    word = "Sokoban"
    canonical = encode(tok, word)
    split = encode(tok, word[:3]) + encode(tok, word[3:])
    assert split != canonical and tok.decode(split) == tok.decode(canonical)
    response = split + [tok.eos_token_id]
    ep = play(tok, SYSTEM, USERS, [word, "Up"], responses=[response, sampled(tok, "Up")])
    s = ep.stream()
    end = s.turn_end_positions[0]
    assert s.input_ids[end - len(response) + 1 : end + 1] == response
    # Same text as the re-render, other tokens: a re-tokenizing pipeline would train on ids never sampled.
    rerender = full_render_ids(tok, messages(SYSTEM, USERS, [word, "Up"]))
    assert tok.decode(s.input_ids) == tok.decode(rerender)
    assert s.input_ids != rerender


def test_token_merge_across_the_prompt_response_boundary(tiny_tokenizer):
    """ChatML prompts end with ``assistant\\n``; a response that starts with a newline is sampled after it.

    A re-render tokenizes the two newlines as one token; the stream keeps the
    prompt's newline and the sampled one, which is what the model saw.
    """
    tok = tiny_tokenizer
    assert len(encode(tok, "\n\n")) == 1
    response = sampled(tok, "\nLeft")
    ep = play(tok, SYSTEM, USERS[:2], ["\nLeft"], responses=[response])
    s = ep.stream()
    rerender = full_render_ids(tok, messages(SYSTEM, USERS[:2], ["\nLeft"]))
    assert tok.decode(s.input_ids) == tok.decode(rerender) and s.input_ids != rerender
    end = s.turn_end_positions[0]
    assert s.input_ids[: end + 1] == ep.prompt_ids(0) + response
    assert ep.prompt() == s.input_ids


# -- windows -------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("window", [1, 2, 3])
def test_window_prompt_is_full_render_of_last_turns(toks, name, window):
    tok = toks[name]
    users = [f"Observation {t}: #_P_#" for t in range(5)]
    answers = [f"Move {t}: Left" for t in range(4)]
    ep = EpisodeTokens(tok, max_context_window=window)
    ep.start(SYSTEM, users[0])
    for t in range(5):
        s = max(0, t - window + 1)
        expected = full_render_ids(tok, messages(SYSTEM, users[s : t + 1], answers[s:t]))
        assert ep.prompt() == expected and len(ep) == len(expected)
        if t == 4:
            break
        ep.add_response(sampled(tok, answers[t]))
        ep.add_observation(users[t + 1])
    starts = [max(0, t - window + 1) for t in range(4)]
    assert [x.prompt_ids for x in ep.turn_samples()] == [
        full_render_ids(tok, messages(SYSTEM, users[s : t + 1], answers[s:t])) for t, s in enumerate(starts)
    ]
    assert ep.window_cut == (window < 5)
    if ep.window_cut:
        with pytest.raises(RuntimeError, match="window"):
            ep.stream()


@pytest.mark.parametrize("window", [1, 2])
def test_each_turn_records_the_first_turn_and_the_length_of_its_prompt(toks, window):
    tok = toks["chatml"]
    users = [f"Observation {t}: #_P_#" for t in range(4)]
    ep = play(tok, SYSTEM, users, [f"Move {t}" for t in range(4)], window=window)
    assert [turn.window_start for turn in ep.turns] == [max(0, t - window + 1) for t in range(4)]
    assert [turn.prompt_length for turn in ep.turns] == [len(ep.prompt_ids(t)) for t in range(4)]


def test_an_episodes_length_is_its_prompt_then_its_prompt_response_and_closing(toks):
    tok = toks["chatml"]
    ep = EpisodeTokens(tok)
    assert len(ep) == 0  # not started
    ep.start(SYSTEM, USERS[0])
    assert len(ep) == len(ep.prompt())
    response = encode(tok, "Left")  # cut: the whole closing follows
    ep.add_response(response)
    assert len(ep) == len(ep.prompt_ids(0)) + len(response) + len(ep.turns[0].closing_ids) == len(ep.stream().input_ids)


def test_a_turn_sample_carries_its_sampled_ids_logprobs_closing_and_stop(toks):
    tok = toks["chatml"]
    responses = [sampled(tok, "Left"), encode(tok, "Up and")]
    ep = play(tok, SYSTEM, USERS[:2], ["Left", "Up and"], responses=responses)
    closing = ChatTemplateDeltas.for_tokenizer(tok).response_closing()
    assert [(x.response_ids, x.logprobs, x.closing_ids, x.stopped) for x in ep.turn_samples()] == [
        (responses[0], [-0.5] * len(responses[0]), closing[1:], True),
        (responses[1], [-1.5] * len(responses[1]), closing, False)]


def test_window_that_never_cuts_allows_stream(toks):
    tok = toks["chatml"]
    ep = play(tok, SYSTEM, USERS, ANSWERS, window=3)
    assert not ep.window_cut
    assert ep.stream().input_ids == full_render_ids(tok, messages(SYSTEM, USERS, ANSWERS))


def test_a_refused_stream_names_the_settings_to_change(toks):
    """The refusal reaches users of the rollout (a whole-trajectory batch): it names the config keys they set."""
    tok = toks["chatml"]
    ep = EpisodeTokens(tok, image_token="<|image_pad|>", max_images=1)
    ep.start(SYSTEM, image_message(1), image_token_counts=[3])
    for _ in range(2):
        ep.add_response(sampled(tok, "Left"))
        ep.add_observation(image_message(1), image_token_counts=[3])
    with pytest.raises(RuntimeError) as info:
        ep.stream()
    assert str(info.value) == (
        "agent.max_images=1 left older images out of later prompts, so the whole-episode stream is not what the "
        "model saw: train one sample per turn (algorithm.sample_mode=turn; turn_samples() here), or set "
        "agent.max_images to null or >= agent.max_turns")
    windowed = play(tok, SYSTEM, USERS, ANSWERS, window=2)
    with pytest.raises(RuntimeError, match=r"^agent\.max_context_window=2 left earlier turns out of later prompts, .*"
                                           r"algorithm\.sample_mode=turn.*agent\.max_context_window to null or >= "
                                           r"agent\.max_turns$"):
        windowed.stream()


def test_a_stream_refused_for_dropped_images_names_max_images_while_the_window_holds_every_turn(toks):
    tok = toks["chatml"]
    ep = EpisodeTokens(tok, max_context_window=2, image_token="<|image_pad|>", max_images=1)
    ep.start(SYSTEM, image_message(1), image_token_counts=[3])
    ep.add_response(sampled(tok, "Left"))
    ep.add_observation(image_message(1), image_token_counts=[3])
    with pytest.raises(RuntimeError, match=r"^agent\.max_images=1 left older images out"):
        ep.stream()


# -- a response prefix (RAGEN's prompt ends with <think>) -------------------------------

PREFIX = "<think>"
# What a model writes after the prefix. Without </think> here: Qwen3's template strips reasoning from earlier
# assistant turns in a re-render (test_qwen3_keeps_sampled_reasoning); RAGEN's whole answers are below.
CONTINUATIONS = [" The box is left of me. Push it.", " Then up || Left"]


def prefixed(answers):
    return [PREFIX + answer for answer in answers]


# A template that opens <think> itself takes no format prefix after it: a run moves RAGEN's into the template's
# (format_for_template; tests/rollout/test_runner.py).
PREFIXABLE = [name for name in NAMES if name != "qwen3_thinking"]


@pytest.mark.parametrize("name", PREFIXABLE)
@pytest.mark.parametrize("system", [SYSTEM, None])
def test_a_response_prefix_ends_every_prompt_and_the_stream_is_a_full_render(toks, name, system):
    tok = toks[name]
    ep = play(tok, system, USERS, CONTINUATIONS, response_prefix=PREFIX)
    # The chat holds each assistant message as the prefix, then what the model wrote after it.
    chat = messages(system, USERS, prefixed(CONTINUATIONS))
    rendered = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ep.prompt() == encode(tok, rendered + PREFIX)
    s = ep.stream()
    assert s.input_ids == encode(tok, rendered + PREFIX)
    # The prefix is prompt: only the sampled ids take the loss.
    responses = [sampled(tok, a) for a in CONTINUATIONS]
    assert [i for i, m in zip(s.input_ids, s.loss_mask) if m] == responses[0] + responses[1]
    for t, sample in enumerate(ep.turn_samples()):
        head = tok.apply_chat_template(messages(system, USERS[: t + 1], prefixed(CONTINUATIONS[:t])),
                                       add_generation_prompt=True, tokenize=False)
        assert sample.prompt_ids == encode(tok, head + PREFIX)


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_ragens_whole_answers_after_the_prefix_are_a_full_render(toks, name):
    # RAGEN's model continues <think> with its reasoning, </think> and the answer (ctx_manager.py).
    tok = toks[name]
    answers = [" The box is left.</think><answer>Left</answer>", " Now up.</think><answer>Up || Left</answer>"]
    s = play(tok, SYSTEM, USERS, answers, response_prefix=PREFIX).stream()
    rendered = tok.apply_chat_template(messages(SYSTEM, USERS, prefixed(answers)), add_generation_prompt=True,
                                       tokenize=False)
    assert s.input_ids == encode(tok, rendered + PREFIX)


@pytest.mark.parametrize("name", PREFIXABLE)
@pytest.mark.parametrize("window", [1, 2])
def test_a_window_head_ends_with_the_response_prefix(toks, name, window):
    tok = toks[name]
    users = [f"Observation {t}: #_P_#" for t in range(4)]
    answers = [f" Move {t}: Left" for t in range(3)]
    ep = play(tok, SYSTEM, users, answers, window=window, response_prefix=PREFIX)
    for t, sample in enumerate(ep.turn_samples()):
        start = max(0, t - window + 1)
        chat = messages(SYSTEM, users[start : t + 1], prefixed(answers[start:t]))
        assert sample.prompt_ids == encode(tok, tok.apply_chat_template(chat, add_generation_prompt=True,
                                                                        tokenize=False) + PREFIX)


@pytest.mark.parametrize("template", ["phi35", "gemma2"])
def test_a_response_prefix_in_templates_that_end_chats_with_eos_or_fold_the_system(toks, template):
    tok = (with_control_tokens(toks["chatml"], "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
           if template == "phi35" else gemma2_tokenizer(toks))
    chat_template = PHI35 if template == "phi35" else GEMMA2
    end = tok.convert_tokens_to_ids("<|end|>" if template == "phi35" else "<end_of_turn>")
    deltas = ChatTemplateDeltas(tok, chat_template=chat_template, response_prefix=PREFIX)
    responses = [sampled(tok, a, end) for a in CONTINUATIONS]
    s = play(deltas, None, USERS, CONTINUATIONS, responses=responses).stream()
    chat = messages(None, USERS, prefixed(CONTINUATIONS))
    rendered = tok.apply_chat_template(chat, chat_template=chat_template, add_generation_prompt=True, tokenize=False)
    assert s.input_ids == encode(tok, rendered + PREFIX)
    assert [i for i, m in zip(s.input_ids, s.loss_mask) if m] == responses[0] + responses[1]


def test_the_response_prefix_must_be_that_of_the_given_template_pieces(toks):
    deltas = ChatTemplateDeltas.for_tokenizer(toks["chatml"])
    with pytest.raises(ValueError, match="response_prefix"):
        EpisodeTokens(deltas, response_prefix=PREFIX)
    assert EpisodeTokens(toks["chatml"], response_prefix="").deltas is deltas  # no prefix: the shared pieces


# -- images ------------------------------------------------------------------------


def test_windows_and_image_limits_below_their_least_are_refused(toks):
    tok = toks["chatml"]
    with pytest.raises(ValueError, match="max_context_window must be >= 1"):
        EpisodeTokens(tok, max_context_window=0)
    with pytest.raises(ValueError, match="max_images must be >= 0"):
        EpisodeTokens(tok, max_images=-1)
    assert (EpisodeTokens(tok, max_context_window=1).max_context_window, EpisodeTokens(tok, max_images=0).max_images) \
        == (1, 0)


@pytest.mark.parametrize(("window", "turns"), [(None, 2), (2, 3)])
def test_a_head_whose_image_is_dropped_is_rendered_without_it(toks, window, turns):
    tok = toks["chatml"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ep = EpisodeTokens(tok, max_context_window=window, image_token="<|image_pad|>", max_images=1)
    ep.start(SYSTEM, image_message(1), image_token_counts=[3])
    for _ in range(1, turns):
        ep.add_response(sampled(tok, "Left"))
        ep.add_observation(image_message(1), image_token_counts=[4])
    # the prompt starts at the turn before the last (a window's head), which shows its message's text alone
    text_only = {"role": "user", "content": [{"type": "text", "text": "Where?"}]}
    expected = full_render_ids(tok, [{"role": "system", "content": SYSTEM}, text_only,
                                     {"role": "assistant", "content": "Left"}, image_message(1)])
    at = expected.index(pad)
    expected[at : at + 1] = [pad] * 4  # the kept image's placeholder, one per visual token
    assert ep.prompt() == expected


def test_image_placeholders_expand(toks):
    tok = toks["chatml"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    image_msg = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where?"}]}
    ep = EpisodeTokens(tok, max_context_window=1, image_token="<|image_pad|>")
    ep.start(SYSTEM, image_msg, image_token_counts=[4])
    assert ep.prompt().count(pad) == 4
    ep.add_response(sampled(tok, "Left"))
    ep.add_observation(image_msg, image_token_counts=[6])
    assert ep.prompt().count(pad) == 6  # the window dropped turn 0 and its image; the new head is expanded


def test_a_placeholders_text_in_a_message_is_refused_rather_than_read_as_an_image_slot(toks):
    """A parse error quotes the response in the next observation. A response that wrote the placeholder's text in
    plain pieces (the sampler never emits the token itself) put the placeholder token into a message without
    images: the prompt held an image slot with no image, and the policy's forward failed for the whole batch."""
    from turnrl.agent.formats import get_format

    tok = toks["chatml"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ep = EpisodeTokens(tok, image_token="<|image_pad|>")
    ep.start(SYSTEM, image_message(1), image_token_counts=[4])
    written = encode(tok, "<answer><|") + encode(tok, "image_pad|></answer>")
    assert pad not in written
    ep.add_response(written + [tok.eos_token_id])
    problem = get_format("no_think").parse(tok.decode(written, skip_special_tokens=True), ["Up"]).errors[0]
    assert "<|image_pad|>" in problem
    with pytest.raises(ValueError, match="renders 1 image placeholders '<|image_pad|>' for its 0 images"):
        ep.add_observation(f"Your last response had no valid action ({problem}).")
    quoted_with_an_image = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": problem}]}
    with pytest.raises(ValueError, match="renders 2 image placeholders .* for its 1 images"):
        ep.add_observation(quoted_with_an_image, image_token_counts=[4])
    assert len(ep.turns) == 1  # nothing was added
    ep.add_observation(image_message(1), image_token_counts=[4])
    assert ep.prompt().count(pad) == 8

    # The placeholder token itself in a response: the next prompt would hold it as an image slot too.
    with pytest.raises(ValueError, match="the response holds the image placeholder"):
        ep.add_response(encode(tok, "Left") + [pad, tok.eos_token_id])
    assert ep.awaiting_response


# -- misuse ------------------------------------------------------------------------


def test_misuse_is_loud(toks):
    tok = toks["chatml"]
    ep = EpisodeTokens(tok)
    with pytest.raises(RuntimeError, match="start"):
        ep.prompt()
    ep.start(None, "hi")
    with pytest.raises(RuntimeError, match="no response"):
        ep.add_observation("again")
    with pytest.raises(ValueError, match="at least one"):
        ep.add_response([])
    with pytest.raises(ValueError, match="logprobs"):
        ep.add_response([1, 2], [0.0])
    ep.add_response(sampled(tok, "ok"))
    with pytest.raises(RuntimeError, match="already"):
        ep.add_response(sampled(tok, "ok"))
    with pytest.raises(RuntimeError, match="awaits"):
        ep.prompt()


# -- templates of other families ---------------------------------------------------------

# Phi-3.5-mini / Phi-4-mini: eos_token after a chat that ends without a generation prompt.
PHI35 = (
    "{% for m in messages %}{{'<|'+m.role+'|>'+m.content+'<|end|>'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|assistant|>'}}{% else %}{{ eos_token }}{% endif %}"
)
# Gemma 2's template, verbatim: no system role, alternating roles, contents trimmed.
GEMMA2 = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}"
)


@pytest.mark.parametrize("system", [SYSTEM, None])
def test_template_that_ends_a_chat_with_eos(toks, system):
    tok = with_control_tokens(toks["chatml"], "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
    end = tok.convert_tokens_to_ids("<|end|>")
    base = tok.apply_chat_template([{"role": "user", "content": "u"}], chat_template=PHI35, tokenize=False)
    assert base == f"<|user|>u<|end|>{tok.eos_token}"  # what defeated the probe: the eos is gone once a message follows
    deltas = ChatTemplateDeltas(tok, chat_template=PHI35)
    assert deltas.matches_full_render
    assert deltas.response_closing() == [end]
    assert tok.decode(deltas.observation("hi")) == "<|user|>hi<|end|><|assistant|>"
    responses = [sampled(tok, a, end) for a in ANSWERS]
    s = play(deltas, system, USERS, ANSWERS, responses=responses).stream()
    assert s.input_ids == full_render_ids(tok, messages(system, USERS, ANSWERS), chat_template=PHI35)
    assert [i for i, m in zip(s.input_ids, s.loss_mask) if m] == responses[0] + responses[1]


def gemma2_tokenizer(toks):
    """The Llama-3 test tokenizer with Gemma's turn markers (its BOS stands in for Gemma's)."""
    return with_control_tokens(toks["llama3"], "<start_of_turn>", "<end_of_turn>")


def test_template_without_system_role_gets_it_in_the_first_user_message(toks):
    tok = gemma2_tokenizer(toks)
    with pytest.raises(Exception, match="System role not supported"):
        tok.apply_chat_template(messages(SYSTEM, USERS[:1], []), chat_template=GEMMA2, tokenize=False)
    deltas = ChatTemplateDeltas(tok, chat_template=GEMMA2)
    assert deltas.system_role is False and deltas.matches_full_render
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    assert deltas.response_closing() == [end, *encode(tok, "\n")]

    # The rollout always passes a system message: it opens the first user message, as Gemma 3's template does.
    folded = [f"{SYSTEM}\n\n{USERS[0]}", *USERS[1:]]
    responses = [sampled(tok, a, end) for a in ANSWERS]
    ep = play(deltas, SYSTEM, USERS, ANSWERS, responses=responses)
    assert tok.decode(ep.prompt()).startswith(f"{tok.bos_token}<start_of_turn>user\n{SYSTEM}\n\n#####")
    s = ep.stream()
    assert s.input_ids == full_render_ids(tok, messages(None, folded, ANSWERS), chat_template=GEMMA2)
    assert [i for i, m in zip(s.input_ids, s.loss_mask) if m] == responses[0] + responses[1]
    assert play(deltas, None, USERS, ANSWERS, responses=responses).stream().input_ids == full_render_ids(
        tok, messages(None, USERS, ANSWERS), chat_template=GEMMA2
    )


def test_window_head_folds_the_system_message(toks):
    tok = gemma2_tokenizer(toks)
    deltas = ChatTemplateDeltas(tok, chat_template=GEMMA2)
    end = tok.convert_tokens_to_ids("<end_of_turn>")
    responses = [sampled(tok, a, end) for a in ANSWERS]
    ep = play(deltas, SYSTEM, USERS, ANSWERS, window=2, responses=responses)
    # Turn 2's prompt starts at turn 1, whose user message now carries the system text.
    expected = messages(None, [f"{SYSTEM}\n\n{USERS[1]}", USERS[2]], ANSWERS[1:])
    assert ep.prompt() == full_render_ids(tok, expected, chat_template=GEMMA2)


# -- random conversations --------------------------------------------------------------

# Any text for user messages. Assistant texts: any text that does not start
# with whitespace (a leading newline would merge with the generation prompt's
# "\n" in a re-render, so the sampled ids and the re-render legitimately differ),
# without surrounding whitespace for Llama-3 (its template trims contents, a
# re-render would drop what was sampled) and without think tags (Qwen3 strips them).
user_text = st.text(max_size=40)
answer_text = st.text(min_size=1, max_size=40).map(str.strip).filter(
    lambda s: s != "" and "<think>" not in s and "</think>" not in s
)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    system=st.one_of(st.none(), user_text),
    users=st.lists(user_text, min_size=1, max_size=4),
    answers=st.lists(answer_text, min_size=4, max_size=4),
    end_with_response=st.booleans(),
)
def test_random_conversations(toks, name, system, users, answers, end_with_response):
    tok = toks[name]
    deltas = ChatTemplateDeltas.for_tokenizer(tok)
    answers = answers[: len(users) - (0 if end_with_response else 1)]
    chat = messages(system, users, answers)

    # String level: each user message and each closed answer extends the previous rendering (an assistant
    # message holds what the generation prompt opened it with, then the answer).
    held = [deltas.template_opening + answer for answer in answers]
    for n in range(1, len(users)):
        before = messages(system, users[:n], held[:n])
        after = messages(system, users[: n + 1], held[:n])
        before_text = tok.apply_chat_template(before[:-1], tokenize=False, add_generation_prompt=True)
        after_text = tok.apply_chat_template(after, tokenize=False, add_generation_prompt=True)
        closed = before_text + answers[n - 1] + tok.decode(deltas.response_closing())
        assert after_text.startswith(closed)
        assert after_text[len(closed) :] == tok.decode(deltas.observation(users[n]))

    # Token level: the incremental stream is the tokenized full render.
    stream = play(tok, system, users, answers).stream().input_ids
    if end_with_response:
        assert continued_render_ids(tok, chat)[: len(stream)] == stream
    else:
        assert stream == full_render_ids(tok, chat)


# --------------------------------------------------------------------------- extra model inputs per turn
def test_model_inputs_travel_with_their_turns(tiny_tokenizer):
    import torch

    def inputs(turn: int, images: int) -> dict:
        return {"pixel_values": torch.full((4 * images, 2), float(turn)), "image_grid_thw": torch.ones(images, 3)}

    tokens = EpisodeTokens(tiny_tokenizer, max_context_window=2)
    tokens.start("sys", "first", model_inputs=inputs(0, 1))
    assert tokens.prompt_model_inputs()["pixel_values"][:, 0].tolist() == [0.0] * 4
    for turn, images in ((1, 2), (2, 1)):
        tokens.add_response(tiny_tokenizer.encode("ok", add_special_tokens=False) + [tiny_tokenizer.eos_token_id])
        tokens.add_observation(f"obs {turn}", model_inputs=inputs(turn, images))
    tokens.add_response(tiny_tokenizer.encode("ok", add_special_tokens=False) + [tiny_tokenizer.eos_token_id])
    # a window of two turns: each sample carries the inputs of the turns its prompt holds
    samples = tokens.turn_samples()
    assert [s.model_inputs["pixel_values"][:, 0].tolist() for s in samples] == [
        [0.0] * 4, [0.0] * 4 + [1.0] * 8, [1.0] * 8 + [2.0] * 4]
    assert [len(s.model_inputs["image_grid_thw"]) for s in samples] == [1, 3, 3]
    unwindowed = EpisodeTokens(tiny_tokenizer)
    unwindowed.start("sys", "first", model_inputs=inputs(0, 1))
    unwindowed.add_response([tiny_tokenizer.eos_token_id])
    unwindowed.add_observation("obs", model_inputs=inputs(1, 2))
    unwindowed.add_response([tiny_tokenizer.eos_token_id])
    stream = unwindowed.stream()
    assert stream.model_inputs["pixel_values"][:, 0].tolist() == [0.0] * 4 + [1.0] * 8


def test_the_streams_inputs_are_every_turns_when_the_last_turn_has_none(toks):
    tok = toks["chatml"]
    ep = EpisodeTokens(tok, image_token="<|image_pad|>")
    ep.start(SYSTEM, image_message(1), image_token_counts=[3], model_inputs=image_inputs(0, 1))
    ep.add_response(sampled(tok, "Left"))
    ep.add_observation("Text alone.")
    ep.add_response(sampled(tok, "Up"))
    assert_same_inputs(ep.stream().model_inputs, image_inputs(0, 1))


def test_text_turns_have_no_model_inputs(tiny_tokenizer):
    tokens = EpisodeTokens(tiny_tokenizer)
    tokens.start("sys", "first")
    tokens.add_response([tiny_tokenizer.eos_token_id])
    assert tokens.stream().model_inputs == {} and tokens.turn_samples()[0].model_inputs == {}


# -- a prompt's inputs as views of the episode's ------------------------------------


def image_message(images: int) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": "Where?"}]}


def image_inputs(turn: int, images: int, dtype=None) -> dict:
    import torch

    rows = torch.arange(3 * images * 2, dtype=torch.float32).reshape(3 * images, 2) + 100 * turn
    return {"pixel_values": rows.to(dtype or torch.bfloat16), "image_grid_thw": torch.ones(images, 3, dtype=torch.long)}


def assert_same_inputs(got: dict, want: dict) -> None:
    import torch

    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(images=st.lists(st.integers(0, 2), min_size=1, max_size=7), window=st.sampled_from([None, 1, 2, 3]),
       max_images=st.sampled_from([None, 0, 1, 2, 3]), expected_turns=st.sampled_from([1, 3, 10]))
def test_prompt_inputs_equal_the_concatenation_of_their_turns(toks, images, window, max_images, expected_turns):
    from turnrl.rollout.context import concat_model_inputs

    tok = toks["chatml"]
    ep = EpisodeTokens(tok, max_context_window=window, image_token="<|image_pad|>", max_images=max_images,
                       expected_turns=expected_turns)

    def plain(t: int) -> dict:
        return concat_model_inputs([ep.turns[j] for j in ep.image_turns(t)])

    seen = []
    for turn, count in enumerate(images):
        inputs = image_inputs(turn, count) if count else {}
        if turn == 0:
            ep.start(SYSTEM, image_message(count), image_token_counts=[3] * count, model_inputs=inputs)
        else:
            ep.add_response(sampled(tok, "Left"))
            ep.add_observation(image_message(count), image_token_counts=[3] * count, model_inputs=inputs)
        prompt = ep.prompt_model_inputs()  # as the rollout asks, turn by turn
        assert_same_inputs(prompt, plain(turn))
        seen.append((prompt, {key: value.clone() for key, value in prompt.items()}))
    ep.add_response(sampled(tok, "Left"))
    for t, sample in enumerate(ep.turn_samples()):
        assert_same_inputs(sample.model_inputs, plain(t))
    for prompt, copied in seen:  # the buffers grew since: what earlier prompts were given is unchanged
        assert_same_inputs(prompt, copied)


def test_a_prompt_that_keeps_every_image_views_the_episode_inputs_instead_of_copying_them(toks):
    tok = toks["chatml"]
    ep = EpisodeTokens(tok, image_token="<|image_pad|>")
    ep.start(SYSTEM, image_message(1), image_token_counts=[3], model_inputs=image_inputs(0, 1))
    for turn in range(1, 6):
        ep.add_response(sampled(tok, "Left"))
        ep.add_observation(image_message(1), image_token_counts=[3], model_inputs=image_inputs(turn, 1))
    first, later = ep.prompt_model_inputs(4)["pixel_values"], ep.prompt_model_inputs(5)["pixel_values"]
    assert len(first) == 15 and len(later) == 18
    assert first._is_view() and first.data_ptr() == later.data_ptr()  # one buffer, no copies
    # the images' own tensors (the image encoder's, which it shares between episodes) are left as they were
    assert not ep.turns[0].model_inputs["pixel_values"]._is_view()


def test_buffers_sized_for_the_expected_turns_are_laid_once_and_grow_past_them(toks):
    tok = toks["chatml"]
    ep = EpisodeTokens(tok, image_token="<|image_pad|>", expected_turns=4)
    ep.start(SYSTEM, image_message(1), image_token_counts=[3], model_inputs=image_inputs(0, 1))
    first = ep.prompt_model_inputs()["pixel_values"]
    assert ep._rows is not None and len(ep._rows._buffers["pixel_values"]) == 12  # four turns of three rows
    for turn in range(1, 6):
        ep.add_response(sampled(tok, "Left"))
        ep.add_observation(image_message(1), image_token_counts=[3], model_inputs=image_inputs(turn, 1))
        pixels = ep.prompt_model_inputs()["pixel_values"]
        # the expected four turns fill the first buffer without a copy; the fifth doubles it
        assert (pixels.data_ptr() == first.data_ptr()) == (turn < 4)
        assert pixels[-3:, 0].tolist() == [100.0 * turn, 100.0 * turn + 2, 100.0 * turn + 4]
    with pytest.raises(ValueError, match="expected_turns must be >= 1"):
        InputRows(0)


@pytest.mark.parametrize(("images", "max_images", "kept"), [((1, 2, 1), 3, (1, 2)), ((1, 1, 1), 1, (2,))])
def test_a_prompt_keeps_the_latest_max_images_and_a_messages_images_together(toks, images, max_images, kept):
    import torch

    tok = toks["chatml"]
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    ep = EpisodeTokens(tok, image_token="<|image_pad|>", max_images=max_images)
    for turn, count in enumerate(images):
        message, inputs = image_message(count), image_inputs(turn, count)
        if turn == 0:
            ep.start(SYSTEM, message, image_token_counts=[3] * count, model_inputs=inputs)
        else:
            ep.add_response(sampled(tok, "Left"))
            ep.add_observation(message, image_token_counts=[3] * count, model_inputs=inputs)
    # the latest images that fit, a message's all or none; the other messages are shown with their text alone
    text_only = {"role": "user", "content": [{"type": "text", "text": "Where?"}]}
    chat = [{"role": "system", "content": SYSTEM}]
    for turn, count in enumerate(images):
        chat += [image_message(count) if turn in kept else text_only, {"role": "assistant", "content": "Left"}]
    rendered = full_render_ids(tok, chat[:-1])
    assert ep.prompt() == [i for rendered_id in rendered for i in ([pad] * 3 if rendered_id == pad else [rendered_id])]
    want = {key: torch.cat([image_inputs(turn, images[turn])[key] for turn in kept]) for key in image_inputs(0, 1)}
    assert_same_inputs(ep.prompt_model_inputs(), want)


def test_a_prompts_image_digests_are_those_of_the_images_it_keeps_or_none_when_one_is_missing(toks):
    tok = toks["chatml"]
    ep = EpisodeTokens(tok, image_token="<|image_pad|>", max_images=2)
    ep.start(SYSTEM, image_message(1), image_token_counts=[3], image_digests=[-5])
    ep.add_response(sampled(tok, "Left"))
    with pytest.raises(ValueError, match="2 image digests for a message with 1 images"):
        ep.add_observation(image_message(1), image_token_counts=[3], image_digests=[-6, -7])
    ep.add_observation(image_message(1), image_token_counts=[3], image_digests=[-6])
    assert (ep.prompt_image_digests(), ep.prompt_image_digests(0)) == ([-5, -6], [-5])
    ep.add_response(sampled(tok, "Left"))
    ep.add_observation(image_message(1), image_token_counts=[3])  # counted, not digested; turn 0's image dropped
    assert (ep.prompt_image_digests(), ep.prompt_image_digests(1)) == (None, [-5, -6])


def test_a_full_buffer_doubles_so_later_turns_are_laid_without_a_copy(toks):
    tok = toks["chatml"]
    ep = EpisodeTokens(tok, image_token="<|image_pad|>", expected_turns=1)
    prompts = []  # kept, so that no buffer is freed and its address taken again
    for turn in range(10):
        if turn == 0:
            ep.start(SYSTEM, image_message(1), image_token_counts=[3], model_inputs=image_inputs(0, 1))
        else:
            ep.add_response(sampled(tok, "Left"))
            ep.add_observation(image_message(1), image_token_counts=[3], model_inputs=image_inputs(turn, 1))
        prompts.append(ep.prompt_model_inputs()["pixel_values"])
    # three rows a turn: a buffer of 3 rows, then 6, 12, 24 and 48, each laid when the turn does not fit
    moved = [t for t in range(1, 10) if prompts[t].data_ptr() != prompts[t - 1].data_ptr()]
    assert moved == [1, 2, 4, 8]


@pytest.mark.parametrize("joined", [True, False])
def test_a_turns_sample_holds_the_inputs_of_its_prompts_turns_only(toks, joined):
    import torch

    tok = toks["chatml"]
    ep = EpisodeTokens(tok, image_token="<|image_pad|>")
    ep.start(SYSTEM, image_message(1), image_token_counts=[3], model_inputs=image_inputs(0, 1))
    ep.add_response(sampled(tok, "Left"))
    # a key the first turn has not; and, unless joined, pixels of another dtype (no shared buffer)
    later = {**image_inputs(1, 1, None if joined else torch.float32), "second_per_grid_ts": torch.ones(1)}
    ep.add_observation(image_message(1), image_token_counts=[3], model_inputs=later)
    ep.add_response(sampled(tok, "Left"))
    first, second = ep.turn_samples()
    assert_same_inputs(first.model_inputs, image_inputs(0, 1))
    assert_same_inputs(second.model_inputs, {key: torch.cat([image_inputs(0, 1)[key], later[key]])
                                             if key in image_inputs(0, 1) else later[key] for key in later})


def test_inputs_that_cannot_share_a_buffer_are_concatenated(toks):
    import torch

    tok = toks["chatml"]
    ep = EpisodeTokens(tok, image_token="<|image_pad|>")
    ep.start(SYSTEM, image_message(1), image_token_counts=[3], model_inputs=image_inputs(0, 1))
    ep.add_response(sampled(tok, "Left"))
    ep.add_observation(image_message(1), image_token_counts=[3], model_inputs=image_inputs(1, 1, torch.float32))
    pixels = ep.prompt_model_inputs()["pixel_values"]
    assert pixels.dtype == torch.float32 and pixels[:3, 0].tolist() == [0.0, 2.0, 4.0]  # torch.cat's promotion


def test_an_episode_sent_to_another_process_leaves_its_buffers_behind_and_reads_the_same_prompts(toks):
    from turnrl.chat.template_deltas import ChatTemplateDeltas
    from turnrl.training import wire

    tok = toks["chatml"]
    ep = EpisodeTokens(tok, image_token="<|image_pad|>")
    ep.start(SYSTEM, image_message(1), image_token_counts=[3], model_inputs=image_inputs(0, 1))
    ep.add_response(sampled(tok, "Left"))
    ep.add_observation(image_message(2), image_token_counts=[3, 3], model_inputs=image_inputs(1, 2))
    before = ep.prompt_model_inputs()
    assert ep._rows is not None

    def send(value):  # as the rollout pool sends trajectories: the template pieces stay in each process
        payload = wire.dumps(value, persistent_id=lambda obj: "deltas" if isinstance(obj, ChatTemplateDeltas) else None)
        return payload, wire.loads(payload, persistent_load=lambda _: ep.deltas)

    payload, received = send(ep)
    assert received._rows is None
    assert len(payload) < len(send(ep.turns)[0]) + 2_000  # the pixels once, not again in the buffers
    assert_same_inputs(received.prompt_model_inputs(), before)
    ep.start(SYSTEM, image_message(1), image_token_counts=[3], model_inputs=image_inputs(7, 1))  # a restart
    assert_same_inputs(ep.prompt_model_inputs(), image_inputs(7, 1))
