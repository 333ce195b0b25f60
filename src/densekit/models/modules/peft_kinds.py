"""LoRA, IA3, prefix and prompt tuning, built by peft on a tower; saved in peft's own layout."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import peft
import torch
from transformers import PreTrainedModel

from densekit.models.loading import read_safetensors
from densekit.models.modules.own_kinds import matching
from densekit.models.modules.specs import Ia3Spec, LoraSpec, ModuleError, PrefixSpec, PromptSpec
from densekit.models.modules.tower import Tower, freeze, shared_copy, state_mismatch

PeftSpec = LoraSpec | Ia3Spec | PrefixSpec | PromptSpec
WEIGHTS_FILE = "adapter_model.safetensors"


def _named_exactly(base: torch.nn.Module | None, pattern: str) -> str:
    """`pattern` as the alternation of the layer names of `base` it matches, each escaped: peft matches
    an IA3 pattern with Python's `re`, which a pattern that backtracks without end would hang, so it is
    matched first under a deadline (`matching`) and peft gets the names it found."""
    if base is None:
        return pattern
    return "|".join(re.escape(name) for name, _ in matching(base, pattern)) or pattern


def peft_config(spec: PeftSpec, base: torch.nn.Module | None = None) -> peft.PeftConfig:
    """peft's configuration for `spec`, for a model that returns token states (with `base`, an IA3's
    patterns name its layers exactly)."""
    task = peft.TaskType.FEATURE_EXTRACTION
    if isinstance(spec, LoraSpec):
        return peft.LoraConfig(
            r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
            target_modules=spec.target_modules, task_type=task,
        )  # fmt: skip
    if isinstance(spec, Ia3Spec):
        return peft.IA3Config(
            target_modules=_named_exactly(base, spec.target_modules),
            feedforward_modules=_named_exactly(base, spec.feedforward_modules), task_type=task,
        )  # fmt: skip
    if isinstance(spec, PrefixSpec):
        return peft.PrefixTuningConfig(
            num_virtual_tokens=spec.virtual_tokens, prefix_projection=spec.projection, task_type=task
        )
    return peft.PromptTuningConfig(num_virtual_tokens=spec.virtual_tokens, task_type=task)


def peft_tower(base: PreTrainedModel, spec: PeftSpec) -> Tower:
    """A tower of `base` carrying a fresh peft module; the base's tensors are frozen."""
    freeze(base)
    with warnings.catch_warnings():
        # peft warns of settings that matter for its causal-LM and seq2seq tasks only
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(shared_copy(base), peft_config(spec, base))
    virtual = spec.virtual_tokens if isinstance(spec, PromptSpec) else 0
    return Tower(model, base, virtual_tokens=virtual)


def save_peft(tower: Tower, folder: Path, base_source: str, spec: PeftSpec | None = None) -> None:
    """Write `tower`'s module as peft does (`adapter_config.json`, `adapter_model.safetensors`), so
    `PeftModel.from_pretrained(base, folder)` loads it too; an IA3's patterns are written as `spec`
    gives them."""
    model = tower.model
    config = model.peft_config["default"]
    config.base_model_name_or_path = base_source
    written = {"target_modules": spec.target_modules, "feedforward_modules": spec.feedforward_modules} \
        if isinstance(spec, Ia3Spec) else {}  # fmt: skip
    exact = {key: getattr(config, key) for key in written}
    try:
        for key, value in written.items():
            setattr(config, key, value)
        # the embedding layers never change here; "auto" would look the base up on the hub to check
        model.save_pretrained(str(folder), safe_serialization=True, save_embedding_layers=False)
    finally:
        for key, value in exact.items():
            setattr(config, key, value)


def load_peft(tower: Tower, folder: Path) -> None:
    """Set `tower`'s peft module to the weights saved in `folder`; every tensor must match."""
    device = next(tower.parameters()).device
    state = read_safetensors(folder / WEIGHTS_FILE, device=str(device))
    problem = state_mismatch(peft.get_peft_model_state_dict(tower.model), state)
    if problem:
        raise ModuleError(
            f"{folder / WEIGHTS_FILE}: does not fit the module its config describes ({problem})"
        )
    peft.set_peft_model_state_dict(tower.model, state)


def merged_backbone(tower: Tower) -> torch.nn.Module:
    """A standalone backbone with the tower's LoRA or IA3 folded into its weights (the tower and its
    base are left as they are)."""
    return copy.deepcopy(tower.model).merge_and_unload()
