"""A route on an encoder: its spec, its router (for learned routes), and its folder.

A route folder holds `densekit-route.json` (the spec; the base, by source and fingerprint; the encoder
settings; each module's folder and fingerprint) and, for a learned route, `router.safetensors`, with
densekit's artefact manifest. `Route.load` loads the base and every module and refuses a module whose
weights are no longer those the route was made with.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from pydantic import BaseModel, ConfigDict, model_validator

from densekit.device import Precision
from densekit.diagnostics import DataError, Problem
from densekit.encoding.embed import embed_texts, embed_tokens
from densekit.errors import InputError
from densekit.io.artefact import artefact_dir, verify
from densekit.io.model_card import write_model_card
from densekit.models.card import route_card
from densekit.models.checkpoint_files import read_safetensors, validated_file
from densekit.models.config import EncoderConfig
from densekit.models.encoder import DenseEncoder
from densekit.models.fingerprint import tensors_fingerprint
from densekit.models.modules.module import BaseRecord, read_module_file
from densekit.models.modules.tower import state_mismatch
from densekit.routing.strategies import AnyRouteSpec, RouteSpec
from densekit.routing.strategy import base_vectors, check_query_only

ROUTE_FILE = "densekit-route.json"
ROUTE_KIND = "route"
ROUTER_WEIGHTS = "router.safetensors"


class SavedModule(BaseModel):
    """Where a route's module is saved and the fingerprint of its weights when the route was made."""

    model_config = ConfigDict(extra="forbid")

    folder: str
    fingerprint: str


class RouteFile(BaseModel):
    """`densekit-route.json`: the route's spec, its base, its modules' folders and the encoder settings."""

    model_config = ConfigDict(extra="forbid")

    spec: AnyRouteSpec
    base: BaseRecord
    modules: dict[str, SavedModule]
    settings: EncoderConfig

    @model_validator(mode="after")
    def _every_module_saved(self) -> RouteFile:
        if set(self.modules) != set(self.spec.modules):
            raise ValueError(
                f"modules {sorted(self.modules)} are saved for a route over {self.spec.modules}; they must "
                "be the same"
            )
        return self


def load_modules(folders: Sequence[str | Path]) -> tuple[DenseEncoder, list[str]]:
    """The base the first module folder names, with every module on it and none its own, and their
    names in order; two modules of one name are an error."""
    if len(folders) < 1:
        raise InputError("give at least one module folder")
    encoder = DenseEncoder.load(folders[0])
    names = [encoder.own]
    encoder.own = None
    for folder in folders[1:]:
        name = encoder.load_module(folder).name
        if name in names:
            raise InputError(f"{folder}: a module called {name!r} is given twice")
        names.append(name)
    return encoder, names


def is_route_folder(path: str | Path) -> bool:
    """Whether `path` is a folder holding a saved route."""
    return (Path(path) / ROUTE_FILE).is_file()


class Route(torch.nn.Module):
    """Routes each query of an encoder among its query-only modules, by the strategy its spec's `type`
    names (`densekit.routing.strategies`)."""

    def __init__(self, encoder: DenseEncoder, spec: RouteSpec, router: torch.nn.Module | None = None):
        super().__init__()
        check_query_only(encoder, spec.modules)
        strategy = spec.strategy
        if not strategy.trainable and router is not None:
            raise InputError(f"a {spec.type} route has no router")
        if strategy.trainable and router is None:
            router = strategy.new_router(spec, encoder.dimension).to(encoder.device)
        self.encoder = encoder
        self.spec = spec
        self.strategy = strategy
        self.router = router

    def scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The router's (queries x modules) scores, from the base's query vectors (soft and top_k)."""
        return self.router(base_vectors(self, input_ids, attention_mask))

    def weights(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, domains: Sequence[str | None] | None
    ) -> torch.Tensor:
        """Each query's weight per module: by its domain (fixed), the router, or the fusion's attention."""
        return self.strategy.weights(self, input_ids, attention_mask, domains)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        domains: Sequence[str | None] | None = None,
    ) -> torch.Tensor:
        """Routed query vectors of a padded batch."""
        return self.strategy.vectors(self, input_ids, attention_mask, domains)

    def encode_queries(
        self,
        texts: list[str],
        domains: Sequence[str | None] | None = None,
        batch_size: int = 64,
        precision: Precision = "float32",
        token_ids: list[list[int]] | None = None,
    ) -> np.ndarray:
        """Routed vectors of `texts` in their order (`domains`, one per text, for a fixed route), under
        torch's `precision`; `token_ids`, the texts' `encoder.tokenize(texts, "query")` where the caller
        has it already, spares tokenizing them again."""
        if domains is not None and not self.strategy.takes_domains:
            raise InputError(
                f"a {self.spec.type} route chooses its modules itself; domains apply to a fixed one"
            )
        if domains is not None and len(domains) != len(texts):
            raise InputError(f"{len(domains)} domains for {len(texts)} queries")

        def encode(input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
            chosen = None if domains is None else [domains[int(i)] for i in rows]
            return self(input_ids, attention_mask, chosen)

        if token_ids is None:
            return embed_texts(self.encoder, texts, "query", batch_size, precision, encode=encode)
        return embed_tokens(self.encoder, token_ids, "query", batch_size, precision, encode=encode)

    def fingerprint(self) -> str:
        """A digest of the spec, the base, the modules' weights and the router's."""
        modules = "|".join(self.encoder.attached[name].fingerprint() for name in self.spec.modules)
        router = {} if self.router is None else dict(self.router.state_dict())
        settings = f"{self.spec.model_dump_json()}|{self.encoder.base_fingerprint()}|{modules}"
        return tensors_fingerprint(router, settings)

    def identity(self) -> dict[str, Any]:
        """What a run made with this route records of it."""
        return {"route": self.fingerprint(), "spec": self.spec.model_dump()}

    def save(self, folder: str | Path, module_folders: dict[str, str | Path]) -> None:
        """Write the route folder; `module_folders` says where each of its modules is saved."""
        missing = sorted(set(self.spec.modules) - set(module_folders))
        if missing:
            raise InputError(f"no folder given for modules {missing}")
        modules = {}
        for name in self.spec.modules:
            held = read_module_file(module_folders[name]).spec.name
            if held != name:
                raise InputError(f"{module_folders[name]} holds module {held!r}, not {name!r}")
            modules[name] = {"folder": str(Path(module_folders[name]).resolve()),
                             "fingerprint": self.encoder.attached[name].fingerprint()}  # fmt: skip
        base = {"source": self.encoder.source, "fingerprint": self.encoder.base_fingerprint()}
        description = {"spec": self.spec.model_dump(), "base": base, "modules": modules,
                       "settings": self.encoder.config.model_dump()}  # fmt: skip
        with artefact_dir(folder, ROUTE_KIND, {"route": self.fingerprint()}, {"base": base["source"]}) as tmp:
            if self.router is not None:
                state = {k: v.detach().contiguous().cpu() for k, v in self.router.state_dict().items()}
                safetensors.torch.save_file(state, str(tmp / ROUTER_WEIGHTS))
            (tmp / ROUTE_FILE).write_text(json.dumps(description, indent=2), encoding="utf-8")
        write_model_card(folder, route_card(Path(folder), json.loads(json.dumps(description))))

    @classmethod
    def load(cls, folder: str | Path, device: torch.device | str = "cpu") -> Route:
        """The route saved in `folder`, on its base with its modules loaded, in inference mode."""
        folder = Path(folder)
        manifest = verify(folder)
        if manifest.kind != ROUTE_KIND or not is_route_folder(folder):
            what = f"not a route folder (densekit made it as a {manifest.kind})"
            raise DataError([Problem(folder, None, what)])
        description = validated_file(folder / ROUTE_FILE, RouteFile)
        spec, base = description.spec, description.base
        settings = description.settings.model_dump(exclude_unset=True)
        encoder = DenseEncoder.load(base.source, **settings).to(device)
        if encoder.base_fingerprint() != base.fingerprint:
            raise InputError(f"{folder}: the base at {base.source} has other weights now")
        for name in spec.modules:
            saved = description.modules[name]
            module_folder = folder / saved.folder  # a relative folder is the route's, not the working one's
            module = encoder.load_module(module_folder)
            if module.name != name or module.fingerprint() != saved.fingerprint:
                raise InputError(f"{folder}: module {name!r} ({module_folder}) changed since the route "
                                 "was made")  # fmt: skip
        router = spec.strategy.new_router(spec, encoder.dimension)
        if router is not None:
            _load_router(router, folder / ROUTER_WEIGHTS)
            router.to(device)
        return cls(encoder.eval(), spec, router).eval()


def _load_router(router: torch.nn.Module, path: Path) -> None:
    """Set `router` to the weights saved in `path`, which must be exactly its tensors."""
    state = read_safetensors(path)
    problem = state_mismatch(dict(router.state_dict()), state)
    if problem:
        raise DataError([Problem(path, None, f"does not fit the route's router ({problem})")])
    router.load_state_dict(state)
