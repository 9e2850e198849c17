"""The trainer's weights as the rollout-process pool receives them: which tensors go (:func:`sent_weights`, LoRA
adapters merged), how they are staged and sent (:class:`PoolCopy`) and how the pool's copy is checked
(:class:`PoolWeights`). How the pool fits a run: :mod:`turnrl.training.backends.pool`."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import cast

import peft
import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer

from turnrl.config import ConfigError
from turnrl.engine.weights import WeightsChecksum, model_checksum
from turnrl.training.backends.backend import WeightsVersion
from turnrl.training.backends.pool_protocol import ProcessPool, TensorSpec
from turnrl.training.backends.weights_check import CheckSeconds, ExpectedWeights, WeightsCheck
from turnrl.training.ranks import whole


# --------------------------------------------------------------------------- the trainer's weights, as sent
def sent_weights(model: torch.nn.Module, every: bool) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """The weights the rollout processes' plain model takes from ``model``, by its parameter names, each made
    whole when its function is called (a collective of the trainer ranks for a sharded one): with ``every`` all of
    them (the first transfer: the rollout processes start from the architecture's initial weights), else the
    trainable ones. A peft model's LoRA layers send their weights merged with the adapters (``W + B A * scaling``),
    every time: the adapters change them; its frozen base weights only with ``every``.

    Raises:
        ConfigError: a LoRA setup this merge does not handle (see :func:`unmergeable_lora`).
    """
    if not isinstance(model, peft.PeftModel):
        return [(name, whole_of(parameter)) for name, parameter in model.named_parameters()
                if every or parameter.requires_grad]
    problem = unmergeable_lora(model)
    if problem is not None:
        raise ConfigError(f"distributed.rollout_processes send LoRA weights merged into plain linear layers; "
                          f"{problem}: train without rollout processes, or adapt linear layers alone")
    base = model.get_base_model()
    out: list[tuple[str, Callable[[], torch.Tensor]]] = []
    lora_prefixes: list[str] = []
    for name, module in base.named_modules():
        if not isinstance(module, LoraLinear):  # the only LoRA layers unmergeable_lora lets through
            continue
        lora_prefixes.append(f"{name}.")
        out.append((f"{name}.weight", merged_weight(module)))
        bias = base_linear(module).bias
        if every and bias is not None:
            out.append((f"{name}.bias", whole_of(bias)))
    for name, parameter in base.named_parameters():
        if ".lora_" in name or any(name.startswith(prefix) for prefix in lora_prefixes):
            continue
        if every or parameter.requires_grad:
            out.append((name.replace(".base_layer.", "."), whole_of(parameter)))
    return out


def unmergeable_lora(model: peft.PeftModel) -> str | None:
    """What of ``model``'s LoRA setup :func:`merged_weight` does not merge (None: all of it is plain LoRA on linear
    layers): DoRA and other variants, a bias on the adapters, adapters on embeddings or convolutions, and
    ``modules_to_save`` (trainable copies the plain model has no names for)."""
    for adapter, settings in model.peft_config.items():
        if isinstance(settings, peft.LoraConfig) and settings.modules_to_save:
            return f"adapter {adapter!r} has modules_to_save={settings.modules_to_save}"
    for name, module in model.get_base_model().named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module, LoraLinear):
            return f"{name} is a LoRA {type(module).__name__} layer, not a linear one"
        if module.lora_variant or any(module.use_dora.values()):
            return f"{name} uses a LoRA variant (DoRA)"
        if any(module.lora_bias.values()):
            return f"{name} has a bias on its adapters (lora_bias)"
    return None


def whole_of(parameter: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: whole(parameter)


def base_linear(layer: LoraLinear) -> torch.nn.Linear:
    """The linear layer a LoRA one adapts."""
    return cast(torch.nn.Linear, layer.get_base_layer())


def merged_weight(layer: LoraLinear) -> Callable[[], torch.Tensor]:
    """A LoRA linear layer's weight with its active adapters merged, out of place (the base never changes); as it
    is where peft merged them into it already (``layer.merged``). Written here, not with the engine's and the Ray
    workers' merge (:func:`~turnrl.engine.weights.lora_merged_weight`, peft's ``get_delta_weight``), because that
    multiplies the layer's shards, not the FSDP2-gathered whole matrices."""

    def merged() -> torch.Tensor:
        weight = whole(base_linear(layer).weight)
        if layer.merged or layer.disable_adapters:
            return weight
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            up, down = cast(torch.nn.Linear, layer.lora_B[adapter]), cast(torch.nn.Linear, layer.lora_A[adapter])
            delta = whole(up.weight) @ whole(down.weight)
            if layer.fan_in_fan_out:
                delta = delta.T
            weight = weight + (delta * layer.scaling[adapter]).to(weight.dtype)
        return weight

    return merged


class PoolCopy:
    """A :class:`~turnrl.training.backends.asynchronous.RolloutCopy` in the rollout processes; every trainer rank
    holds one (the gathers are collectives of theirs), trainer 0's with the pool (``pool``; None elsewhere).

    Args:
        pool: the rollout processes (trainer 0), else None.
        dtype: the rollout dtype: the weights are staged and sent in it.
        device: trainer 0's device, where the staging copy lives.
    """

    def __init__(self, pool: ProcessPool | None, dtype: torch.dtype, device: torch.device) -> None:
        self.pool = pool
        self.dtype = dtype
        self.device = device
        self._staged: list[tuple[TensorSpec, torch.Tensor]] = []
        self.parts: Sequence[int] = pool.processes if pool is not None else ()
        """Each rollout process takes weights apart (trainer 0; no rollout thread elsewhere)."""

    def send(self, source: torch.nn.Module, version: WeightsVersion, every: bool = False) -> None:
        """Stream ``source``'s weights to the rollout processes now, one tensor at a time (each gathered, cast to the
        rollout dtype, broadcast); the trainable ones, or with ``every`` all."""
        weights = sent_weights(source, every)
        if self.pool is None:
            for _, make in weights:
                make()  # this rank's part of the gather
            return
        shapes = sent_shapes(source)
        specs = [TensorSpec(name, tuple(shapes[name]), self.dtype) for name, _ in weights]
        values = (make() for _, make in weights)
        try:
            self.pool.send_weights(version.updates, specs, values)
        finally:
            # A transfer that failed part-way (a rollout process died) leaves gathers the other trainer ranks make
            # all the same: this rank takes part in them, so that every rank then reaches the sharing of the error
            # (pool.TrainerGroup) instead of waiting in a collective this one never joins.
            for _ in values:
                pass

    def start(self, source: torch.nn.Module, version: WeightsVersion) -> None:
        self.send(source, version, every=True)

    @torch.no_grad()
    def stage(self, source: torch.nn.Module, version: WeightsVersion) -> None:
        staged = []
        for name, make in sent_weights(source, every=False):
            value = make()
            if self.pool is not None:
                staged.append((TensorSpec(name, tuple(value.shape), self.dtype),
                               value.to(device=self.device, dtype=self.dtype, copy=True)))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the rollout thread broadcasts them from another stream
        self._staged = staged

    def apply(self, version: WeightsVersion, parts: Sequence[int]) -> None:
        assert self.pool is not None, "trainer 0 alone runs the rollout thread"
        self.pool.send_weights(version.updates, [spec for spec, _ in self._staged],
                               (tensor for _, tensor in self._staged), to=parts)


def sent_shapes(model: torch.nn.Module) -> dict[str, torch.Size]:
    """The whole shape of each weight :func:`sent_weights` sends, by its name, without gathering any (a DTensor knows
    its global shape)."""
    shapes = {name: parameter.shape for name, parameter in model.named_parameters()}
    if not isinstance(model, peft.PeftModel):
        return shapes
    base = model.get_base_model()
    for module_name, module in base.named_modules():
        if isinstance(module, LoraLinear):
            layer = base_linear(module)
            shapes[f"{module_name}.weight"] = layer.weight.shape
            if layer.bias is not None:
                shapes[f"{module_name}.bias"] = layer.bias.shape
    for name, parameter in base.named_parameters():
        shapes.setdefault(name.replace(".base_layer.", "."), parameter.shape)
    return shapes


class PoolWeights:
    """The check of the rollout processes' weights (the :class:`~turnrl.training.backends.asynchronous.CopyCheck`
    of a pool): :meth:`expect` computes the trainer's checksum on every trainer rank (a collective for shards);
    :meth:`take`, on trainer 0, checks each rollout process's checksum of the weights it took against it
    (:class:`WeightsCheck`: a skipped sync stops the run with ``WeightsSyncError``). Each process takes versions on
    its own (partial rollouts switch one process's weights at its turn boundary), so each has its versions noted
    and not taken yet."""

    def __init__(self, pool: ProcessPool | None, dtype: torch.dtype) -> None:
        self.pool = pool
        self.dtype = dtype
        self.checks: dict[int, WeightsCheck] = {}
        self.expected: dict[int, ExpectedWeights[WeightsChecksum]] = {
            j: ExpectedWeights() for j in (pool.processes if pool is not None else ())}
        self.seconds = CheckSeconds()

    def expect(self, model: torch.nn.Module, version: WeightsVersion) -> None:
        start = time.perf_counter()
        trainer = model_checksum(model, self.dtype)
        for expected in self.expected.values():
            expected.note(version, trainer)
        self.seconds.add(time.perf_counter() - start)

    def take(self, steps: int | None = None, parts: Sequence[int] | None = None) -> None:
        if self.pool is None:
            return
        start = time.perf_counter()
        checked = False
        for j in self.pool.processes if parts is None else parts:
            taken = self.expected[j].take(steps)
            rollout = self.pool.checksums.get(j)
            if taken is None or rollout is None:
                continue
            version, trainer = taken
            check = self.checks.setdefault(j, WeightsCheck(f"pool (rollout process {self.pool._name(j)})"))
            check.verify(version, trainer, rollout)
            checked = True
        if checked:
            self.seconds.add(time.perf_counter() - start)

    def metrics(self) -> dict[str, float]:
        return self.seconds.metrics()
