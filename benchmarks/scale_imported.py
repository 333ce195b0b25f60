"""MS MARCO's size without encoding it: the stages after encoding at 8,841,823 passages, from vectors
made elsewhere and brought in with `densekit import-embeddings`.

Encoding 8.8M passages is out of reach of a 2-core CPU, and at 768 dimensions the float32 vectors alone
(27 GB) outgrow its memory. This benchmark generates the scale benchmark's collection at N passages
(`scale_collection`: same vocabulary, 1,000 test and 2,000 training queries) and writes the vectors
straight into a `.npy` (a chunk at a time through a memory map): random unit vectors, except that every
judged passage gets the vector the scale benchmark's one-layer encoder makes of its text, so that the
queries (encoded by that encoder) have something to find and `evaluate` measures a real search. Then it
runs, each as its own process as `benchmarks/scale.py` does (wall seconds, the process's own peak
resident memory): import-embeddings, index ivfpq (the automatic parameters), search of the 1,000 test
queries (read in and memory-mapped), dense mining of the 2,000 training queries against that index, and
evaluate. Results, with the machine, go to `--output` (runs/benchmarks/scale/scale_imported.json unless
given; the committed ones are benchmarks/results/scale_imported.json). Run from the repository root:

    nice -n 10 .venv/bin/python -m benchmarks.scale_imported --passages 8841823

`--prepare-only` makes the collection and the vectors and stops (they are kept and reused by size).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np

from benchmarks import WORK
from benchmarks.machine import machine_info
from benchmarks.scale import DENSEKIT, run_children, stage_outputs
from benchmarks.scale_collection import generate_collection, make_encoder

ROOT = Path(__file__).resolve().parents[1]
MS_MARCO_PASSAGES = 8_841_823
CHUNK = 262_144
LIMIT_GIB = 20  # the bound on any stage's peak resident memory at 8.8M


def judged_passages(data: Path) -> set[str]:
    """The ids of every passage judged in any split."""
    judged = set()
    for qrels in (data / "qrels").glob("*.tsv"):
        for line in qrels.read_text().splitlines()[1:]:
            judged.add(line.split("\t")[1])
    return judged


def write_vectors(data: Path, model: Path, path: Path, seed: int = 0) -> Path:
    """Write `path`, one float32 unit vector a passage of `data` in corpus order (see the module), a chunk
    at a time, into a temporary file renamed into place at the end; kept when already there."""
    if path.is_file():
        return path
    from densekit.data import Dataset
    from densekit.encoding.embed import embed_texts
    from densekit.models import DenseEncoder

    dataset = Dataset.open(data)
    rows = dataset.count_documents()
    encoder = DenseEncoder.load(model)
    judged = judged_passages(data)
    partial = path.with_name(path.name + ".partial")
    out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(rows, encoder.dimension))
    rng = np.random.default_rng(seed)
    for start in range(0, rows, CHUNK):
        chunk = rng.standard_normal((min(CHUNK, rows - start), encoder.dimension), dtype=np.float32)
        chunk /= np.linalg.norm(chunk, axis=1, keepdims=True)
        out[start : start + len(chunk)] = chunk
    positions, texts = [], []
    for row, document in enumerate(dataset.iter_corpus()):
        if document.id in judged:
            positions.append(row)
            texts.append(document.full_text)
    out[positions] = embed_texts(encoder, texts, "passage")
    out.flush()
    del out
    partial.rename(path)
    return path


def measure(passages: int, work: Path, shared: Path, only: set[str] | None = None) -> dict:
    """Every stage after encoding at `passages` passages (or the stages `only` names, over an earlier
    run's artefacts, each one's own output made again); artefacts under `work/imported-<passages>`."""
    base = work / f"imported-{passages}"
    begin = time.perf_counter()
    data = generate_collection(base / "data", passages, shared)
    model = make_encoder(work / "model")
    vectors = write_vectors(data, model, base / "vectors.npy")
    prepared = round(time.perf_counter() - begin, 1)
    logs, out = base / "logs", base / "out"
    if out.exists() and only is None:
        shutil.rmtree(out)  # every artefact of the last run here, so that each stage does its whole work
    out.mkdir(parents=True, exist_ok=True)

    def dk(*args: object) -> list[str]:
        return [*DENSEKIT, "--quiet", *map(str, args)]

    index, run = out / "index-ivfpq", out / "dense-ivfpq.trec"
    dense = ("--source", "dense", "--model", model, "--index", index)
    stages = {
        "import-embeddings": dk(
            "import-embeddings", model, data, vectors, "-o", out / "emb", "--no-progress"
        ),
        "index ivfpq": dk("index", out / "emb", "-o", index, "--type", "ivfpq", "--no-progress"),
        "search ivfpq": dk("search", model, index, data, "-o", run, "--no-progress"),
        "search ivfpq --mmap-index": dk(
            "search", model, index, data, "-o", out / "dense-ivfpq-mmap.trec", "--mmap-index", "--no-progress"
        ),
        "mine dense": dk(
            "mine", data, "--split", "train", *dense, "-o", out / "mined.jsonl", "--no-progress"
        ),
        "evaluate": dk("evaluate", data / "qrels" / "test.tsv", run, "--json", out / "dense-ivfpq.json"),
    }
    started = time.perf_counter()
    results = {}
    for name, argv in stages.items():
        if only is not None:
            if name not in only:
                continue
            for output in stage_outputs([argv]):
                shutil.rmtree(output) if output.is_dir() else output.unlink(missing_ok=True)
        results[name] = run_children([argv], logs / f"{name.replace(' ', '_')}.log")
        print(f"{passages}: {name}: {results[name]}", flush=True)
        if results[name]["status"] != "ok":
            break
    measures, built, spec = out / "dense-ivfpq.json", index / "index.faiss", index / "index.json"
    peak = max(stage["peak_rss_mib"] for stage in results.values())
    return {
        "passages": passages,
        "machine": machine_info(),
        "prepare_s": prepared,
        "wall_s": round(time.perf_counter() - started, 1),
        "stages": results,
        "largest_peak_gib": round(peak / 1024, 2),
        "within_limit": peak / 1024 <= LIMIT_GIB,
        "bytes": {
            "vectors.npy": vectors.stat().st_size,
            "index.faiss": built.stat().st_size if built.is_file() else None,
        },
        "index": json.loads(spec.read_text())["spec"] if spec.is_file() else None,
        "dense_measures": json.loads(measures.read_text()) if measures.is_file() else None,
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--passages", type=int, default=MS_MARCO_PASSAGES)
    parser.add_argument("--work", type=Path, default=WORK / "scale", help="collections, artefacts")
    parser.add_argument("--shared", type=Path, default=Path("../shared/data"))
    results_file = WORK / "scale" / "scale_imported.json"
    parser.add_argument("--output", type=Path, default=results_file)
    parser.add_argument("--prepare-only", action="store_true", help="make the collection and vectors; stop")
    parser.add_argument(
        "--only", nargs="+", help="run just these stages again, in place of the earlier run's"
    )
    args = parser.parse_args()
    args.work, args.shared = args.work.resolve(), args.shared.resolve()  # its stages run from the root
    if args.prepare_only:
        base = args.work / f"imported-{args.passages}"
        data = generate_collection(base / "data", args.passages, args.shared)
        print(write_vectors(data, make_encoder(args.work / "model"), base / "vectors.npy"))
        return
    results = json.loads(args.output.read_text()) if args.output.is_file() else {}
    run = measure(args.passages, args.work, args.shared, set(args.only) if args.only else None)
    earlier = results.get(str(args.passages))
    if args.only and earlier is not None:
        for entry in run["stages"].values():
            entry["measured_separately"] = run["machine"]["date"]
        earlier["stages"].update(run["stages"])
        peak = max(stage["peak_rss_mib"] for stage in earlier["stages"].values())
        earlier.update(largest_peak_gib=round(peak / 1024, 2), within_limit=peak / 1024 <= LIMIT_GIB)
        run = earlier
    results[str(args.passages)] = run
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
