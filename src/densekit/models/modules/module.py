"""A module on an encoder: one tower for queries and passages, or one each, and its folder.

A module folder holds `densekit-module.json` (the spec, the encoder settings it was trained with, and
the base: where it came from and the fingerprint of its weights), the module's weights (for LoRA, IA3,
prefix and prompt tuning in peft's own layout, `PeftModel.from_pretrained` reads it) and densekit's
artefact manifest. It loads only onto the base it names.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict
from transformers import PreTrainedModel

from densekit.diagnostics import DataError, Problem
from densekit.io.artefact import artefact_dir, verify
from densekit.io.model_card import write_model_card
from densekit.models.card import module_card
from densekit.models.checkpoint_files import validated_file
from densekit.models.config import EncoderConfig
from densekit.models.fingerprint import tensors_fingerprint
from densekit.models.modules.kind import ModuleError, Positions, kind_of
from densekit.models.modules.sizing import check_module_size
from densekit.models.modules.specs import ModuleSpec
from densekit.models.modules.tower import Tower, freeze

MODULE_FILE = "densekit-module.json"
MODULE_KIND = "module"
PLACES = {"shared": ["."], "separate": ["query", "passage"], "query": ["query"]}


class BaseRecord(BaseModel):
    """The base a module, route or hypernetwork was made on: where it was loaded from, its weights'
    fingerprint."""

    model_config = ConfigDict(extra="forbid")

    source: str
    fingerprint: str


class ModuleFile(BaseModel):
    """`densekit-module.json`: the module's spec, the encoder settings it was trained with, its base."""

    model_config = ConfigDict(extra="forbid")

    spec: ModuleSpec
    settings: EncoderConfig
    base: BaseRecord


def is_module_folder(path: str | Path) -> bool:
    """Whether `path` is a folder holding a saved module."""
    return (Path(path) / MODULE_FILE).is_file()


def read_module_file(folder: str | Path) -> ModuleFile:
    """The description a module folder holds of itself; an invalid one is named by file and line."""
    return validated_file(Path(folder) / MODULE_FILE, ModuleFile)


def _build_tower(base: PreTrainedModel, spec: Any, positions: Positions | None) -> Tower:
    return kind_of(spec).build(base, spec, positions)


class EncoderModule(torch.nn.Module):
    """A named module of an encoder: the towers that encode queries and passages with it."""

    def __init__(self, spec: Any, query_tower: Tower, passage_tower: Tower, base: dict[str, str]):
        super().__init__()
        self.spec = spec
        self.query_tower = query_tower
        self.passage_tower = passage_tower
        self.base = base  # {"source": where the base was loaded from, "fingerprint": its weights'}
        self.folder: Path | None = None  # where it was loaded from; None for one made in this process

    @property
    def name(self) -> str:
        """The name the encoder knows it by (`module=`)."""
        return self.spec.name

    @classmethod
    def build(
        cls,
        query_base: PreTrainedModel,
        passage_base: PreTrainedModel,
        spec: Any,
        base: dict[str, str],
        sparse_indices: dict[str, Positions] | None = None,
    ) -> EncoderModule:
        """A fresh module of `spec` on the encoder's backbones (the same one when tied); a kind with
        positions (a sparse difference) takes them per tower ("query", "passage")."""
        indices = sparse_indices or {}
        check_module_size(query_base, spec)
        if spec.towers == "shared":
            if query_base is not passage_base:
                raise ModuleError(
                    f"module {spec.name!r}: towers 'shared' needs a tied encoder; this one has two towers "
                    "(use towers: separate)"
                )
            tower = _build_tower(query_base, spec, indices.get("query"))
            return cls(spec, tower, tower, base)
        query = _build_tower(query_base, spec, indices.get("query"))
        if spec.towers == "query":
            freeze(passage_base)
            return cls(spec, query, Tower(passage_base, passage_base), base)
        passage = _build_tower(passage_base, spec, indices.get("passage"))
        return cls(spec, query, passage, base)

    def towers(self) -> dict[str, Tower]:
        """Its towers by the folder they save in: "." when shared, else "query" (and "passage" unless
        passages are the base's)."""
        return {place: self.query_tower if place in (".", "query") else self.passage_tower
                for place in PLACES[self.spec.towers]}  # fmt: skip

    def fingerprint(self) -> str:
        """A digest of the spec and the module's own tensors, as they are now."""
        state = {
            f"{place}/{name}": tensor
            for place, tower in self.towers().items()
            for name, tensor in tower.own_state().items()
        }
        return tensors_fingerprint(state, self.spec.model_dump_json())

    def save(self, folder: str | Path, settings: dict[str, Any]) -> None:
        """Write the module folder atomically; `settings` are the encoder settings it was trained with."""
        identity = {"base": self.base["fingerprint"], "module": self.fingerprint(), "settings": settings}
        kind = kind_of(self.spec)
        with artefact_dir(folder, MODULE_KIND, identity, {"base": self.base["source"]}) as tmp:
            for place, tower in self.towers().items():
                target = tmp / place
                target.mkdir(exist_ok=True)
                kind.save(tower, target, self.base["source"], self.spec)
            description = {"spec": self.spec.model_dump(), "settings": settings, "base": self.base}
            (tmp / MODULE_FILE).write_text(json.dumps(description, indent=2), encoding="utf-8")
        spec, plain_settings = self.spec.model_dump(mode="json"), json.loads(json.dumps(settings))
        write_model_card(folder, module_card(Path(folder), spec, self.base, plain_settings))

    @classmethod
    def load(
        cls, folder: str | Path, query_base: PreTrainedModel, passage_base: PreTrainedModel, fingerprint: str
    ) -> EncoderModule:
        """The module saved in `folder`, on these backbones; refused when their weights (`fingerprint`)
        are not those it was trained on, or when its files were changed since."""
        folder = Path(folder)
        if not is_module_folder(folder):
            raise DataError([Problem(folder, None, f"not a module folder: it has no {MODULE_FILE}")])
        manifest = verify(folder)
        if manifest.kind != MODULE_KIND:
            what = f"not a module folder: densekit made it as a {manifest.kind}"
            raise DataError([Problem(folder, None, what)])
        description = read_module_file(folder)
        spec, base = description.spec, description.base.model_dump()
        if base["fingerprint"] != fingerprint:
            raise ModuleError(
                f"{folder}: module {spec.name!r} was trained on another base ({base['source']}, weights "
                f"{base['fingerprint'][:19]}...), not on this model (weights {fingerprint[:19]}...)"
            )
        kind = kind_of(spec)
        saved = {("query" if place == "." else place): kind.saved_positions(folder / place)
                 for place in PLACES[spec.towers]}  # fmt: skip
        indices = None if all(positions is None for positions in saved.values()) else saved
        module = cls.build(query_base, passage_base, spec, base, indices)
        for place, tower in module.towers().items():
            kind.load(tower, folder / place)
        module.folder = folder
        return module
