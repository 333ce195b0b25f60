r"""Quality at a million passages: BM25, all-MiniLM-L6-v2 zero-shot and their fusion on wiki1m's test
queries at each size, and a fine-tuned model's run tested against zero-shot.

For each size given (`--sizes NAME=FOLDER`: a slice of `densekit slice`, or the whole collection), on
the split's queries (`--split`, test):

- `BM25`: densekit's BM25 (bm25s, k1 0.9, b 0.4, English stemmer and stop words), as `densekit bm25`
  runs it, 1,000 deep;
- `MiniLM zero-shot`: exact inner-product search (`exact_top_k`, what a flat index searches with) over
  the passages' vectors taken by id from `--embeddings` (an embedding folder of the whole corpus or of
  the slice, `wiki_inputs`: never encoded again), the queries encoded by `--model` with the settings
  the embeddings record;
- `RRF`: the two fused by reciprocal rank fusion (`densekit.evaluation.fusion`, k 60), 1,000 deep;
- with `--fine-tuned NAME=RUN`, a run of the size's test queries (the `test.trec` of
  `benchmarks/recipes/wiki1m-round1.yaml`) as a fourth row.

Each is scored by nDCG@10, R@100 and R@1000 and tested against MiniLM zero-shot query by query (the
paired t-test and randomisation test `densekit compare` runs: BM25 and RRF Holm-corrected over the
two, the fine-tuned run in a test of its own, as `densekit compare` of the two runs gives). Every run
is written as TREC under `--work/NAME/` (`densekit compare` and `evaluate` read them); the results go
to `--output` (JSON, with each run's command and machine), a markdown table and a plot of each
measure against the size beside it (`.md`, `.png`), all saved after every stage. A stage already
measured from the same inputs is kept: a killed run started again resumes. Run from the repository
root (`runs/wiki/enc1m`: the whole corpus's embeddings):

    S="100k=runs/wiki/data-wiki-100k 300k=runs/wiki/data-wiki-300k 1m=../shared/data/wiki1m"
    E="--embeddings runs/wiki/enc1m --work runs/wiki/bench"
    Q="nice -n 5 .venv/bin/python -m benchmarks.wiki_quality $E"
    $Q --sizes $S --output benchmarks/results/wiki_quality.json
    nice -n 5 .venv/bin/densekit run benchmarks/recipes/wiki1m-round1.yaml --out runs/wiki/round1
    $Q --sizes $S --fine-tuned 100k=runs/wiki/round1/test.trec --output benchmarks/results/wiki_quality.json
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import WORK
from benchmarks.wiki_inputs import (
    Ledger,
    Passages,
    digest,
    parse_sizes,
    setup_logging,
    vectors_made_by,
    wiki_parser,
)
from densekit.limits import DEFAULT_TRIALS

MEASURES = ("nDCG@10", "R@100", "R@1000")
ZERO_SHOT, BM25, FUSED, FINE_TUNED = "MiniLM zero-shot", "BM25", "RRF (BM25, MiniLM)", "fine-tuned"


def write(path: Path, run: dict, tag: str, identity: dict) -> None:
    """Write `run` as TREC at `path`, recording what made it (`identity`), over a run this benchmark
    made before (never over a file densekit did not write)."""
    from densekit.data.trec import write_run

    write_run(path, run, tag=tag, identity=identity, overwrite=True)


def current(path: Path, identity: dict) -> bool:
    """Whether `path` is the run made from `identity`, unchanged since."""
    from densekit.data.trec import RUN_KIND
    from densekit.io.outputs import is_current

    return is_current(path, RUN_KIND, identity)


def read(path: Path) -> dict:
    """A TREC run."""
    from densekit.data.trec import read_run
    from densekit.diagnostics import Diagnostics

    return read_run(path, Diagnostics())


def bm25_run(dataset: Any, queries: dict[str, str], depth: int) -> tuple[dict, dict]:
    """The BM25 run of `queries` over `dataset`'s corpus, and its index and search seconds."""
    from densekit.retrieval.bm25 import BM25Index

    start = time.perf_counter()
    index = BM25Index.of_dataset(dataset, show_progress=False)
    indexed = time.perf_counter()
    run = index.search(queries, depth)
    searched = time.perf_counter()
    return run, {"index_s": round(indexed - start, 1), "search_s": round(searched - indexed, 1),
                 "queries_without_terms": len(index.queries_without_terms)}  # fmt: skip


def dense_run(store: Any, query_ids: list[str], vectors: np.ndarray, depth: int) -> tuple[dict, dict]:
    """Exact inner-product search of `vectors` over `store`'s, `depth` deep (a query whose id is a
    passage's skips it, as `densekit search` does), and its seconds."""
    from densekit.data.hits import Hits
    from densekit.index.exact_search import exact_top_k

    start = time.perf_counter()
    scores, rows = exact_top_k(store.vectors(), vectors, min(depth + 1, len(store)))
    run = Hits(scores, rows, np.asarray(store.ids(), dtype=object)).to_run(query_ids, depth)
    return run, {"search_s": round(time.perf_counter() - start, 1), "passages": len(store)}


def measure_size(
    name: str, folder: Path, args: argparse.Namespace, passages: Passages, ledger: Ledger
) -> None:
    """Every row of one size, each a stage of `ledger`."""
    from densekit.data.dataset import Dataset
    from densekit.evaluation.compare import compare_runs
    from densekit.evaluation.fusion import reciprocal_rank_fusion
    from densekit.evaluation.measures import evaluate
    from densekit.retrieval.bm25 import BM25Config

    dataset = Dataset.open(folder)
    queries, qrels = dataset.split_queries(args.split)
    work = args.work / name
    collection = {"collection": dataset.fingerprint(), "split": args.split, "depth": args.depth}
    measures = list(args.measures)
    files = {label: work / f"{stem}.trec" for label, stem in
             ((BM25, "bm25"), (ZERO_SHOT, "minilm-zero-shot"), (FUSED, "rrf"))}  # fmt: skip
    identities = {
        BM25: {"benchmark": "wiki_quality bm25", **collection, "bm25": BM25Config().model_dump()},
        ZERO_SHOT: {"benchmark": "wiki_quality zero-shot", **collection, **passages.identity()},
    }
    identities[FUSED] = {"benchmark": "wiki_quality rrf", "k": args.rrf_k, "runs": [digest(identities[BM25]),
                         digest(identities[ZERO_SHOT])], **collection}  # fmt: skip
    where = ("sizes", name)
    ledger.data.setdefault("sizes", {}).setdefault(name, {})["collection"] = {
        "folder": str(folder), "documents": dataset.count_documents(), "queries": len(queries),
        "judgements": sum(len(judged) for judged in qrels.values()),
    }  # fmt: skip

    def scored(label: str, run: dict, extra: dict) -> dict:
        write(files[label], run, label.split()[0].lower(), identities[label])
        return {"metrics": evaluate(qrels, run, measures), "run": str(files[label]), **extra}

    def bm25() -> dict:
        return scored(BM25, *bm25_run(dataset, queries, args.depth))

    def zero_shot() -> dict:
        ids, vectors = passages.queries(dataset, args.split)
        run, extra = dense_run(passages.of(name, dataset), ids, vectors, args.depth)
        return scored(ZERO_SHOT, run, {**extra, "inference": passages.store.identity.get("inference")})

    def fused() -> dict:
        runs = [read(files[BM25]), read(files[ZERO_SHOT])]
        return scored(FUSED, reciprocal_rank_fusion(runs, k=args.rrf_k, depth=args.depth), {"k": args.rrf_k})

    for label, measure in ((BM25, bm25), (ZERO_SHOT, zero_shot), (FUSED, fused)):
        ledger.stage((*where, label), {**identities[label], "measures": measures}, measure,
                     present=lambda label=label: current(files[label], identities[label]))  # fmt: skip
    runs = {label: files[label] for label in (ZERO_SHOT, BM25, FUSED)}
    fine_tuned = args.fine_tuned.get(name)
    if fine_tuned is not None:
        from densekit.io.fingerprint import file_digest

        def tuned() -> dict:
            run = read(fine_tuned)
            strangers = sorted(set(run) - set(queries))[:5]
            if strangers:
                raise SystemExit(f"{fine_tuned}: queries {', '.join(strangers)} are not {folder}'s "
                                 f"{args.split} queries; give a run of them")  # fmt: skip
            return {"metrics": evaluate(qrels, run, measures), "run": str(fine_tuned), "queries": len(run)}

        inputs = {"run": file_digest(fine_tuned), **collection, "measures": measures}
        ledger.stage((*where, FINE_TUNED), inputs, tuned)
        runs[FINE_TUNED] = fine_tuned

    def tested(compared: dict[str, dict]) -> list[dict]:
        return [c.to_json() for c in compare_runs(qrels, compared, measures, args.trials, seed=0)]

    def compared() -> dict:
        loaded = {label: read(path) for label, path in runs.items()}
        result = {
            "against": ZERO_SHOT,
            "measures": tested({label: loaded[label] for label in (ZERO_SHOT, BM25, FUSED)}),
        }
        if FINE_TUNED in loaded:  # a test of its own, as `densekit compare` of the two runs gives
            result["fine-tuned"] = tested({ZERO_SHOT: loaded[ZERO_SHOT], FINE_TUNED: loaded[FINE_TUNED]})
        return result

    inputs = {label: ledger.data["sizes"][name][label]["made_from"] for label in runs}
    ledger.stage((*where, "paired tests"), {**inputs, "trials": args.trials}, compared)


def measured(results: dict) -> list[str]:
    """The measures the zero-shot rows were scored by (none before one is)."""
    return next((list(size[ZERO_SHOT]["metrics"]) for size in results.get("sizes", {}).values()
                 if ZERO_SHOT in size), [])  # fmt: skip


def table(results: dict) -> str:
    """The results as markdown: a row per size and system, each measure, and its difference from
    zero-shot with the randomisation test's p (Holm-corrected where several runs were tested)."""
    measures = measured(results) or list(MEASURES)
    heading = ["size", "passages", "system", *measures, *(f"{m} - zero-shot (p)" for m in measures)]
    lines = ["| " + " | ".join(heading) + " |", "|" + "---|" * len(heading)]
    for name, size in results.get("sizes", {}).items():
        paired = size.get("paired tests", {})
        tests: dict[str, dict] = {}
        for m in [*paired.get("measures", []), *paired.get("fine-tuned", [])]:
            tests.setdefault(m["measure"], {}).update({r["name"]: r for r in m["runs"]})
        for label in (BM25, ZERO_SHOT, FUSED, FINE_TUNED):
            if label not in size:
                continue
            metrics = size[label]["metrics"]
            made_by = f" ({vectors_made_by(size[label].get('inference'))})" if label == ZERO_SHOT else ""
            cells = [
                name,
                f"{size['collection']['documents']:,}",
                label + made_by,
                *(f"{metrics[m]:.4f}" for m in measures),
            ]
            for m in measures:
                test = tests.get(m, {}).get(label)
                cells.append(
                    f"{test['mean_difference']:+.4f} ({test['p_randomisation_holm']:.3g})" if test else ""
                )
            lines.append("| " + " | ".join(cells) + " |")
    commands = [f"    {run['command']}" for run in results.get("runs", [])]
    return "\n".join([*lines, "", "Commands (each run of the benchmark that wrote these results):", "",
                      *dict.fromkeys(commands)]) + "\n"  # fmt: skip


def plot(results: dict, output: Path) -> None:
    """Each measure against the collection's size (log scale), a line per system; a fine-tuned run is
    a point at its size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(results.get("sizes", {}).values(), key=lambda size: size["collection"]["documents"])
    measures = measured(results)
    if not measures:
        return
    figure, axes = plt.subplots(1, len(measures), figsize=(4.2 * len(measures), 4.2), squeeze=False)
    for axis, measure in zip(axes[0], measures, strict=True):
        for label, style in ((BM25, "s-"), (ZERO_SHOT, "o-"), (FUSED, "^--"), (FINE_TUNED, "*")):
            points = [(size["collection"]["documents"], size[label]["metrics"][measure])
                      for size in sizes if label in size]  # fmt: skip
            if points:
                axis.plot(*zip(*points, strict=True), style, label=label, markersize=9 if style == "*" else 5)
        axis.set_xscale("log")
        axis.set_xlabel("passages")
        axis.set_title(measure)
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("score")
    axes[0][-1].legend(fontsize=8)
    figure.suptitle("wiki1m: retrieval quality as the collection grows", fontsize=11)
    figure.tight_layout()
    figure.savefig(output, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = wiki_parser(__doc__, "wiki_quality", WORK / "wiki_quality", "runs")
    parser.add_argument("--split", default="test")
    parser.add_argument("--depth", type=int, default=1000, help="documents a run keeps per query")
    parser.add_argument("--measures", nargs="+", default=list(MEASURES))
    parser.add_argument("--rrf-k", type=int, default=60)
    parser.add_argument("--fine-tuned", nargs="*", default=[], help="NAME=RUN: a fine-tuned model's run")
    parser.add_argument(
        "--trials", type=int, default=DEFAULT_TRIALS, help="the randomisation test's sign flips"
    )
    args = parser.parse_args(argv)
    sizes = parse_sizes(args.sizes)
    args.fine_tuned = {name: Path(run) for name, run in parse_sizes(args.fine_tuned).items()}
    unknown = sorted(set(args.fine_tuned) - set(sizes))
    if unknown:
        parser.error(f"--fine-tuned {', '.join(unknown)}: not among --sizes")
    setup_logging()
    output = args.output or args.work / "wiki_quality.json"

    def save_table(results: dict, where: tuple[str, ...]) -> None:
        output.with_suffix(".md").write_text(table(results), encoding="utf-8")
        plot(results, output.with_suffix(".png"))

    ledger = Ledger(output, "wiki_quality", sys.argv[1:] if argv is None else argv, save_table)
    passages = Passages(args.embeddings, args.model, args.work, args.batch_size)
    for name, folder in sizes.items():
        measure_size(name, folder, args, passages, ledger)
    ledger.save()
    print(f"wrote {output} and {output.with_suffix('.md')}")


if __name__ == "__main__":
    main()
