"""What a kind of module is: its settings (a spec), and a class that builds, saves, loads, folds and
averages modules of it, registered under the spec's `type` in a `densekit.registry.Registry` (PEFT's
`register_peft_method` pattern, the shape of every extension point of densekit's).

A kind is one file in `densekit.models.modules.kinds`: a spec class (a `BaseSpec` whose `type` is a
one-value `Literal`, the kind's name) and a `ModuleKind` subclass decorated with `@register_module_kind`.
Importing that package registers every kind in it; the `modules:` section of a training config, the
module files and every command then take the new `type`, and the shared tests run it through
(`tests/test_modules.py`'s matrix is the registry's).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import regex
import torch
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator
from transformers import PreTrainedModel

from densekit.errors import DensekitError
from densekit.models.modules.tower import Tower
from densekit.registry import Registry, spec_type

Towers = Literal["shared", "separate", "query"]
MAX_PATTERN_CHARS = 1000  # a regular expression naming layers; BERT's longest default is 48 characters
# a kind's changes to the base's tensors at given flat positions, by layer name, per tower ("query",
# "passage"): a sparse difference's
Positions = dict[str, torch.Tensor]


class ModuleError(DensekitError, ValueError):
    """A module that does not fit the encoder it is put on."""


def _layer_pattern(pattern: str) -> str:
    """A regular expression naming layers, refused when it is too long or does not compile."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"a layer pattern of {len(pattern)} characters; at most {MAX_PATTERN_CHARS}")
    try:
        regex.compile(pattern)
    except regex.error as err:
        raise ValueError(f"{pattern!r} is not a regular expression ({err})") from None
    return pattern


LayerPattern = Annotated[str, AfterValidator(_layer_pattern)]
LayerName = Annotated[str, Field(min_length=1, max_length=MAX_PATTERN_CHARS)]

# BERT's module names (all-MiniLM-L6-v2, Contriever, coCondenser...); other architectures name theirs
BERT_ATTENTION = ["query", "key", "value", "attention.output.dense"]
BERT_FFN_IN = r"encoder\.layer\.\d+\.intermediate"
BERT_FFN_OUT = r"encoder\.layer\.\d+\.output\.dense"


class BaseSpec(BaseModel):
    """What every module has: a name and whether queries and passages share it. A kind's spec adds
    `type: Literal["<kind>"] = "<kind>"` and its own settings."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("module", description="the name the encoder knows it by (module=)")
    towers: Towers = Field(
        "shared",
        description="shared: one module for queries and passages; separate: one each; query: queries only, "
        "passages encoded by the base (modules routed per query share one passage index)",
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        # no '.': torch holds modules by name, and a dotted name is a path to it
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,99}", name):
            raise ValueError(f"{name!r}: a module name is 1 to 100 letters, digits, '_' and '-'")
        return name


class ModuleKind(ABC):
    """One kind of module: how a tower carrying a module of it is built, saved, loaded, folded into the
    base and averaged with others.

    A subclass sets `spec` (its settings' class), `title` (its name in words, "LoRA"), `mergeable`
    (whether `fold` gives a plain model), `starts_as_base` (whether a fresh module's output is exactly
    the base's: prefix and prompt tuning add inputs, so theirs is not), `averages_across_settings`
    (whether modules of other settings average, as LoRA's weight changes add up), `size_setting` (the
    setting named when a module would outgrow its base) and `positions_from_gradients` (whether
    training chooses the positions it changes, as a sparse difference's, before it builds it: from the
    gradients of its `gradient_targets`, by `positions_from_scores`).

    It implements `build` and `parameters`; the families implement `save`, `load` and `fold`
    (`PeftKind` for the kinds peft provides, `OwnKind` for densekit's own).
    """

    spec: ClassVar[type[BaseSpec]]
    title: ClassVar[str]
    mergeable: ClassVar[bool] = False
    starts_as_base: ClassVar[bool] = True
    averages_across_settings: ClassVar[bool] = False
    size_setting: ClassVar[str | None] = None
    positions_from_gradients: ClassVar[bool] = False

    @property
    def name(self) -> str:
        """The kind's name: the `type` its spec takes."""
        return spec_type(self.spec)

    @abstractmethod
    def build(self, base: PreTrainedModel, spec: Any, positions: Positions | None = None) -> Tower:
        """A tower of `base` carrying a fresh module of `spec` (at `positions`, for a kind that takes
        them); the base's tensors are frozen and never written."""

    @abstractmethod
    def parameters(self, base: torch.nn.Module, spec: Any) -> int:
        """How many parameters a module of `spec` would add to `base`, worked out before any of it is
        allocated; `ModuleError` for targets that match nothing it can adapt."""

    @abstractmethod
    def save(self, tower: Tower, folder: Path, base_source: str, spec: Any) -> None:
        """Write `tower`'s module into `folder` (one tower's place in the module folder)."""

    @abstractmethod
    def load(self, tower: Tower, folder: Path) -> None:
        """Set `tower`'s module to the weights saved in `folder`; every tensor must fit."""

    def saved_positions(self, folder: Path) -> Positions | None:
        """The positions a saved tower's module changes, needed to build it before it loads; None for a
        kind without positions."""
        return None

    def virtual_positions(self, spec: Any) -> int:
        """The positions of the base's input a module of `spec` takes from the text (prefix and prompt
        tuning's virtual tokens)."""
        return 0

    def gradient_targets(self, base: torch.nn.Module, spec: Any) -> dict[str, torch.nn.Parameter]:
        """The weights of `base`, by layer name, whose gradients over a module's first
        `spec.selection_batches` batches choose its positions; only a `positions_from_gradients` kind
        chooses them."""
        raise ModuleError(f"a {self.name} module does not choose its positions from gradients")

    def positions_from_scores(self, scores: dict[str, torch.Tensor], spec: Any) -> Positions:
        """The positions a module of `spec` changes, by layer name, from each of its `gradient_targets`'
        summed gradient magnitudes."""
        raise ModuleError(f"a {self.name} module does not choose its positions from gradients")

    def fold(self, tower: Tower, base: torch.nn.Module) -> torch.nn.Module:
        """A standalone copy of `base` with `tower`'s module folded into its weights; the tower and the
        base are left as they are. Only a `mergeable` kind folds."""
        raise ModuleError(f"a {self.name} module does not fold into the base's weights")

    def shared_positions(self, sources: list[Any]) -> dict[str, Positions] | None:
        """The positions every one of `sources` changes, which must be the same for them to average;
        None for a kind without positions."""
        return None

    def average(self, encoder: Any, sources: list[Any], weights: list[float], specs: list[Any]) -> Any:
        """Put on `encoder` (a `DenseEncoder`) a module of `specs[0]` (the sources' spec, renamed) whose
        every tensor is the `weights`-weighted average of the `sources`' (`EncoderModule`s of this kind
        with the same settings), and return it."""
        if any(spec != specs[0] for spec in specs):
            raise ModuleError(settings_differ(sources))
        averaged = encoder.new_module(specs[0], self.shared_positions(sources))
        with torch.no_grad():
            for place, tower in averaged.towers().items():
                parts = [module.towers()[place].own_parameters() for module in sources]
                for key, parameter in tower.own_parameters().items():
                    parameter.copy_(sum(w * part[key] for w, part in zip(weights, parts, strict=True)))
        return averaged


MODULE_KINDS: Registry[ModuleKind] = Registry(
    "module kind", lambda cls: spec_type(cls.spec), lambda cls: cls(), unknown=ModuleError
)
# `@register_module_kind` registers a kind under its spec's `type`; `kind_named` finds it, an unknown name
# an error that lists the known ones
register_module_kind = MODULE_KINDS.register
kind_named = MODULE_KINDS.named


def kind_of(spec: Any) -> ModuleKind:
    """The kind of a module `spec`."""
    return kind_named(spec.type)


def settings_differ(sources: list[Any]) -> str:
    """Why modules of other kinds or settings do not average, naming them and the kinds that would."""
    kinds = ", ".join(f"{m.name} ({m.spec.type})" for m in sources)
    across = " and ".join(kind.title for kind in MODULE_KINDS.values() if kind.averages_across_settings)
    return (f"modules {kinds} differ in their settings; only {across} modules of different settings "
            "average (their weight changes add up)")  # fmt: skip
