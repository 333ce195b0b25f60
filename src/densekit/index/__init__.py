"""Faiss indexes built from saved embeddings, saved to and loaded from disk."""

from densekit.index.faiss_index import SearchIndex, build_index
from densekit.index.spec import IndexSpec, SpecError

__all__ = ["IndexSpec", "SearchIndex", "SpecError", "build_index"]
