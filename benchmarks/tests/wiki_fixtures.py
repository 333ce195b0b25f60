"""A small stand-in for wiki1m: a compressed corpus of generated passages with test and train queries
judging several passages each, a nested slice of it, and the whole corpus encoded by a tiny model."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import faiss
import numpy as np
import pytest
import torch

PASSAGES, SLICE = 1200, 700
QUERIES = {"test": 40, "train": 60}


def write_collection(root: Path, seed: int = 0) -> Path:
    """`PASSAGES` passages of 12 to 20 words drawn from a made-up vocabulary, as `corpus.jsonl.gz`; each
    query judges 1 to 3 passages (none judged twice) and is 3 words of the first of them."""
    rng = np.random.default_rng(seed)
    words = ["".join(rng.choice(list("abcdefghijklmnoprstuvw"), size=6)) for _ in range(400)]
    texts = [" ".join(rng.choice(words, size=rng.integers(12, 21))) for _ in range(PASSAGES)]
    (root / "qrels").mkdir(parents=True)
    with gzip.open(root / "corpus.jsonl.gz", "wt", encoding="utf-8") as corpus:
        for row, text in enumerate(texts):
            corpus.write(json.dumps({"_id": f"{row // 10}-{row % 10}", "title": "", "text": text}) + "\n")
    judged = iter(rng.permutation(PASSAGES))
    queries = []
    for split, count in QUERIES.items():
        lines = ["query-id\tcorpus-id\tscore"]
        for number in range(count):
            rows = [next(judged) for _ in range(rng.integers(1, 4))]
            query = f"{split}-{number}"
            queries.append({"_id": query, "text": " ".join(texts[rows[0]].split()[:3])})
            lines += [f"{query}\t{row // 10}-{row % 10}\t1" for row in rows]
        (root / "qrels" / f"{split}.tsv").write_text("\n".join(lines) + "\n")
    (root / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    return root


def wiki_like(root: Path, model: Path) -> tuple[Path, Path, Path]:
    """The collection, its `SLICE`-passage slice (test and train judgements kept, seed 0) and the
    whole corpus's embeddings by `model`."""
    from densekit.data import Dataset
    from densekit.data.slices import slice_collection
    from densekit.encoding.corpus import encode_corpus
    from densekit.models import DenseEncoder

    full = write_collection(root / "full")
    part = slice_collection(full, SLICE, root / "slice", ["test", "train"], seed=0).folder
    embeddings = root / "embeddings"
    encode_corpus(DenseEncoder.load(model).eval(), Dataset.open(full), embeddings, show_progress=False)
    return full, part, embeddings


@pytest.fixture(autouse=True)
def one_thread():
    """faiss and torch on one thread: on a shared machine, OpenMP's threads waiting on each other make
    training a 700-vector IVF-PQ take seconds instead of milliseconds (no test checks a timing)."""
    threads = faiss.omp_get_max_threads(), torch.get_num_threads()
    faiss.omp_set_num_threads(1)
    torch.set_num_threads(1)
    yield
    faiss.omp_set_num_threads(threads[0])
    torch.set_num_threads(threads[1])
