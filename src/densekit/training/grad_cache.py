"""Gradient caching (Gao et al., 2021): a big batch's exact gradient for the memory of one chunk.

1. Encode every chunk without a graph, saving the random state each started from.
2. Compute the loss on the detached representations and its gradient with respect to them.
3. Encode each chunk again with a graph, replaying its saved random state so dropout draws the same
   masks, and back-propagate the cached gradient through it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class RandomState:
    """The CPU (and current GPU) random state at one moment."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> RandomState:
        """The state now."""
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run with this state; the global random state is left as it was before."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


class Encode(Protocol):
    """Encodes one chunk; with `with_chunk_loss`, also returns a loss of that chunk alone (or None)."""

    def __call__(self, chunk: Any, with_chunk_loss: bool) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def cached_backward(
    inputs: Sequence[tuple[Encode, Sequence[Any]]],
    loss_fn: Callable[..., torch.Tensor],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Back-propagate `loss_fn(*representations)` through every `(encode, chunks)` input, chunk by chunk.

    Each input's representations are its chunks' encodings concatenated; `loss_fn` gets one tensor
    per input. Losses that need no other chunk (an MLM loss) are returned by `encode` on the second
    pass and back-propagated with it, scaled by the caller so that they sum to the batch's. Returns
    the cached loss and the sum of chunk losses, detached. Gradients accumulate into the parameters
    as with `loss.backward()` on the whole batch.
    """
    states: list[list[RandomState]] = []
    detached: list[torch.Tensor] = []
    for encode, chunks in inputs:
        chunk_states = []
        outputs = []
        for chunk in chunks:
            chunk_states.append(RandomState.capture(device))
            with torch.no_grad():
                outputs.append(encode(chunk, with_chunk_loss=False)[0])
        states.append(chunk_states)
        detached.append(torch.cat(outputs).detach().requires_grad_())
    loss = loss_fn(*detached)
    loss.backward()
    chunk_total = torch.zeros((), device=device)
    for (encode, chunks), chunk_states, reps in zip(inputs, states, detached, strict=True):
        offset = 0
        for chunk, state in zip(chunks, chunk_states, strict=True):
            with state.replay():
                output, chunk_loss = encode(chunk, with_chunk_loss=True)
            grad = reps.grad[offset : offset + len(output)]
            offset += len(output)
            surrogate = (output * grad).sum()
            if chunk_loss is not None:
                surrogate = surrogate + chunk_loss
                chunk_total += chunk_loss.detach()
            if surrogate.requires_grad:  # a frozen input (a route's base passages) has nothing to train
                surrogate.backward()
    return loss.detach(), chunk_total


def split_inputs(inputs: dict[str, torch.Tensor], chunk_size: int) -> list[dict[str, torch.Tensor]]:
    """Row chunks of a dict of equally long tensors (model inputs)."""
    rows = next(iter(inputs.values())).shape[0]
    return [
        {name: tensor[start : start + chunk_size] for name, tensor in inputs.items()}
        for start in range(0, rows, chunk_size)
    ]
