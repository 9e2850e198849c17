"""Forward passes the trainer needs: token log-probs, entropy, values.

Notation: b batch size, s sequence length, h hidden size, v vocabulary size,
n number of scored tokens.

Alignment: every per-token tensor is indexed by the position of the token it
scores. ``logprobs[i] = log p(input_ids[i] | input_ids[:i])`` and
``values[i] = V(input_ids[:i])`` (the value of the state in which token ``i``
is chosen); position 0 is never scored. Masks use the same indexing.

Only the scored positions go through the LM head, in chunks: a full
``(b, s, v)`` logits tensor for a 150k vocabulary would not fit. The body
runs as the model's own base model with every extra input of the batch
(``pixel_values``, ``image_grid_thw``, ...), so a VLM merges its image
features and computes its own positions (M-RoPE) exactly as in ``generate``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModel, PreTrainedModel

from turnrl.algorithms import entropy_of_log_probs
from turnrl.models.vision import position_inputs


def _body_and_head(model: Any) -> tuple[nn.Module, nn.Module]:
    """The base model (everything but the LM head) and the LM head of a causal LM or VLM, peft-wrapped or not."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.base_model, base.get_output_embeddings()


def last_hidden_states(
    body: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    model_inputs: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Shape (b, s, h): final-layer (normed) hidden states of ``body`` given the extra inputs."""
    extra = dict(model_inputs or {})
    if extra:  # a VLM: its image tokens get their own (3D) positions, as in generation
        extra.update(position_inputs(body, input_ids))
    output = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra)
    return output.last_hidden_state


def scored_positions(score_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and columns of scored tokens; position 0 is never scored.

    Args:
        score_mask: Shape (b, s), nonzero where a token is scored.

    Returns:
        Two index tensors of Shape (n,).
    """
    mask = score_mask.bool().clone()
    mask[:, 0] = False
    rows, cols = mask.nonzero(as_tuple=True)
    return rows, cols


def token_logprobs(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_size: int = 4096,
    model_inputs: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities (and entropies) of the scored tokens under ``softmax(logits / temperature)``.

    Args:
        input_ids: Shape (b, s).
        attention_mask: Shape (b, s).
        score_mask: Shape (b, s); which tokens to score (usually the loss mask).
        temperature: the sampling temperature (0 is treated as 1).
        model_inputs: extra inputs of the model (a VLM's pixel values and grid sizes), passed to its forward.

    Returns:
        ``logprobs`` Shape (b, s) and ``entropy`` Shape (b, s) or None; zero where not scored.
    """
    body, head = _body_and_head(model)
    hidden = last_hidden_states(body, input_ids, attention_mask, model_inputs)
    rows, cols = scored_positions(score_mask)
    targets = input_ids[rows, cols]
    states = hidden[rows, cols - 1]  # the state before each scored token
    scale = temperature if temperature > 0 else 1.0
    logprob_chunks, entropy_chunks = [], []
    # At least one (possibly empty) chunk: with nothing scored the zeros still hang
    # off the graph, so backward() on a loss of a batch without trained tokens works.
    for start in range(0, max(states.shape[0], 1), chunk_size):
        logits = head(states[start : start + chunk_size]).float() / scale  # (chunk, v)
        log_probs = torch.log_softmax(logits, dim=-1)
        logprob_chunks.append(log_probs.gather(-1, targets[start : start + chunk_size, None]).squeeze(-1))
        if with_entropy:
            entropy_chunks.append(entropy_of_log_probs(log_probs))
    logprobs = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
    logprobs = logprobs.index_put((rows, cols), torch.cat(logprob_chunks))
    entropy = None
    if with_entropy:
        entropy = torch.zeros(input_ids.shape, dtype=torch.float32, device=input_ids.device)
        entropy = entropy.index_put((rows, cols), torch.cat(entropy_chunks))
    return logprobs, entropy


class ValueModel(nn.Module):
    """A critic: a transformer backbone of its own plus a linear value head.

    Built from the actor's weights (the backbone without the LM head), as is
    usual for PPO on language models.
    """

    def __init__(self, backbone: PreTrainedModel) -> None:
        super().__init__()
        self.backbone = backbone
        hidden_size = backbone.config.get_text_config().hidden_size  # a VLM keeps it in its text config
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> ValueModel:
        path = Path(path)
        backbone = AutoModel.from_pretrained(path, dtype=dtype)
        critic = cls(backbone)
        head = path / "value_head.pt"
        if head.exists():
            critic.value_head.load_state_dict(torch.load(head, map_location="cpu", weights_only=True))
        return critic

    def save_pretrained(self, path: str | Path, state_dict: Mapping[str, torch.Tensor] | None = None) -> None:
        """The backbone as a transformers model and ``value_head.pt``; ``state_dict`` (the critic's own keys,
        gathered from a sharded critic) replaces the module's weights."""
        path = Path(path)
        if state_dict is None:
            self.backbone.save_pretrained(path)
            torch.save(self.value_head.state_dict(), path / "value_head.pt")
            return
        backbone = {k.removeprefix("backbone."): v for k, v in state_dict.items() if k.startswith("backbone.")}
        head = {k.removeprefix("value_head."): v for k, v in state_dict.items() if k.startswith("value_head.")}
        self.backbone.save_pretrained(path, state_dict=backbone)
        torch.save(head, path / "value_head.pt")

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        model_inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Shape (b, s): ``values[i] = V(input_ids[:i])``; position 0 is 0."""
        backbone: Any = self.backbone
        backbone = backbone.get_base_model() if hasattr(backbone, "get_base_model") else backbone
        hidden = last_hidden_states(backbone, input_ids, attention_mask, model_inputs)
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()  # value after token i
        return torch.cat([torch.zeros_like(values[:, :1]), values[:, :-1]], dim=1)

