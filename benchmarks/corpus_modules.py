"""Label-free corpus modules and routes against the base, collection by collection, with paired tests.

Reads the runs that `recipes/corpus-module.yaml` (one per collection) and `recipes/corpus-routing.yaml`
made, and compares on each collection's test queries, with nDCG@10: the base zero-shot (the control),
the collection's corpus module after round 1 and round 2, and every route (fixed by collection, learned
soft and top-1, and the hypernetwork's module where the collection is the unseen one). Paired
randomisation and t-tests, Holm-corrected across the arms of a collection. Writes `compare.json`, a
Markdown table and a plot of the differences from the base.

    for c in scifact nfcorpus vaswani cranfield; do
      densekit run recipes/corpus-module.yaml --out runs/corpus/$c data.path=../shared/data/$c data.domain=$c
    done
    densekit run recipes/corpus-routing.yaml --out runs/corpus/routing
    python -m benchmarks.corpus_modules --runs runs/corpus --data ../shared/data \\
        --output benchmarks/results/corpus_modules
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.machine import machine_info
from densekit.data.dataset import Dataset
from densekit.data.trec import read_run
from densekit.diagnostics import Diagnostics
from densekit.evaluation.compare import compare_runs
from densekit.plots import pyplot, save_png

COLLECTIONS = ("scifact", "nfcorpus", "vaswani", "cranfield")
MEASURE = "nDCG@10"


def arms(runs: Path, collection: str) -> dict[str, Path]:
    """The run files compared on `collection`, the control first; those not made are left out."""
    own, routing = runs / collection, runs / "routing"
    candidates = {
        "base zero-shot": own / "bench-base" / collection / "dense.trec",
        "corpus module, round 1": own / "bench-round1" / collection / "dense.trec",
        "corpus module, round 2": own / "bench-round2" / collection / "dense.trec",
        "fixed by collection": routing / "bench-fixed" / collection / "dense.trec",
        "learned soft": routing / "bench-soft" / collection / "dense.trec",
        "top-1": routing / "bench-top-k" / collection / "dense.trec",
        "BM25": own / "bench-base" / collection / "bm25.trec",
    }
    if collection == "cranfield":
        candidates["hypernetwork, unseen"] = routing / "bench-hyper-cranfield" / collection / "dense.trec"
    return {name: path for name, path in candidates.items() if path.is_file()}


def main() -> None:
    """Compare, write the JSON, the table and the plot."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--runs", type=Path, required=True, help="folder of the corpus-module runs and routing/"
    )
    parser.add_argument("--data", type=Path, required=True, help="folder of the four collections")
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--trials", type=int, default=100_000)
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    for collection in COLLECTIONS:
        files = arms(args.runs, collection)
        if len(files) < 2:
            print(f"{collection}: fewer than two runs under {args.runs}, left out")
            continue
        qrels = Dataset.open(args.data / collection).qrels("test")
        runs = {name: read_run(path, Diagnostics()) for name, path in files.items()}
        [comparison] = compare_runs(qrels, runs, [MEASURE], args.trials)
        results[collection] = {"files": {k: str(v) for k, v in files.items()}, **comparison.to_json()}
    report = {"machine": machine_info(), "measure": MEASURE, "trials": args.trials, "collections": results}
    (args.output / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
    names = list(dict.fromkeys(arm["name"] for r in results.values() for arm in r["runs"]))
    lines = [
        f"| {MEASURE} (p, Holm) | " + " | ".join(results) + " |",
        "|---" * (len(results) + 1) + "|",
        "| base zero-shot | " + " | ".join(f"{r['control']['mean']:.4f}" for r in results.values()) + " |",
    ]
    for name in names:
        cells = []
        for result in results.values():
            arm = next((a for a in result["runs"] if a["name"] == name), None)
            if arm is None:
                cells.append("")
                continue
            delta = arm["mean"] - result["control"]["mean"]
            cells.append(f"{arm['mean']:.4f} ({delta:+.4f}, p={arm['p_randomisation_holm']:.2g})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    (args.output / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        xs, ys, colours = [], [], []
        for j, result in enumerate(results.values()):
            arm = next((a for a in result["runs"] if a["name"] == name), None)
            if arm is not None:
                xs.append(j + i * width)
                ys.append(arm["mean"] - result["control"]["mean"])
                colours.append(arm["p_randomisation_holm"] < 0.05)
        bars = axes.bar(xs, ys, width, label=name)
        for bar, significant in zip(bars, colours, strict=True):
            bar.set_hatch("" if significant else "//")
    axes.axhline(0, color="black", linewidth=0.8)
    axes.set_xticks([j + 0.4 - width / 2 for j in range(len(results))], list(results))
    axes.set_ylabel(f"{MEASURE} minus the base's")
    axes.set_title("Label-free corpus modules and routes against the base (hatched: p >= 0.05 after Holm)")
    axes.legend(fontsize=7, ncol=2)
    save_png(figure, args.output / "differences.png")


if __name__ == "__main__":
    main()
