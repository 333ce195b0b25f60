"""The kinds peft provides (LoRA, IA3, prefix and prompt tuning...), built by peft on a tower and saved in
peft's own layout, so `PeftModel.from_pretrained(base, folder)` loads a module folder too."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path
from typing import Any, ClassVar

import peft
import torch
from transformers import PreTrainedModel

from densekit.io.readme import CARD_FILE
from densekit.models.checkpoint_files import read_safetensors
from densekit.models.modules.kind import ModuleError, ModuleKind, Positions
from densekit.models.modules.layers import matching
from densekit.models.modules.tower import Tower, freeze, shared_copy, state_mismatch

WEIGHTS_FILE = "adapter_model.safetensors"
TASK = peft.TaskType.FEATURE_EXTRACTION  # a model that returns token states


def named_exactly(base: torch.nn.Module | None, pattern: str) -> str:
    """`pattern` as the alternation of the layer names of `base` it matches, each escaped: peft matches
    a pattern with Python's `re`, which a pattern that backtracks without end would hang, so it is
    matched first under a deadline (`matching`) and peft gets the names it found."""
    if base is None:
        return pattern
    return "|".join(re.escape(name) for name, _ in matching(base, pattern)) or pattern


class PeftKind(ModuleKind):
    """A kind peft provides: a subclass gives `config`, peft's configuration for a spec; `build`, `save`,
    `load` and `fold` are peft's."""

    # settings peft would rewrite into the saved `adapter_config.json` (a regular expression expanded
    # by `named_exactly`), written as the spec gives them instead
    saved_as_given: ClassVar[tuple[str, ...]] = ()

    def config(self, spec: Any, base: torch.nn.Module | None = None) -> peft.PeftConfig:
        """peft's configuration for `spec` (with `base`, patterns may name its layers exactly)."""
        raise NotImplementedError(f"module kind {self.name!r} gives no peft configuration")

    def output_virtual_tokens(self, spec: Any) -> int:
        """Learned states peft puts before the text's in the output (prompt tuning's), dropped by the
        tower so that the output lines up with the text's attention mask."""
        return 0

    def build(self, base: PreTrainedModel, spec: Any, positions: Positions | None = None) -> Tower:
        """A tower of `base` carrying a fresh peft module; the base's tensors are frozen."""
        freeze(base)
        with warnings.catch_warnings():
            # peft warns of settings that matter for its causal-LM and seq2seq tasks only
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(shared_copy(base), self.config(spec, base))
        return Tower(model, base, virtual_tokens=self.output_virtual_tokens(spec))

    def save(self, tower: Tower, folder: Path, base_source: str, spec: Any) -> None:
        """Write `tower`'s module as peft does (`adapter_config.json`, `adapter_model.safetensors`, but
        not its card), so `PeftModel.from_pretrained(base, folder)` loads it too."""
        model = tower.model
        config = model.peft_config["default"]
        config.base_model_name_or_path = base_source
        written = {key: getattr(spec, key) for key in self.saved_as_given}
        exact = {key: getattr(config, key) for key in written}
        try:
            for key, value in written.items():
                setattr(config, key, value)
            # the embedding layers never change here; "auto" would look the base up on the hub to check
            model.save_pretrained(str(folder), safe_serialization=True, save_embedding_layers=False)
            # peft's boilerplate card, which names the base by this machine's path: the module folder
            # gets densekit's card instead
            (folder / CARD_FILE).unlink(missing_ok=True)
        finally:
            for key, value in exact.items():
                setattr(config, key, value)

    def load(self, tower: Tower, folder: Path) -> None:
        """Set `tower`'s peft module to the weights saved in `folder`; every tensor must match."""
        device = next(tower.parameters()).device
        state = read_safetensors(folder / WEIGHTS_FILE, device=str(device))
        problem = state_mismatch(peft.get_peft_model_state_dict(tower.model), state)
        if problem:
            raise ModuleError(
                f"{folder / WEIGHTS_FILE}: does not fit the module its config describes ({problem})"
            )
        peft.set_peft_model_state_dict(tower.model, state)

    def fold(self, tower: Tower, base: torch.nn.Module) -> torch.nn.Module:
        """peft's `merge_and_unload` on a copy of the tower (the tower and its base are left as they
        are)."""
        if not self.mergeable:
            return super().fold(tower, base)
        return copy.deepcopy(tower.model).merge_and_unload()
