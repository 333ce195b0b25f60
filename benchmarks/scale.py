"""Scale: how each stage's seconds and peak resident memory grow with the corpus.

For each size N it generates a BEIR collection of N passages and a tiny random encoder
(`scale_collection`), then runs every stage in its own child process, a `densekit` command where there is
one: validate, bm25 (index and search), encode (one process, and `--shard` over two at once),
import-embeddings, index flat / hnsw / ivfpq, search each (and ivfpq memory-mapped), mine (bm25 and
dense), evaluate, fuse, the documents store, the Milvus Lite backend and `serve` until it answers
/health. Beside them, in the same run, the peers: raw faiss building and searching the same vectors
with the same parameters, and raw bm25s indexing and searching the same texts. A child's wall time is
timed from outside (so it includes Python's and densekit's imports: the `cli start-up` row is that
floor); its peak resident memory is the kernel's `ru_maxrss` of that child alone (`os.wait4`). Results
for each N (with the machine it ran on) are merged into `--output` (runs/benchmarks/scale/scale.json
unless given; the committed ones are benchmarks/results/scale.json), and the PNG beside it plots seconds
and peak memory against N, log-log, with each stage's fitted exponent. Collections and artefacts go
under `--work` (runs/benchmarks/scale). Run from the repository root:

    nice -n 10 .venv/bin/python -m benchmarks.scale --sizes 10000 100000
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path

from benchmarks import WORK
from benchmarks.machine import machine_info
from benchmarks.scale_collection import TEST_QUERIES, generate_collection, is_generated, make_encoder

ROOT = Path(__file__).resolve().parents[1]
DENSEKIT = [sys.executable, "-m", "densekit"]

# Raw faiss over the same vectors as `densekit index` with the parameters its index.json records:
# the whole .npy read into memory, trained on the same number of points, then the test queries searched.
FAISS_PEER = """
import json, sys, time
import faiss, numpy as np
vectors_file, queries_file, meta_file, k = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
spec = json.load(open(meta_file))["spec"]
start = time.perf_counter()
vectors = np.load(vectors_file)
queries = np.load(queries_file)
read = time.perf_counter() - start
if spec["type"] == "flat":
    index = faiss.IndexFlatIP(vectors.shape[1])
elif spec["type"] == "hnsw":
    index = faiss.IndexHNSWFlat(vectors.shape[1], spec["hnsw_m"], faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = spec["ef_construction"]
else:
    quantizer = faiss.IndexFlatIP(vectors.shape[1])
    index = faiss.IndexIVFPQ(quantizer, vectors.shape[1], spec["nlist"], spec["pq_m"], spec["pq_bits"],
                             faiss.METRIC_INNER_PRODUCT)
    index.do_polysemous_training = False
start = time.perf_counter()
if not index.is_trained:
    sample = np.random.default_rng(0).choice(len(vectors), size=min(len(vectors), 256 * 1024), replace=False)
    index.train(vectors[np.sort(sample)])
index.add(vectors)
build = time.perf_counter() - start
if spec["type"] == "hnsw":
    index.hnsw.efSearch = spec["ef_search"]
elif spec["type"] == "ivfpq":
    index.nprobe = spec["nprobe"]
start = time.perf_counter()
index.search(queries, k)
print(json.dumps({"read_s": read, "build_s": build, "search_s": time.perf_counter() - start}))
"""

# Raw bm25s with densekit's text processing (English stop words, the Snowball stemmer) and parameters.
BM25S_PEER = """
import json, sys, time
import bm25s, Stemmer
corpus_file, queries_file, qrels_file, k = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
start = time.perf_counter()
texts = []
with open(corpus_file, encoding="utf-8") as handle:
    for line in handle:
        document = json.loads(line)
        texts.append(f"{document['title']} {document['text']}".strip())
wanted = {line.split("\\t")[0] for line in open(qrels_file).read().splitlines()[1:]}
queries = [q["text"] for q in map(json.loads, open(queries_file, encoding="utf-8")) if q["_id"] in wanted]
read = time.perf_counter() - start
stemmer = Stemmer.Stemmer("english")
start = time.perf_counter()
retriever = bm25s.BM25(k1=0.9, b=0.4)
tokens = bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, show_progress=False)
retriever.index(tokens, show_progress=False)
index = time.perf_counter() - start
start = time.perf_counter()
tokens = bm25s.tokenize(queries, stopwords="en", stemmer=stemmer, show_progress=False)
retriever.retrieve(tokens, k=k, show_progress=False, n_threads=1)
print(json.dumps({"read_s": read, "index_s": index, "search_s": time.perf_counter() - start}))
"""

# The test queries' vectors, for the faiss peer to search (not a stage: preparation).
QUERY_VECTORS = """
import sys
import numpy as np
from densekit.data import Dataset
from densekit.encoding.embed import embed_texts
from densekit.models import DenseEncoder
queries, _ = Dataset.open(sys.argv[2]).split_queries("test")
np.save(sys.argv[3], embed_texts(DenseEncoder.load(sys.argv[1]), list(queries.values()), "query"))
"""

DOCUMENT_STORE = """
import sys
from densekit.data import Dataset
from densekit.retrieval.documents import build_document_store
build_document_store(Dataset.open(sys.argv[1]), sys.argv[2], False)
"""


# Each stage is started by this small launcher, which reports the stage's own peak memory: a child
# started straight from the benchmark would count the benchmark's (Linux carries the memory high-water
# mark of the process that execs into the new program).
LAUNCHER = """
import json, os, signal, sys
report, argv = sys.argv[1], sys.argv[2:]
pid = os.posix_spawnp(argv[0], argv, os.environ)
signal.signal(signal.SIGTERM, lambda *_: os.kill(pid, signal.SIGTERM))
_, status, usage = os.wait4(pid, 0)
json.dump({"code": os.waitstatus_to_exitcode(status), "maxrss_kib": usage.ru_maxrss}, open(report, "w"))
"""


_SCRIPTS = {FAISS_PEER: "FAISS_PEER", BM25S_PEER: "BM25S_PEER", QUERY_VECTORS: "QUERY_VECTORS",
            DOCUMENT_STORE: "DOCUMENT_STORE"}  # fmt: skip  # recorded by name: the scripts are above


def run_children(argvs: list[list[str]], log: Path) -> dict:
    """Run `argvs` at once, each its own child; their wall seconds together, each one's peak resident
    memory (the largest is reported), its exit status and, on failure, the last line it printed."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    children = []
    for number, argv in enumerate(argvs):
        out, err = (log.with_name(f"{log.stem}.{number}.{suffix}") for suffix in ("out", "err"))
        report = log.with_name(f"{log.stem}.{number}.json")
        launch = [sys.executable, "-c", LAUNCHER, str(report), *map(str, argv)]
        with out.open("w") as stdout, err.open("w") as stderr:
            children.append(
                (subprocess.Popen(launch, stdout=stdout, stderr=stderr, cwd=ROOT), out, err, report)
            )
    peaks, codes = [], []
    for child, _, _, report in children:
        child.wait()
        measured = json.loads(report.read_text())
        peaks.append(measured["maxrss_kib"] / 1024)
        codes.append(measured["code"])
    result = {
        "seconds": round(time.perf_counter() - start, 3),
        "peak_rss_mib": round(max(peaks), 1),
        "command": [" ".join(_SCRIPTS.get(str(arg), str(arg)) for arg in argv) for argv in argvs],
        "status": "ok" if not any(codes) else "failed",
    }
    failed = [err for (_, _, err, _), code in zip(children, codes, strict=True) if code]
    if failed:
        lines = failed[0].read_text(errors="replace").strip().splitlines()
        result["error"] = lines[-1] if lines else f"exit status {codes}"
    else:
        printed = children[0][1].read_text().strip().splitlines()
        if printed and printed[-1].startswith("{"):
            result["inside"] = json.loads(printed[-1])  # a peer's own timings, imports left out
    return result


def stage_outputs(argvs: list[list[str]]) -> list[Path]:
    """What a stage's commands write: the values of their `-o`, `--json` and `--uri` options."""
    return [
        Path(argv[i + 1])
        for argv in argvs
        for i, arg in enumerate(argv[:-1])
        if arg in ("-o", "--json", "--uri")
    ]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_start_up(model: Path, index: Path, data: Path, log: Path, limit: float = 600) -> dict:
    """Seconds from starting `densekit serve` until /health answers 200, and its peak memory by then."""
    port = free_port()
    argv = [*DENSEKIT, "serve", str(model), str(index), "--corpus", str(data), "--port", str(port)]
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    report = log.with_suffix(".json")
    launch = [sys.executable, "-c", LAUNCHER, str(report), *argv]
    with log.open("w") as stderr:
        child = subprocess.Popen(launch, stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT)
    ready = None
    while time.perf_counter() - start < limit and child.poll() is None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as answer:
                if answer.status == 200:
                    ready = time.perf_counter() - start
                    break
        except OSError:
            time.sleep(0.2)
    if child.poll() is None:
        child.terminate()  # the launcher passes it on to `serve`
    child.wait()
    peak = json.loads(report.read_text())["maxrss_kib"] / 1024
    result = {"seconds": round(ready, 3) if ready else None, "peak_rss_mib": round(peak, 1),
              "command": [" ".join(argv)], "status": "ok" if ready else "failed"}  # fmt: skip
    if not ready:
        lines = log.read_text(errors="replace").strip().splitlines()
        result["error"] = lines[-1] if lines else "never answered /health"
    return result


def measure(size: int, work: Path, shared: Path, skip: set[str], only: set[str] | None = None) -> dict:
    """Every stage and peer at `size` passages (or the stages `only` names, over the artefacts an earlier
    run left); artefacts under `work/<size>`."""
    base = work / str(size)
    started = time.perf_counter()
    reused = is_generated(base / "data", size)
    begin = time.perf_counter()
    data = generate_collection(base / "data", size, shared)
    generated = None if reused else round(time.perf_counter() - begin, 3)  # None: an earlier run's
    model = make_encoder(work / "model")
    logs = base / "logs"
    out = base / "out"
    if out.exists() and only is None:
        shutil.rmtree(out)  # every artefact of the last run here, so that each stage does its whole work
    out.mkdir(parents=True, exist_ok=True)
    py = [sys.executable, "-c"]
    part = out / "emb" / "part-00000-of-00001.npy"

    def dk(*args: object) -> list[str]:
        return [*DENSEKIT, "--quiet", *map(str, args)]

    stages: dict[str, list[list[str]]] = {
        "cli start-up": [dk("--help")],
        "validate": [dk("validate", data)],
        "bm25": [dk("bm25", data, "--split", "test", "-o", out / "bm25.trec", "--no-progress")],
        "encode": [dk("encode", model, data, "-o", out / "emb", "--no-progress")],
        "encode --shard over two": [
            dk("encode", model, data, "-o", out / "emb2", "--shard", f"{i}/2", "--no-progress")
            for i in range(2)
        ],
        "import-embeddings": [
            dk("import-embeddings", model, data, part, "-o", out / "emb-imported", "--no-progress")
        ],
    }
    for kind in ("flat", "hnsw", "ivfpq"):
        index = out / f"index-{kind}"
        stages[f"index {kind}"] = [dk("index", out / "emb", "-o", index, "--type", kind, "--no-progress")]
        run = out / f"dense-{kind}.trec"
        stages[f"search {kind}"] = [dk("search", model, index, data, "-o", run, "--no-progress")]
    mapped = out / "dense-ivfpq-mmap.trec"
    stages["search ivfpq --mmap-index"] = [
        dk("search", model, out / "index-ivfpq", data, "-o", mapped, "--mmap-index", "--no-progress")
    ]
    mine = ("mine", data, "--split", "train", "--no-progress", "-o")
    stages["mine bm25"] = [dk(*mine, out / "mined-bm25.jsonl", "--source", "bm25")]
    dense = ("--source", "dense", "--model", model, "--index", out / "index-flat")
    stages["mine dense"] = [dk(*mine, out / "mined-dense.jsonl", *dense)]
    qrels, dense_run = data / "qrels" / "test.tsv", out / "dense-flat.trec"
    stages["evaluate"] = [dk("evaluate", qrels, dense_run, "--json", out / "dense-flat.json")]
    stages["fuse"] = [dk("fuse", out / "bm25.trec", dense_run, "--method", "rrf", "-o", out / "hybrid.trec")]
    store = out / "index-flat.documents.sqlite"  # where `serve` looks for it: serve start-up reuses it
    stages["documents store"] = [[*py, DOCUMENT_STORE, str(data), str(store)]]
    milvus = ("--backend", "milvus", "--uri", out / "milvus.db", "--no-progress")
    stages["milvus lite"] = [dk("index", out / "emb", "-o", out / "index-milvus", *milvus)]

    results: dict[str, dict] = {}
    peers: dict[str, dict] = {}
    queries = out / "queries.npy"
    for name, argvs in stages.items():
        if only is not None and name not in only:
            continue
        if name in skip:
            results[name] = {"status": "skipped", "reason": "--skip"}
            continue
        if only is not None:  # the earlier run's outputs of this stage: made again, not reused
            for output in stage_outputs(argvs) + ([store] if name == "documents store" else []):
                for made in (output, Path(f"{output}.report.json")):
                    shutil.rmtree(made) if made.is_dir() else made.unlink(missing_ok=True)
                    made.with_name(f".{made.name}.densekit.json").unlink(missing_ok=True)
        results[name] = run_children(argvs, logs / f"{name.replace(' ', '_')}.log")
        print(f"{size}: {name}: {results[name]}", flush=True)
        if name == "bm25":
            files = [str(data / "corpus.jsonl"), str(data / "queries.jsonl"), str(qrels)]
            peers["bm25s"] = run_children([[*py, BM25S_PEER, *files, "1000"]], logs / "peer_bm25s.log")
            print(f"{size}: peer bm25s: {peers['bm25s']}", flush=True)
        if name == "encode":
            run_children([[*py, QUERY_VECTORS, str(model), str(data), str(queries)]], logs / "queries.log")
        if name.startswith("index ") and results[name]["status"] == "ok":
            kind = name.split()[1]
            meta = out / f"index-{kind}" / "index.json"
            argv = [*py, FAISS_PEER, str(part), str(queries), str(meta), "1000"]
            peers[f"faiss {kind}"] = run_children([argv], logs / f"peer_faiss_{kind}.log")
            print(f"{size}: peer faiss {kind}: {peers[f'faiss {kind}']}", flush=True)
    if "serve start-up" not in skip and (only is None or "serve start-up" in only):
        results["serve start-up"] = serve_start_up(model, out / "index-flat", data, logs / "serve.log")
        print(f"{size}: serve start-up: {results['serve start-up']}", flush=True)
    sizes = {"index.faiss bytes": {kind: (out / f"index-{kind}" / "index.faiss").stat().st_size
                                   for kind in ("flat", "hnsw", "ivfpq")
                                   if (out / f"index-{kind}" / "index.faiss").is_file()}}  # fmt: skip
    quality = out / "dense-flat.json"
    return {
        "passages": size,
        "test_queries": TEST_QUERIES,
        "machine": machine_info(),
        "generate_s": generated,
        "wall_s": round(time.perf_counter() - started, 1),
        "stages": results,
        "peers": peers,
        "artefacts": sizes,
        "dense_flat_measures": json.loads(quality.read_text()) if quality.is_file() else None,
    }


def _points(runs: Iterable[dict], group: str, name: str, field: str) -> list[tuple[int, float]]:
    """(N, value) of a stage or peer at each size where it ran to its end."""
    found = []
    for run in runs:
        entry = run[group].get(name, {})
        if entry.get("status") == "ok" and entry.get(field):
            found.append((run["passages"], entry[field]))
    return sorted(found)


def exponents(runs: dict[str, dict], group: str, field: str) -> dict[str, float]:
    """Each stage's least-squares slope of log(`field`) against log(N) over the sizes where it ran."""
    names = {name for run in runs.values() for name in run[group]}
    slopes = {}
    for name in sorted(names):
        points = [(math.log(n), math.log(value)) for n, value in _points(runs.values(), group, name, field)]
        if len(points) >= 2:
            mean_x = sum(x for x, _ in points) / len(points)
            mean_y = sum(y for _, y in points) / len(points)
            spread = sum((x - mean_x) ** 2 for x, _ in points)
            slopes[name] = round(sum((x - mean_x) * (y - mean_y) for x, y in points) / spread, 3)
    return slopes


def plot(results: dict, path: Path) -> None:
    """Seconds and peak memory against N, log-log, a line per stage and peer labelled with its exponent
    in that panel's measure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(results["runs"].values(), key=lambda run: run["passages"])
    series = [
        (group, name)
        for group in ("stages", "peers")
        for name in dict.fromkeys(n for r in runs for n in r[group])
    ]
    colours = plt.get_cmap("tab20").colors + plt.get_cmap("Dark2").colors
    figure, axes = plt.subplots(1, 2, figsize=(22, 9))
    panels = ((axes[0], "seconds", "wall seconds"), (axes[1], "peak_rss_mib", "peak RSS, MiB"))
    for axis, field, label in panels:
        for number, (group, name) in enumerate(series):
            points = _points(runs, group, name, field)
            if not points:
                continue
            slope = results["exponents"][group][field].get(name)
            text = f"{'peer ' if group == 'peers' else ''}{name}" + (
                f" (N^{slope:.2f})" if slope is not None else ""
            )
            style = "--s" if group == "peers" else "-o"
            axis.plot(
                *zip(*points, strict=True),
                style,
                color=colours[number % len(colours)],
                label=text,
                markersize=4,
            )
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("passages N")
        axis.set_ylabel(label)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.suptitle("densekit at scale: each stage in its own process (2-core CPU); exponent = log-log slope")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def table(results: dict) -> str:
    """The results as a markdown table: seconds and peak MiB per stage and peer at each N, and exponents."""
    runs = sorted(results["runs"].values(), key=lambda run: run["passages"])
    sizes = [f"{run['passages']:,}" for run in runs]
    lines = ["| stage | " + " | ".join(f"N={n} s / MiB" for n in sizes) + " | exponent s / MiB |",
             "|---|" + "---|" * (len(runs) + 1)]  # fmt: skip
    for group in ("stages", "peers"):
        slopes = results["exponents"][group]
        for name in [n for run in runs for n in run[group]]:
            if any(line.startswith(f"| {'peer ' if group == 'peers' else ''}{name} |") for line in lines):
                continue
            cells = []
            for run in runs:
                entry = run[group].get(name, {})
                ok = entry.get("status") == "ok"
                cells.append(
                    f"{entry['seconds']:.1f} / {entry['peak_rss_mib']:.0f}"
                    if ok
                    else entry.get("status", "-")
                )
            slope = [str(slopes[field].get(name, "-")) for field in ("seconds", "peak_rss_mib")]
            label = f"peer {name}" if group == "peers" else name
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {' / '.join(slope)} |")
    lines.append("| whole run (wall) | " + " | ".join(f"{run['wall_s']:.0f}" for run in runs) + " | |")
    return "\n".join(lines)


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--work", type=Path, default=WORK / "scale", help="collections, artefacts")
    parser.add_argument("--shared", type=Path, default=Path("../shared/data"))
    parser.add_argument("--output", type=Path, default=WORK / "scale" / "scale.json")
    parser.add_argument("--skip", nargs="*", default=[], help="stages to leave out (their names as recorded)")
    parser.add_argument(
        "--only",
        nargs="+",
        help="run just these stages (with their peers) over the artefacts of an earlier run of each size, "
        "and put them in place of that run's entries, marked measured_separately",
    )
    parser.add_argument(
        "--table", action="store_true", help="print the saved results as a table; run nothing"
    )
    args = parser.parse_args()
    args.work, args.shared = args.work.resolve(), args.shared.resolve()  # its stages run from the root
    results = json.loads(args.output.read_text()) if args.output.is_file() else {"runs": {}}
    if args.table:
        print(table(results))
        plot(results, args.output.with_suffix(".png"))
        return
    for size in args.sizes:
        only = set(args.only) if args.only else None
        run = measure(size, args.work, args.shared, set(args.skip), only)
        earlier = results["runs"].get(str(size))
        if only is not None and earlier is not None:
            for group in ("stages", "peers"):
                for entry in run[group].values():
                    entry["measured_separately"] = run["machine"]["date"]
                earlier[group].update(run[group])
            run = earlier
        results["runs"][str(size)] = run
        print(f"{size}: wall {results['runs'][str(size)]['wall_s']} s", flush=True)
        results["exponents"] = {
            group: {field: exponents(results["runs"], group, field) for field in ("seconds", "peak_rss_mib")}
            for group in ("stages", "peers")
        }
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=2) + "\n")
        plot(results, args.output.with_suffix(".png"))


if __name__ == "__main__":
    main()
