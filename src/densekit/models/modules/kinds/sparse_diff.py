"""Sparse differences (Guo et al., 2021; Ansell et al., 2022), which peft does not provide: a learned
change to a fixed share of the entries of chosen weight matrices, as a parametrisation `base + delta` of
the tower's own copies, the change zero at the start. Training chooses the positions (the entries with
the largest summed gradient magnitude over the first batches, `densekit.training.modules`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from torch.nn.utils import parametrize
from transformers import PreTrainedModel

from densekit.models.checkpoint_files import read_safetensors
from densekit.models.modules.kind import (
    BaseSpec,
    LayerPattern,
    ModuleError,
    Positions,
    register_module_kind,
)
from densekit.models.modules.layers import matching
from densekit.models.modules.own_kind import OWN_WEIGHTS, OwnKind
from densekit.models.modules.tower import Tower, freeze, shared_copy


class SparseDiffSpec(BaseSpec):
    """A sparse difference (Guo et al., 2021; Ansell et al., 2022): a change to a fixed share of the
    weights, chosen as the entries with the largest accumulated gradient magnitude over the first
    `selection_batches` training batches."""

    type: Literal["sparse_diff"] = "sparse_diff"
    density: float = Field(0.01, gt=0, le=1, description="share of each chosen weight matrix's entries")
    selection_batches: int = Field(4, gt=0)
    target_modules: LayerPattern = Field(
        r"encoder\.layer\.\d+\..*\.(query|key|value|dense)", description="a regular expression"
    )


class AddSparseDelta(torch.nn.Module):
    """A parametrisation: the base tensor plus learned values at fixed flat positions."""

    def __init__(self, indices: torch.Tensor, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("indices", indices.to(torch.long))
        self.values = torch.nn.Parameter(torch.zeros(len(indices), dtype=dtype))

    def forward(self, original: torch.Tensor) -> torch.Tensor:
        """The changed tensor."""
        return original.flatten().index_add(0, self.indices, self.values).view_as(original)


@register_module_kind
class SparseDiffKind(OwnKind):
    """A sparse difference is built at given positions (chosen in training, or saved with it); it folds
    into the weights, and averages with others of the same positions."""

    spec = SparseDiffSpec
    title = "sparse difference"
    mergeable = True
    positions_from_gradients = True

    def build(self, base: PreTrainedModel, spec: SparseDiffSpec, positions: Positions | None = None) -> Tower:
        """A tower of `base` whose target weights change at `positions` (by layer name); the base's
        tensors are frozen."""
        freeze(base)
        model = shared_copy(base)
        if positions is None:
            raise ModuleError("a sparse difference needs the positions it changes")
        targets = dict(matching(model, spec.target_modules))
        _weights(list(targets.items()), spec.target_modules)
        unknown = sorted(set(positions) - set(targets))
        if unknown:
            raise ModuleError(f"sparse difference for layers the model lacks: {', '.join(unknown[:3])}")
        for name, indices in positions.items():
            weight = targets[name].weight
            _check_positions(name, indices, weight.numel())
            parametrize.register_parametrization(
                targets[name], "weight", AddSparseDelta(indices, weight.dtype)
            )
        return Tower(model, base, torch.nn.ModuleDict())

    def gradient_targets(self, base: torch.nn.Module, spec: SparseDiffSpec) -> dict[str, torch.nn.Parameter]:
        return sparse_targets(base, spec)

    def positions_from_scores(self, scores: dict[str, torch.Tensor], spec: SparseDiffSpec) -> Positions:
        return choose_sparse_indices(scores, spec.density)

    def parameters(self, base: torch.nn.Module, spec: SparseDiffSpec) -> int:
        return 0  # a change to a share of the base's own weights, no more

    def saved_positions(self, folder: Path) -> Positions:
        """The positions saved with a tower's module, by layer name."""
        return sparse_positions(read_safetensors(folder / OWN_WEIGHTS))

    def shared_positions(self, sources: list[Any]) -> dict[str, Positions]:
        """The positions of sparse differences, which must be the same in every module."""
        first = sources[0]
        indices = {}
        for place, tower in first.towers().items():
            positions = sparse_positions(tower.own_state())
            for other in sources[1:]:
                theirs = sparse_positions(other.towers()[place].own_state())
                if positions.keys() != theirs.keys() or any(
                    not torch.equal(v, theirs[k]) for k, v in positions.items()
                ):
                    raise ModuleError(f"sparse differences {first.name!r} and {other.name!r} change other "
                                     "positions; they average only on the same ones")  # fmt: skip
            indices["query" if place == "." else place] = positions
        return indices


def sparse_positions(state: dict[str, torch.Tensor]) -> Positions:
    """A sparse difference's positions by layer name, from its tower's state (live or saved)."""
    marker = ".parametrizations.weight.0.indices"
    return {key[len("model.") : -len(marker)]: t for key, t in state.items() if key.endswith(marker)}


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
