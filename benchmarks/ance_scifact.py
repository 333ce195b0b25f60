"""ANCE on SciFact against static negatives, with equal training steps from the same warm start.

All runs continue from the round-1 model of `recipes/scifact-two-round.yaml` (trained on BM25
negatives: ANCE's warm-up) for the same number of steps, batch, group size and learning rate:

- in-batch: no hard negatives (group size 1);
- bm25: the BM25 negatives of round 1;
- static: the negatives the round-1 model mined once (the second round of the two-round recipe);
- ance: negatives refreshed asynchronously by an inferencer from the trainer's newest checkpoint,
  starting from the static ones.

Reported: SciFact test nDCG@10, wall-clock, the async gap (steps between the checkpoint that made the
negatives in use and the current step), and per-step gradient norms, plotted. Run from the repository
root after the two-round recipe:

    .venv/bin/python -m benchmarks.ance_scifact --two-round runs/scifact-two-round --out runs/ance-scifact
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks import WORK
from benchmarks.machine import machine_info
from densekit.configuration import validate_config
from densekit.data import Dataset
from densekit.evaluation.encoder_evaluation import evaluate_encoder
from densekit.models import DenseEncoder
from densekit.training.config import TrainConfig
from densekit.training.fine_tuning import run_training

RUNS = ["in-batch", "bm25", "static", "ance"]


def config_for(run: str, data: Path, two_round: Path, steps: int, refresh_every: int) -> TrainConfig:
    train_file = two_round / (
        "round1-examples.jsonl" if run in ("in-batch", "bm25") else "round2-examples.jsonl"
    )
    tree = {
        "model": {
            "path": str(two_round / "round1" / "model"),
            "query_max_length": 64,
            "passage_max_length": 256,
        },
        "data": {
            "path": str(data),
            "train": str(train_file),
            "group_size": 1 if run == "in-batch" else 2,
            "shortfall": "random",  # as the two-round recipe: a few queries have no mined negative left
        },
        "loss": {"temperature": 0.05},
        "optim": {"learning_rate": 2e-5, "max_steps": steps, "batch_size": 32, "warmup_ratio": 0.1},
        "checkpoint": {"every": refresh_every, "keep": 3},  # ANCE refreshes from these; others resume
        "log_every": 1,
        "device": "cpu",
    }
    if run == "ance":
        tree["ance"] = {
            "enabled": True, "inferencer": "local", "threads": 1, "depth": 100,
            "negatives": {"first_rank": 3, "last_rank": 100, "count": 16, "relative_margin": 0.95},
        }  # fmt: skip
    return validate_config(tree, TrainConfig, run)


def moving_average(values: list[float], window: int) -> list[float]:
    """Mean of each value and the `window - 1` before it (fewer at the start)."""
    return [statistics.mean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def plot(results: Path) -> None:
    """Gradient norms of every run logged in `results` (raw and averaged over 10 steps) and ANCE's gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = {
        run: [json.loads(line) for line in log.read_text().splitlines()]
        for run in RUNS
        if (log := results / f"ance_scifact_{run}_log.jsonl").is_file()
    }
    figure, (norms, gaps) = plt.subplots(1, 2, figsize=(13, 4.5))
    colours = dict(zip(RUNS, ["tab:gray", "tab:orange", "tab:green", "tab:red"], strict=True))
    for run, rows in records.items():
        colour = colours[run]
        steps = [r["step"] for r in rows if "grad_norm" in r]
        values = [r["grad_norm"] for r in rows if "grad_norm" in r]
        norms.plot(steps, values, color=colour, alpha=0.2, linewidth=0.8)
        label = f"{run} (mean {statistics.mean(values):.2f})"
        norms.plot(steps, moving_average(values, 10), color=colour, linewidth=2, label=label)
    norms.set_xlabel("step")
    norms.set_ylabel("gradient norm (before clipping)")
    norms.set_title("Gradient norms by source of negatives (faint: per step; bold: 10-step mean)")
    norms.legend()
    ance = [r for r in records.get("ance", []) if "ance_async_gap" in r]
    gaps.plot([r["step"] for r in ance], [r["ance_async_gap"] for r in ance], color="tab:red")
    gaps.set_xlabel("step")
    gaps.set_ylabel("async gap (steps)", color="tab:red")
    versions = gaps.twinx()
    versions.step(
        [r["step"] for r in ance], [r["ance_version"] for r in ance], where="post", color="tab:blue"
    )
    versions.set_ylabel("version of negatives in use", color="tab:blue")
    versions.yaxis.get_major_locator().set_params(integer=True)
    gaps.set_title("ANCE: version in use and the async gap")
    figure.tight_layout()
    figure.savefig(results / "ance_gradient_norms.png", dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=Path("../shared/data/scifact"))
    parser.add_argument("--two-round", type=Path, default=Path("runs/scifact-two-round"))
    parser.add_argument("--out", type=Path, default=Path("runs/ance-scifact"))
    parser.add_argument("--steps", type=int, default=75)
    parser.add_argument("--refresh-every", type=int, default=15)
    parser.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS)
    parser.add_argument("--plot-only", action="store_true", help="redraw the plot from the logged runs")
    parser.add_argument(
        "--results", type=Path, default=WORK / "ance_scifact",
        help="folder of the figures and logs (the committed ones: benchmarks/results)",
    )
    args = parser.parse_args()
    if args.plot_only:
        plot(args.results)
        return

    dataset = Dataset.open(args.data)
    documents = list(dataset.iter_corpus())
    queries, qrels = dataset.split_queries("test")
    args.results.mkdir(parents=True, exist_ok=True)
    summary_file = args.results / "ance_scifact.json"
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {"runs": {}}
    for run in args.runs:
        output = args.out / run
        began = time.perf_counter()
        state = run_training(
            config_for(run, args.data, args.two_round, args.steps, args.refresh_every), output, resume=None
        )
        wall = time.perf_counter() - began
        scores = evaluate_encoder(
            DenseEncoder.load(output / "model"), documents, queries, qrels, ["nDCG@10", "RR@10", "R@100"]
        )
        rows = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
        row = {
            **{k: round(v, 4) for k, v in scores.items()},
            "train_seconds": round(state["elapsed_s"], 1),
            "wall_seconds": round(wall, 1),
            "steps": state["step"],
            "mean_grad_norm": round(statistics.mean(r["grad_norm"] for r in rows if "grad_norm" in r), 4),
        }
        if run == "ance":
            gaps = [r["ance_async_gap"] for r in rows if "ance_async_gap" in r]
            row["versions_used"] = sorted({int(r["ance_version"]) for r in rows if "ance_version" in r})
            row["async_gap_mean"] = round(statistics.mean(gaps), 2)
            row["async_gap_max"] = max(gaps)
            row["inferencer_versions"] = [
                json.loads(p.read_text()) for p in sorted((output / "ance").glob("version-*/commit.json"))
            ]
        summary["runs"][run] = row
        print(run, json.dumps({k: v for k, v in row.items() if k != "inferencer_versions"}), flush=True)
        (args.results / f"ance_scifact_{run}_log.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows)
        )
        summary.update(
            benchmark="ance_scifact", steps=args.steps, refresh_every=args.refresh_every, batch_size=32,
            start="round-1 model of recipes/scifact-two-round.yaml", machine=machine_info(),
        )  # fmt: skip
        summary_file.write_text(json.dumps(summary, indent=2) + "\n")  # after each run: runs take hours
    plot(args.results)


if __name__ == "__main__":
    main()
