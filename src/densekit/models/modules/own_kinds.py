"""Bottleneck adapters, BitFit and sparse differences, which peft does not provide, built on a tower.

Each adds to the frozen base: adapters through forward hooks on the tower's own copies of the
feed-forward layers, BitFit and sparse differences as a parametrisation `base + delta` of the copies'
biases or weights, the delta zero at the start. The base's tensors are never written.
"""

from __future__ import annotations

import copy
import time

import regex
import torch
from torch.nn.utils import parametrize
from transformers import PreTrainedModel

from densekit.models.modules.specs import AdapterSpec, BitFitSpec, ModuleError, SparseDiffSpec
from densekit.models.modules.tower import Tower, freeze, shared_copy

OwnSpec = AdapterSpec | BitFitSpec | SparseDiffSpec
# Layer patterns come from module files as well as configs: `regex` matches them under a deadline, as
# Python's `re` cannot (`(.*)*x` would take it years on one layer name).
MATCH_SECONDS = 2.0


class Bottleneck(torch.nn.Module):
    """up(relu(down(x))) times `scaling`, with the up-projection zero so it adds nothing at the start."""

    def __init__(self, inputs: int, outputs: int, size: int, scaling: float):
        super().__init__()
        self.down = torch.nn.Linear(inputs, size)
        self.up = torch.nn.Linear(size, outputs)
        torch.nn.init.zeros_(self.up.weight)
        torch.nn.init.zeros_(self.up.bias)
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's addition for `x`."""
        return self.scaling * self.up(torch.relu(self.down(x)))


class AddDelta(torch.nn.Module):
    """A parametrisation: the base tensor plus a learned change of its shape."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype):
        super().__init__()
        self.delta = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        """The changed tensor."""
        return original + self.delta


class AddSparseDelta(torch.nn.Module):
    """A parametrisation: the base tensor plus learned values at fixed flat positions."""

    def __init__(self, indices: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("indices", indices.to(torch.long))
        self.values = torch.nn.Parameter(torch.zeros(len(indices), dtype=dtype))

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        """The changed tensor."""
        return original.flatten().index_add(0, self.indices, self.values).view_as(original)


def matching(model: torch.nn.Module, pattern: str) -> list[tuple[str, torch.nn.Module]]:
    """The submodules whose full name matches `pattern`, in the model's order; `ModuleError` when
    matching them takes more than `MATCH_SECONDS` (a pattern that backtracks without end)."""
    deadline = time.monotonic() + MATCH_SECONDS
    found = []
    for name, module in model.named_modules():
        try:
            if name and regex.fullmatch(pattern, name, timeout=max(deadline - time.monotonic(), 1e-3)):
                found.append((name, module))
        except TimeoutError:
            raise ModuleError(
                f"layer pattern {pattern!r} takes over {MATCH_SECONDS:g} s to match the model's layer names "
                "(it backtracks without end): write it without nested repetition"
            ) from None
    return found


def own_tower(
    base: PreTrainedModel, spec: OwnSpec, sparse_indices: dict[str, torch.Tensor] | None = None
) -> Tower:
    """A tower of `base` with a fresh module of `spec`; a sparse difference needs its chosen positions
    (`choose_sparse_indices`, or those saved with it). The base's tensors are frozen."""
    freeze(base)
    model = shared_copy(base)
    parts = torch.nn.ModuleDict()
    if isinstance(spec, AdapterSpec):
        _add_adapters(model, spec, parts)
    elif isinstance(spec, BitFitSpec):
        for _, module in model.named_modules():
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.nn.Parameter):
                parametrize.register_parametrization(module, "bias", AddDelta(bias.shape, bias.dtype))
    else:
        if sparse_indices is None:
            raise ValueError("a sparse difference needs the positions it changes")
        targets = dict(matching(model, spec.target_modules))
        _weights(list(targets.items()), spec.target_modules)
        unknown = sorted(set(sparse_indices) - set(targets))
        if unknown:
            raise ModuleError(f"sparse difference for layers the model lacks: {', '.join(unknown[:3])}")
        for name, indices in sparse_indices.items():
            weight = targets[name].weight
            _check_positions(name, indices, weight.numel())
            parametrize.register_parametrization(
                targets[name], "weight", AddSparseDelta(indices, weight.dtype)
            )
    return Tower(model, base, parts)


def _check_positions(layer: str, indices: torch.Tensor, size: int) -> None:
    """Refuse a sparse difference's positions that are not whole numbers in a list within its layer's
    `size` entries (a saved module's file could hold any)."""
    whole = not (indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool)
    if indices.dim() != 1 or not whole:
        raise ModuleError(f"sparse difference of {layer}: its positions are a {indices.dim()}-D "
                          f"{indices.dtype} tensor, not a list of whole numbers")  # fmt: skip
    if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= size):
        raise ModuleError(f"sparse difference of {layer}: positions from {int(indices.min())} to "
                          f"{int(indices.max())}, outside its {size} entries")  # fmt: skip


def _add_adapters(model: torch.nn.Module, spec: AdapterSpec, parts: torch.nn.ModuleDict) -> None:
    outputs = matching(model, spec.ffn_output)
    if not outputs:
        raise ModuleError(f"no layer of the model matches ffn_output {spec.ffn_output!r}")
    for name, layer in outputs:
        if not isinstance(getattr(layer, "out_features", None), int):
            raise ModuleError(f"ffn_output {spec.ffn_output!r} matches {name}, which is no linear layer")
    if spec.placement == "sequential":
        for i, (_, layer) in enumerate(outputs):
            adapter = Bottleneck(layer.out_features, layer.out_features, spec.bottleneck, spec.scaling)
            parts[f"adapter_{i}"] = adapter
            layer.register_forward_hook(lambda _m, _i, out, a=adapter: out + a(out))
        return
    inputs = matching(model, spec.ffn_input)
    if len(inputs) != len(outputs):
        raise ModuleError(
            f"ffn_input {spec.ffn_input!r} matches {len(inputs)} layers, ffn_output {len(outputs)}"
        )
    for i, ((name, first), (_, last)) in enumerate(zip(inputs, outputs, strict=True)):
        adapter = Bottleneck(_in_features(name, first), last.out_features, spec.bottleneck, spec.scaling)
        parts[f"adapter_{i}"] = adapter
        seen: dict[str, torch.Tensor] = {}
        first.register_forward_pre_hook(lambda _m, args, seen=seen: seen.update(x=args[0]))
        last.register_forward_hook(lambda _m, _i, out, a=adapter, seen=seen: out + a(seen.pop("x")))


def _in_features(name: str, module: torch.nn.Module) -> int:
    linear = next((m for m in module.modules() if isinstance(m, torch.nn.Linear)), None)
    if linear is None:
        raise ModuleError(f"ffn_input matches {name}, which holds no linear layer")
    return linear.in_features


def _weights(layers: list[tuple[str, torch.nn.Module]], pattern: str) -> dict[str, torch.nn.Parameter]:
    """The weight of each matched layer, by name; a match without one (a container, a dropout) is
    refused."""
    for name, module in layers:
        if not isinstance(getattr(module, "weight", None), torch.nn.Parameter):
            raise ModuleError(f"target_modules {pattern!r} matches {name}, which has no weight to change")
    return {name: module.weight for name, module in layers}


def sparse_targets(base: PreTrainedModel, spec: SparseDiffSpec) -> dict[str, torch.nn.Parameter]:
    """The weight matrices of `base` a sparse difference may change, by layer name."""
    targets = _weights(matching(base, spec.target_modules), spec.target_modules)
    if not targets:
        raise ModuleError(f"no layer of the model matches target_modules {spec.target_modules!r}")
    return targets


def choose_sparse_indices(scores: dict[str, torch.Tensor], density: float) -> dict[str, torch.Tensor]:
    """For each weight matrix, the flat positions of its `density` share of largest scores (summed
    gradient magnitudes), at least one, in increasing order."""
    chosen = {}
    for name, score in scores.items():
        count = max(1, round(density * score.numel()))
        chosen[name] = torch.topk(score.flatten(), count).indices.sort().values.cpu()
    return chosen


def folded_backbone(tower: Tower, base: PreTrainedModel) -> torch.nn.Module:
    """A standalone copy of `base` with the BitFit or sparse difference of `tower` (built on it) added
    into its tensors; the tower and the base are left as they are."""
    model = copy.deepcopy(base)
    with torch.no_grad():
        for name, module in tower.model.named_modules():
            if parametrize.is_parametrized(module):
                for tensor in module.parametrizations:
                    getattr(model.get_submodule(name), tensor).copy_(getattr(module, tensor))
    return model
