"""A tower: a copy of a base backbone that shares every base tensor, with one module's parts added.

Copying the module tree but not its tensors lets one loaded base carry any number of modules at once,
each changing only its own copy's layers; switching modules is choosing a tower, and the base itself is
never modified (its tensors are frozen and stay bit-identical).
"""

from __future__ import annotations

import copy
import itertools

import torch
from transformers import PreTrainedModel


def shared_copy(backbone: torch.nn.Module) -> torch.nn.Module:
    """A copy of `backbone`'s modules whose parameters and buffers are the very tensors of `backbone`."""
    memo = {id(t): t for t in itertools.chain(backbone.parameters(), backbone.buffers())}
    return copy.deepcopy(backbone, memo)


def freeze(backbone: torch.nn.Module) -> None:
    """Stop gradients to every tensor of `backbone`."""
    for parameter in backbone.parameters():
        parameter.requires_grad_(False)


class Tower(torch.nn.Module):
    """A backbone with one module's parts: `model` runs it, `parts` holds densekit's own parameters.

    `virtual_tokens` states are dropped from the front of the output (prompt tuning's learned inputs),
    so the output lines up with the attention mask of the text.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        base: PreTrainedModel,
        parts: torch.nn.Module | None = None,
        virtual_tokens: int = 0,
    ):
        super().__init__()
        self.model = model
        self.parts = parts if parts is not None else torch.nn.Module()
        self.virtual_tokens = virtual_tokens
        self._base_ids = {id(t) for t in itertools.chain(base.parameters(), base.buffers())}

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Token states of a padded batch."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return hidden[:, self.virtual_tokens :]

    def own_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The module's parameters by name: every one the base does not hold."""
        return {name: p for name, p in self.named_parameters() if id(p) not in self._base_ids}

    def own_state(self) -> dict[str, torch.Tensor]:
        """The module's parameters and buffers (a sparse difference's positions) by name."""
        buffers = {name: b for name, b in self.named_buffers() if id(b) not in self._base_ids}
        return {**self.own_parameters(), **buffers}


def _number_kind(tensor: torch.Tensor) -> str:
    """Whether `tensor` holds real numbers, whole numbers, complex numbers or truth values."""
    if tensor.dtype == torch.bool:
        return "bool"
    return "complex" if tensor.is_complex() else "float" if tensor.is_floating_point() else "int"


def state_mismatch(expected: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> str | None:
    """What keeps `saved` tensors from filling `expected` ones: the names missing, unexpected, of
    another shape or of another kind of number (a float in place of a float of other precision fits;
    three of each at most); None when they fit."""
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    common = set(expected) & set(saved)
    reshaped = sorted(key for key in common if expected[key].shape != saved[key].shape)
    retyped = sorted(key for key in common if _number_kind(expected[key]) != _number_kind(saved[key]))
    if not (missing or unexpected or reshaped or retyped):
        return None
    found = [("missing", missing), ("unexpected", unexpected), ("of another shape", reshaped),
             ("of another dtype", retyped)]  # fmt: skip
    return ", ".join(f"{what} {names[:3]}" for what, names in found if names)
