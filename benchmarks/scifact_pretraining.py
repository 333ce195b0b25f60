"""Pre-training all-MiniLM-L6-v2 on SciFact's corpus, and what it adds to the two-round fine-tune.

1. With `--steps N`: pre-trains with Condenser, coCondenser and RetroMAE on the SciFact corpus with the
   settings of `recipes/scifact-cocondenser.yaml` and `recipes/scifact-retromae.yaml` (Condenser: the
   coCondenser settings without the span contrast) for N steps each, and writes each method's log and
   loss plot into `--results` (runs/benchmarks/scifact_pretraining unless given; the committed ones:
   `--results benchmarks/results`).
2. With `--recipes`: runs `recipes/scifact-two-round.yaml` (fine-tuning alone, with mean pooling as
   all-MiniLM-L6-v2 was trained, and again with the CLS vector, the control for the pre-trained arms),
   `recipes/scifact-cocondenser.yaml` (also with 2 epochs of pre-training instead of 0.5) and
   `recipes/scifact-retromae.yaml` (the same fine-tuning budget after pre-training), each skipping
   what is done, and collects their test nDCG@10 and wall-clock.

Run from the repository root:

    .venv/bin/python -m benchmarks.scifact_pretraining --steps 60
    .venv/bin/python -m benchmarks.scifact_pretraining --recipes
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import asdict
from pathlib import Path

from benchmarks import WORK
from benchmarks.machine import machine_info
from densekit.configuration import validate_config
from densekit.data.dataset import Dataset
from densekit.data.trec import read_run
from densekit.diagnostics import Diagnostics
from densekit.evaluation.significance import paired_test, per_query
from densekit.pretraining.config import PretrainConfig
from densekit.pretraining.run import run_pretraining
from densekit.recipes.runner import load_recipe, run_recipe
from densekit.training.log import plot_curves

RECIPES = {"two-round": "recipes/scifact-two-round.yaml", "cocondenser": "recipes/scifact-cocondenser.yaml",
           "retromae": "recipes/scifact-retromae.yaml"}  # fmt: skip
# Each compared run: a recipe and its overrides. "two-round-cls" is the control that separates the
# switch to the CLS vector (which the pre-trained arms retrieve with) from the pre-training itself;
# "cocondenser-2ep" pre-trains four times as long (2 epochs of the corpus against the recipe's 0.5).
ARMS = {
    "two-round": (RECIPES["two-round"], []),
    "two-round-cls": (RECIPES["two-round"], ["steps.round1.config.model.pooling=cls"]),
    "cocondenser": (RECIPES["cocondenser"], []),
    "retromae": (RECIPES["retromae"], []),
    "cocondenser-2ep": (RECIPES["cocondenser"], ["pretrain.epochs=2"]),
}


def recipe_pretraining(method: str, runs: Path) -> dict:
    """The config tree of a recipe's pre-training step; Condenser's is coCondenser's without the contrast."""
    recipe = "retromae" if method == "retromae" else "cocondenser"
    _, steps = load_recipe(Path(RECIPES[recipe]), runs / f"scifact-{recipe}", [])
    tree = dict(steps["pretrain"].config)
    if method == "condenser":
        tree = {k: v for k, v in tree.items() if k not in ("cocondenser", "grad_cache")}
        tree["method"] = "condenser"
    return tree


def keep_log(run: Path, stem: Path, title: str) -> dict:
    """Copy a run's log to `stem`_log.jsonl, plot it to `stem`.png; its first and last logged losses."""
    log = stem.parent / f"{stem.name}_log.jsonl"
    shutil.copyfile(run / "train_log.jsonl", log)
    plot_curves(log, stem.parent / f"{stem.name}.png", title=title)
    losses = [r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]
    return {"first_logged_loss": round(losses[0], 4), "last_logged_loss": round(losses[-1], 4)}


def pretrain_losses(runs: Path, results: Path, steps: int) -> dict:
    """Pre-train with each method; write its log and loss plot into `results`; first and last losses."""
    rows = {}
    for method in ("condenser", "cocondenser", "retromae"):
        tree = recipe_pretraining(method, runs)
        tree["optim"] = {**tree["optim"], "max_steps": steps}
        tree["log_every"] = 2  # averaged over 2 steps: enough points for a plot of a short run
        output = runs / f"scifact-pretrain-{steps}" / method
        state = run_pretraining(
            validate_config({**tree, "device": "cpu"}, PretrainConfig, method), output, resume=None,
            show_progress=False,
        )  # fmt: skip
        losses = keep_log(output, results / f"scifact_pretrain_{method}", f"{method} on the SciFact corpus")
        rows[method] = {
            "steps": state["step"], "seconds": round(state["elapsed_s"], 1), **losses,
            "settings": {k: tree[k] for k in tree if k not in ("data", "checkpoint")},
        }  # fmt: skip
        print(method, json.dumps({k: v for k, v in rows[method].items() if k != "settings"}), flush=True)
    return rows


def recipe_scores(runs: Path, results: Path) -> dict:
    """Run (or finish) each arm's recipe; their test nDCG@10, wall-clock and pre-training losses."""
    rows = {}
    tree, _ = load_recipe(Path(RECIPES["two-round"]), runs / "scifact-two-round", [])
    _, qrels = Dataset.open(Path(tree["data"]["path"])).split_queries("test")
    control_run = runs / "scifact-two-round-cls" / "test.trec"
    for name, (recipe, overrides) in ARMS.items():  # the CLS control comes before the pre-trained arms
        out = runs / f"scifact-{name}"
        metrics = run_recipe(Path(recipe), out, overrides)
        if name == "two-round-cls":
            control = per_query(qrels, read_run(control_run, Diagnostics()), "nDCG@10")
        timings = json.loads((out / "timings.json").read_text())
        rows[name] = {
            "command": " ".join(["densekit run", recipe, "--out", str(out), *overrides]),
            "nDCG@10": round(metrics["nDCG@10"], 4),
            "round1_nDCG@10": round(json.loads((out / "round1-test.json").read_text())["nDCG@10"], 4),
            "pretrain_seconds": timings.get("pretrain"),
            "total_seconds": round(sum(timings.values()), 1),
        }
        if (out / "pretrained").is_dir():
            arm = per_query(qrels, read_run(out / "test.trec", Diagnostics()), "nDCG@10")
            rows[name]["against_cls_control"] = {
                "against": str(control_run),
                **asdict(paired_test(control, arm)),
            }
            title = " ".join([f"pre-training in {recipe}", *overrides])
            rows[name]["pretraining"] = keep_log(
                out / "pretrained", results / f"scifact_recipe_{name}", title
            )
        print(name, json.dumps(rows[name]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=Path, default=Path("runs"))
    parser.add_argument("--steps", type=int, default=None, help="pre-train each method this many steps")
    parser.add_argument("--recipes", action="store_true", help="run the recipes and collect nDCG@10")
    parser.add_argument(
        "--results", type=Path, default=WORK / "scifact_pretraining",
        help="folder of the figures (the committed ones: benchmarks/results)",
    )
    args = parser.parse_args()
    if args.steps is None and not args.recipes:
        parser.error("say what to measure: --steps N (pre-training losses), --recipes (nDCG@10), or both")

    args.results.mkdir(parents=True, exist_ok=True)
    output_file = args.results / "scifact_pretraining.json"
    output = json.loads(output_file.read_text()) if output_file.is_file() else {}
    output.update(
        benchmark="scifact_pretraining",
        model="sentence-transformers/all-MiniLM-L6-v2",
        machine=machine_info(),
    )
    if args.steps is not None:
        output.update(losses=pretrain_losses(args.runs, args.results, args.steps))
        output_file.write_text(json.dumps(output, indent=2) + "\n")
    if args.recipes:
        output["fine-tuning"] = "two-round budget: 3 epochs a round, batch 32, group 2, lr 2e-5"
        output["recipes"] = recipe_scores(args.runs, args.results)
        output_file.write_text(json.dumps(output, indent=2) + "\n")


if __name__ == "__main__":
    main()
