"""The kinds densekit builds itself, which peft does not provide (bottleneck adapters, BitFit, sparse
differences): their tensors saved as one safetensors file per tower, and, for those that change the
base's own tensors through a parametrisation `base + delta`, folded by adding the delta in."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import safetensors.torch
import torch
from torch.nn.utils import parametrize

from densekit.models.checkpoint_files import read_safetensors
from densekit.models.modules.kind import ModuleError, ModuleKind
from densekit.models.modules.tower import Tower, state_mismatch

OWN_WEIGHTS = "module.safetensors"


def _stored(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as saved: 64-bit positions (a sparse difference's) in 32 bits where they fit, which
    makes its folder about a third smaller; loading widens them again."""
    if tensor.dtype == torch.int64 and (tensor.numel() == 0 or int(tensor.max()) < 2**31):
        return tensor.to(torch.int32)
    return tensor


class OwnKind(ModuleKind):
    """A kind densekit builds: its module's own tensors (`Tower.own_state`) in `module.safetensors`."""

    def save(self, tower: Tower, folder: Path, base_source: str, spec: Any) -> None:
        """Write the module's own tensors, positions in 32 bits where they fit."""
        state = {name: _stored(t.detach().contiguous()) for name, t in tower.own_state().items()}
        safetensors.torch.save_file(state, str(folder / OWN_WEIGHTS))

    def load(self, tower: Tower, folder: Path) -> None:
        """Set the module's own tensors to those saved; every tensor must fit."""
        path = folder / OWN_WEIGHTS
        state = read_safetensors(path)
        expected = tower.own_state()
        problem = state_mismatch(expected, state)
        if problem:
            raise ModuleError(f"{path}: does not fit the module its config describes ({problem})")
        with torch.no_grad():
            for name, tensor in expected.items():
                tensor.copy_(state[name])

    def fold(self, tower: Tower, base: torch.nn.Module) -> torch.nn.Module:
        """A standalone copy of `base` with the tower's parametrised tensors (`base + delta`) written into
        it; the tower and the base are left as they are."""
        if not self.mergeable:
            return super().fold(tower, base)
        model = copy.deepcopy(base)
        with torch.no_grad():
            for name, module in tower.model.named_modules():
                if parametrize.is_parametrized(module):
                    for tensor in module.parametrizations:
                        getattr(model.get_submodule(name), tensor).copy_(getattr(module, tensor))
        return model
