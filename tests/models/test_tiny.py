"""The built-in tokenizer, chat templates and small Qwen2 models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM

from turnrl.chat.templates import TEMPLATES, template_spec
from turnrl.models import (
    PRESETS,
    build_model,
    build_tokenizer,
    count_parameters,
    model_preset,
    preset_config,
    tiny_qwen2_config,
)
from turnrl.models.tiny import BUILD_FILE, texts_digest

GRIDS = ["#####\n#_OX#\n#_P_#\n#####", "____\n_O_G\n__P_\n√_X_", "P: player, X: box, O: target, √: box on target"]
CHAT = [
    "You are solving a Sokoban puzzle. Push every box onto a target.",
    "<think>The box is left of me, so I push left.</think><answer>Left || Up</answer>",
    "Target 24, nums [3, 8, 1, 6]. Answer with an equation.",
    "Invalid action. Valid actions are Up, Down, Left, Right.",
]
CORPUS = [f"Turn {i}. {c}\n{g}" for i in range(12) for c in CHAT for g in GRIDS]


@pytest.fixture(scope="module")
def tokenizers():
    return {name: build_tokenizer(CORPUS, vocab_size=512, template=name) for name in TEMPLATES}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-chatml"
    return build_model(path, CORPUS, preset="tiny", template="chatml", seed=0)


# -- tokenizer ------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_tokenizer_attributes(tokenizers, name):
    tok, spec = tokenizers[name], template_spec(name)
    assert len(tok) <= 512
    assert tok.eos_token == spec.end_of_turn
    assert tok.pad_token == spec.end_of_text
    assert tok.bos_token == spec.bos
    assert tok.padding_side == "left"
    assert tok.chat_template == spec.chat_template
    # Control tokens take the last ids, after every BPE token.
    control = [tok.convert_tokens_to_ids(t) for t in spec.special_tokens + spec.added_tokens]
    assert sorted(control) == list(range(len(tok) - len(control), len(tok)))


text_with_controls = st.lists(
    st.one_of(st.text(), st.sampled_from(sorted({t for s in TEMPLATES.values() for t in s.special_tokens}))),
    max_size=6,
).map("".join)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@settings(max_examples=150, deadline=None)
@given(text=st.one_of(st.text(), text_with_controls))
def test_round_trip_any_text(tokenizers, name, text):
    tok = tokenizers[name]
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_text_is_not_normalized(tokenizers):
    tok = tokenizers["chatml"]
    # NFKC would fold the full-width letter and the ligature; lowercasing, the case.
    assert tok.backend_tokenizer.normalizer is None
    for text in ["Ｆﬁle ÅNGSTRÖM", "  two  spaces\t\r\n", "√ on █ ░", "e\u0301 vs \u00e9"]:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_control_tokens_are_atomic(tokenizers, name):
    tok, spec = tokenizers[name], template_spec(name)
    for token in spec.special_tokens + spec.added_tokens:
        token_id = tok.convert_tokens_to_ids(token)
        assert tok.encode(token, add_special_tokens=False) == [token_id]
        ids = tok.encode(f"abc{token}def", add_special_tokens=False)
        assert ids.count(token_id) == 1
        assert tok.decode(ids) == f"abc{token}def"
    # Special tokens are dropped by skip_special_tokens; plain added tokens (<think>) are text.
    text = f"{spec.end_of_turn}<think>x</think>"
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=True) == "<think>x</think>"


def test_grid_cells_are_tokens_and_closing_tags_start_with_their_own_token(tokenizers):
    tok = tokenizers["chatml"]
    pieces = lambda text: [tok.decode([i]) for i in tok.encode(text, add_special_tokens=False)]  # noqa: E731
    assert pieces("_P_O") == ["_", "P", "_", "O"]
    assert pieces("<answer>Left</answer>")[0] == "<"
    assert pieces("<answer>Left</answer>")[4] == "</"


@pytest.mark.parametrize("role", ["system", "user", "assistant"])
def test_role_names_are_single_tokens(tokenizers, role):
    assert len(tokenizers["chatml"].encode(role, add_special_tokens=False)) == 1


def test_llama3_bos_only_once(tokenizers):
    tok = tokenizers["llama3"]
    bos = tok.bos_token_id
    assert tok("hello")["input_ids"][0] == bos  # a plain encode adds BOS, as Llama-3 tokenizers do
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, return_dict=False)
    assert ids.count(bos) == 1  # the template writes it; apply_chat_template must not add a second one


def test_tokenizer_is_deterministic():
    a = build_tokenizer(CORPUS, vocab_size=400, template="qwen3")
    b = build_tokenizer(list(reversed(CORPUS)), vocab_size=400, template="qwen3")
    assert a.backend_tokenizer.to_str() == b.backend_tokenizer.to_str()
    c = build_tokenizer(CORPUS + ["something else entirely"], vocab_size=400, template="qwen3")
    assert c.backend_tokenizer.to_str() != a.backend_tokenizer.to_str()


def test_vocab_size_too_small():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(CORPUS, vocab_size=100)


# -- chat templates ----------------------------------------------------------------

VISION_CHAT = [
    {"role": "system", "content": "You play Sokoban."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where is the box?"}]},
    {"role": "assistant", "content": "Left"},
    {"role": "user", "content": "Done?"},
]


def render(tok, messages, gen, **kwargs):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)


def test_chatml_render(tokenizers):
    tok = tokenizers["chatml"]
    assert render(tok, VISION_CHAT, True) == (
        "<|im_start|>system\nYou play Sokoban.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Where is the box?<|im_end|>\n"
        "<|im_start|>assistant\nLeft<|im_end|>\n"
        "<|im_start|>user\nDone?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # No system message: the default one, as Qwen2.5 does.
    assert render(tok, [{"role": "user", "content": "Hi"}], False) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_qwen3_render(tokenizers):
    tok = tokenizers["qwen3"]
    chat = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"},
        {"role": "user", "content": [{"type": "text", "text": "U2 "}, {"type": "image_url", "image_url": {}}]},
        {"role": "assistant", "content": "<think>\nr2\n</think>\n\nA2"},
    ]
    # Reasoning before the last user query is stripped; after it, kept.
    assert render(tok, chat, False) == (
        "<|im_start|>system\nS<|im_end|>\n"
        "<|im_start|>user\nU1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nU2 <|vision_start|><|image_pad|><|vision_end|><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nr2\n</think>\n\nA2<|im_end|>\n"
    )
    # No default system message; the last assistant turn after the query gets a think block even when empty.
    assert render(tok, [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}], False) == (
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA<|im_end|>\n"
    )
    user = [{"role": "user", "content": "U"}]
    assert render(tok, user, True) == "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert render(tok, user, True, enable_thinking=False) == (
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_llama3_render(tokenizers):
    tok = tokenizers["llama3"]
    chat = [
        {"role": "system", "content": "  S \n"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "U"}]},
        {"role": "assistant", "content": "A"},
    ]
    assert render(tok, chat, True) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n<|image|>U<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_unknown_content_part_is_an_error(tokenizers, name):
    with pytest.raises(Exception, match="Unsupported content part type: audio"):
        render(tokenizers[name], [{"role": "user", "content": [{"type": "audio"}]}], True)


# -- models ---------------------------------------------------------------------------


def test_presets_and_parameter_counts():
    assert set(PRESETS) == {"tiny", "small", "base", "0.5b", "1.5b", "3b", "7b"}
    assert count_parameters("tiny") < 200_000
    assert 2_000_000 < count_parameters("small") < 5_000_000
    assert 50_000_000 < count_parameters("base") < 100_000_000
    assert 300_000_000 < count_parameters("0.5b") < 400_000_000
    tok = build_tokenizer(CORPUS, vocab_size=512)
    for name in PRESETS:
        with torch.device("meta"):
            model = Qwen2ForCausalLM(preset_config(name, tok))
        assert sum(p.numel() for p in model.parameters()) == count_parameters(name, len(tok))
    with pytest.raises(ValueError, match="unknown model preset"):
        model_preset("huge")


@pytest.mark.parametrize(("name", "parameters", "rows"), [
    ("1.5b", 1_543_714_304, 151_936), ("3b", 3_085_938_688, 151_936), ("7b", 7_615_616_512, 152_064)])
def test_real_size_presets_have_the_released_shapes(name, parameters, rows):
    """Qwen2.5-1.5B, 3B and 7B as released: the parameter counts of their checkpoints, whatever the tokenizer."""
    tok = build_tokenizer(CORPUS, vocab_size=512)
    config = preset_config(name, tok)
    assert config.vocab_size == rows and config.rope_parameters["rope_theta"] == 1e6
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(name, len(tok)) == parameters
    assert model_preset(name).real_size and not model_preset("0.5b").real_size


def _build_once(out: str, log: str, barrier) -> str:
    """One of several processes building the same recipe at once; the build itself logs its process."""
    import os
    import time

    from turnrl.models.tiny import BuildSpec, cached_build

    recipe = BuildSpec(preset="tiny", sizes={}, template="chatml", vocab_size=512, texts_digest="x", n_texts=1,
                         seed=0)

    def build_into(path):
        with open(log, "a") as file:
            file.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough for the others to arrive while it builds
        (path / "config.json").write_text("{}")
        (path / "tokenizer.json").write_text("{}")
        (path / "tokenizer_config.json").write_text("{}")
        return {"key": recipe.key()}

    barrier.wait()
    return str(cached_build(Path(out), recipe, build_into))


def test_a_build_that_writes_no_complete_model_is_never_published(tmp_path):
    """transformers writes weights on rank 0 only under torch.distributed: a build elsewhere finds an empty
    directory, which must fail loudly rather than become a cache entry that other processes read."""
    from turnrl.models.tiny import BuildSpec, cached_build

    recipe = BuildSpec(preset="tiny", sizes={}, template="chatml", vocab_size=512, texts_digest="x", n_texts=1,
                         seed=0)
    with pytest.raises(RuntimeError, match="no complete model"):
        cached_build(tmp_path / "model", recipe, lambda path: {"key": recipe.key()})
    assert not (tmp_path / "model").exists()
    assert [p.name for p in tmp_path.iterdir()] == [".model.lock"]


def test_processes_building_the_same_model_at_once_build_it_once(tmp_path):
    import multiprocessing

    # Fresh processes, forked from one that has imported this module (torch, transformers) once, rather than four
    # that each import it (spawn: 3 s of a core each); none inherits this process's threads (fork).
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    barrier = context.Manager().Barrier(4)
    out, log = tmp_path / "cache" / "model", tmp_path / "builds.log"
    with context.Pool(4) as pool:
        paths = pool.starmap(_build_once, [(str(out), str(log), barrier)] * 4)
    assert paths == [str(out)] * 4
    assert len(log.read_text().splitlines()) == 1  # one process built; three waited and reused it
    assert json.loads((out / BUILD_FILE).read_text())["key"]
    assert not [p for p in out.parent.iterdir() if ".build-" in p.name or ".stale-" in p.name]


def test_config_takes_ids_from_tokenizer(tokenizers):
    tok = tokenizers["llama3"]
    cfg = tiny_qwen2_config(len(tok), tokenizer=tok)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert cfg.model_type == "qwen2" and cfg.hidden_size == 128 and cfg.num_hidden_layers == 4


def test_build_forward_generate(built):
    model = AutoModelForCausalLM.from_pretrained(built)
    tok = AutoTokenizer.from_pretrained(built)
    assert isinstance(model, Qwen2ForCausalLM)
    assert model.config.vocab_size >= len(tok) and model.config.vocab_size % 64 == 0
    assert model.config.eos_token_id == tok.eos_token_id
    assert tok.eos_token_id in model.generation_config.eos_token_id
    batch = tok.apply_chat_template(
        [[{"role": "user", "content": "Where is the box?"}], [{"role": "user", "content": "Hi"}]],
        add_generation_prompt=True,
        padding=True,
        return_tensors="pt",
    )
    assert (batch["attention_mask"][:, -1] == 1).all()  # left padding
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, batch["input_ids"].shape[1], model.config.vocab_size)
    torch.manual_seed(0)
    out = model.generate(**batch, max_new_tokens=6, do_sample=True, pad_token_id=tok.pad_token_id)
    assert out.shape[0] == 2 and out.shape[1] <= batch["input_ids"].shape[1] + 6
    info = json.loads((built / BUILD_FILE).read_text())
    assert info["build"]["texts_digest"] == texts_digest(CORPUS)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())


def test_save_load_identical_logits(built, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(built)
    ids = torch.tensor([[1, 2, 3, 50, 60, 70]])
    model.save_pretrained(tmp_path / "copy")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "copy")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, again(ids).logits)


def test_build_is_deterministic_and_cached(built, tmp_path):
    same = build_model(tmp_path / "same", CORPUS, preset="tiny", template="chatml", seed=0)
    other_seed = build_model(tmp_path / "seed1", CORPUS, preset="tiny", template="chatml", seed=1)
    a, b, c = (AutoModelForCausalLM.from_pretrained(p).state_dict() for p in (built, same, other_seed))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert (built / "tokenizer.json").read_text() == (same / "tokenizer.json").read_text()

    # Same recipe, same directory: reused without writing anything.
    weights = same / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert build_model(tmp_path / "same", list(reversed(CORPUS)), preset="tiny", template="chatml") == same
    assert weights.stat().st_mtime_ns == stamp
    # Another recipe in the same directory replaces the old build.
    build_model(tmp_path / "same", CORPUS, preset="tiny", template="llama3")
    assert AutoTokenizer.from_pretrained(same).eos_token == "<|eot_id|>"


def test_build_never_overwrites_foreign_directory(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_model(tmp_path / "mine", CORPUS, preset="tiny")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
