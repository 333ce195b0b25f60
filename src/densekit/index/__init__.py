"""Indexes of saved embeddings: a backend-independent `SearchIndex` (`base`), Faiss indexes built,
saved and loaded from disk (`faiss_index`), and Milvus collections (`milvus_index`, its client imported
only when used). Importing the package registers both backends with `SearchIndex.load`."""

from densekit.index import milvus_index
from densekit.index.base import SearchIndex
from densekit.index.faiss_index import FaissIndex, build_index
from densekit.index.spec import IndexSpec, SpecError

__all__ = ["FaissIndex", "IndexSpec", "SearchIndex", "SpecError", "build_index", "milvus_index"]
