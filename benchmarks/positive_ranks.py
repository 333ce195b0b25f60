"""Where a split's judged documents rank in a run, and whether a mining rank range can teach a listwise loss.

Hard negatives drawn from ranks [first, last] of a dense run train a cross-encoder (or a bi-encoder)
against one positive drawn at random from the query's judged documents. When most judged documents
rank below that range, the drawn positive is usually less like the query than the negatives and the
listwise loss cannot leave chance (NFCorpus: docs/reranking.md). For each --range this prints the mean
over queries of the chance that a random positive ranks above a random candidate negative of the
range (positives excluded, as mining excludes them); 0.5 is no signal. Documents missing from the run
rank below all it holds: search with --k as large as the corpus.

    densekit search runs/nf-two-round/round2/model runs/nf-two-round/index ../shared/data/nfcorpus \\
        --split train --k 3633 --output runs/nf-train-full.trec
    python -m benchmarks.positive_ranks ../shared/data/nfcorpus/qrels/train.tsv runs/nf-train-full.trec \\
        --range 3-100 --range 100-3633
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from densekit.data.records import Qrels, Run
from densekit.data.trec import read_qrels, read_run
from densekit.diagnostics import Diagnostics
from densekit.io.atomic import write_text_atomic


class QueryRanks(NamedTuple):
    """One query's positives' ranks and how deep its run goes."""

    positives: list[int]
    depth: int


def positive_ranks(qrels: Qrels, run: Run) -> dict[str, QueryRanks]:
    """Each judged query's positives' ranks (from 1, by descending score, ties in the run's order; a
    positive the run lacks ranks one below its last document). Queries the run lacks are left out:
    `summary` counts them."""
    ranks = {}
    for query, judged in qrels.items():
        if not run.get(query):
            continue
        ordered = sorted(run[query].items(), key=lambda item: -item[1])
        ranked = {doc: rank for rank, (doc, _) in enumerate(ordered, start=1)}
        found = sorted(ranked.get(doc, len(ranked) + 1) for doc, grade in judged.items() if grade > 0)
        if found:
            ranks[query] = QueryRanks(found, len(ranked))
    return ranks


def chance_positive_above(ranks: dict[str, QueryRanks], first: int, last: int) -> float:
    """Mean over queries of P(a random positive ranks above a random non-positive of ranks first..last),
    the range cut to each query's run as mining cuts it; NaN when no query has a candidate there."""
    shares = []
    for positives, depth in ranks.values():
        taken = set(positives)
        candidates = np.array([r for r in range(first, min(last, depth) + 1) if r not in taken])
        if candidates.size:
            shares.append(float(np.mean([(candidates > r).mean() for r in positives])))
    return float(np.mean(shares)) if shares else float("nan")


def summary(qrels: Qrels, run: Run, ranges: list[tuple[int, int]]) -> dict:
    """Percentiles of the positives' ranks, the share within a few depths, each range's chance, and
    the judged queries the run lacks."""
    ranks = positive_ranks(qrels, run)
    if not ranks:
        raise ValueError("the run ranks none of the judged queries")
    flat = np.array([r for found in ranks.values() for r in found.positives])
    judged = [q for q, grades in qrels.items() if any(g > 0 for g in grades.values())]
    return {
        "queries": len(ranks),
        "judged_queries_missing_from_the_run": sum(1 for q in judged if not run.get(q)),
        "positives": int(flat.size),
        "rank_percentiles": {str(p): float(np.percentile(flat, p)) for p in (10, 25, 50, 75, 90)},
        "share_within": {str(k): float((flat <= k).mean()) for k in (2, 10, 100, 1000)},
        "chance_positive_above_negative": {
            f"{first}-{last}": chance_positive_above(ranks, first, last) for first, last in ranges
        },
    }


def _range(text: str) -> tuple[int, int]:
    first, _, last = text.partition("-")
    if not (first.isdigit() and last.isdigit()) or not 1 <= int(first) <= int(last):
        raise argparse.ArgumentTypeError(f"{text!r}: expected FIRST-LAST, 1 <= FIRST <= LAST")
    return int(first), int(last)


def main() -> None:
    """Read the judgements and the run, print the summary (and write it with --output)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("qrels", type=Path)
    parser.add_argument("run", type=Path)
    parser.add_argument("--range", dest="ranges", type=_range, action="append", default=[])
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    diagnostics = Diagnostics()
    qrels = read_qrels(args.qrels, diagnostics)
    run = read_run(args.run, diagnostics)
    diagnostics.raise_if_errors()
    result = {"qrels": str(args.qrels), "run": str(args.run)}
    result |= summary(qrels, run, args.ranges)
    text = json.dumps(result, indent=2)
    print(text)
    if args.output:
        write_text_atomic(args.output, text + "\n")


if __name__ == "__main__":
    main()
