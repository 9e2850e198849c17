"""The interface every policy shares: a batch of prompts in, completions out.

Model backends read ``prompt_ids`` (the exact tokens of the context) and return
the sampled token ids with their sampling logprobs; HTTP backends read
``messages``; scripted policies (expert, random) read ``env``.

:class:`Policy` declares everything its callers (the rollout, the policy
server, the trainer) read of a policy, each with its default: a backend
subclasses it and sets what differs, and a caller never probes for an
attribute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import nn

    from turnrl.config import SamplingConfig
    from turnrl.engine.weights import ImageFeatures, WeightsChecksum
    from turnrl.envs.contract import AgentEnv
    from turnrl.models.vision import ImageEncoder


@dataclass
class GenerationRequest:
    """One prompt to complete."""

    prompt_ids: list[int] | None
    """Token ids of the context, generation prompt included; None for text-only rollouts."""
    messages: list[dict[str, Any]]
    """The same context as chat messages (for HTTP backends and logs)."""
    env: AgentEnv | None = None
    """The episode's env, for scripted policies that read the state."""
    max_new_tokens: int | None = None
    """Cap below the sampling setting (the context budget may leave less room)."""
    images: list[Any] | None = None
    """The ``HxWx3`` uint8 arrays of the image parts of ``messages``, in order (image modes)."""
    model_inputs: dict[str, Any] | None = None
    """The model's extra inputs for ``prompt_ids`` (a VLM's ``pixel_values`` and ``image_grid_thw`` of the
    images in the prompt, each concatenated along dim 0), built with the context; None for text."""
    image_digests: list[int] | None = None
    """The digest of each image in ``model_inputs``, in order, as the image encoder made them: the engine's cache
    keys for the images (None: it hashes their pixel values)."""


@dataclass
class Completion:
    """A sampled response."""

    text: str
    """Decoded response, special tokens removed."""
    token_ids: list[int] = field(default_factory=list)
    """The sampled token ids, end-of-turn token included when it was sampled; empty for text-only policies."""
    logprobs: list[float] = field(default_factory=list)
    """Log-probability of each sampled token under the sampling distribution (logits / temperature)."""
    finish_reason: str = "stop"
    """``stop`` (end of turn or a stop string), ``length`` (max tokens), ``context`` (nothing generated: the
    prompt no longer fits the model's context, which ends the episode as its context budget does) or ``error``."""
    error: str | None = None
    """Why the request failed, when ``finish_reason`` is ``error`` (or the server's words for ``context``)."""
    expert_actions: list[str] = field(default_factory=list)
    """The env solver's actions for this state, where a scripted expert answered (before it replaced some with
    random ones); empty for every other policy. Soft SFT targets read them."""


@runtime_checkable
class Policy(Protocol):
    """Anything that completes a batch of prompts.

    The built-in backends subclass it and inherit the defaults below; a class that does not must
    define every member itself.
    """

    tokenizer: Any = None
    """The tokenizer whose ids ``generate`` returns; None for text-only policies (an API, a script),
    which get chat messages and return text."""
    model: nn.Module | None = None
    """The weights that sample (a transformers model); None for policies without local weights."""
    image_encoder: ImageEncoder | None = None
    """Encodes the images of a token context for the model (a VLM's processor); None for a text model
    and for text-only policies."""
    eos_ids: Sequence[int] = ()
    """The token ids that end a response (empty for text-only policies)."""
    max_batch_size: int | None = None
    """Prompts one ``generate`` call samples together at most; None where no such limit is set (the
    engine batches continuously, an API or a script takes any batch)."""
    max_sequence_tokens: int | None = None
    """Tokens one sequence (prompt and response) may hold at most (the engine's ``model.engine.max_seq_len``);
    None where the policy sets no such limit. The rollout ends an episode whose next prompt and response
    would not fit, as at ``agent.max_context_tokens``, instead of sending a request that would fail or be cut."""
    weights_version: int | None = None
    """The trainer's update count of the weights this policy samples with (``WeightsVersion.updates``), set by the
    rollout backend that hands it the trainer's weights; every turn records it. None where the weights are no
    trainer's (an API, a script, an evaluation)."""

    @property
    def accepts_images(self) -> bool:
        """Whether image observations can go to this policy: a text-only policy takes them as message
        parts, a token policy only with an image encoder (a text model would play blind)."""
        return self.tokenizer is None or self.image_encoder is not None

    @property
    def continues_response_prefix(self) -> bool:
        """Whether the responses can continue a format's response prefix, the text a prompt ends with after the
        generation prompt (RAGEN's ``<think>``): a token policy's ``prompt_ids`` end with it; a text-only policy
        gets chat messages, which cannot end inside an assistant turn (a chat API cannot prefill one). A
        scripted policy, which knows the format and writes only what follows the prefix, says yes."""
        return self.tokenizer is not None

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[Completion]:
        """Complete every request; one failed request yields a ``finish_reason="error"`` completion."""
        ...

    def streaming(self) -> StreamingPolicy | None:
        """This policy as one that takes requests one at a time and returns completions as they finish,
        or None when it completes whole batches only (the default)."""
        return None

    def release_memory(self) -> None:
        """Free what the policy holds between generations (the engine's key/value cache and computed weights)
        for a training update to use; the next ``generate`` builds it again. The default holds nothing."""
        return None

    def weights_checksum(self) -> WeightsChecksum | None:
        """A checksum of a few of the weights the next generation computes with, as this policy computes with
        them (the engine's merged and cast buffers, brought up to date as a generation would): what the rollout
        backend compares with the trainer's actor after each weights sync. None (the default) for a policy
        without local weights. Call it between generations only."""
        return None

    def keep_image_features(self) -> bool:
        """From now on keep the features of the images this policy encodes, in host memory, for
        :meth:`take_image_features`; returns whether it will (the engine on a VLM). A training step whose vision
        tower is frozen then takes them instead of encoding the same images again. The default keeps none."""
        return False

    def take_image_features(self) -> dict[int, ImageFeatures]:
        """The features of the images encoded since the last call, by digest (the rollout's
        ``image_digests``), each one row per image token; empty where none are kept (the default)."""
        return {}

    def counters(self) -> dict[str, float]:
        """Running totals of the policy's own work since it was made (the engine's prefilled, reused and
        generated tokens, prefill calls, decode steps): a rollout logs how much each grew. The default counts
        nothing."""
        return {}


class StreamingPolicy(Protocol):
    """A policy that takes requests one at a time and returns completions as they finish (the engine).

    The rollout loop uses it to let episodes advance independently (``agent.wait_for_turns=false``), and to
    prefill a round's requests in parts while it steps the environments (``agent.prefill_groups``).
    """

    def submit(self, request: GenerationRequest, sampling: SamplingConfig) -> int:
        """Queue one request; returns its handle."""
        ...

    def poll(self) -> list[tuple[int, Completion]]:
        """Advance generation a little; returns the requests finished since the last call, by handle."""
        ...

    def prefill(self) -> None:
        """Start the queued requests' prefill, decoding nothing and waiting for nothing: a caller queuing a round's
        requests in parts (``agent.prefill_groups``) lets the device work on one part while it builds the next.
        Their completions come out of later polls."""
        ...
