"""Loading a model, its tokenizer and its processor by path, text model or VLM alike, and readying it
to train (the path a run starts from, activation checkpointing, compiled layer parts, a frozen vision tower);
and the quick check that a model path can load at all (:func:`locate_model`), which every command runs
before it writes or loads.

Everything is ``transformers``' own loading: a built-in model and a downloaded
checkpoint take the same path. A VLM is any checkpoint whose config has a
``vision_config``; it loads with ``AutoModelForImageTextToText`` (which maps
Qwen2-VL, Qwen2.5-VL and Qwen3-VL), a text model with ``AutoModelForCausalLM``.
"""

from __future__ import annotations

import copy
import difflib
import logging
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import MethodType
from typing import Any, Literal

import huggingface_hub
import torch
import torch._inductor.config as inductor_config
from accelerate import init_empty_weights
from huggingface_hub.errors import HFValidationError, HTTPError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

from turnrl.config import ConfigError, ModelConfig
from turnrl.files import parse_json
from turnrl.models.vision_attention import use_chunked_attention
from turnrl.models.vision_mlp import align_vision_mlps

logger = logging.getLogger(__name__)


HUB_PROBE_TIMEOUT_S = 3.0
"""How long :func:`locate_model` waits for the Hugging Face hub to say whether it has a model."""

ADAPTER_CONFIG = "adapter_config.json"
"""What peft's ``save_pretrained`` writes beside LoRA adapters: their settings and the model under them."""

MODEL_FILES = ("config.json", ADAPTER_CONFIG)
"""A directory holding one of these is a model transformers loads (a full model, or LoRA adapters)."""

ModelSource = Literal["local", "cache", "hub"]


def locate_model(path: str, key: str) -> ModelSource:
    """Where the model ``path`` names loads from, checked in well under a second without a network.

    ``local``: a model directory here; ``cache``: a hub id (``org/name``) in the local Hugging Face cache;
    ``hub``: a hub id the hub has (downloaded when it loads). A path that looks local (``/``, ``.``, ``~``,
    deeper than ``org/name``, or under a folder that exists here) must exist. A hub id that is not cached
    is asked of the hub with a timeout of :data:`HUB_PROBE_TIMEOUT_S` (not at all under ``HF_HUB_OFFLINE``).

    Args:
        key: how the command line names the path (``model.path``, ``--policy``), for the message.

    Raises:
        ConfigError: one line: which of the two ``path`` is, what is wrong, and what to do.
    """
    local = Path(path).expanduser()
    if local.exists():
        return _check_model_directory(local, path, key)
    if _looks_local(path):
        raise ConfigError(f"{key}={path!r} does not exist{_near_miss(local)}; give a model directory "
                          "(with config.json) or a Hugging Face hub id (org/name)")
    for name in MODEL_FILES:
        if isinstance(huggingface_hub.try_to_load_from_cache(path, name), str):
            return "cache"
    if len(local.parts) > 1 and local.parent.is_dir():  # runs/nothere: a folder here, not an organization
        raise ConfigError(f"{key}={path!r} does not exist{_near_miss(local)}, and no model of that hub id is in "
                          "the local Hugging Face cache; give a model directory (with config.json)")
    return _ask_hub(path, key)


def model_line(config: ModelConfig, source: ModelSource | None) -> str:
    """One line saying which model a run starts from: ``config.path`` and where it loads from (``source``, as
    :func:`locate_model` found it), or the built-in preset; and, for a recipe that expects a pretrained model
    (``config.expects_pretrained``) but has none, that the built-in one starts from random weights."""
    if config.path is not None:
        where = {"local": "a local directory", "cache": "the local Hugging Face cache",
                 "hub": "the Hugging Face hub, downloaded on first use", None: "its path"}[source]
        return f"model: {config.path} (from {where})"
    line = f"model: the built-in {config.builtin_preset!r} preset, built from a config with random weights"
    if config.expects_pretrained:
        line += ("; this recipe expects a pretrained model (model.path=ORG/NAME or a model directory; its first "
                 "line names one): without one it is a smoke run, and success stays near 0")
    return line


def _looks_local(path: str) -> bool:
    """Whether ``path`` can only be a path on this machine: not of a hub id's form ``name`` or ``org/name``."""
    if path.startswith((".", "/", "~")) or "\\" in path or path.count("/") > 1:
        return True
    try:
        validate_repo_id(path)
    except HFValidationError:
        return True
    return False


def _check_model_directory(local: Path, path: str, key: str) -> ModelSource:
    base = adapter_base(local) if local.is_dir() else None
    if base is not None:
        try:
            locate_model(base, "base_model_name_or_path")
        except ConfigError as error:
            raise ConfigError(f"{key}={path!r} holds LoRA adapters; the model they were trained on, named in "
                              f"{local / ADAPTER_CONFIG}: {error}") from error
        return "local"
    if local.is_dir() and (local / "config.json").is_file():
        return "local"
    if not local.is_dir():
        raise ConfigError(f"{key}={path!r} is a file; give the model directory that holds config.json")
    if (local / "checkpoints").is_dir() or (local / "sft").is_dir():
        models = [*sorted(Path(path).glob("checkpoints/step_*/actor"))[-1:], *Path(path).glob("sft/model")]
        found = f"its models: {' and '.join(map(str, models))}" if models else "it holds no model yet"
        raise ConfigError(f"{key}={path!r} is a run directory, not a model; {found}")
    raise ConfigError(f"{key}={path!r} is a directory without config.json, not a model; give a directory that "
                      "transformers' save_pretrained wrote")


def _near_miss(local: Path) -> str:
    """``" (did you mean runs/quickstart/...?)"``: the path with its first missing part replaced by the closest
    folder name in the deepest folder that exists (a model is a folder: a run's log file beside the run's folder
    is no near miss); empty when there is no close name."""
    parts = local.parts
    for depth in range(len(parts) - 1, -1, -1):
        folder = Path(*parts[:depth]) if depth else Path(".")
        if folder.is_dir():
            names = [child.name for child in folder.iterdir() if child.is_dir()]
            close = difflib.get_close_matches(parts[depth], names, n=1)
            return f" (did you mean {Path(folder, close[0], *parts[depth + 1:])}?)" if close else ""
    return ""


def _ask_hub(path: str, key: str) -> ModelSource:
    """``hub`` when the hub has the model ``path``; else a one-line error (not there, gated, or no answer)."""
    advice = "give a local model directory, or download it where there is internet (`hf download " \
             f"{path}`) and copy the Hugging Face cache (~/.cache/huggingface) here"
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{key}={path!r} is neither a local directory nor in the local Hugging Face cache, and "
                          f"HF_HUB_OFFLINE is set; {advice}")
    try:
        info = huggingface_hub.model_info(path, timeout=HUB_PROBE_TIMEOUT_S)
    except RepositoryNotFoundError as error:
        raise ConfigError(f"{key}={path!r} is neither a local directory nor a model on the Hugging Face hub; check "
                          "the name (org/name), or log in (`hf auth login`) for a private model") from error
    except (HTTPError, OSError) as error:  # no network, no DNS, a proxy, a timeout
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"{key}={path!r} is neither a local directory nor in the local Hugging Face cache, and "
                          f"the hub cannot be reached ({reason}); {advice}") from error
    if info.gated and huggingface_hub.get_token() is None:
        raise ConfigError(f"{key}={path!r} is a gated model: accept its terms at https://huggingface.co/{path} "
                          "and log in with `hf auth login`")
    return "hub"


def adapter_base(path: Path | str) -> str | None:
    """The model that the LoRA adapters at ``path`` were trained on (``base_model_name_or_path`` in their
    ``adapter_config.json``: a directory or a hub id), or None where ``path`` holds no adapters.

    Raises:
        ConfigError: the adapters' settings do not read as a JSON object, or name no model.
    """
    settings = Path(path) / ADAPTER_CONFIG
    if not settings.is_file():
        return None
    try:
        values = parse_json(settings.read_bytes())
    except ValueError as error:  # not JSON, not UTF-8, nested too deep
        raise ConfigError(f"the LoRA adapters at {path}: {settings} is damaged ({' '.join(str(error).split())[:120]}); "
                          "save the adapters again, or write it as JSON naming the model they were trained on "
                          "(base_model_name_or_path)") from None
    base = values.get("base_model_name_or_path") if isinstance(values, dict) else None
    if not isinstance(base, str) or not base:
        raise ConfigError(f"the LoRA adapters at {path} do not name the model they were trained on "
                          f"(base_model_name_or_path in {settings}); set it to that model's directory or hub id")
    return base


def _model_files(path: Path | str) -> Path | str:
    """Where the config, tokenizer and processor of the model at ``path`` are: LoRA adapters' model's (a run's
    checkpoint saves its tokenizer beside them, but a processor nowhere), else ``path``'s own."""
    return adapter_base(path) or path


def is_vision_language(path: Path | str) -> bool:
    """Whether the checkpoint at ``path`` is a VLM (its config has a vision part)."""
    return getattr(AutoConfig.from_pretrained(_model_files(path)), "vision_config", None) is not None


def context_window(model: Any) -> int | None:
    """Tokens a sequence of ``model`` (a transformers model) may hold: its text config's
    ``max_position_embeddings`` (a VLM's is in its text part), None where the config does not say."""
    value = getattr(model.config.get_text_config(), "max_position_embeddings", None)  # not every config has one
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def auto_class(path: Path | str) -> Any:
    """The transformers auto class that builds the model at ``path``: ``AutoModelForImageTextToText`` for a VLM,
    ``AutoModelForCausalLM`` for a text model.

    Raises:
        ConfigError: the class does not build the model's architecture (an encoder-decoder, a CLIP, ...), said in
            a line rather than transformers' list of the hundred configurations it builds.
    """
    config = AutoConfig.from_pretrained(path)
    vision = is_vision_language(path)
    auto, mapping = ((AutoModelForImageTextToText, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING) if vision
                     else (AutoModelForCausalLM, MODEL_FOR_CAUSAL_LM_MAPPING))
    if type(config) not in mapping:
        kind = "an image-text-to-text model (a VLM: its config has a vision_config)" if vision else "a causal LM"
        architectures = ", ".join(config.architectures or []) or "none named"
        raise ConfigError(f"the model at {path} is of type {config.model_type!r} (architectures: {architectures}), "
                          f"which transformers does not build as {kind}; turnrl trains decoder-only language models "
                          "(Qwen2, Qwen3, Llama, ...) and VLMs (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): give a checkpoint "
                          "of one")
    return auto


def load_model(path: Path | str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               attention: str | None = None) -> Any:
    """The causal LM or VLM at ``path`` on ``device``, with weights in ``dtype``.

    On the ``meta`` device it is the model's structure only, read from its config in well under a second:
    parameters without storage, buffers (rotary frequencies) computed for real. A sharded trainer's processes
    other than rank 0 build this and receive their shards of rank 0's weights.

    LoRA adapters (a directory of peft's, a LoRA run's checkpoint) load as the model they were trained on with
    the adapters merged into its weights: a model to play, serve or train from, no longer a ``PeftModel``.

    Args:
        attention: transformers' ``attn_implementation`` (``sdpa``, ``flex_attention``, ...); None: its default.
    """
    base = adapter_base(path)
    if base is not None:
        from peft import PeftModel

        if torch.device(device).type == "meta":  # merged adapters leave the model's structure as it was
            return load_model(base, dtype, device, attention)
        merged = PeftModel.from_pretrained(load_model(base, dtype, "cpu", attention), path).merge_and_unload()
        return merged.to(device)
    auto = auto_class(path)
    if torch.device(device).type == "meta":
        return model_structure(auto, path, dtype, attention)
    options = {"attn_implementation": attention} if attention is not None else {}
    loaded: Any = auto.from_pretrained(path, dtype=dtype, output_loading_info=True, **options)
    model, loading = loaded
    check_all_weights_loaded(path, model, loading["missing_keys"])
    prepare_vision_tower(model)
    return model.to(device)


def check_all_weights_loaded(path: Path | str, model: Any, missing: set[str] | list[str]) -> None:
    """Refuse a model that its checkpoint leaves weights of (``missing``: the keys ``from_pretrained`` found in no
    weights file). transformers fills them with random values and goes on, with a table in its log: a policy with
    a random head or layer samples noise, and a run would train it without a word (a checkpoint cut short, a
    backbone saved without its head, a config of another architecture than its weights).

    Raises:
        ConfigError: some weights are missing; which, and what to do.
    """
    if not missing:
        return
    shown = ", ".join(sorted(missing)[:3]) + (", ..." if len(missing) > 3 else "")
    architectures = ", ".join(model.config.architectures or []) or "none"
    raise ConfigError(f"the checkpoint at {path} lacks {len(missing)} weights of the {type(model).__name__} its "
                      f"config.json makes ({shown}), which would start from random values: its weights files are "
                      f"incomplete or of another model (its config names architectures: {architectures}); give a "
                      "complete checkpoint of a causal LM or a VLM (what save_pretrained writes)")


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``model.to(dtype)`` for its parameters alone, in place; its buffers keep their dtype, as
    ``from_pretrained(dtype=...)`` leaves them: the rotary frequencies stay float32.

    Cast to bf16 (8 bits of mantissa) a frequency is off by up to 0.4%, so the angle ``position x frequency`` is
    off by radians a few thousand positions in: the model would not compute what the same weights loaded by
    ``from_pretrained`` compute (its rollout copy or reference would disagree with the actor)."""
    buffers = dict(model.named_buffers())
    model.to(dtype)
    for name, value in buffers.items():
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, value)
    return model


def cast_copy(model: torch.nn.Module, dtype: torch.dtype | None, device: torch.device) -> torch.nn.Module:
    """A frozen copy of ``model`` on ``device`` with its parameters in ``dtype`` (None: their own) and its buffers
    as they are (the rotary frequencies stay float32, as :func:`cast_parameters` keeps them); parameters tied in
    ``model`` stay tied. Each parameter is cast as it is copied, so the copy costs its own memory and no more: a
    deep copy followed by a cast holds a full-precision copy on the way (15 GB at 3B beside a training run's
    peak). On the ``meta`` device (the structure a sharded run's ranks past 0 load) the buffers keep their values
    where they are, as the sharding that fills the parameters expects."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = torch.nn.Parameter(param.detach().to(device=device, dtype=dtype or param.dtype, copy=True),
                                             requires_grad=False)
    copied = copy.deepcopy(model, memo)
    return copied if device.type == "meta" else copied.to(device)


def model_structure(auto: Any, path: Path | str, dtype: torch.dtype = torch.float32,
                    attention: str | None = None) -> Any:
    """The model that ``auto`` (a transformers auto class) builds for the checkpoint at ``path``, from its config
    alone: parameters on the ``meta`` device, buffers (rotary frequencies) computed for real, tied weights
    tied, and the checkpoint's generation config (its end-of-turn ids)."""
    options = {"attn_implementation": attention} if attention is not None else {}
    with init_empty_weights(include_buffers=False):
        structure: Any = auto.from_config(AutoConfig.from_pretrained(path), dtype=dtype, **options)
    structure.tie_weights()  # the context makes a new parameter of each one assigned, the tied head too
    prepare_vision_tower(structure)
    try:  # as from_pretrained reads it (from_config knows only config.json's ids)
        structure.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # the model has no generation_config.json
        pass
    return structure


def load_tokenizer(path: Path | str) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with a pad token (its eos token when it has none).

    Raises:
        ConfigError: it has neither: every batch is padded with the pad token, and without one a run would stop at
            its first update, its first rollout made for nothing.
    """
    tokenizer = AutoTokenizer.from_pretrained(_model_files(path))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"the tokenizer of {path} has neither a pad token nor an eos token; set eos_token in "
                              f"{Path(_model_files(path)) / 'tokenizer_config.json'} to the token that ends its "
                              "chat template's turns (Qwen's: <|im_end|>), or pad_token to an unused special token")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_processor(path: Path | str, min_pixels: int | None = None, max_pixels: int | None = None) -> Any | None:
    """The model's processor where it has one beyond its tokenizer (a VLM's image processor), else None.

    ``min_pixels`` / ``max_pixels`` bound the size images are resized to (Qwen-VL processors: the
    number of pixels, a multiple of 28 x 28 per side pair); None keeps the checkpoint's. A processor
    that cannot load for want of a library is reported and left out: a text env still trains; an
    image env then stops with a clear error where the images would be processed.
    """
    sizes = {key: value for key, value in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if value}
    try:
        processor = AutoProcessor.from_pretrained(_model_files(path), **sizes)
    except (OSError, ValueError, TypeError, KeyError):  # no processor files, or a tokenizer-only model
        return None
    except ImportError as error:
        logger.warning("the processor of %s cannot load, images cannot be processed: %s", path, error)
        return None
    if isinstance(processor, PreTrainedTokenizerBase):
        return None
    if processor.tokenizer.pad_token is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    return processor


VISION_TOWERS = ("visual", "vision_tower", "vision_model")
"""Attribute names of a VLM's vision encoder on its base model (Qwen-VL: ``visual``; LLaVA-style: the others)."""


def vision_tower(model: Any) -> torch.nn.Module | None:
    """The vision encoder of a VLM (peft-wrapped or not), or None for a text model."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for owner in (getattr(base, "base_model", None), base):
        for name in VISION_TOWERS:
            tower = getattr(owner, name, None)
            if isinstance(tower, torch.nn.Module):
                return tower
    return None


def prepare_vision_tower(model: Any) -> None:
    """A VLM's vision tower attends each image (or window) in one SDPA call a layer for all of them
    (:mod:`turnrl.models.vision_attention`) where it would call SDPA once per chunk, and runs an MLP of an unaligned
    width as an aligned one (:mod:`turnrl.models.vision_mlp`); text models are left alone."""
    tower = vision_tower(model)
    if tower is not None:
        use_chunked_attention(tower.config)
        use_chunked_attention(model.config.vision_config)
        align_vision_mlps(tower)


def freeze_vision_tower(model: Any) -> int:
    """Stop gradients into a VLM's vision encoder; returns the number of parameters frozen (0 for text models)."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())


def base_model_path(config: ModelConfig) -> Path | str:
    """``model.path``, or the built-in model of ``model.builtin_preset`` (built on first use)."""
    if config.path is not None:
        return config.path
    from turnrl.models.builtin import builtin_model_path

    return builtin_model_path(config)


def enable_checkpointing(model: Any, checkpointed_layers: int | None = None) -> None:
    """Recompute activations in the backward pass (the method's name changed in transformers 5): in every decoder
    layer and vision block, or with ``checkpointed_layers`` (``model.checkpointed_layers``) in the decoder's first
    N layers only, the others keeping their activations. The first ones, since the backward reaches them last:
    by then the kept layers' activations are freed, and the recomputed layer's set takes their place.

    Transformers checkpoints each layer that its ``gradient_checkpointing`` flag marks (a
    :class:`~transformers.modeling_layers.GradientCheckpointingLayer`), so a layer left out is a flag cleared.
    (Its own ``every_n_layers`` option would count the vision blocks among the layers and spread the recomputed
    ones apart, which frees nothing before the first recompute.)

    Raises:
        ConfigError: ``checkpointed_layers`` exceeds the decoder's layers, or the model's layers are not
            checkpointed one by one.
    """
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable()
    else:
        model.gradient_checkpointing_enable()
    if checkpointed_layers is None:
        return
    layers = decoder_layers(model)
    if not layers:
        raise ConfigError(f"model.checkpointed_layers chooses among the decoder's layers, and {type(model).__name__}'s "
                          "are not transformers' checkpointed layers: leave model.checkpointed_layers unset")
    check_checkpointed_layers(checkpointed_layers, len(layers))
    for layer in layers[checkpointed_layers:]:
        layer.gradient_checkpointing = False


def check_checkpointed_layers(checkpointed_layers: int, layers: int) -> None:
    """Raise a ConfigError where ``model.checkpointed_layers`` exceeds the model's ``layers`` decoder layers: when
    the model loads, and before it, where the memory estimate counts them."""
    if checkpointed_layers > layers:
        raise ConfigError(f"model.checkpointed_layers={checkpointed_layers} exceeds the model's {layers} decoder "
                          f"layers: give at most {layers}, or leave it unset to recompute every layer")


def decoder_layers(model: Any) -> list[GradientCheckpointingLayer]:
    """The decoder's layers in order, of a causal LM, a VLM or either's inner model (a critic's backbone): a
    transformers model's ``get_decoder()`` is the text decoder, never the vision tower."""
    return [module for module in model.get_decoder().modules() if isinstance(module, GradientCheckpointingLayer)]


ATTENTION_PART = "self_attn"
"""The attention's name among a decoder layer's parts in every family turnrl builds (Qwen2, Qwen3, Llama, the
text decoders of Qwen2.5-VL and Qwen3-VL); their vision blocks call theirs ``attn``."""

VISION_ATTENTION_PART = "attn"
"""The attention's name among a vision block's parts (Qwen2.5-VL's and Qwen3-VL's towers)."""

RECOMPILE_LIMIT = 32
"""Graphs a compiled part's code may hold (see :func:`compile_layer_parts`)."""

_compiled_forwards: dict[Callable[..., Any], Callable[..., Any]] = {}
"""One compiled ``forward`` a function a part runs (:func:`part_forward`), shared by every layer, model and copy of
a process."""

ROTARY_FUNCTION = "apply_rotary_pos_emb"
"""What a decoder family's attention calls its rotary embedding by, in its transformers module (every family
turnrl builds: Qwen2, Qwen3, Llama, and the text decoders of Qwen2-VL, Qwen2.5-VL and Qwen3-VL)."""

VISION_ROTARY_FUNCTION = "apply_rotary_pos_emb_vision"
"""What a Qwen-VL vision tower's attention calls its rotary embedding by (Qwen2-VL, Qwen2.5-VL, Qwen3-VL)."""


class CompiledRotary:
    """A family's rotary embedding, compiled with the cast to the autocast dtype that attention makes of its result.

    The trainer holds float32 weights and runs under bf16 autocast. The rotary module returns cos and sin in the
    hidden states' dtype, float32, so ``q * cos + rotate_half(q) * sin`` runs as a handful of float32 kernels over
    copies of the queries and keys in every layer of every pass, and attention then casts the result to bf16.
    Compiled, with that cast inside, it is one or two kernels each way with the same float32 arithmetic: on an H200
    the forward and backward of one Qwen2.5-3B layer's 8,192 tokens took 0.566 ms against 0.829 ms
    (``benchmarks/rotary.py``), and the VisGym ``vlm-3b`` step 32.0-32.4 s against 33.1-33.2 s (docs/benchmarks.md).
    Where cos and sin are bf16 too (a reference held in bf16), the compiled kernels keep float32 between the
    operations and round once, where eager rounds after each. Outside autocast (float32 passes, the tests') the
    original function runs: there is nothing to cast, and nothing compiles.

    Why the function is replaced in its module rather than in each model: transformers' attention calls it as a
    module global, so each family's is swapped once, for every model and copy of the process (the reference's and
    the critic's too). The result's dtype is what attention would cast it to anyway.
    """

    def __init__(self, function: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.original = function

        def rotate_and_cast(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any,
                            cast_to: torch.dtype, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            q, k = function(q, k, cos, sin, *args, **kwargs)
            return q.to(cast_to), k.to(cast_to)

        self.compiled = torch.compile(rotate_and_cast, dynamic=True)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        device = q.device.type
        if not torch.is_autocast_enabled(device):
            return self.original(q, k, cos, sin, *args, **kwargs)
        return self.compiled(q, k, cos, sin, *args, cast_to=torch.get_autocast_dtype(device), **kwargs)


class CompiledVisionRotary:
    """A Qwen-VL vision tower's rotary embedding, compiled.

    The towers' function casts the queries and keys to float32, rotates them and casts the result back to their
    dtype, eagerly a dozen kernels over float32 copies of a block's queries and keys. Compiled, it is one kernel
    with the same float32 arithmetic, rounded once at the end as the eager function rounds. The `vlm-3b` tower over
    a rollout prefill's 64 frames, as training's rollout runs it (float32 weights under bf16 autocast, the blocks'
    norms and MLPs compiled), took 0.0764 s a call eager and 0.0573 s with this on an H200
    (``benchmarks/vision_attention.py --rotary``). The function rounds to its inputs' dtype whatever autocast says,
    so unlike :class:`CompiledRotary` it is compiled as it is, for every call.
    """

    def __init__(self, function: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.original = function
        self.compiled = torch.compile(function, dynamic=True)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.compiled(q, k, cos, sin)


def compile_rotary(attention: torch.nn.Module, vision: bool = False) -> bool:
    """Replace the rotary embedding function that ``attention``'s family calls with its compiled form, once a
    family: :data:`ROTARY_FUNCTION` by :class:`CompiledRotary` for a decoder layer's attention,
    :data:`VISION_ROTARY_FUNCTION` by :class:`CompiledVisionRotary` for a vision block's (``vision``; a Qwen-VL's
    module holds both). Returns whether it was replaced now (False: already, or the family's module has no such
    function, whose attention then runs as it is)."""
    module = sys.modules[type(attention).__module__]
    name, wrapper = (VISION_ROTARY_FUNCTION, CompiledVisionRotary) if vision else (ROTARY_FUNCTION, CompiledRotary)
    function = vars(module).get(name)
    if not callable(function) or isinstance(function, (CompiledRotary, CompiledVisionRotary)):
        return False
    setattr(module, name, wrapper(function))
    return True


def compile_layer_parts(model: torch.nn.Module, vision: bool = True) -> int:
    """``torch.compile`` the parts of each decoder layer around its attention (its norms and its MLP), in place,
    and the rotary embedding its attention calls (:func:`compile_rotary`); returns how many parts.

    A norm in eager mode is half a dozen kernels over float32 copies of the hidden states, the MLP's gate two
    more: at 2-4k hidden width such memory-bound kernels took as long as the matrix products in a profiled 3B
    update. Compiled, a norm is a kernel or two each way and the gate fuses with its neighbours. The
    attention stays eager: packed rows attend sequence by sequence (:mod:`turnrl.training.packed_attention`), a
    Python loop whose bounds change every pass. Shapes are compiled dynamic, so varying token counts do not
    compile again; the first training and the first no-grad pass each compile once (seconds on a GPU).

    Each part's ``forward`` function (its class's, :func:`part_forward`: an unaligned vision MLP's
    :func:`~turnrl.models.vision_mlp.aligned_mlp_forward`) is compiled once and bound to the part as its own
    ``forward``: copies of the model (``copy.deepcopy``: the critic, the reference, FSDP's structures) bind it to
    their own parts, and a copy of a compiled part keeps it.
    A VLM's vision blocks are compiled the same way around their ``attn``, with their rotary embedding, unless
    ``vision`` is false: in eager mode the tower's norms, GELUs and biases took about as long as its matrix
    products (a profiled 3B tower ran at about a fifth of the card's bf16 peak).
    """
    # A part's code is compiled once for each kind of call a run makes: with and without gradients, trainable
    # or frozen weights (the reference), one row or several, one token or many (0/1 sizes are specialized).
    # Past torch's default of 8 such graphs a function falls back to eager mode.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    attention_parts = (ATTENTION_PART, VISION_ATTENTION_PART) if vision else (ATTENTION_PART,)
    parts = 0
    for layer in list(model.modules()):
        children = dict(layer.named_children())
        attention = next((name for name in attention_parts if name in children), None)
        if attention is None:
            continue
        compile_rotary(children[attention], vision=attention == VISION_ATTENTION_PART)
        for name, part in children.items():
            if name == attention or next(part.parameters(), None) is None:
                continue
            function = part_forward(part)
            if function not in _compiled_forwards.values():  # a copy of a compiled part keeps its function
                if function not in _compiled_forwards:
                    _compiled_forwards[function] = torch.compile(function, dynamic=True)
                function = _compiled_forwards[function]
            part.forward = MethodType(function, part)
            parts += 1
    return parts


def part_forward(part: torch.nn.Module) -> Callable[..., Any]:
    """The function ``part``'s forward runs: one bound to the instance (a compiled one, in a copy of a compiled
    model), else its class's."""
    own = vars(part).get("forward")
    return own.__func__ if isinstance(own, MethodType) else type(part).forward


def start_compile_workers_ignoring_sigterm() -> None:
    """Start inductor's pool of compile workers now, with SIGTERM ignored, as the workers then stay (an ignored
    signal stays ignored in the processes a process starts, and the workers are started by the pool's first
    process, not by this one): a job-wide SIGTERM (Slurm's at a time limit, ``timeout``'s), which this process
    outlives to finish its step, then leaves them alive, also with a compile in hand, which dead workers would
    never answer (:func:`compile_in_this_process`). This process's own handler is put back at once. A pool
    already started is left as it is; outside the main thread (where no handler can be set) nothing is done."""
    if threading.current_thread() is not threading.main_thread():
        return
    from torch._inductor.async_compile import AsyncCompile  # here: 0.3 s more for every importer of this module

    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        AsyncCompile.warm_pool()
    finally:
        signal.signal(signal.SIGTERM, previous)


def compile_in_this_process() -> None:
    """Compile in this process from now on, not in inductor's pool of compile workers; for a SIGTERM.

    A batch scheduler (Slurm at a job's time limit) and ``timeout`` send their SIGTERM to every process of the
    job, and inductor's compile workers, in the process group of the process that started them, die of it (unless
    :func:`start_compile_workers_ignoring_sigterm` started them, as ``turnrl train`` does on a GPU). The
    stop that follows still runs the step in progress, a validation and a checkpoint, and any of them may compile
    (a new shape): handed to the dead workers, such a compile waits forever (torch 2.11; on an H200, the next
    compile after the workers' SIGTERM hung where it took 1.6 s with this setting), and the job hangs until the
    scheduler kills it, its checkpoint unsaved. Inductor reads the setting at each kernel it compiles.

    Safe in a signal handler: a plain setting.
    """
    inductor_config.compile_threads = 1
