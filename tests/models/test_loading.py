"""Loading models by path: the tokenizer with a pad token, the processor where the model has one; and the check
that a model path can load (a local directory, or a hub id cached or on the hub) before anything loads."""

from __future__ import annotations

import http.server
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
import torch
from huggingface_hub import hf_api
from transformers import AutoTokenizer, CLIPImageProcessor, LlavaProcessor
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from tests.new_memory import FloatOutputs
from turnrl.config import ConfigError, ModelConfig
from turnrl.models import loading
from turnrl.models.loading import load_processor, load_tokenizer, locate_model, model_line


def test_a_text_model_has_no_processor_beyond_its_tokenizer(tiny_model_dir):
    assert load_processor(tiny_model_dir) is None
    assert load_tokenizer(tiny_model_dir).pad_token is not None


def test_a_model_with_an_image_processor_gets_its_processor(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    LlavaProcessor(image_processor=CLIPImageProcessor(), tokenizer=tokenizer, patch_size=14,
                   image_token="<image>").save_pretrained(tmp_path)
    processor = load_processor(tmp_path)
    assert isinstance(processor, LlavaProcessor) and processor.image_processor is not None


def test_a_directory_without_model_files_has_no_processor(tmp_path):
    assert load_processor(tmp_path) is None



def test_a_processor_that_needs_a_missing_library_is_reported_and_left_out(tiny_model_dir, monkeypatch, caplog):
    import turnrl.models.loading as models

    def needs_torchvision(path):
        raise ImportError("Qwen2VLVideoProcessor requires the Torchvision library")

    monkeypatch.setattr(models.AutoProcessor, "from_pretrained", needs_torchvision)
    with caplog.at_level("WARNING"):
        assert load_processor(tiny_model_dir) is None
    assert "Torchvision" in caplog.text


def test_image_size_bounds_set_the_visual_tokens_of_an_image(tiny_vlm_dir):
    from turnrl.envs import make
    from turnrl.models.vision import ImageEncoder

    obs, _ = make("FrozenLake", mode="image").reset(seed=0)  # 100 x 100 pixels
    default = ImageEncoder(load_processor(tiny_vlm_dir)).encode([obs["image"]])[0]
    small = ImageEncoder(load_processor(tiny_vlm_dir, max_pixels=56 * 56)).encode([obs["image"]])[0]
    large_processor = load_processor(tiny_vlm_dir, min_pixels=224 * 224, max_pixels=224 * 224)
    large = ImageEncoder(large_processor).encode([obs["image"]])[0]
    assert (small.placeholder_tokens, default.placeholder_tokens, large.placeholder_tokens) == (4, 16, 64)
    assert small.model_inputs["pixel_values"].shape[0] == 4 * small.placeholder_tokens


# --------------------------------------------------------------------------- locate_model: one line, at once
class FakeHub(http.server.BaseHTTPRequestHandler):
    """The hub's model API for three repos: ``org/there``, ``org/gated`` (terms to accept) and ``org/slow``
    (answers after 5 s); any other repo is not found, with the hub's own error code. The server's ``asked`` lists
    the repos asked for, a request each."""

    def do_GET(self) -> None:
        repo = self.path.split("?")[0].removeprefix("/api/models/")
        self.server.asked.append(repo)
        if repo == "org/slow":
            time.sleep(5)
        if repo in ("org/there", "org/gated", "org/slow"):
            body = json.dumps({"id": repo, "gated": "manual" if repo == "org/gated" else False}).encode()
            self.send_response(200)
        else:
            body = json.dumps({"error": "Repository not found"}).encode()
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # org/slow: the client gave up waiting, as it should
            pass

    def log_message(self, *args) -> None:
        pass


def test_a_cast_copy_of_a_structure_on_meta_keeps_its_buffers_values(tiny_model_dir):
    """A sharded run's ranks past 0 load the structure on ``meta`` and copy the reference from it: parameters stay
    on ``meta`` (sharding fills them), the rotary frequencies keep their values."""
    model = loading.load_model(tiny_model_dir).eval()
    structure = model.to_empty(device="meta")
    buffers = {name: value.clone() for name, value in loading.load_model(tiny_model_dir).named_buffers()}
    for name, value in buffers.items():
        owner, _, attribute = name.rpartition(".")
        setattr(structure.get_submodule(owner), attribute, value.clone())
    copied = loading.cast_copy(structure, torch.bfloat16, torch.device("meta"))
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in copied.parameters())
    assert buffers and all(torch.equal(dict(copied.named_buffers())[name], value) for name, value in buffers.items())


@pytest.fixture
def hub(unreachable_hub, monkeypatch, tmp_path):
    """A hub on localhost (with the empty cache and no token of ``unreachable_hub``), and ``tmp_path`` as the
    current directory."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    server.asked = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(hf_api.api, "endpoint", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.chdir(tmp_path)
    yield server
    server.shutdown()


def cache_model(cache: Path, repo: str) -> None:
    """``repo`` in the Hugging Face cache layout, as a download leaves it (refs/main, a snapshot)."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0" * 40)
    (root / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (root / "snapshots" / ("0" * 40) / "config.json").write_text("{}")


def located_error(path: str, key: str = "model.path") -> str:
    with pytest.raises(ConfigError) as info:
        locate_model(path, key)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{key}={path!r} ")
    return message


def test_a_model_directory_and_a_cached_hub_id_are_found_without_asking_the_hub(unreachable_hub, tmp_path,
                                                                                  tiny_model_dir):
    cache_model(tmp_path / "hf_cache", "org/cached")
    assert locate_model(str(tiny_model_dir), "policy") == "local"
    assert locate_model("org/cached", "model.path") == "cache"


@pytest.mark.parametrize("path", ["/nonexistent", "./runs/old/sft/model", "~/no/such", "a/b/c", "bad name"])
def test_a_local_path_that_does_not_exist_is_one_line_without_asking_the_hub(path, unreachable_hub, monkeypatch,
                                                                            tmp_path):
    monkeypatch.chdir(tmp_path)
    assert "does not exist" in located_error(path)


def test_a_typo_in_a_checkpoint_path_names_the_path_meant(hub, tmp_path):
    (tmp_path / "runs" / "quickstart" / "checkpoints" / "step_000039" / "actor").mkdir(parents=True)
    message = located_error("runs/quikstart/checkpoints/step_000039/actor", "policy")
    assert "(did you mean runs/quickstart/checkpoints/step_000039/actor?)" in message
    # org/name under a folder that exists here is a path: said so, even though a hub id looks the same
    assert "does not exist (did you mean runs/quickstart?)" in located_error("runs/quikstart", "--model")


def test_a_file_is_no_near_miss_for_a_model_folder(hub, tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "sft_start.log").write_text("the run's log, beside where its folder would be")
    message = located_error(str(tmp_path / "runs" / "sft_start" / "sft" / "model"), "model.path")
    assert "does not exist" in message and "did you mean" not in message


def test_a_run_directory_a_file_and_a_folder_without_config_are_not_models(hub, tmp_path, tiny_model_dir):
    run = tmp_path / "runs" / "quickstart"
    for step in ("step_000001", "step_000003"):
        (run / "checkpoints" / step / "actor").mkdir(parents=True)
    (run / "sft" / "model").mkdir(parents=True)
    message = located_error("runs/quickstart", "policy")
    assert "is a run directory, not a model; its models: runs/quickstart/checkpoints/step_000003/actor and " \
           "runs/quickstart/sft/model" in message
    assert "is a file" in located_error(str(tiny_model_dir / "config.json"))
    assert "without config.json" in located_error("runs")


def test_a_hub_id_is_checked_on_the_hub(hub, tmp_path):
    assert locate_model("org/there", "model.path") == "hub"
    assert "neither a local directory nor a model on the Hugging Face hub" in located_error("org/missing")
    assert "gated model: accept its terms at https://huggingface.co/org/gated" in located_error("org/gated")


def test_an_unreachable_hub_fails_at_once_with_what_to_do(unreachable_hub):
    message = located_error("Qwen/Qwen2.5-0.5B-Instruct")
    assert "Connection refused" in message, "the refusal itself, not a timeout waited out"
    assert "neither a local directory nor in the local Hugging Face cache, and the hub cannot be reached" in message
    assert "hf download Qwen/Qwen2.5-0.5B-Instruct" in message


def test_a_hub_that_does_not_answer_is_given_up_after_the_probe_timeout(hub, monkeypatch):
    monkeypatch.setattr(loading, "HUB_PROBE_TIMEOUT_S", 0.5)
    # org/slow exists and answers after 5 s: only a probe that gave up at its timeout says the hub is unreachable.
    assert "the hub cannot be reached" in located_error("org/slow")
    assert hub.asked == ["org/slow"], "asked once, not again after the timeout"


def test_offline_mode_never_asks_the_hub(hub, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert "HF_HUB_OFFLINE is set" in located_error("org/there")


def test_the_model_line_says_which_model_and_warns_where_a_pretrained_one_is_expected():
    assert model_line(ModelConfig(path="org/name"), "cache") == "model: org/name (from the local Hugging Face cache)"
    builtin = model_line(ModelConfig(builtin_preset="small"), None)
    assert builtin.startswith("model: the built-in 'small' preset") and "expects" not in builtin
    warned = model_line(ModelConfig(builtin_preset="small", expects_pretrained=True), None)
    assert "this recipe expects a pretrained model (model.path=ORG/NAME" in warned
    assert "expects" not in model_line(ModelConfig(path="org/name", expects_pretrained=True), "hub")


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_vlm_dir"])
def test_a_model_on_meta_is_the_loaded_model_without_its_weights(fixture, request):
    """The structure a sharded trainer's other processes build: the same parameters (names, shapes, dtypes,
    the tied LM head), none with storage, and the same buffers (rotary frequencies) computed for real."""
    path = request.getfixturevalue(fixture)
    loaded = loading.load_model(path)
    structure = loading.load_model(path, device="meta")
    assert type(structure) is type(loaded)
    real = {name: (p.shape, p.dtype) for name, p in loaded.named_parameters(remove_duplicate=False)}
    empty = {name: (p.shape, p.dtype) for name, p in structure.named_parameters(remove_duplicate=False)}
    assert empty == real
    assert all(p.is_meta for p in structure.parameters())
    assert (structure.get_output_embeddings().weight is structure.get_input_embeddings().weight) == \
        (loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight)
    assert structure.generation_config.eos_token_id == loaded.generation_config.eos_token_id  # where turns end
    buffers = dict(loaded.named_buffers())
    assert dict(structure.named_buffers()).keys() == buffers.keys() and buffers
    for name, buffer in structure.named_buffers():
        assert not buffer.is_meta
        assert torch.equal(buffer, buffers[name]), name


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_vlm_dir"])
def test_parameters_cast_alone_compute_what_the_model_loaded_in_that_dtype_computes(fixture, request):
    """The reference a run makes from its actor and a sharded trainer's rollout copy: parameters in bf16,
    buffers (the text and vision rotary frequencies) float32 as ``from_pretrained`` keeps them. ``Module.to``
    rounds the frequencies too, and 3,000 positions in its logits are another model's."""
    path = request.getfixturevalue(fixture)
    loaded = loading.load_model(path, dtype=torch.bfloat16).eval()
    cast = loading.cast_parameters(loading.load_model(path).eval(), torch.bfloat16)
    assert {n: b.dtype for n, b in cast.named_buffers()} == {n: b.dtype for n, b in loaded.named_buffers()}
    assert any(buffer.dtype == torch.float32 for buffer in cast.buffers())
    assert all(p.dtype == torch.bfloat16 for p in cast.parameters())
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    positions = torch.arange(3000, 3006)[None]
    if fixture == "tiny_vlm_dir":  # M-RoPE: three rows of positions
        positions = positions.expand(3, 1, -1)
    with torch.no_grad():
        expected = loaded(input_ids=ids, position_ids=positions).logits
        torch.testing.assert_close(cast(input_ids=ids, position_ids=positions).logits, expected, rtol=0, atol=0)
        rounded = loading.load_model(path).eval().to(torch.bfloat16)
        assert not torch.equal(rounded(input_ids=ids, position_ids=positions).logits, expected)


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_vlm_dir"])
def test_a_cast_copy_is_the_cast_model_and_leaves_the_original_as_it_was(fixture, request):
    """The asynchronous rollout's copy of a float32 actor: each parameter cast as it is copied, buffers as they
    are, tied weights still one tensor; it computes what the model loaded in bf16 computes."""
    path = request.getfixturevalue(fixture)
    original = loading.load_model(path).eval()
    before = {name: p.detach().clone() for name, p in original.named_parameters()}
    with FloatOutputs() as made:
        copied = loading.cast_copy(original, torch.bfloat16, torch.device("cpu"))
    assert made.shapes == []  # cast as copied: never a float32 copy of the model on the way (14 GiB at 3B)
    loaded = loading.load_model(path, dtype=torch.bfloat16).eval()
    assert {n: b.dtype for n, b in copied.named_buffers()} == {n: b.dtype for n, b in loaded.named_buffers()}
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in copied.parameters())
    assert len(list(copied.parameters())) == len(list(original.parameters()))  # tied ones counted once in both
    if original.get_output_embeddings().weight is original.get_input_embeddings().weight:
        assert copied.get_output_embeddings().weight is copied.get_input_embeddings().weight
    assert all(p.dtype == torch.float32 and torch.equal(p, before[name]) for name, p in original.named_parameters())
    assert not any(a.data_ptr() == b.data_ptr() for a, b in zip(copied.parameters(), original.parameters()))
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    positions = torch.arange(3000, 3006)[None]
    if fixture == "tiny_vlm_dir":
        positions = positions.expand(3, 1, -1)
    with torch.no_grad():
        torch.testing.assert_close(copied(input_ids=ids, position_ids=positions).logits,
                                   loaded(input_ids=ids, position_ids=positions).logits, rtol=0, atol=0)


@pytest.fixture
def scalar_kernels():
    """Inductor's C++ kernels without SIMD for a test that compiles: g++, most of a compile on a CPU, takes about
    half as long on them, and no instruction set is probed (a g++ run for each, once a machine). The tests check
    which parts are compiled and that they compute the eager numbers, which scalar kernels do as well."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch({"cpp.vec_isa_ok": False}):
        yield


@pytest.fixture
def original_rotary(monkeypatch):
    """Compiling layer parts swaps a family's rotary embedding in its transformers module, for the process: the test
    starts from the family's own function, whatever an earlier test of its worker compiled, and its swaps are
    undone after it."""
    for name, module in list(sys.modules.items()):
        for function in (loading.ROTARY_FUNCTION, loading.VISION_ROTARY_FUNCTION):
            if name.startswith("transformers.models.") and function in vars(module):
                current = vars(module)[function]
                swapped = isinstance(current, (loading.CompiledRotary, loading.CompiledVisionRotary))
                monkeypatch.setattr(module, function, current.original if swapped else current)


@pytest.mark.parametrize(("fixture", "checkpointing"), [
    ("tiny_model_dir", False), ("tiny_model_dir", True),
    # slow: 11 s, kernels of its own for decoder layers like the text model's (the case above); the default
    # run checks the VLM's parts compiled and its tower left eager in
    # test_compiled_vision_blocks_give_the_eager_towers_features
    pytest.param("tiny_vlm_dir", False, marks=pytest.mark.slow),
])
@pytest.mark.usefixtures("scalar_kernels")
def test_compiled_layer_parts_give_the_eager_outputs_and_gradients(fixture, checkpointing, request, original_rotary):
    """Each decoder layer's norms and MLP compiled (the attention eager; a VLM's vision blocks too, see the next
    test): the same logits and gradients as the eager model over token counts that change from pass to pass
    (with activation checkpointing too, which runs the compiled parts again in the backward pass), and a copy of
    the model (the critic, the reference) runs its own weights through the compiled code."""
    import copy

    path = request.getfixturevalue(fixture)
    eager = loading.load_model(path)
    if checkpointing:
        loading.enable_checkpointing(eager)
        eager.train()
    compiled = copy.deepcopy(eager)
    layers = [m for m in eager.modules() if loading.ATTENTION_PART in dict(m.named_children())]
    parts = loading.compile_layer_parts(compiled, vision=False)
    assert parts == 3 * len(layers) > 0  # two norms and the MLP
    vision = loading.vision_tower(compiled)
    if vision is not None:
        assert all("forward" not in vars(m) for m in vision.modules())  # vision=False leaves the tower eager
    generator = torch.Generator().manual_seed(0)
    for tokens in (37, 52, 29):
        ids = torch.randint(0, 200, (1, tokens), generator=generator)
        for model in (eager, compiled):
            model.zero_grad()
            model(input_ids=ids).logits.square().mean().backward()
        torch.testing.assert_close(compiled(input_ids=ids).logits, eager(input_ids=ids).logits)
        for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
            if b.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5, msg=name)
    twin = copy.deepcopy(compiled)
    mlp = next(m.mlp for m in twin.modules() if loading.ATTENTION_PART in dict(m.named_children()))
    assert mlp.forward.__self__ is mlp  # bound to the copy's own part
    with torch.no_grad():
        for param in twin.parameters():
            param.mul_(0.5)
    ids = torch.randint(0, 200, (1, 20), generator=generator)  # with gradients: the kernels compiled above
    assert not torch.allclose(twin(input_ids=ids).logits, compiled(input_ids=ids).logits)


@pytest.mark.usefixtures("scalar_kernels")
def test_the_compiled_rotary_embedding_trains_as_the_eager_one_under_autocast(tiny_vlm_dir, original_rotary):
    """Under bf16 autocast over float32 weights (how the trainer runs), the rotary embedding compiled with its cast
    returns exactly what the eager function returns cast to bf16, and gradients within bf16's rounding (the eager
    backward rounds each of a query's two terms, the compiled one their sum); a model whose family's function is
    swapped (once) gives the eager logits and gradients; outside autocast the original runs, uncast."""
    import copy

    eager = loading.load_model(tiny_vlm_dir)
    compiled = copy.deepcopy(eager)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 200, (2, 23), generator=generator)

    def logits_and_grads(model):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(input_ids=ids).logits.float()
        logits.square().mean().backward()
        return logits.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    expected, expected_grads = logits_and_grads(eager)  # before the swap
    attention = next(getattr(m, loading.ATTENTION_PART) for m in compiled.modules()
                     if loading.ATTENTION_PART in dict(m.named_children()))
    assert loading.compile_rotary(attention)
    assert isinstance(vars(sys.modules[type(attention).__module__])[loading.ROTARY_FUNCTION], loading.CompiledRotary)
    assert not loading.compile_rotary(attention)  # once a family
    got, grads = logits_and_grads(compiled)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], atol=2e-3, rtol=5e-2, msg=name)

    rotary = loading.CompiledRotary(apply_rotary_pos_emb)  # the text families' function, on plain tensors
    q, k = torch.randn(1, 4, 37, 16, generator=generator).bfloat16(), torch.randn(1, 2, 37, 16, generator=generator)
    k = k.bfloat16()
    cos, sin = torch.randn(1, 37, 16, generator=generator), torch.randn(1, 37, 16, generator=generator)
    upstream = [torch.randn(q.shape, generator=generator).bfloat16(), torch.randn(k.shape, generator=generator)]
    upstream[1] = upstream[1].bfloat16()

    def rotated(function):
        leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs = function(*leaves)
        torch.autograd.backward(list(outputs), upstream)
        return outputs, [leaf.grad for leaf in leaves]

    outputs, grads = rotated(lambda q, k: rotary(q, k, cos, sin))
    plain, plain_grads = rotated(lambda q, k: [x.bfloat16() for x in apply_rotary_pos_emb(q, k, cos, sin)])
    assert all(out.dtype == torch.bfloat16 and torch.equal(out, ref) for out, ref in zip(outputs, plain))
    for grad, ref in zip(grads, plain_grads):
        torch.testing.assert_close(grad, ref, atol=0.0625, rtol=2**-6)
    float32 = rotary(q.float(), k.float(), cos, sin)  # no autocast
    assert all(out.dtype == torch.float32 and torch.equal(out, ref)
               for out, ref in zip(float32, apply_rotary_pos_emb(q.float(), k.float(), cos, sin)))


@pytest.mark.usefixtures("scalar_kernels")
def test_compiled_vision_blocks_give_the_eager_towers_features(tiny_vlm_dir, original_rotary):
    """A VLM's vision blocks compiled around their attention (two norms and the MLP each, and the tower's rotary
    embedding) encode images as the eager tower does, over image sizes that change from call to call, and a
    trained tower's gradients are the eager tower's; ``vision=False`` compiles the decoder's parts alone."""
    import copy

    eager = loading.load_model(tiny_vlm_dir)
    compiled = copy.deepcopy(eager)
    layers = [m for m in eager.modules() if loading.ATTENTION_PART in dict(m.named_children())]
    blocks = [m for m in loading.vision_tower(eager).modules()
              if loading.VISION_ATTENTION_PART in dict(m.named_children())]
    assert blocks
    assert loading.compile_layer_parts(compiled) == 3 * (len(layers) + len(blocks))
    text_only = copy.deepcopy(eager)
    assert loading.compile_layer_parts(text_only, vision=False) == 3 * len(layers) > 0
    assert all("forward" not in vars(m) for m in loading.vision_tower(text_only).modules())  # the tower eager
    tower_attention = getattr(blocks[0], loading.VISION_ATTENTION_PART)
    tower_module = sys.modules[type(tower_attention).__module__]
    assert isinstance(vars(tower_module)[loading.VISION_ROTARY_FUNCTION], loading.CompiledVisionRotary)
    assert not loading.compile_rotary(tower_attention, vision=True)  # once a family
    # A Qwen-VL's module holds the decoder's function too: each is swapped by its own kind.
    decoder_module = sys.modules[type(getattr(layers[0], loading.ATTENTION_PART)).__module__]
    assert isinstance(vars(decoder_module)[loading.ROTARY_FUNCTION], loading.CompiledRotary)
    config = eager.config.vision_config
    generator = torch.Generator().manual_seed(0)
    # Patches a side, even (2x2 patches merge into a token). Sides of 2 and 4 would compile the rotary embedding
    # twice more: a dimension of 1 (one token) and one equal to another (4 x 4) are specialized.
    for side in (6, 10, 8):
        grid = torch.tensor([[1, side, side]])
        pixels = torch.randn(side * side, 3 * config.temporal_patch_size * config.patch_size**2, generator=generator)
        features = []
        for model in (eager, compiled):
            model.zero_grad()
            output = loading.vision_tower(model)(pixels, grid_thw=grid)
            # transformers 5 returns a model output
            features.append(output if isinstance(output, torch.Tensor) else output.pooler_output)
            features[-1].square().mean().backward()
        torch.testing.assert_close(features[1], features[0])
        for (name, a), b in zip(loading.vision_tower(compiled).named_parameters(),
                                loading.vision_tower(eager).parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.usefixtures("scalar_kernels")
def test_the_compiled_vision_rotary_embedding_rounds_as_the_eager_one(tiny_vlm_dir, original_rotary):
    """The tower's rotary embedding compiled: bf16 queries and keys with float32 cos and sin (a tower under bf16
    autocast, or in bf16) come back in bf16, the eager function's values to one rounding step (both compute in
    float32 and round once), and gradients within bf16's rounding; float32 ones as the eager function's."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision

    rotary = loading.CompiledVisionRotary(apply_rotary_pos_emb_vision)
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(53, 4, 16, generator=generator) for _ in range(2))  # (patches, heads, head dim)
    cos, sin = (torch.randn(53, 16, generator=generator) for _ in range(2))
    upstream = [torch.randn(q.shape, generator=generator).bfloat16() for _ in range(2)]

    def rotated(function, dtype):
        leaves = [q.to(dtype).requires_grad_(), k.to(dtype).requires_grad_()]
        outputs = function(*leaves, cos, sin)
        torch.autograd.backward(list(outputs), [g.to(dtype) for g in upstream])
        return outputs, [leaf.grad for leaf in leaves]

    for dtype, tolerance in ((torch.bfloat16, 2**-7), (torch.float32, 1e-6)):
        (outputs, grads), (plain, plain_grads) = (rotated(f, dtype) for f in (rotary, apply_rotary_pos_emb_vision))
        for out, ref in zip(outputs, plain):
            assert out.dtype == dtype
            torch.testing.assert_close(out, ref, rtol=tolerance, atol=tolerance)
        for grad, ref in zip(grads, plain_grads):
            torch.testing.assert_close(grad, ref, rtol=tolerance, atol=4 * tolerance)


# --------------------------------------------------------------------------- compile workers and SIGTERM
COMPILE_WORKERS = """
import os
import signal
import psutil
from torch._inductor import async_compile, config
from turnrl.models.loading import start_compile_workers_ignoring_sigterm

config.compile_threads = 2  # a pool on any machine


def mine(signum, frame):
    pass


signal.signal(signal.SIGTERM, mine)
start_compile_workers_ignoring_sigterm()
assert signal.getsignal(signal.SIGTERM) is mine, "the process's own handler is back"
# The pool's first process, which starts the workers (they keep what it ignores, as it keeps this process's).
workers = psutil.Process().children(recursive=True)
assert workers, "no compile worker started"
for worker in workers:
    status = dict(line.split(":", 1) for line in open(f"/proc/{worker.pid}/status").read().splitlines())
    assert int(status["SigIgn"], 16) >> (signal.SIGTERM - 1) & 1, (worker.cmdline(), status["SigIgn"])
print(len(workers), "workers ignore SIGTERM", flush=True)
for worker in workers:  # the pool's shutdown at exit would wait for them to have started (seconds)
    worker.kill()
os._exit(0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_compile_workers_started_so_ignore_sigterm_and_the_process_keeps_its_own_handler():
    """A job-wide SIGTERM must not kill the workers of a run that finishes its step after it: they are started with
    SIGTERM ignored, which every process they start keeps, and the run's own handler is put back at once."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", COMPILE_WORKERS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "workers ignore SIGTERM" in done.stdout, done.stderr[-3000:]


def saved_adapters(model_dir: Path, out: Path, targets: list[str]) -> Any:
    """The model at ``model_dir`` with LoRA adapters of random weights (not the zeros peft starts from, which
    would change nothing), saved at ``out``; returns the adapted model."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    adapted = get_peft_model(loading.load_model(model_dir),
                             LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    adapted.save_pretrained(out)
    return adapted.eval()


def test_lora_adapters_load_as_their_model_with_the_adapters_merged(tiny_model_dir, tmp_path):
    """A LoRA run's checkpoint (adapters only) plays, serves and trains from as its model: ``load_model`` gives the
    model under them with the adapters merged (the adapted model's logits), its tokenizer is the model's, and
    ``locate_model`` takes it at once."""
    adapted = saved_adapters(tiny_model_dir, tmp_path / "adapters", ["q_proj", "v_proj"])
    assert loading.adapter_base(tmp_path / "adapters") == str(tiny_model_dir)
    assert loading.adapter_base(tiny_model_dir) is None
    merged = loading.load_model(tmp_path / "adapters")
    assert type(merged) is type(adapted.get_base_model()), "a plain model, not a PeftModel"
    ids = torch.tensor([[1, 5, 9, 14, 3]])
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted(ids).logits, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(merged(ids).logits, loading.load_model(tiny_model_dir)(ids).logits, atol=1e-3)
    assert load_tokenizer(tmp_path / "adapters").get_vocab() == load_tokenizer(tiny_model_dir).get_vocab()
    assert locate_model(str(tmp_path / "adapters"), "policy") == "local"
    structure = loading.load_model(tmp_path / "adapters", device="meta")
    assert {name: p.shape for name, p in structure.named_parameters()} == \
        {name: p.shape for name, p in merged.named_parameters()}


def test_lora_adapters_of_a_vlm_load_with_the_models_processor(tiny_vlm_dir, tmp_path):
    """A VLM's adapters (saved without a processor, as a LoRA run's checkpoint is) load as the VLM, with its
    processor, its vision tower readied as every loaded tower is."""
    saved_adapters(tiny_vlm_dir, tmp_path / "adapters", ["q_proj", "v_proj"])
    assert loading.is_vision_language(tmp_path / "adapters")
    processor = load_processor(tmp_path / "adapters")
    assert processor is not None and type(processor) is type(load_processor(tiny_vlm_dir))
    merged = loading.load_model(tmp_path / "adapters")
    assert loading.vision_tower(merged) is not None and type(merged).__name__.endswith("ForConditionalGeneration")


def test_adapters_whose_model_is_gone_are_refused_in_one_line_naming_where_it_is_set(tiny_model_dir, tmp_path):
    saved_adapters(tiny_model_dir, tmp_path / "adapters", ["q_proj"])
    settings = tmp_path / "adapters" / "adapter_config.json"
    values = json.loads(settings.read_text())
    settings.write_text(json.dumps({**values, "base_model_name_or_path": str(tmp_path / "moved" / "model")}))
    with pytest.raises(ConfigError, match="holds LoRA adapters; the model they were trained on, named in .*"
                                          "adapter_config.json: base_model_name_or_path=.* does not exist"):
        locate_model(str(tmp_path / "adapters"), "policy")
    settings.write_text(json.dumps({**values, "base_model_name_or_path": None}))
    with pytest.raises(ConfigError, match="do not name the model they were trained on"):
        locate_model(str(tmp_path / "adapters"), "policy")
    for damaged in ('{"base_model_name_or_path": "/mo', "[" * 100_000, "[1, 2]"):  # JSON's own traceback before
        settings.write_text(damaged)
        with pytest.raises(ConfigError, match="adapter_config.json is damaged|do not name the model"):
            locate_model(str(tmp_path / "adapters"), "policy")


# --------------------------------------------------------------------------- load_model: every weight, or a clear no
def copy_with_weights(model_dir: Path, out: Path, keep) -> Path:
    """``model_dir``'s files in ``out``, its weights file holding only the weights whose name ``keep`` takes."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = load_file(model_dir / "model.safetensors")
    save_file({name: value for name, value in weights.items() if keep(name)}, out / "model.safetensors",
              metadata={"format": "pt"})
    return out


@pytest.mark.parametrize(("fixture", "dropped"), [
    ("tiny_model_dir", "model.norm."),
    ("tiny_model_dir", "model.layers.1."),  # a checkpoint cut short
    ("tiny_vlm_dir", "visual.merger."),
])
def test_a_checkpoint_that_lacks_weights_is_refused_not_filled_with_random_ones(fixture, dropped, request, tmp_path):
    """transformers fills the weights no file holds with random values and goes on (a table in its log): a policy
    with a random head samples noise, and a run would train it without a word."""
    model_dir = request.getfixturevalue(fixture)
    cut = copy_with_weights(model_dir, tmp_path / "cut", lambda name: not name.startswith(dropped))
    with pytest.raises(ConfigError, match=rf"the checkpoint at {cut} lacks \d+ weights of the \w+ its config.json "
                                          rf"makes \((model\.)?{dropped}.*random values.*give a complete checkpoint"):
        loading.load_model(cut)
    complete = copy_with_weights(model_dir, tmp_path / "complete", lambda name: True)
    assert loading.load_model(complete) is not None


def test_weights_of_another_architecture_are_refused(tiny_model_dir, tmp_path):
    """A config.json whose model_type is not that of its weights (here BERT's, which AutoModelForCausalLM maps)
    built a model of none of the checkpoint's weights."""
    other = copy_with_weights(tiny_model_dir, tmp_path / "other", lambda name: True)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ConfigError, match="lacks .* weights of the BertLMHeadModel .*architectures: BertModel"):
        loading.load_model(other)


def test_a_tokenizer_without_pad_and_eos_tokens_is_refused_with_where_to_set_one(tiny_model_dir, tmp_path):
    """Batches are padded with the pad token (the eos token where there is none): with neither, a run stopped at
    its first update, after its first rollout, with a TypeError from torch.full."""
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "model")
    settings = tmp_path / "model" / "tokenizer_config.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "eos_token": None, "pad_token": None}))
    with pytest.raises(ConfigError, match=r"neither a pad token nor an eos token; set eos_token in .*"
                                          r"tokenizer_config.json"):
        load_tokenizer(tmp_path / "model")
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "eos_token": "<|im_end|>"}))
    assert load_tokenizer(tmp_path / "model").pad_token == "<|im_end|>"


@pytest.mark.parametrize(("config", "kind"), [
    ({"model_type": "t5", "architectures": ["T5ForConditionalGeneration"]}, "a causal LM"),
    ({"model_type": "clip", "architectures": ["CLIPModel"], "vision_config": {}, "text_config": {}},
     "an image-text-to-text model"),
])
def test_an_architecture_turnrl_cannot_train_is_refused_in_a_line(config, kind, tiny_model_dir, tmp_path):
    """transformers' own error listed the hundred configurations its auto class builds."""
    other = copy_with_weights(tiny_model_dir, tmp_path / "other", lambda name: True)
    (other / "config.json").write_text(json.dumps(config))
    for device in ("cpu", "meta"):
        with pytest.raises(ConfigError) as refused:
            loading.load_model(other, device=device)
        message = str(refused.value)
        assert message.startswith(f"the model at {other} is of type {config['model_type']!r} (architectures: "
                                  f"{config['architectures'][0]}), which transformers does not build as {kind}")
        assert message.endswith("give a checkpoint of one") and "\n" not in message


# --------------------------------------------------------------------------- partial checkpointing
@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_vlm_dir"])
def test_checkpointed_layers_recompute_the_first_layers_only_with_the_same_gradients(fixture, request):
    """``model.checkpointed_layers=1`` of the tiny models' 2 decoder layers: the first recomputes, the second keeps
    its activations (a VLM's vision blocks stay checkpointed), and the loss and every gradient equal those of the
    model checkpointed whole and of the model not checkpointed at all."""
    import copy

    path = request.getfixturevalue(fixture)
    plain = loading.load_model(path).train()
    whole, partial = copy.deepcopy(plain), copy.deepcopy(plain)
    loading.enable_checkpointing(whole)
    loading.enable_checkpointing(partial, 1)
    layers = loading.decoder_layers(partial)
    assert len(layers) == 2 and [layer.gradient_checkpointing for layer in layers] == [True, False]
    assert all(layer.gradient_checkpointing for layer in loading.decoder_layers(whole))
    tower = loading.vision_tower(partial)
    if tower is not None:
        blocks = [m for m in tower.modules() if isinstance(m, GradientCheckpointingLayer)]
        assert blocks and all(block.gradient_checkpointing for block in blocks)
    ids = torch.randint(0, 200, (2, 31), generator=torch.Generator().manual_seed(0))
    losses, runs = [], []
    for model in (plain, whole, partial):
        # A layer's MLP starts once in the forward pass, and again in the backward where its layer is recomputed
        # (a pre-hook: the recomputation stops once it has what the backward needs, before the MLP returns).
        calls = [0] * len(layers)
        hooks = [layer.mlp.register_forward_pre_hook(lambda *_, index=index: calls.__setitem__(index, calls[index] + 1))
                 for index, layer in enumerate(loading.decoder_layers(model))]
        loss = model(input_ids=ids).logits.float().square().mean()
        loss.backward()
        losses.append(loss.detach())
        runs.append(calls)
        for hook in hooks:
            hook.remove()
    assert runs == [[1, 1], [2, 2], [2, 1]]
    assert losses[0] == losses[1] == losses[2]
    for (name, a), b, c in zip(plain.named_parameters(), whole.parameters(), partial.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(c.grad, a.grad, rtol=0, atol=0, msg=name)


def test_checkpointed_layers_past_the_decoders_are_refused_with_the_count(tiny_model_dir):
    model = loading.load_model(tiny_model_dir)
    with pytest.raises(ConfigError, match=r"model.checkpointed_layers=3 exceeds the model's 2 decoder layers"):
        loading.enable_checkpointing(model, 3)
    loading.enable_checkpointing(model, 0)  # none recomputed: every layer keeps its activations
    assert not any(layer.gradient_checkpointing for layer in loading.decoder_layers(model))
    loading.enable_checkpointing(model)  # and every layer recomputed again
    assert all(layer.gradient_checkpointing for layer in loading.decoder_layers(model))
