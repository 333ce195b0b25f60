"""Passage vectors looked up in saved embeddings instead of encoded at every step.

When what a run trains leaves passages to the frozen base (a route, a hypernetwork, a module with
`towers: query`), a passage's vector never changes during the run: the base's embeddings of the
corpus, the very ones its index is built from, are those vectors. Looking them up makes a step cost
its queries' forward and backward passes alone. The vectors were encoded with the base in inference
mode, so they carry no dropout, unlike passages encoded in a training step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from densekit.data.dataset import Dataset
from densekit.encoding.store import EmbeddingStore
from densekit.errors import InputError
from densekit.models.encoder import DenseEncoder
from densekit.retrieval.dense import check_passages_made_by


class PassageVectors:
    """Saved vectors by document id (as the training texts name documents: `DOMAIN<US>ID` for the
    documents of `data.collections`)."""

    def __init__(self, matrix: np.ndarray, rows: dict[str, int]):
        self.matrix = torch.from_numpy(np.ascontiguousarray(matrix, dtype=np.float32))
        self.rows = rows

    def __call__(self, doc_ids: list[str]) -> torch.Tensor:
        """The vectors of `doc_ids`, in order."""
        return self.matrix[[self.rows[doc_id] for doc_id in doc_ids]]


def load_passage_vectors(
    folders: list[str], encoder: DenseEncoder, collections: dict[str, Path | str], separator: str
) -> PassageVectors:
    """The vectors of every collection (by prefix: "" for data.path's, the domain for the others) from
    `folders`, each folder matched to the collection whose corpus bytes it was made from; every folder
    must have been made by `encoder`'s passage side with its passage settings, and every collection
    needs one."""
    wanted: dict[str, list[str]] = {}
    for prefix, path in collections.items():
        wanted.setdefault(Dataset.open(path).corpus_digest(), []).append(prefix)
    matrices: list[np.ndarray] = []
    rows: dict[str, int] = {}
    matched: set[str] = set()
    for folder in folders:
        store = EmbeddingStore.open(folder)
        if store.maxp is not None:
            raise InputError(f"data.passage_embeddings: {folder} holds MaxP passages, not one vector a text")
        check_passages_made_by(encoder, store.identity, f"data.passage_embeddings: {folder} was encoded")
        inference = store.identity.get("inference")
        if inference is not None:
            raise InputError(
                f"data.passage_embeddings: {folder} was encoded by {inference['backend']} at "
                f"{inference['precision']}; training looks up the float32 vectors PyTorch computes"
            )
        prefixes = [p for p in wanted.get(store.identity["corpus"], []) if p not in matched]
        if store.identity["corpus"] not in wanted:
            raise InputError(
                f"data.passage_embeddings: {folder} was encoded from none of the training collections' "
                f"corpora ({', '.join(str(path) for path in collections.values())})"
            )
        start = sum(len(m) for m in matrices)
        for prefix in prefixes:
            name = "" if prefix == "" else f"{prefix}{separator}"
            rows.update((f"{name}{doc_id}", start + row) for row, doc_id in enumerate(store.ids()))
            matched.add(prefix)
        if prefixes:
            matrices.append(store.vectors())
    missing = [str(path) for prefix, path in collections.items() if prefix not in matched]
    if missing:
        raise InputError(f"data.passage_embeddings: no embeddings of the corpus of {', '.join(missing)}")
    return PassageVectors(np.concatenate(matrices), rows)
