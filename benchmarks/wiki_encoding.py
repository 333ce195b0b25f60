r"""Encoding wiki1m's passages on the CPU: every densekit path's rate, its share of the CPU's arithmetic
peak, and the quality of its vectors, measured in one run against sentence-transformers' `encode`.

Two parts, each writing what it measured with the machine it ran on (`--output`, JSON):

- `rates`: a sample of `--sample` passages spread evenly over the corpus (every (N / sample)-th), encoded
  by all-MiniLM-L6-v2 (max length 256, mean pooling, L2) through each path in alternating rounds, the
  order rotated each round, tokenisation inside the timed region:
  sentence-transformers `encode` (the peer), densekit torch float32 (packed where a batch is more than a
  tenth padding, densekit's default on a CPU), densekit torch float32 with packing off, densekit torch
  bf16 (timed only where a bf16 matrix product runs at least at float32's rate: elsewhere it is
  emulated, and its measured product rate says why it is left out), densekit ONNX Runtime float32 and
  int8, densekit OpenVINO bf16 (where the CPU computes bf16) and int8 (calibrated on the corpus as
  `densekit encode` calibrates it). Each path's useful arithmetic (the passages' real tokens,
  `flops_per_passage`) per second is given as a share of a large matrix product in its own precision
  measured in the same run (torch's for torch paths and OpenVINO's bf16, ONNX Runtime's MatMul /
  MatMulInteger for ONNX ones and OpenVINO's int8), beside each path's agreement with float32's vectors
  (least and mean cosine).
- `quality`: for each path named in `--paths`, the collection at `--data` (the 100k slice of
  `densekit slice`) encoded by `encode_corpus`, its test queries searched exactly (`exact_top_k`), and
  nDCG@10, R@100 and R@1000; the difference from float32's is the criterion the full encode's path is
  chosen by (within 0.005 nDCG@10). Embeddings are kept under `--work` and reused by identity.

Run from the repository root:

    nice -n 5 .venv/bin/python -m benchmarks.wiki_encoding rates --data ../shared/data/wiki1m
    nice -n 5 .venv/bin/python -m benchmarks.wiki_encoding quality --data runs/wiki/data-wiki-100k \
        --paths "torch float32" "onnx int8"
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import WORK
from benchmarks.machine import machine_info

MODEL = "sentence-transformers/all-MiniLM-L6-v2"
ST = "sentence-transformers encode"
# name -> (backend, precision, packing allowed)
PATHS: dict[str, tuple[str, str, bool]] = {
    "torch float32": ("torch", "float32", True),
    "torch float32, not packed": ("torch", "float32", False),
    "torch bf16": ("torch", "bf16", True),
    "onnx float32": ("onnx", "float32", True),
    "onnx int8": ("onnx", "int8", True),
    "openvino bf16": ("openvino", "bf16", True),
    "openvino int8": ("openvino", "int8", True),
}
# OpenVINO's paths against the same products' rates: its int8 runs the CPU's u8 x s8 products (VNNI)
# as ONNX Runtime's MatMulInteger does, its bf16 the bf16 products torch's times
PEAK_OF = {"torch float32": "torch float32", "torch float32, not packed": "torch float32",
           "torch bf16": "torch bf16", "onnx float32": "onnx float32", "onnx int8": "onnx int8",
           "openvino bf16": "torch bf16", "openvino int8": "onnx int8"}  # fmt: skip


def sample_texts(data: Path, size: int) -> list[str]:
    """`size` passages spread evenly over the corpus (every (documents / size)-th, from the first)."""
    from densekit.data.dataset import Dataset

    dataset = Dataset.open(data)
    total = sum(1 for _ in dataset.iter_corpus())
    step = max(1, total // size)
    return [doc.full_text for doc in itertools.islice(dataset.iter_corpus(), 0, None, step)][:size]


def flops_per_passage(token_counts: list[int], config: Any) -> float:
    """Mean multiply-adds x 2 of a BERT encoder's forward over passages of these token counts: the
    projections and feed-forward per token, and attention's two products per pair of tokens."""
    hidden, inner, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    per_token = 2 * (4 * hidden * hidden + 2 * hidden * inner)
    total = sum(layers * (n * per_token + 4 * n * n * hidden) for n in token_counts)
    return total / len(token_counts)


def torch_matmul_rate(dtype: str, size: int = 2048, calls: int = 5) -> float:
    """FLOP/s of torch's `mm` of two `size` x `size` matrices in `dtype`, the best of `calls`."""
    import torch

    a = torch.randn(size, size).to(getattr(torch, dtype))
    b = torch.randn(size, size).to(getattr(torch, dtype))
    torch.mm(a, b)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def onnx_matmul_rate(integer: bool, size: int = 2048, calls: int = 5) -> float:
    """Operations/s of ONNX Runtime's MatMul (float32) or MatMulInteger (uint8 x int8, what dynamic
    quantisation runs) on two `size` x `size` matrices, on as many threads as torch uses."""
    import onnxruntime
    import torch
    from onnx import TensorProto, helper

    kinds = (TensorProto.UINT8, TensorProto.INT8, TensorProto.INT32) if integer else (TensorProto.FLOAT,) * 3
    inputs = [helper.make_tensor_value_info(n, t, [size, size]) for n, t in zip("AB", kinds[:2], strict=True)]
    output = helper.make_tensor_value_info("Y", kinds[2], [size, size])
    node = helper.make_node("MatMulInteger" if integer else "MatMul", ["A", "B"], ["Y"])
    graph = helper.make_graph([node], "matmul", inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = onnxruntime.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    rng = np.random.default_rng(0)
    if integer:
        feeds = {"A": rng.integers(0, 255, (size, size), dtype=np.uint8),
                 "B": rng.integers(-128, 127, (size, size), dtype=np.int8)}  # fmt: skip
    else:
        feeds = {"A": rng.standard_normal((size, size), dtype=np.float32),
                 "B": rng.standard_normal((size, size), dtype=np.float32)}  # fmt: skip
    session.run(None, feeds)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        session.run(None, feeds)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def densekit_encoder(
    backend: str, precision: str, max_length: int, data: Path, model: str = MODEL
) -> tuple[Any, str]:
    """`model` (all-MiniLM-L6-v2) loaded by densekit for passages of the collection at `data` through
    `backend` at `precision`, and the torch precision to encode at (an export is made, calibrated on
    the collection where it needs it as `densekit encode` does, and checked here, not timed)."""
    from densekit.data.dataset import Dataset
    from densekit.encoding.corpus import use_corpus_backend
    from densekit.models import DenseEncoder

    encoder = DenseEncoder.load(model, passage_max_length=max_length).eval()
    return encoder, use_corpus_backend(encoder, backend, precision, Dataset.open(data))


def densekit_runner(name: str, texts: list[str], args: argparse.Namespace) -> Callable[[], np.ndarray]:
    """Encode `texts` by densekit's path `name`; packing is switched off for the call where it says so."""
    from densekit.encoding.embed import embed_texts
    from densekit.models import padding

    backend, precision, packing = PATHS[name]
    encoder, autocast = densekit_encoder(backend, precision, args.max_length, args.data, args.model)

    def run() -> np.ndarray:
        if packing:
            return embed_texts(encoder, texts, "passage", args.batch_size, autocast)
        saved = padding.worth_packing
        padding.worth_packing = lambda mask: False  # the padded forward, for comparison only
        try:
            return embed_texts(encoder, texts, "passage", args.batch_size, autocast)
        finally:
            padding.worth_packing = saved

    return run


def rates(args: argparse.Namespace) -> dict:
    """The `rates` part."""
    import torch
    from sentence_transformers import SentenceTransformer

    from densekit.models.hub import resolve_model_path

    texts = sample_texts(args.data, args.sample)
    path = resolve_model_path(args.model)
    peer = SentenceTransformer(path, device="cpu")
    peer.max_seq_length = args.max_length
    counts = [
        len(ids) for ids in peer.tokenizer(texts, truncation=True, max_length=args.max_length)["input_ids"]
    ]
    flops = flops_per_passage(counts, peer[0].auto_model.config)
    peaks = {
        "torch float32": torch_matmul_rate("float32"),
        "torch bf16": torch_matmul_rate("bfloat16", size=512 if not args.force_bf16 else 2048),
        "onnx float32": onnx_matmul_rate(False),
        "onnx int8": onnx_matmul_rate(True),
    }
    print("matrix product peaks (G op/s): " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in peaks.items()))
    skipped = {}
    names = [n for n in PATHS if n not in args.skip]
    if "torch bf16" in names and peaks["torch bf16"] < peaks["torch float32"] and not args.force_bf16:
        names.remove("torch bf16")
        skipped["torch bf16"] = (
            f"bf16 is emulated on this CPU: its matrix product ran at {peaks['torch bf16'] / 1e9:.2f} G op/s "
            f"against float32's {peaks['torch float32'] / 1e9:.1f}, so encoding in it would be slower still"
        )
    runners: dict[str, Callable[[], np.ndarray]] = {
        ST: lambda: peer.encode(
            texts, batch_size=args.batch_size, convert_to_numpy=True, show_progress_bar=False
        )
    }
    for name in names:
        runners[name] = densekit_runner(name, texts, args)
    vectors = {name: np.asarray(run(), dtype=np.float32) for name, run in runners.items()}  # warm-up
    timings: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners)
    for round_index in range(args.rounds):
        shift = round_index % len(order)
        for name in order[shift:] + order[:shift]:
            start = time.perf_counter()
            runners[name]()
            timings[name].append(len(texts) / (time.perf_counter() - start))
        print(
            f"round {round_index}: " + ", ".join(f"{n} {r[-1]:.1f}/s" for n, r in timings.items()), flush=True
        )
    reference = vectors["torch float32"] if "torch float32" in vectors else vectors[ST]
    peer_rate = statistics.median(timings[ST])
    paths = {}
    for name, measured in timings.items():
        rate = statistics.median(measured)
        cosines = np.sum(vectors[name] * reference, axis=1)
        entry = {
            "passages_per_s": [round(r, 2) for r in measured],
            "median_passages_per_s": round(rate, 2),
            "ratio_to_sentence_transformers": round(rate / peer_rate, 3),
            "useful_gflop_per_s": round(rate * flops / 1e9, 2),
            "least_cosine_to_float32": round(float(cosines.min()), 6),
            "mean_cosine_to_float32": round(float(cosines.mean()), 6),
            "hours_for_1004001": round(1_004_001 / rate / 3600, 2),
        }
        peak = peaks.get(PEAK_OF.get(name, "torch float32"))
        entry["share_of_matmul_peak"] = round(rate * flops / peak, 3) if peak else None
        paths[name] = entry
    return {
        "sample": len(texts),
        "mean_tokens": round(float(np.mean(counts)), 1),
        "flops_per_passage": flops,
        "matmul_peak_op_per_s": {k: round(v) for k, v in peaks.items()},
        "paths": paths,
        "skipped": skipped,
        "torch_threads": torch.get_num_threads(),
    }


def quality(args: argparse.Namespace) -> dict:
    """The `quality` part."""
    from densekit.data.dataset import Dataset
    from densekit.encoding.corpus import encode_corpus
    from densekit.encoding.embed import embed_texts
    from densekit.encoding.store import EmbeddingStore, part_stem
    from densekit.evaluation.measures import evaluate
    from densekit.index.exact_search import exact_top_k

    dataset = Dataset.open(args.data)
    queries, qrels = dataset.split_queries(args.split)
    ids = list(queries)
    results: dict[str, Any] = {"collection": str(args.data), "split": args.split, "queries": len(ids)}
    for name in args.paths:
        backend, precision, packing = PATHS[name]
        if not packing:
            raise SystemExit(
                f"{name}: its vectors are float32's (packing changes no vector); time it in `rates`"
            )
        if backend == "openvino":  # its int8 has no queries' texts to calibrate on
            raise SystemExit(
                f"{name}: encode the corpus with `densekit encode --backend openvino` and measure it with "
                "`python -m benchmarks.wiki_quality --embeddings FOLDER` (queries in torch float32)"
            )
        encoder, autocast = densekit_encoder(backend, precision, args.max_length, args.data, args.model)
        if backend == "onnx":  # queries through the same export
            from densekit.encoding.runtimes import use_backend

            autocast = use_backend(encoder, backend, precision, ["query", "passage"])
        folder = args.work / name.replace(" ", "-") / "embeddings"
        # encode_corpus keeps a complete part made from the same model, settings and corpus (and refuses
        # one made otherwise): its seconds are then not this path's encoding time
        reused = (folder / f"{part_stem(0, 1)}.json").is_file()
        start = time.perf_counter()
        encode_corpus(
            encoder, dataset, folder, batch_size=args.batch_size, precision=autocast, show_progress=True
        )
        seconds = time.perf_counter() - start
        store = EmbeddingStore.open(folder)
        query_vectors = embed_texts(encoder, [queries[q] for q in ids], "query", args.batch_size, autocast)
        scores, rows = exact_top_k(store.vectors(), query_vectors, min(1000, len(store)))
        doc_ids = np.asarray(store.ids(), dtype=object)
        run = {q: {str(doc_ids[r]): float(s) for r, s in zip(rows[i], scores[i], strict=True) if r >= 0}
               for i, q in enumerate(ids)}  # fmt: skip
        metrics = evaluate(qrels, run, ["nDCG@10", "R@100", "R@1000"])
        encoding = {"encoding_reused": True} if reused else {"encode_s": round(seconds, 1)}
        results[name] = {"metrics": metrics, **encoding, "passages": len(store)}
        print(f"{name}: {metrics} ({'encoding reused' if reused else f'encode {seconds:.0f} s'})", flush=True)
    if "torch float32" in results:
        base = results["torch float32"]["metrics"]["nDCG@10"]
        for name in args.paths:
            results[name]["nDCG@10_minus_float32"] = round(results[name]["metrics"]["nDCG@10"] - base, 5)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("part", choices=["rates", "quality"])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/wiki1m"))
    parser.add_argument("--sample", type=int, default=1000, help="rates: passages timed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--skip", nargs="*", default=[], help="rates: paths left out")
    parser.add_argument("--force-bf16", action="store_true", help="rates: time bf16 even where emulated")
    parser.add_argument("--paths", nargs="+", default=["torch float32", "onnx int8"], help="quality: paths")
    parser.add_argument("--split", default="test")
    parser.add_argument("--model", default=MODEL, help="the model (sentence-transformers' too, in rates)")
    parser.add_argument("--work", type=Path, default=WORK / "wiki_encoding")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    measured = rates(args) if args.part == "rates" else quality(args)
    result = {
        "benchmark": f"wiki_encoding {args.part}",
        "command": shlex.join(["python", "-m", "benchmarks.wiki_encoding", *(argv or sys.argv[1:])]),
        "model": args.model,
        "max_length": args.max_length,
        "batch_size": args.batch_size,
        **measured,
        "wall_s": round(time.perf_counter() - started, 1),
        "machine": machine_info(),
    }
    output = args.output or args.work / f"{args.part}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
