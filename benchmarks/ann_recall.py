"""Approximate indexes against exact search: recall@10 against flat, queries per second, and nDCG@10.

Two parts, each writing what it measured with the machine it ran on:

- `scale`: for each size N, the scale benchmark's collection of N passages and its one-layer encoder
  (`scale_collection`: encoder vectors of generated passages, not random vectors), encoded with
  `encode_corpus`; flat, IVF-PQ and HNSW built with `build_index` at `--target-recall` (the held-out
  queries: the collection's 2,000 training queries, or the first `--held-out-queries` of them; what the
  collection's own vectors, densekit's default, would choose is recorded beside), then its 1,000 test queries,
  encoded by the same encoder, searched with each: recall@10 against the flat index's top 10 and
  queries per second (k = 10, all queries in one call, the best of three calls). A sweep of `nprobe`
  and `ef_search` gives the curve of recall against queries per second (the plot). With
  `--sample-effect`, IVF-PQ is also built on a training sample of 22 vectors a list (what the
  automatic nlist got at 8.8M before the sample grew with nlist) to show what too small a sample costs.
- `collections`: the four shared collections with all-MiniLM-L6-v2: the test queries' nDCG@10 from
  flat, IVF-PQ and HNSW at `--target-recall`, with the settings chosen and recall@10 against flat.

Embeddings already encoded by the same model from the same corpus are reused (`encode_corpus` checks
their identity and encodes only what is missing; `--embeddings DIR` copies `DIR/<name>/embeddings` in
first). Results go to `--output` (by default the work folder's `ann_recall.json`; committed results in
`benchmarks/results/` change only when `--output` names them) and the plot beside it (`.png`). Run from the
repository root:

    nice -n 10 .venv/bin/python -m benchmarks.ann_recall --part scale --sizes 100000 1000000
    nice -n 10 .venv/bin/python -m benchmarks.ann_recall --part collections
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import WORK
from benchmarks.ann_measures import draw_sweeps, recall_against, sweep, timed_search
from benchmarks.machine import machine_info
from benchmarks.scale_collection import generate_collection, make_encoder

COLLECTIONS = ("scifact", "nfcorpus", "vaswani", "cranfield")
APPROXIMATE = ("ivfpq", "hnsw")
OLD_POINTS_PER_LIST = 22  # 262,144 training vectors for the 11,894 lists automatic at 8.8M


def encode(model: str, data: Path, embeddings: Path, device: str, batch: int) -> tuple[Any, Any]:
    """The encoder of `model` and the embedding folder of `data`'s corpus (encoded where missing)."""
    from densekit.data.dataset import Dataset
    from densekit.encoding.corpus import encode_corpus
    from densekit.encoding.store import EmbeddingStore
    from densekit.models.config import EncoderOptions
    from densekit.routing.model_or_route import load_model_or_route

    encoder, _ = load_model_or_route(model, device, EncoderOptions())
    encoder.eval()
    encode_corpus(encoder, Dataset.open(data), embeddings, batch_size=batch, show_progress=False)
    return encoder, EmbeddingStore.open(embeddings)


def split_queries(
    encoder: Any, data: Path, batch: int, split: str = "test"
) -> tuple[list[str], np.ndarray, Any]:
    """A split's query ids, their vectors and judgements."""
    from densekit.data.dataset import Dataset
    from densekit.encoding.embed import embed_texts

    queries, qrels = Dataset.open(data).split_queries(split)
    ids = list(queries)
    return ids, embed_texts(encoder, [queries[q] for q in ids], "query", batch), qrels


def build(
    store: Any, kind: str, folder: Path, target: float | None, held_out: tuple[np.ndarray, str] | None = None
) -> tuple[Any, dict, float]:
    """Build (replacing) and load an index of `kind` at `target`; its manifest's recall and build seconds.
    A target no setting meets is recorded (`target_error`) and the index built with its defaults."""
    from densekit.index import IndexSpec, SearchIndex, build_index
    from densekit.index.recall import RecallSettings, TargetUnreachable
    from densekit.io.artefact import read_manifest

    given = {} if held_out is None else {"vectors": held_out[0], "source": held_out[1], "digest": held_out[1]}
    start = time.perf_counter()
    error = None
    try:
        build_index(
            store,
            IndexSpec(type=kind),
            folder,
            show_progress=False,
            recall=RecallSettings(target=target, **given),
            overwrite=True,
        )
    except TargetUnreachable as err:
        error = str(err)
        print(f"{folder}: {error}", flush=True)
        recall = RecallSettings(**given)
        build_index(store, IndexSpec(type=kind), folder, show_progress=False, recall=recall, overwrite=True)
    seconds = time.perf_counter() - start
    recorded = read_manifest(folder).about["recall"]  # type: ignore[union-attr]
    return SearchIndex.load(folder), {**recorded, "target_error": error} if error else recorded, seconds


def sample_effect(store: Any, folder: Path, queries: np.ndarray, exact: np.ndarray, nprobe: int) -> dict:
    """IVF-PQ trained on `OLD_POINTS_PER_LIST` vectors a list against the default sample, at `nprobe`."""
    from densekit.index import IndexSpec, SearchIndex, build_index, spec
    from densekit.index.backends import faiss_index

    resolved = IndexSpec(type="ivfpq").resolved(len(store), store.dimension)
    results = {}
    saved = (faiss_index._MAX_TRAINING_POINTS, spec.TRAINING_POINTS_PER_LIST)
    for label, per_list in (("default", None), ("22 a list", OLD_POINTS_PER_LIST)):
        if per_list is not None:  # the sample the old rule gave 8.8M vectors, scaled to these lists
            faiss_index._MAX_TRAINING_POINTS, spec.TRAINING_POINTS_PER_LIST = (
                per_list * resolved.nlist,
                per_list,
            )
        try:
            training = faiss_index._training_rows(resolved, len(store))
            build_index(store, resolved.updated(nprobe=nprobe), folder, show_progress=False, overwrite=True)
        finally:
            faiss_index._MAX_TRAINING_POINTS, spec.TRAINING_POINTS_PER_LIST = saved
        index = SearchIndex.load(folder)
        found, qps = timed_search(index, queries)
        results[label] = {"training_rows": training, "recall@10": recall_against(found, exact), "qps": qps}
    return {"nlist": resolved.nlist, "nprobe": nprobe, **results}


def own_vectors_choice(index: Any, store: Any, target: float, queries: np.ndarray, exact: np.ndarray) -> dict:
    """What densekit's default held-out queries (the collection's own vectors) would choose for `index`,
    by `nprobe` or `ef_search` alone, and the test queries' recall@10 against flat at that setting."""
    from densekit.index import recall

    chunks = recall.chunk_reader(store.parts, 65536)
    held = recall.held_out(recall.RecallSettings(), chunks, len(store))
    chosen = recall.choose_parameter(index.index, index.spec, held, chunks, target)
    if chosen.best is not None:
        return {"reached": chosen.best, "where": chosen.where}
    name = "nprobe" if index.spec.type == "ivfpq" else "ef_search"
    index.set_search_parameters(**{name: getattr(chosen.spec, name)})
    found, qps = timed_search(index, queries)
    index.set_search_parameters()
    return {name: getattr(chosen.spec, name), "test_recall@10": recall_against(found, exact), "qps": qps}


def guarded(measure: Any, *args: Any) -> dict:
    """What `measure(*args)` gives, or the error it raised, so that one extra measurement failing does
    not lose the others."""
    try:
        return measure(*args)
    except Exception as err:  # recorded in the results, beside what did run
        return {"error": f"{type(err).__name__}: {err}"}


def measure_scale(size: int, args: argparse.Namespace, result: dict, save: Any) -> None:
    """Flat, IVF-PQ and HNSW over the scale collection of `size` passages, into `result`, saved as it
    grows. The target is met on the training queries (the first `--held-out-queries` of them where
    given); recall is measured on the 1,000 test ones."""
    work = args.work / f"scale-{size}"
    start = time.perf_counter()
    data = generate_collection(work / "collection", size, args.shared)
    encoder_dir = make_encoder(args.work / "scale-encoder")
    result.update(passages=size, generate_s=time.perf_counter() - start)
    start = time.perf_counter()
    encoder, store = encode(str(encoder_dir), data, work / "embeddings", args.device, args.batch_size)
    result["encode_s"] = time.perf_counter() - start
    _, queries, _ = split_queries(encoder, data, args.batch_size)
    _, train, _ = split_queries(encoder, data, args.batch_size, "train")
    which = "the first" if args.held_out_queries is not None and args.held_out_queries < len(train) else "the"
    train = train[: args.held_out_queries]
    held_out = (train, f"{which} {len(train)} training queries of {data}")
    result["queries"] = len(queries)
    flat, _, seconds = build(store, "flat", work / "flat", None)
    exact, flat_qps = timed_search(flat, queries)
    result["flat"] = {"build_s": seconds, "qps": flat_qps}
    del flat
    save()
    for kind in APPROXIMATE:
        if kind in args.skip:
            continue
        index, recorded, seconds = build(store, kind, work / kind, args.target_recall, held_out)
        found, qps = timed_search(index, queries)
        result[kind] = {
            "build_s": seconds, "at_build": recorded, "recall@10": recall_against(found, exact), "qps": qps,
            "speedup_over_flat": qps / flat_qps,
        }  # fmt: skip
        print(f"{size} {kind}: {result[kind]['recall@10']:.4f} at {recorded['parameters']}, "
              f"{qps:.0f} q/s (flat {flat_qps:.0f})", flush=True)  # fmt: skip
        save()
        result[kind]["sweep"] = sweep(index, queries, exact)
        save()
        result[kind]["own_vectors_choice"] = guarded(
            own_vectors_choice, index, store, args.target_recall, queries, exact
        )
        save()
        del index
    if args.sample_effect:
        result["sample_effect"] = guarded(sample_effect, store, work / "ivfpq-sample", queries, exact, 32)
        save()


def real_queries(encoder: Any, data: Path, batch: int) -> tuple[np.ndarray, str]:
    """Held-out queries like the ones searched: the training split's where there is one, else the test
    split's own (only the index's agreement with flat is tuned on them, never their judgements)."""
    from densekit.data.dataset import Dataset

    split = "train" if "train" in Dataset.open(data).splits() else "test"
    _, vectors, _ = split_queries(encoder, data, batch, split)
    return vectors, f"the {len(vectors)} {split} queries of {data.name}"


def measure_collection(name: str, args: argparse.Namespace) -> dict:
    """nDCG@10 of flat, and of IVF-PQ and HNSW at the target met on the collection's own vectors
    (densekit's default) and on real queries, on one shared collection's test queries."""
    from densekit.evaluation.measures import evaluate

    data = args.shared / name
    work = args.work / name
    if args.embeddings is not None and not (work / "embeddings").exists():
        shutil.copytree(args.embeddings / name / "embeddings", work / "embeddings")
    encoder, store = encode(args.model, data, work / "embeddings", args.device, args.batch_size)
    ids, queries, qrels = split_queries(encoder, data, args.batch_size)
    result: dict[str, Any] = {"documents": len(store), "queries": len(ids)}
    helds = {"own vectors": None, "queries": real_queries(encoder, data, args.batch_size)}
    exact = None
    for kind in ("flat", *[kind for kind in APPROXIMATE if kind not in args.skip]):
        for held_name, held in helds.items() if kind != "flat" else [("exact", None)]:
            label = kind if kind == "flat" else f"{kind}, held out: {held_name}"
            target = None if kind == "flat" else args.target_recall
            folder = work / label.replace(", held out: ", "-").replace(" ", "_")
            index, recorded, seconds = build(store, kind, folder, target, held)
            run = index.search_run(queries, ids, 1000)
            found, qps = timed_search(index, queries)
            exact = found if kind == "flat" else exact
            result[label] = {
                "nDCG@10": evaluate(qrels, run, ["nDCG@10"])["nDCG@10"], "build_s": seconds, "qps": qps,
                "at_build": {k: v for k, v in recorded.items() if k != "rows"},
                "recall@10": recall_against(found, exact),
            }  # fmt: skip
            print(f"{name} {label}: nDCG@10 {result[label]['nDCG@10']:.4f}, test recall@10 "
                  f"{result[label]['recall@10']:.4f}, {recorded.get('parameters')}", flush=True)  # fmt: skip
    return result


def plot(results: dict, output: Path) -> None:
    """Recall@10 against queries per second for each size's sweep, log scale, flat as a point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = results.get("scale", {})
    if not sizes:
        return
    figure, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.5), squeeze=False)
    for axis, (size, run) in zip(axes[0], sizes.items(), strict=True):
        kinds = [kind for kind in ("ivfpq", "hnsw") if "sweep" in run.get(kind, {})]
        chosen = {kind: (run[kind]["qps"], run[kind]["recall@10"],
                         f"{kind} at --target-recall {run[kind]['at_build'].get('target')}")
                  for kind in kinds}  # fmt: skip
        curves = {kind: run[kind]["sweep"] for kind in kinds}
        draw_sweeps(axis, curves, chosen, run["flat"]["qps"], f"{int(size):,} passages, one-layer encoder")
    figure.tight_layout()
    figure.savefig(output, dpi=120)


def output_path(args: argparse.Namespace) -> Path:
    """Where results go: `--output`, else the work folder (committed results change only when asked)."""
    return args.output if args.output is not None else args.work / "ann_recall.json"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--part", nargs="+", choices=["scale", "collections"], default=["scale", "collections"]
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--collections", nargs="+", default=list(COLLECTIONS))
    parser.add_argument("--work", type=Path, default=WORK / "ann_recall", help="collections, artefacts")
    parser.add_argument("--shared", type=Path, default=Path("../shared/data"))
    parser.add_argument("--embeddings", type=Path, help="DIR/<collection>/embeddings to copy in first")
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--target-recall", type=float, default=0.95)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--skip", nargs="*", default=[], help="index types to leave out")
    parser.add_argument(
        "--held-out-queries", type=int, help="scale: meet the target on the first N training queries (all)"
    )
    parser.add_argument("--sample-effect", action="store_true", help="scale: IVF-PQ on 22 vectors a list too")
    parser.add_argument("--output", type=Path, help="the results' JSON (the plot beside it)")
    parser.add_argument(
        "--faiss-threads", type=int, help="the timed searches' threads (faiss's; torch's for a flat index)"
    )
    args = parser.parse_args()
    if args.held_out_queries is not None and args.held_out_queries < 1:
        parser.error(f"--held-out-queries {args.held_out_queries}: give at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    logging.getLogger("densekit.index.recall").setLevel(logging.INFO)  # each value a target tries
    if args.faiss_threads is not None:
        import faiss

        faiss.omp_set_num_threads(args.faiss_threads)
    output = output_path(args)
    results: dict[str, Any] = {"machine": machine_info(), "target_recall": args.target_recall}
    for part in args.part:
        results[part] = {}
        names = args.sizes if part == "scale" else args.collections
        for name in names:
            start = time.perf_counter()
            entry: dict[str, Any] = {}
            results[part][str(name)] = entry

            def save(entry: dict = entry, start: float = start) -> None:
                entry["wall_s"] = time.perf_counter() - start
                output.parent.mkdir(parents=True, exist_ok=True)
                output.write_text(json.dumps(results, indent=2) + "\n")
                plot(results, output.with_suffix(".png"))

            if part == "scale":
                measure_scale(name, args, entry, save)
            else:
                entry.update(measure_collection(name, args))
            save()
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
