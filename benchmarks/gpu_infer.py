"""The GPU suite's inference parts (`benchmarks/gpu_suite.py`): encoding against sentence-transformers'
`encode` in bf16, the rate wiki1m's passages would encode at, and exact search on the GPU against the
CPU's."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.gpu_inputs import WIKI_PASSAGES, read_jsonl_gz
from densekit.data import Dataset
from densekit.encoding.corpus import encode_corpus
from densekit.encoding.store import EmbeddingStore
from densekit.models import DenseEncoder


def synchronize(device: str) -> None:
    """Wait for the GPU's queued work (nothing on a CPU)."""
    import torch

    if device != "cpu":
        torch.cuda.synchronize()


def beir_folder(documents: list[dict], folder: Path) -> Path:
    """A BEIR folder holding `documents` as its corpus."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in documents), encoding="utf-8")
    return folder


def densekit_encode(encoder: DenseEncoder, dataset: Dataset, output: Path, batch: int, device: str
                    ) -> tuple[float, np.ndarray]:  # fmt: skip
    """Seconds `densekit encode`'s path (encode_corpus, bf16) takes over the corpus, and its vectors."""
    start = time.perf_counter()
    encode_corpus(encoder, dataset, output, batch_size=batch, precision="bf16", show_progress=False)
    synchronize(device)
    seconds = time.perf_counter() - start
    return seconds, np.asarray(EmbeddingStore.open(output).vectors())


def encoding(models: dict[str, Path], data: Path, device: str, batch: int, length: int, rounds: int,
             work: Path) -> dict:  # fmt: skip
    """Passages a second of densekit's bf16 encoding (autocast, as `--precision bf16`) against
    sentence-transformers' `encode` with the model's weights in bf16 and under bf16 autocast, in
    alternating rounds over the same passages, each model shape in turn; the ratio is densekit's
    median over the faster of sentence-transformers' medians."""
    dataset = Dataset.open(data)
    texts = [doc.full_text for doc in dataset.iter_corpus()]
    shapes = {
        name: encoding_of_shape(model, dataset, texts, device, batch, length, rounds, work / name)
        for name, model in models.items()
    }
    lowest = min(s["ratio_to_best_peer"] for s in shapes.values())
    return {"passages": len(texts), "batch": batch, "max_length": length, "rounds": rounds, "shapes": shapes,
            "lowest_ratio": lowest}  # fmt: skip


def encoding_of_shape(model: Path, dataset: Dataset, texts: list[str], device: str, batch: int, length: int,
                      rounds: int, work: Path) -> dict:  # fmt: skip
    """`encoding`'s rounds for one model."""
    import torch
    from sentence_transformers import SentenceTransformer

    encoder = DenseEncoder.load(model, passage_max_length=length).to(device)
    peers = {}
    for who, dtype in (("st_bf16_weights", torch.bfloat16), ("st_autocast", torch.float32)):
        peers[who] = SentenceTransformer(str(model), device=device).to(dtype)
        peers[who].max_seq_length = length
    autocast = torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)

    def st_encode(who: str) -> tuple[float, np.ndarray]:
        with autocast if who == "st_autocast" else contextlib.nullcontext():
            return timed(lambda: peers[who].encode(texts, batch_size=batch, convert_to_numpy=True), device)

    runs: dict[str, list[float]] = {"densekit": [], "st_bf16_weights": [], "st_autocast": []}
    for index in range(rounds + 1):  # round 0 warms each path up and is not counted
        for who in list(runs) if index % 2 else list(reversed(runs)):
            if who == "densekit":
                seconds, ours = densekit_encode(encoder, dataset, work / f"round-{index}", batch, device)
            else:
                seconds, theirs = st_encode(who)
            if index:
                runs[who].append(len(texts) / seconds)
    medians = {who: statistics.median(rates) for who, rates in runs.items()}
    best_peer = max(medians["st_bf16_weights"], medians["st_autocast"])
    return {"passages_per_s": {who: [round(r, 1) for r in rates] for who, rates in runs.items()},
            "ratio_to_best_peer": round(medians["densekit"] / best_peer, 3),
            "mean_cosine_to_peer": round(float(np.mean(np.sum(ours * theirs, axis=1))), 4)}  # fmt: skip


def timed(work, device: str) -> tuple[float, np.ndarray]:
    """Seconds `work()` takes, the GPU's queue included, and what it returned."""
    start = time.perf_counter()
    result = work()
    synchronize(device)
    return time.perf_counter() - start, result


def wiki_rate(model: Path, sample: Path, device: str, batch: int, length: int, work: Path,
              limit: int | None = None) -> dict:  # fmt: skip
    """Passages a second at which the carried sample of wiki1m (its first `limit` passages, or all)
    encodes (densekit, bf16), and the time the whole corpus would take at that rate."""
    documents = read_jsonl_gz(sample)[:limit]
    dataset = Dataset.open(beir_folder(documents, work / "wiki-sample"))
    encoder = DenseEncoder.load(model, passage_max_length=length).to(device)
    densekit_encode(encoder, Dataset.open(beir_folder(documents[:batch], work / "wiki-warm")),
                    work / "wiki-warm-embeddings", batch, device)  # fmt: skip
    seconds, _ = densekit_encode(encoder, dataset, work / "wiki-embeddings", batch, device)
    rate = len(documents) / seconds
    return {"passages": len(documents), "passages_per_s": round(rate, 1), "batch": batch,
            "max_length": length, "corpus_passages": WIKI_PASSAGES,
            "corpus_minutes_at_this_rate": round(WIKI_PASSAGES / rate / 60, 1)}  # fmt: skip


def exact_search(
    rows: int, dimension: int, queries: int, ks: list[int], device: str, cpu_threads: int
) -> dict:
    """Exact inner-product search of `queries` random unit vectors over `rows` random unit vectors: the
    CPU path (`exact_top_k` on `cpu_threads` threads) against the same blocks searched on the device's
    tensors, and on the device in one block; the device's results checked against the CPU's."""
    import torch

    from densekit.index.exact_search import BLOCK_ROWS, _top_k_of_blocks, exact_top_k

    generator = torch.Generator(device=device).manual_seed(0)
    table = torch.nn.functional.normalize(
        torch.randn(rows, dimension, device=device, generator=generator), dim=1
    )
    asked = torch.nn.functional.normalize(
        torch.randn(queries, dimension, device=device, generator=generator), dim=1
    )
    vectors, query_vectors = table.cpu().numpy(), asked.cpu().numpy()
    threads = torch.get_num_threads()
    torch.set_num_threads(cpu_threads)
    results = []
    try:
        for k in ks:
            cpu_seconds, (_, cpu_rows) = timed(lambda k=k: exact_top_k(vectors, query_vectors, k), "cpu")
            entry = {"k": k, "cpu_queries_per_s": round(queries / cpu_seconds, 1)}
            for label, block in (("device_blocks", BLOCK_ROWS), ("device_one_block", rows)):
                search = lambda k=k, block=block: _top_k_of_blocks(table, asked, k, min(block, rows))  # noqa: E731
                timed(search, device)  # warm-up
                seconds = statistics.median(timed(search, device)[0] for _ in range(3))
                found = search()[1].cpu().numpy()
                agreement = np.mean([len(set(a) & set(b)) / k for a, b in zip(found, cpu_rows, strict=True)])
                entry[f"{label}_queries_per_s"] = round(queries / seconds, 1)
                entry[f"{label}_speedup"] = round(cpu_seconds / seconds, 2)
                entry[f"{label}_agreement_with_cpu"] = round(float(agreement), 5)
            results.append(entry)
    finally:
        torch.set_num_threads(threads)
    return {"rows": rows, "dimension": dimension, "queries": queries, "cpu_threads": cpu_threads,
            "block_rows": BLOCK_ROWS, "runs": results}  # fmt: skip
