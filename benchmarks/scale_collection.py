"""The scale benchmark's inputs: a generated BEIR collection of any size and a tiny random encoder.

Passages are 40 to 80 words (60 on average) drawn with the word frequencies of the shared test
collections' corpora, so BM25 meets a realistic vocabulary; each query is six words of its one relevant
passage. The encoder has all-MiniLM-L6-v2's shape (width 384, 12 heads, 1,536 in the feed-forward layer,
its tokenizer, mean pooling, normalised) but one layer and random weights, so encoding is cheap.
"""

from __future__ import annotations

import collections
import json
import re
from pathlib import Path

import numpy as np

SOURCES = ("scifact", "nfcorpus", "vaswani", "cranfield")
TEST_QUERIES = 1000
TRAIN_QUERIES = 2000
QUERY_WORDS = 6
_WORD = re.compile(r"[a-z]{2,}")
_MARK = "scale-collection.json"  # what was generated here, so the same collection is not made twice


def _mark(passages: int, seed: int) -> dict:
    return {"passages": passages, "seed": seed, "test": TEST_QUERIES, "train": TRAIN_QUERIES, "version": 1}


def is_generated(root: Path, passages: int, seed: int = 0) -> bool:
    """True when `root` holds the collection `generate_collection` makes for `passages` and `seed`."""
    return (root / _MARK).is_file() and json.loads((root / _MARK).read_text()) == _mark(passages, seed)


def vocabulary(shared: Path) -> tuple[np.ndarray, np.ndarray]:
    """The words of the shared collections' corpora (seen at least twice) and their frequencies."""
    counts: collections.Counter[str] = collections.Counter()
    for name in SOURCES:
        corpus = shared / name / "corpus.jsonl"
        if not corpus.is_file():
            raise FileNotFoundError(f"{corpus} not found: the vocabulary comes from the shared collections")
        with corpus.open(encoding="utf-8") as handle:
            for line in handle:
                document = json.loads(line)
                counts.update(_WORD.findall(f"{document.get('title', '')} {document['text']}".lower()))
    words = sorted(word for word, count in counts.items() if count >= 2)
    frequencies = np.array([counts[word] for word in words], dtype=np.float64)
    return np.array(words, dtype=object), frequencies / frequencies.sum()


def generate_collection(root: Path, passages: int, shared: Path, seed: int = 0) -> Path:
    """Write a BEIR collection of `passages` passages at `root` (kept when one of the same size and seed
    is there already: see `is_generated`) and return it."""
    if is_generated(root, passages, seed):
        return root
    words, frequencies = vocabulary(shared)
    rng = np.random.default_rng(seed)
    lengths = rng.integers(40, 81, size=passages)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    drawn = rng.choice(len(words), size=int(starts[-1]), p=frequencies)
    chosen = rng.choice(passages, size=TEST_QUERIES + TRAIN_QUERIES, replace=False)
    root.mkdir(parents=True, exist_ok=True)
    (root / "qrels").mkdir(exist_ok=True)
    with (root / "corpus.jsonl").open("w", encoding="utf-8") as corpus:
        for row in range(passages):
            text = " ".join(words[drawn[starts[row] : starts[row + 1]]])
            corpus.write(json.dumps({"_id": f"d{row}", "title": "", "text": text}) + "\n")
    queries, qrels = [], {"test": [], "train": []}
    for number, row in enumerate(chosen):
        own = np.unique(drawn[starts[row] : starts[row + 1]])
        picked = rng.choice(own, size=min(QUERY_WORDS, len(own)), replace=False)
        queries.append({"_id": f"q{number}", "text": " ".join(words[picked])})
        qrels["test" if number < TEST_QUERIES else "train"].append(f"q{number}\td{row}\t1")
    (root / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries), encoding="utf-8")
    for split, lines in qrels.items():
        (root / "qrels" / f"{split}.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(lines) + "\n")
    (root / _MARK).write_text(json.dumps(_mark(passages, seed)))
    return root


def make_encoder(path: Path, seed: int = 0) -> Path:
    """Save a one-layer random encoder of all-MiniLM-L6-v2's shape at `path` as a sentence-transformers
    folder (kept when there) and return it."""
    if (path / "modules.json").is_file():
        return path
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from densekit.models.hub import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("sentence-transformers/all-MiniLM-L6-v2"))
    torch.manual_seed(seed)
    shape = {"hidden_size": 384, "num_attention_heads": 12, "intermediate_size": 1536}
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, num_hidden_layers=1, max_position_embeddings=512, **shape
    )
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 384, "pooling_mode_mean_tokens": True})
    )
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256}))
    (path / "modules.json").write_text(json.dumps(modules))
    return path
