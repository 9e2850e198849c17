"""The interface every policy shares: a batch of prompts in, completions out.

Model backends read ``prompt_ids`` (the exact tokens of the context) and return
the sampled token ids with their sampling logprobs; HTTP backends read
``messages``; scripted policies (expert, random) read ``env``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from turnrl.config import SamplingConfig
    from turnrl.envs.base import AgentEnv


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
    """``stop`` (end of turn or a stop string), ``length`` (max tokens) or ``error``."""
    error: str | None = None
    """Why the request failed, when ``finish_reason == "error"``."""


@runtime_checkable
class Policy(Protocol):
    """Anything that completes a batch of prompts."""

    tokenizer: Any
    """The tokenizer whose ids ``generate`` returns, or None for text-only policies."""

    def generate(self, requests: Sequence[GenerationRequest], sampling: SamplingConfig) -> list[Completion]:
        """Complete every request; one failed request yields a ``finish_reason="error"`` completion."""
        ...


@runtime_checkable
class StreamingPolicy(Protocol):
    """A policy that takes requests one at a time and returns completions as they finish (the engine).

    The rollout loop uses it to let episodes advance independently (``agent.wait_for_turns=false``).
    """

    tokenizer: Any

    def submit(self, request: GenerationRequest, sampling: SamplingConfig) -> int:
        """Queue one request; returns its handle."""
        ...

    def poll(self) -> list[tuple[int, Completion]]:
        """Advance generation a little; returns the requests finished since the last call, by handle."""
        ...
