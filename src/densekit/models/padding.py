"""The CPU padding policy, decided here alone: whether a padded batch is packed (only its real tokens
computed, `densekit.models.packed`), and what one more forward pass costs where padding is computed, by
which `densekit.inference.infer_in_batches` cuts its batches."""

from __future__ import annotations

import torch

from densekit.models.packed import packs

# What one more forward pass costs on a CPU beyond the tokens it computes, in tokens' worth of compute:
# all-MiniLM-L6-v2 on SciFact's queries (23 tokens on average) in groups of 32 and 64 as they arrive ran
# within 4% of each other at 64, 128 and 256 (a one-off sweep), and 1.2 to 1.3x as fast as in fixed
# batches of 32 (benchmarks/results/inference_padding.json).
CPU_PASS_TOKENS = 128

# The share of a batch's positions that must be padding for packing to pay: measured with
# all-MiniLM-L6-v2 on SciFact, packing cost more where there is next to none (sorted passages near 256
# tokens: 4% more; a lone query: 15.1 to 15.5 ms of CPU against 14.1 to 14.5, alternating in process).
PACK_ABOVE_PADDING = 0.1


def packs_on(backbone: torch.nn.Module, device: torch.device, module: str | None) -> bool:
    """Whether inference by `backbone` on `device` with `module` (None: the base alone) computes only the
    real tokens where padding is worth skipping: the base alone, a BERT `packed_hidden` runs, on a CPU;
    a module's towers compute every position."""
    return module is None and device.type == "cpu" and packs(backbone)


def worth_packing(attention_mask: torch.Tensor) -> bool:
    """Whether `packed_hidden` costs less than transformers' forward pass over every position of this
    padded batch: more than `PACK_ABOVE_PADDING` of its positions are padding."""
    return float(attention_mask.sum()) < (1 - PACK_ABOVE_PADDING) * attention_mask.numel()


def pass_cost(device: torch.device, computes_padding: bool = True) -> int | None:
    """What one more forward pass costs in tokens, for cutting length-sorted batches short where their
    padding would cost more (`densekit.inference.length_batches`): `CPU_PASS_TOKENS` on a CPU for a model
    that computes its padding; None (batches of the full size) on an accelerator or for one that packs."""
    return CPU_PASS_TOKENS if computes_padding and device.type == "cpu" else None
