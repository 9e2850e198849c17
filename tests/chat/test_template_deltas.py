"""A chat template's pieces as token ids: what each template writes, the self-check, folding a system
message, expanding image placeholders. (Whole episodes built from them: tests/rollout/test_context.py.)"""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from turnrl.chat.template_deltas import (
    ChatTemplateDeltas,
    TemplateDeltaError,
    as_message,
    expand_placeholders,
    fold_system,
)
from turnrl.chat.templates import TEMPLATES
from turnrl.models import build_tokenizer

CORPUS = [
    f"Turn {i}. {c}"
    for i in range(10)
    for c in (
        "You are playing Sokoban. Move the player P to push box X onto target O.\n#####\n#_OX#\n#_P_#\n#####",
        "<think>The box is left of me, so I push left.</think><answer>Left || Up</answer>",
        "Reward: -0.1. The player moved. Current observation follows.",
        "Target 24, nums [3, 8, 1, 6]. Answer with an equation like (8 - 6) * 12.",
        "FrozenLake: avoid the holes O and reach the goal G.",
    )
]
NAMES = sorted(TEMPLATES)


def template_tokenizers() -> dict:
    """A test tokenizer for each built-in template, by name."""
    return {name: build_tokenizer(CORPUS, vocab_size=512, template=name) for name in NAMES}


@pytest.fixture(scope="module")
def toks():
    return template_tokenizers()


def encode(tok, text):
    return tok.encode(text, add_special_tokens=False)


SYSTEM = "You are playing Sokoban."


# The Llama-2-style template: a space, then the end-of-turn token, closes an answer.
LLAMA2_STYLE = (
    "{% for m in messages %}{% if m.role == 'user' %}{{ '[INST] ' + m.content + ' [/INST]' }}"
    "{% else %}{{ ' ' + m.content + ' ' + eos_token }}{% endif %}{% endfor %}"
)


# -- pieces of the templates ------------------------------------------------------


def test_pieces(toks):
    chatml, qwen3, llama3 = (ChatTemplateDeltas(toks[n]) for n in ("chatml", "qwen3", "llama3"))
    tok = toks["chatml"]
    assert chatml.response_closing() == [tok.convert_tokens_to_ids("<|im_end|>"), *encode(tok, "\n")]
    assert tok.decode(chatml.observation("hi")) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert [m["role"] for m in chatml.observation_base] == ["user", "assistant"]
    # Qwen3 renders the last assistant turn with a think block: a base ending with a user message is used.
    assert [m["role"] for m in qwen3.observation_base] == ["system", "user"]
    assert toks["llama3"].decode(llama3.response_closing()) == "<|eot_id|>"
    assert toks["llama3"].decode(llama3.head(None, "u")) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nu<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert ChatTemplateDeltas.for_tokenizer(tok) is ChatTemplateDeltas.for_tokenizer(tok)
    assert ChatTemplateDeltas.for_tokenizer(toks["qwen3"], enable_thinking=False) is not (
        ChatTemplateDeltas.for_tokenizer(toks["qwen3"])
    )


# A DeepSeek-R1 distill's template, cut down: history answers lose their reasoning, and the generation prompt
# opens the think block.
R1_STYLE = (
    "{% for m in messages %}{% if m.role == 'user' %}{{ '<|im_start|>user\\n' + m.content + '<|im_end|>' }}"
    "{% elif m.role == 'system' %}{{ m.content }}{% else %}{% set c = m.content %}"
    "{% if '</think>' in c %}{% set c = c.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>assistant\\n' + c + '<|im_end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)


def test_the_text_a_generation_prompt_opens_and_leaves_open_is_found(toks):
    """A thinking model's template ends the prompt inside the assistant's think block; Qwen3's
    enable_thinking=False block is closed there, and the other templates open nothing."""
    assert ChatTemplateDeltas(toks["qwen3_thinking"]).template_opening == "<think>\n"
    assert ChatTemplateDeltas(toks["qwen3"], chat_template=R1_STYLE).template_opening == "<think>\n"
    assert ChatTemplateDeltas(toks["qwen3"], enable_thinking=False).template_opening == ""
    assert {name: ChatTemplateDeltas(toks[name]).template_opening for name in ("chatml", "qwen3", "llama3")} == {
        "chatml": "", "qwen3": "", "llama3": ""}
    deltas = ChatTemplateDeltas(toks["qwen3_thinking"])
    assert toks["qwen3_thinking"].decode(deltas.observation("hi")).endswith("<|im_start|>assistant\n<think>\n")


def test_a_thinking_templates_self_check_renders_the_chat_as_a_rollout_keeps_it(toks):
    """A rollout keeps each assistant message as the template's opening, then the answer: the full render of that
    chat is the stream, and the self-check says so (it rendered the answer without the opening, so found them
    apart and let any difference before the answer through)."""
    thinking = ChatTemplateDeltas(toks["qwen3_thinking"]), ChatTemplateDeltas(toks["qwen3"], chat_template=R1_STYLE)
    for deltas in thinking:
        assert deltas.template_opening == "<think>\n" and deltas.matches_full_render is True


@pytest.mark.parametrize("name", NAMES)
def test_remembered_heads_and_observations_are_the_templates_renderings(toks, name):
    tok = toks[name]
    deltas = ChatTemplateDeltas(tok)
    for _ in range(2):  # rendered, then remembered
        for board in ("#####\n#P X#", "#####\n# PX#"):
            head = deltas.head(SYSTEM, board)
            assert head == encode(tok, deltas.render(deltas.opening(SYSTEM, board), add_generation_prompt=True))
            assert deltas.observation(board) == encode(tok, deltas._observation_text({"role": "user", "content": board}))
    head = deltas.head(SYSTEM, "#####")
    head.append(-1)  # a caller's list is its own: the memo keeps the ids
    assert deltas.head(SYSTEM, "#####")[-1] != -1
    hits = deltas._memo_ids.cache_info().hits
    named = {"role": "user", "content": "#####", "name": "env"}  # a field beyond role and text: not remembered
    assert deltas.observation(named) == encode(tok, deltas._observation_text(named))
    assert deltas._memo_ids.cache_info().hits == hits


def with_picture(picture, text: str) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": text}]}


def test_messages_with_pictures_are_remembered_where_the_template_renders_any_picture_alike(tiny_vlm_dir):
    """Qwen-VL's template writes one placeholder for any picture: a head or observation of a picture and a
    caption is rendered once and remembered, whatever the picture; the ids are the template's rendering."""
    from turnrl.models.loading import load_processor

    tok = load_processor(tiny_vlm_dir).tokenizer
    deltas = ChatTemplateDeltas(tok)
    rng = np.random.default_rng(0)
    pictures = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in ((150, 150), (60, 90), (150, 150))]
    for picture in pictures:
        for caption in ("The grid is shown above.", "Turn 2. The grid is shown above."):
            message = with_picture(picture, caption)
            assert deltas.head(SYSTEM, message) == encode(tok, deltas.render(deltas.opening(SYSTEM, message),
                                                                             add_generation_prompt=True))
            assert deltas.observation(message) == encode(tok, deltas._observation_text(message))
    info = deltas._memo_ids.cache_info()
    assert (info.misses, info.hits) == (4, 8)  # two captions, head and observation each: the pictures change nothing
    two = {"role": "user", "content": [{"type": "image", "image": pictures[0]}, {"type": "image", "image": pictures[1]},
                                       {"type": "text", "text": "Two pictures."}]}
    assert deltas.head(SYSTEM, two) == encode(tok, deltas.render(deltas.opening(SYSTEM, two), add_generation_prompt=True))


def test_a_template_for_text_alone_keeps_pictures_out_of_the_memo(toks):
    """A template that refuses a list of parts gives no stand-in picture: messages of texts are still
    remembered, and one with a picture fails in the template as before."""
    template = ("{% for m in messages %}{% if m.content is not string %}{{ raise_exception('text only') }}"
                "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    deltas = ChatTemplateDeltas(toks["chatml"], chat_template=template)
    assert deltas.head(SYSTEM, "Look.") == deltas.head(SYSTEM, "Look.")
    assert deltas._memo_ids.cache_info().hits == 1
    with pytest.raises(Exception, match="text only"):
        deltas.head(SYSTEM, with_picture(np.zeros((7, 4, 3), dtype=np.uint8), "Look."))


def test_other_stop_id_counts_as_stopped(toks):
    tok = toks["chatml"]
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    deltas = ChatTemplateDeltas(tok, stop_ids=[tok.eos_token_id, eot])
    closing, stopped = deltas.close(encode(tok, "Left") + [eot])
    assert stopped and closing == deltas.response_closing()


def test_verify_probes_with_a_sampled_end_of_turn_token(tiny_tokenizer):
    """A close() that does not see a sampled eos behind the closing's leading text fails verify()."""

    class OldClose(ChatTemplateDeltas):
        def close(self, response_ids):
            # Recognises the end-of-turn token only as the first token of the closing.
            for k in range(min(len(self.closing), len(response_ids)), 0, -1):
                if tuple(response_ids[-k:]) == self.closing[:k]:
                    return list(self.closing[k:]), True
            return list(self.closing), response_ids[-1] in self.stop_ids

    with pytest.raises(TemplateDeltaError, match="tokenize differently"):
        OldClose(tiny_tokenizer, chat_template=LLAMA2_STYLE)
    OldClose(tiny_tokenizer)  # right where the closing starts with its end-of-turn token (ChatML)


def test_template_that_cannot_be_incremental(toks):
    tok = toks["chatml"]
    # Renders the number of messages first: no rendering is a prefix of a longer one.
    counting = "{{ messages|length }}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(TemplateDeltaError, match="cannot be rendered incrementally"):
        ChatTemplateDeltas(tok, chat_template=counting)
    # The last user message is marked: the head is not how the template renders that message later.
    marked = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{{ ' (your turn)' if loop.last and m.role == 'user' else '' }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(TemplateDeltaError, match="differs from a full render"):
        ChatTemplateDeltas(tok, chat_template=marked)
    assert ChatTemplateDeltas(tok, chat_template=marked, verify=False).response_closing() == encode(tok, "\n")


def test_template_whose_rerender_differs_only_in_the_past_answer(toks):
    tok = toks["chatml"]
    # The generation prompt is "assistant:" but a past answer renders as "assistant: <content>": the
    # pieces are right, a re-render just differs from what was sampled, as with Qwen3's reasoning.
    spaced = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    deltas = ChatTemplateDeltas(tok, chat_template=spaced)
    assert deltas.matches_full_render is False
    assert deltas.response_closing() == encode(tok, "\n")
    assert ChatTemplateDeltas.for_tokenizer(tok).matches_full_render is True
    assert ChatTemplateDeltas.for_tokenizer(toks["qwen3"], enable_thinking=False).matches_full_render is False


def test_closing_is_taken_from_a_past_answer(toks):
    tok = toks["chatml"]
    # The final assistant message of a chat ends with <|endoftext|>, past ones with <|im_end|>\n.
    ends_differently = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if m.role == 'assistant' and loop.last %}<|endoftext|>{% else %}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    deltas = ChatTemplateDeltas(tok, chat_template=ends_differently)
    assert tok.decode(deltas.response_closing()) == "<|im_end|>\n"
    assert deltas.matches_full_render


def test_template_that_drops_the_system_message(toks):
    tok = toks["chatml"]
    drops = (
        "{% for m in messages if m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    deltas = ChatTemplateDeltas(tok, chat_template=drops)
    assert deltas.system_role is False
    assert tok.decode(deltas.head(SYSTEM, "hi")) == f"<|im_start|>user\n{SYSTEM}\n\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert ChatTemplateDeltas.for_tokenizer(tok).system_role is True


def test_fold_system():
    system = {"role": "system", "content": "Rules."}
    assert fold_system(system, {"role": "user", "content": "Go."}) == {"role": "user", "content": "Rules.\n\nGo."}
    image_msg = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where?"}]}
    assert fold_system(system, image_msg) == {
        "role": "user",
        "content": [
            {"type": "text", "text": "Rules."},
            {"type": "text", "text": "\n\n"},
            {"type": "image"},
            {"type": "text", "text": "Where?"},
        ],
    }


def test_expand_placeholders(toks):
    pad = toks["chatml"].convert_tokens_to_ids("<|image_pad|>")
    assert expand_placeholders([1, pad, 2, pad], pad, [2, 0]) == [1, pad, pad, 2]
    with pytest.raises(ValueError, match="placeholders"):
        expand_placeholders([1, pad], pad, [1, 1])


# -- any input -----------------------------------------------------------------------

FUZZ = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ANY_TEXT = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=100),
    st.lists(st.sampled_from(["<|im_end|>", "<|im_start|>", "<|eot_id|>", "<|image_pad|>", "<think>", "</think>",
                              "{{", "{%", "\n", " ", "user", "\udfff"]), max_size=20).map("".join),
)
"""An env's text: every code point (lone surrogates included: an env's output read with ``surrogateescape``, JSON's
``"\\udfff"`` through the env service), and text that looks like the templates' control tokens and syntax."""
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=10)


@pytest.fixture(scope="module")
def deltas(toks):
    return {name: ChatTemplateDeltas(tok) for name, tok in toks.items()}


@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(system=ANY_TEXT, user=ANY_TEXT)
@example(system="", user="hi \udfff")  # was a TypeError from the tokenizer
def test_a_head_and_an_observation_of_any_text_hold_that_text(deltas, name, system, user):
    d = deltas[name]
    text = user.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate is read as its escape
    text = text.strip() if name == "llama3" else text  # Llama-3's template trims contents
    for ids in (d.head(system, user), d.observation(user)):
        assert text in d.tokenizer.decode(ids, skip_special_tokens=False)


@FUZZ
@given(value=st.one_of(JSON, st.fixed_dictionaries({"role": JSON, "content": JSON})))
@example(value={"role": [], "content": ""})  # was accepted, then a TypeError (unhashable) from the memo
def test_any_value_is_a_message_or_refused_saying_what_a_message_is(deltas, value):
    try:
        message = as_message(value)
    except ValueError as error:
        assert re.search(r"a message is a string or a dict|a message needs 'role' and 'content'|a message's 'role' "
                         r"is a string", str(error)), error
        with pytest.raises(ValueError, match="message"):
            deltas["chatml"].observation(value)
        return
    assert isinstance(message["role"], str) and "content" in message


@pytest.mark.parametrize("name", NAMES)
@FUZZ
@given(ids=st.lists(st.integers(0, 511), max_size=12), tail=st.integers(0, 4))
def test_any_response_is_closed_by_a_suffix_of_the_closing(deltas, name, ids, tail):
    d = deltas[name]
    response = [*ids, *d.closing[:tail]]  # often a part of the closing itself
    appended, stopped = d.close(response)
    assert tuple(appended) == d.closing[len(d.closing) - len(appended):]
    assert stopped or tuple(appended) == d.closing


@FUZZ
@given(ids=st.lists(st.integers(0, 4), max_size=20), counts=st.lists(st.integers(0, 3), max_size=6))
def test_placeholders_of_any_ids_expand_to_their_counts_or_are_refused(ids, counts):
    try:
        out = expand_placeholders(ids, 3, counts)
    except ValueError as error:
        assert f"{ids.count(3)} image placeholders in the message but {len(counts)} image token counts" in str(error)
        return
    assert [i for i in out if i != 3] == [i for i in ids if i != 3] and out.count(3) == sum(counts)


def test_a_message_lacking_its_role_or_its_content_is_refused():
    for value in ({"role": "user"}, {"content": "hi"}, {}):
        with pytest.raises(ValueError, match="a message needs 'role' and 'content'"):
            as_message(value)
    assert as_message({"role": "user", "content": "hi"}) == {"role": "user", "content": "hi"}



def test_the_tokenizers_eos_token_stops_a_response_by_default(toks, tiny_tokenizer):
    for tok in (toks["chatml"], tiny_tokenizer):
        deltas = ChatTemplateDeltas(tok)
        assert deltas.stop_ids == {tok.eos_token_id}
        closing, stopped = deltas.close(encode(tok, "Left") + [tok.eos_token_id])
        assert stopped and closing == deltas.response_closing()[len(closing) - len(deltas.closing):]


def test_for_tokenizer_caches_one_instance_per_template_and_arguments(toks):
    tok = build_tokenizer(CORPUS, vocab_size=512, template="chatml")
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    stops = ChatTemplateDeltas.for_tokenizer(tok, stop_ids=[tok.eos_token_id, eot])
    assert ChatTemplateDeltas.for_tokenizer(tok, stop_ids=[tok.eos_token_id, eot]) is stops
    assert ChatTemplateDeltas.for_tokenizer(tok, verify=False) is ChatTemplateDeltas.for_tokenizer(tok, verify=False)
    plain = ChatTemplateDeltas.for_tokenizer(tok)
    assert plain.system_role is True
    tok.chat_template = (  # replaced after caching: a new instance for the new template
        "{% for m in messages if m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert ChatTemplateDeltas.for_tokenizer(tok) is not plain
    assert ChatTemplateDeltas.for_tokenizer(tok).system_role is False


def test_a_template_that_rejects_a_system_message_gets_it_folded_into_the_first_user_message(toks):
    tok = toks["chatml"]
    rejects = (  # Gemma 2's way
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    deltas = ChatTemplateDeltas(tok, chat_template=rejects)
    assert deltas.system_role is False and deltas.matches_full_render is True
    folded = [{"role": "user", "content": f"{SYSTEM}\n\nhi"}]
    assert deltas.head(SYSTEM, "hi") == encode(tok, tok.apply_chat_template(
        folded, chat_template=rejects, add_generation_prompt=True, tokenize=False))


# Phi-3.5-mini's way: a chat that ends without the generation prompt ends with the eos token, which is gone once
# another message follows; here the last assistant message of a chat also has no closing of its own.
EOS_AFTER_CHAT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if not (loop.last and m.role == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% else %}<|endoftext|>{% endif %}"
)


@pytest.mark.parametrize("system", [True, False])
def test_a_template_that_writes_eos_after_a_chat_is_rendered_incrementally(toks, system):
    """The base is a render less its trailing control token, and one ending with a user message: taking the eos off
    ``[user, assistant]`` would leave an answer without its closing, and every observation would start with it."""
    tok = toks["chatml"]
    drop_system = "{% set messages = messages | rejectattr('role', 'eq', 'system') | list %}"
    template = EOS_AFTER_CHAT if system else drop_system + EOS_AFTER_CHAT
    deltas = ChatTemplateDeltas(tok, chat_template=template)
    assert deltas.system_role is system and deltas.matches_full_render is True
    assert [m["role"] for m in deltas.observation_base] == (["system", "user"] if system else ["user"])
    assert tok.decode(deltas.response_closing()) == "<|im_end|>\n"
    assert tok.decode(deltas.observation("hi")) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    answer = encode(tok, "Left") + [tok.convert_tokens_to_ids("<|im_end|>")]
    opening = deltas.opening(SYSTEM, "go")
    stream = deltas.head(SYSTEM, "go") + answer + deltas.close(answer)[0] + deltas.observation("hi")
    chat = [*opening, {"role": "assistant", "content": "Left"}, {"role": "user", "content": "hi"}]
    assert stream == encode(tok, tok.apply_chat_template(chat, chat_template=template, add_generation_prompt=True,
                                                         tokenize=False))


def test_a_closing_of_plain_text_is_matched_only_as_text(toks):
    """A closing with no control token: its end-of-turn position is 0, and an empty response did not stop."""
    tok = toks["chatml"]
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}" \
            "assistant:{% endif %}"
    deltas = ChatTemplateDeltas(tok, chat_template=plain)
    assert deltas.end_of_turn_index == 0 and deltas.response_closing() == encode(tok, "\n")
    assert deltas.close([]) == (encode(tok, "\n"), False)
    assert deltas.close(encode(tok, "Left\n")) == ([], True)


def test_a_llama2_style_closing_is_its_space_then_the_sampled_eos(tiny_tokenizer):
    """The closing's text before its end-of-turn token is found; the sampled eos stands in for both, and the stream
    lacks only that space where a full render has it."""
    tok = tiny_tokenizer
    deltas = ChatTemplateDeltas(tok, chat_template=LLAMA2_STYLE)
    assert deltas.end_of_turn_index == 1 and deltas.matches_full_render is False
    assert deltas.response_closing() == [*encode(tok, " "), tok.eos_token_id]
    answer = encode(tok, "Left") + [tok.eos_token_id]
    assert deltas.close(answer) == ([], True)
    assert deltas.head(None, "go") == encode(tok, "[INST] go [/INST]")
    assert deltas.observation("hi") == encode(tok, "[INST] hi [/INST]")


def test_a_message_without_content_renders_as_the_template_writes_it(toks):
    tok = toks["chatml"]
    deltas = ChatTemplateDeltas(tok)
    message = {"role": "user", "content": None}
    assert tok.decode(deltas.observation(message)) == "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
    assert deltas.head(SYSTEM, message) == encode(tok, tok.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, message], add_generation_prompt=True, tokenize=False))


def test_an_opening_that_ends_with_its_tag_is_the_whole_tag(toks):
    """A generation prompt that opens the think block with no newline after it: the opening is the tag itself."""
    no_newline = R1_STYLE.replace("'<|im_start|>assistant\\n<think>\\n'", "'<|im_start|>assistant\\n<think>'")
    assert no_newline != R1_STYLE
    deltas = ChatTemplateDeltas(toks["qwen3"], chat_template=no_newline)
    assert deltas.template_opening == "<think>" and deltas.matches_full_render is True
