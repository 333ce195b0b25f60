"""Indexes of saved embeddings: a backend-independent `SearchIndex` (`base`), the backends that build,
save, load and search them (`backends`: faiss; binary and int8 codes rescored from disk; Milvus), and
`build_index`, which builds with the backend whose spec it is given (`registry`).

The names load on first use and the backends when one is first asked for, so that importing
`densekit.index` (as the command line does for its options) imports neither faiss nor pymilvus.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from densekit.index.backends.faiss_index import FaissIndex
    from densekit.index.backends.quantized_index import QuantizedIndex, QuantizedSpec
    from densekit.index.base import BuildOptions, SearchIndex
    from densekit.index.registry import build_index
    from densekit.index.spec import IndexSpec, SpecError

__all__ = [
    "BuildOptions", "FaissIndex", "IndexSpec", "QuantizedIndex", "QuantizedSpec", "SearchIndex", "SpecError",
    "build_index",
]  # fmt: skip
_WHERE = {
    "BuildOptions": "base",
    "FaissIndex": "backends.faiss_index",
    "IndexSpec": "spec",
    "QuantizedIndex": "backends.quantized_index",
    "QuantizedSpec": "backends.quantized_index",
    "SearchIndex": "base",
    "SpecError": "spec",
    "build_index": "registry",
}


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"densekit.index.{_WHERE[name]}"), name)
