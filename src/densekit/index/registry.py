"""The backend that builds what is asked, and building with it: the one way the command line, the recipes
and Python build an index, whichever backend makes it. Loading goes through `SearchIndex.load`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from densekit.encoding.store import EmbeddingStore
from densekit.index.base import (
    ADD_BATCH,
    DEFAULT_BACKEND,
    BuildOptions,
    SearchIndex,
    registered_backends,
)
from densekit.index.spec import SpecError

if TYPE_CHECKING:
    from densekit.index.recall import RecallSettings


def one_of(names: list[str] | tuple[str, ...]) -> str:
    """Names for a sentence: "a", "a or b", "a, b or c"."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def backend_for(index_type: str | None = None, backend: str | None = None) -> type[SearchIndex]:
    """The backend named, checked to build `index_type`; without a name, the one building
    `index_type` (faiss where it is one of several, the default where no type is given). A name or
    type no backend knows is a `SpecError` naming the known ones."""
    backends = registered_backends()
    if backend is not None:
        chosen = backends.get(backend)
        if chosen is None:
            raise SpecError("backend", backend, f"densekit has {one_of(sorted(backends))}")
        if index_type is not None and index_type not in chosen.types:
            raise SpecError("type", index_type, f"the {backend} backend builds {one_of(chosen.types)}")
        return chosen
    if index_type is None:
        return backends[DEFAULT_BACKEND]
    building = [found for found in backends.values() if index_type in found.types]
    if not building:
        known = [name for found in backends.values() for name in found.types]
        raise SpecError("type", index_type, f"densekit builds {one_of(list(dict.fromkeys(known)))}")
    if backends.get(DEFAULT_BACKEND) in building:
        return backends[DEFAULT_BACKEND]
    if len(building) > 1:
        names = one_of([found.backend for found in building])
        raise SpecError("type", index_type, f"the {names} backends build it: choose one with --backend")
    return building[0]


def spec_for(index_type: str | None, backend: str | None, settings: dict[str, Any]) -> BaseModel:
    """The spec of the backend building `index_type` (its default type where None), from its
    `settings` by field name; `SpecError` names the first that it refuses."""
    chosen = backend_for(index_type, backend)
    return chosen.spec_of({**settings, "type": index_type or chosen.types[0]})


def backend_of(spec: BaseModel) -> type[SearchIndex]:
    """The backend whose spec `spec` is."""
    for backend in registered_backends().values():
        if type(spec) is backend.spec_class:
            return backend
    raise TypeError(f"{type(spec).__name__} is the spec of no index backend")


def build_index(
    store: EmbeddingStore,
    spec: BaseModel,
    output: Path | str,
    seed: int = 0,
    show_progress: bool = True,
    add_batch: int = ADD_BATCH,
    check_memory: bool = True,
    recall: RecallSettings | None = None,
    overwrite: bool = False,
) -> Path:
    """Build an index of `spec` (any backend's: `IndexSpec` for faiss's) over `store` and save it
    atomically to `output`, with the backend whose spec it is (`BuildOptions` says what the other
    arguments do)."""
    options = BuildOptions(seed, show_progress, check_memory, recall, overwrite, add_batch)
    return backend_of(spec).build(store, spec, Path(output), options)
