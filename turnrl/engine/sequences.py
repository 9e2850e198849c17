"""The engine's records: what a caller asks for (:class:`SamplingParams`), a sequence as the scheduler and the
model runner see it (:class:`SequenceRecord`), what comes out (:class:`Result`), and the counters of the work done
(:class:`EngineStats`)."""

from __future__ import annotations

from dataclasses import dataclass

from turnrl.engine.images import PromptImages


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0 is greedy."""
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop_ids: tuple[int, ...] = ()
    """Token ids that end the sequence (kept as its last token)."""
    stop_strings: tuple[str, ...] = ()
    """Texts that end the sequence at the token that completes one (needs the engine's ``decode``)."""


@dataclass
class Result:
    """A finished sequence."""

    id: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    """``stop`` (a stop id or string), ``length`` (max_new_tokens) or ``error``."""
    error: str | None = None
    reused_tokens: int = 0
    """Prompt tokens found in the cache (not prefilled)."""


@dataclass
class SequenceRecord:
    """A submitted prompt, from the queue to its last token."""

    id: int
    prompt: list[int]
    params: SamplingParams
    images: PromptImages | None = None
    """A VLM prompt's images (None: text)."""
    row: int = -1
    """Its cache row, once admitted."""
    cached: int = 0
    """Prompt tokens whose keys and values are in the row (while it is prefilled; then the row's counters hold
    the sequence's progress, :class:`~turnrl.engine.running.RunningRows`)."""
    reused: int = 0
    """Prompt tokens the row held when it was admitted (not prefilled)."""
    waited_for_pages: bool = False
    """It found its row but not the pages of its prompt and budget at least once (counted once, in
    :attr:`EngineStats.page_waits`)."""

    @property
    def keys(self) -> list[int]:
        """What the cache rows are matched on: the prompt, with each image's placeholders standing for its pixels."""
        return self.images.keys if self.images is not None else self.prompt


@dataclass
class EngineStats:
    prefill_tokens: int = 0
    prefill_calls: int = 0
    reused_tokens: int = 0
    shared_tokens: int = 0
    """Prompt tokens copied from the prefill of an identical prompt admitted with them, not computed again."""
    decode_steps: int = 0
    generated_tokens: int = 0
    evictions: int = 0
    """Idle rows' cached conversations dropped for a sequence to start: for a row (a prompt that extends no idle
    row takes the lowest row not running, an idle one even where a higher row is free, since decode computes rows
    0 .. the highest running) or for the pages of its prompt and budget (the key/value cache full:
    ``page_evictions``). A dropped conversation whose episode comes back for another turn is prefilled again."""
    page_evictions: int = 0
    """Of ``evictions``, those that freed pages (the cache full), not a row."""
    page_waits: int = 0
    """Sequences that waited for running ones to free pages (the cache full even without its idle rows): the
    rollout then generates in waves, each adding decode steps."""
    prefill_attention_pairs: int = 0
    """Query-key pairs of the prefilled tokens' causal attention: each new token against its sequence's cached
    prefix and the new tokens up to itself (:func:`~turnrl.engine.timing.causal_pairs`)."""
    decode_key_tokens: int = 0
    """Cached tokens the decode steps attended to: each step, every decoded row's keys and values up to its new
    token, summed over the steps (what the decode steps read of the cache: this x a token's key and value bytes)."""
