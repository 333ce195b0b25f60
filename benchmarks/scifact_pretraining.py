"""Pre-training on SciFact's corpus before the two-round fine-tune, with the same fine-tuning budget.

Collects the SciFact test nDCG@10 of `recipes/scifact-two-round.yaml` (fine-tuning alone),
`recipes/scifact-cocondenser.yaml` and `recipes/scifact-retromae.yaml` (each runs the recipes, skipping
what is done), pre-trains with Condenser as well (same settings) so that all three methods' losses can
be shown, and copies each pre-training log and plot into `results/`. Run from the repository root:

    .venv/bin/python -m benchmarks.scifact_pretraining
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import yaml

from benchmarks.machine import machine_info
from densekit.configuration import validate_config
from densekit.pretraining.config import PretrainConfig
from densekit.pretraining.run import run_pretraining
from densekit.recipes.runner import run_recipe
from densekit.training.log import plot_curves


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--data", type=Path, default=Path("../shared/data/scifact"))
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    rows = {}
    for name in ("two-round", "cocondenser", "retromae"):
        out = args.runs / f"scifact-{name}"
        metrics = run_recipe(Path(f"recipes/scifact-{name}.yaml"), out)
        timings = json.loads((out / "timings.json").read_text())
        rows[name] = {
            "command": f"densekit run recipes/scifact-{name}.yaml --out {out}",
            "nDCG@10": round(metrics["nDCG@10"], 4),
            "round1_nDCG@10": round(json.loads((out / "round1-test.json").read_text())["nDCG@10"], 4),
            "pretrain_seconds": timings.get("pretrain"),
            "total_seconds": round(sum(timings.values()), 1),
        }

    condenser = args.runs / "scifact-condenser-pretrain"
    recipe_pretrain = yaml.safe_load(Path("recipes/scifact-cocondenser.yaml").read_text())["pretrain"]
    config = validate_config(
        {
            "method": "condenser",
            "model": {
                "path": "sentence-transformers/all-MiniLM-L6-v2",
                "max_length": recipe_pretrain["max_length"],
            },
            "data": {"path": str(args.data)},
            "optim": {k: recipe_pretrain[k] for k in ("learning_rate", "epochs", "batch_size")},
            "checkpoint": {"every": 40},
        },
        PretrainConfig,
        "condenser",
    )
    state = run_pretraining(config, condenser, resume=True, show_progress=False)
    rows["condenser (pre-training only)"] = {"pretrain_seconds": round(state["elapsed_s"], 1)}

    for method, folder in (
        ("condenser", condenser),
        ("cocondenser", args.runs / "scifact-cocondenser" / "pretrained"),
        ("retromae", args.runs / "scifact-retromae" / "pretrained"),
    ):
        log = folder / "train_log.jsonl"
        shutil.copyfile(log, args.results / f"scifact_pretrain_{method}_log.jsonl")
        plot_curves(
            log, args.results / f"scifact_pretrain_{method}.png", title=f"{method} on the SciFact corpus"
        )
        records = [json.loads(line) for line in log.read_text().splitlines()]
        losses = [r["loss"] for r in records if "loss" in r]
        rows.setdefault(method, {}).update(
            first_logged_loss=round(losses[0], 4), last_logged_loss=round(losses[-1], 4)
        )

    output = {
        "benchmark": "scifact_pretraining",
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "pretraining": recipe_pretrain,
        "fine-tuning": "the two-round recipe's budget: 75 steps per round, batch 32, group 2, lr 2e-5",
        "results": rows,
        "machine": machine_info(),
    }
    (args.results / "scifact_pretraining.json").write_text(json.dumps(output, indent=2) + "\n")
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
