"""Do the pre-training objectives shape the CLS embedding space? A small BERT from scratch.

A randomly initialised BERT (4 layers, hidden 256, the bundled all-MiniLM-L6-v2 vocabulary) is
pre-trained on a collection's own corpus with each method for the same number of steps (same data,
batch, length and learning rate), then used zero-shot (CLS pooling, exact search) on that
collection's test queries, scored by inner product (as exported) and by cosine. "none" is the random
model itself. Run from the repository root:

    .venv/bin/python -m benchmarks.pretrain_small_bert --collections cranfield vaswani --steps 400

`--methods` picks some of the methods; `--spans MIN MAX` sets coCondenser's span lengths in tokens
(default 16 64; other lengths get their own run folder); `--curve-every N` keeps a checkpoint every
N steps and scores each one zero-shot too, for a plot of nDCG@10 against pre-training steps
(`<output>_curve.png`). `--fine-tune RECIPE` then runs that recipe (the SciFact two-round one: the
collection needs a train split) from each model, the random one included, with the CLS vector
cosine-normalised, passages cut at the pre-training's 128 tokens and `--fine-tune-lr` (default
1e-4), and compares the fine-tuned test nDCG@10 of each method with MLM's and the random start's
(paired randomisation test): does the objective add to fine-tuning, beyond plain MLM for the same
steps?

    .venv/bin/python -m benchmarks.pretrain_small_bert --collections scifact --steps 500 \
        --methods none mlm cocondenser retromae --fine-tune recipes/scifact-two-round.yaml

Runs live under `--runs` (one folder per collection, method and step budget) and resume: a killed
benchmark started again continues where each run stopped, and finished runs are only re-evaluated.
The results file keeps the rows of earlier invocations made with the same steps, batch, spans, seed
and fine-tune, so collections and methods can be run separately into one file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

from benchmarks import WORK
from benchmarks.machine import machine_info
from densekit.configuration import validate_config
from densekit.data import Dataset
from densekit.data.trec import read_run
from densekit.device import resolve_device
from densekit.diagnostics import DataError, Diagnostics
from densekit.evaluation.encoder_evaluation import evaluate_encoder
from densekit.evaluation.significance import paired_test, per_query
from densekit.io.atomic import write_text_atomic
from densekit.models import DenseEncoder, resolve_model_path
from densekit.pretraining.config import PretrainConfig
from densekit.pretraining.run import run_pretraining
from densekit.recipes.runner import load_recipe, run_recipe

METHODS = ["none", "mlm", "condenser", "cocondenser", "retromae"]
MAX_LENGTH = 128  # tokens a document is cut to in pre-training, and a passage in the fine-tune
SIMILARITIES = {"inner_product": False, "cosine": True}
FINE_TUNE_OUTPUTS = ("round1-test.json", "test.json", "test.trec")  # what `fine_tune` reads of a recipe's run


def random_bert(path: Path, seed: int) -> Path:
    """A 4-layer, 256-wide BERT with the bundled vocabulary, randomly initialised (kept if present)."""
    if (path / "densekit.json").is_file():
        return path
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("sentence-transformers/all-MiniLM-L6-v2"))
    config = BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=1024, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(seed)
    BertForMaskedLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    settings = {"pooling": "cls", "normalize": False, "query_max_length": 64, "passage_max_length": 256}
    (path / "densekit.json").write_text(json.dumps(settings))
    return path


DEFAULT_SPANS = (16, 64)


def pretrain_config(method: str, model: Path, data: Path, args: argparse.Namespace) -> PretrainConfig:
    """The validated settings of pre-training `model` on `data`'s corpus with `method`.

    With `--curve-every`, a checkpoint is kept every that many steps (the zero-shot curve reads their
    models)."""
    every = args.curve_every or args.steps
    tree = {
        "method": method,
        "model": {"path": str(model), "max_length": MAX_LENGTH},
        "data": {"path": str(data)},
        "condenser": {"skip_from": 2, "head_layers": 2},
        "cocondenser": {"span_min": args.spans[0], "span_max": args.spans[1]},
        "masking": {"ratio": 0.3 if method == "retromae" else 0.15},
        "optim": {
            "max_steps": args.steps, "batch_size": args.batch_size,
            "learning_rate": 5e-4, "warmup_ratio": 0.1,
        },
        "checkpoint": {"every": every, "keep": args.steps // every + 1},
        "log_every": 10,
        "device": args.device,
    }  # fmt: skip
    return validate_config(tree, PretrainConfig, f"{method} on {data}")


def pretrain(config: PretrainConfig, output: Path) -> dict:
    """Run (or resume in `output`) one pre-training; its time and first and last losses."""
    state = run_pretraining(config, output, resume=None, show_progress=False)
    records = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    return {"seconds": round(state["elapsed_s"], 1), "first_loss": losses[0], "last_loss": losses[-1]}


def zero_shot(model: Path, normalize: bool, documents, queries, qrels, device) -> dict[str, float]:
    """Zero-shot nDCG@10 and R@100 of `model` with CLS pooling (cosine when `normalize`)."""
    encoder = DenseEncoder.load(model, pooling="cls", normalize=normalize).to(device)
    scores = evaluate_encoder(encoder, documents, queries, qrels, ["nDCG@10", "R@100"])
    return {k: round(v, 4) for k, v in scores.items()}


def zero_shot_curve(
    output: Path, steps: int, every: int, documents, queries, qrels, device
) -> dict[int, float]:
    """Inner-product nDCG@10 of every kept checkpoint of a run, by step (cached in the run folder).

    A run made without `--curve-every` kept only its last checkpoint: the steps it lacks are named
    on stderr rather than left out of the curve unsaid."""
    cache = output / "zero_shot_curve.json"
    curve = {int(k): v for k, v in json.loads(cache.read_text()).items()} if cache.is_file() else {}
    for folder in sorted((output / "checkpoints").glob("step-*")):
        step = int(folder.name.split("-")[1])
        if step not in curve:
            curve[step] = zero_shot(folder / "model", False, documents, queries, qrels, device)["nDCG@10"]
            write_text_atomic(cache, json.dumps(curve))
    missing = sorted({*range(every, steps + 1, every), steps} - set(curve))
    if missing:
        print(
            f"warning: {output} has no checkpoint at steps {missing}; the curve lacks them", file=sys.stderr
        )
    return dict(sorted(curve.items()))


def fine_tune_overrides(model: Path, data: Path, learning_rate: float) -> list[str]:
    """The recipe overrides of fine-tuning `model` on `data`: CLS vector, cosine, pre-training length."""
    return [
        f"data.path={data}", f"model.path={model}", f"model.passage_max_length={MAX_LENGTH}",
        f"train.learning_rate={learning_rate}", "steps.round1.config.model.pooling=cls",
        "steps.round1.config.model.normalize=true",
    ]  # fmt: skip


def check_fine_tune(recipe: Path, model: Path, data: Path, learning_rate: float, runs: Path) -> None:
    """Fail now, not after hours of pre-training, where `recipe` cannot run from `model` on `data`:
    the recipe's own errors (file, YAML, overrides, step settings) and a split it reads that `data`
    has no judgements for."""
    try:
        _, steps = load_recipe(recipe, runs, fine_tune_overrides(model, data, learning_rate))
    except DataError as err:
        raise SystemExit(str(err)) from None
    needed = {step.split for step in steps.values() if getattr(step, "split", None)}
    missing = sorted(needed - set(Dataset.open(data).splits()))
    if missing:
        raise SystemExit(
            f"error: {recipe} reads the {', '.join(missing)} split of {data}, which has no qrels for it"
        )
    written = {Path(step.output).name for step in steps.values() if getattr(step, "output", None)}
    absent = [name for name in FINE_TUNE_OUTPUTS if name not in written]
    if absent:
        raise SystemExit(
            f"error: {recipe} writes no {', '.join(absent)}, which the benchmark reads: it needs a "
            "two-round recipe like recipes/scifact-two-round.yaml (a test evaluation after each round)"
        )


def fine_tune(recipe: Path, model: Path, data: Path, output: Path, learning_rate: float) -> dict:
    """Run (or finish) `recipe` in `output` from `model` on `data`: its test nDCG@10 after round 1 and
    at the end, its wall-clock and its test run."""
    overrides = fine_tune_overrides(model, data, learning_rate)
    metrics = run_recipe(recipe, output, overrides)
    timings = json.loads((output / "timings.json").read_text())
    return {
        "command": " ".join(["densekit run", str(recipe), "--out", str(output), *overrides]),
        "round1_nDCG@10": round(json.loads((output / "round1-test.json").read_text())["nDCG@10"], 4),
        "nDCG@10": round(metrics["nDCG@10"], 4),
        "seconds": round(sum(timings.values()), 1),
        "run": str(output / "test.trec"),
    }


def compare_fine_tuned(rows: dict[str, dict], qrels) -> None:
    """Add to each fine-tuned row a paired test of its per-query nDCG@10 against MLM's and the random
    start's."""
    tuned = {
        m: per_query(qrels, read_run(Path(r["fine_tune"]["run"]), Diagnostics()), "nDCG@10")
        for m, r in rows.items()
        if "fine_tune" in r
    }
    for method, scores in tuned.items():
        for control in ("mlm", "none"):
            if control in tuned and control != method:
                rows[method]["fine_tune"][f"against_{control}"] = asdict(paired_test(tuned[control], scores))


def fine_tune_settings(args: argparse.Namespace) -> dict | None:
    """The fine-tune's recipe and learning rate, as the results file records them (None: no fine-tune)."""
    return {"recipe": str(args.fine_tune), "learning_rate": args.fine_tune_lr} if args.fine_tune else None


def earlier_results(args: argparse.Namespace) -> dict[str, dict]:
    """The rows already in the results file, where it was written with the same settings and seed."""
    if not args.output.is_file():
        return {}
    earlier = json.loads(args.output.read_text())
    settings = (
        earlier["steps"],
        earlier["batch_size"],
        earlier.get("cocondenser_spans", list(DEFAULT_SPANS)),
        earlier.get("seed", 0),
        earlier.get("fine_tune"),
    )
    if settings != (args.steps, args.batch_size, list(args.spans), args.seed, fine_tune_settings(args)):
        print(f"warning: {args.output} was written with other settings; it is replaced", file=sys.stderr)
        return {}
    return earlier["results"]


def write_results(args: argparse.Namespace, results: dict) -> None:
    """Write what has been measured so far."""
    output = {
        "benchmark": "pretrain_small_bert",
        "model": "random BERT, 4 layers, hidden 256, 4 heads, bundled all-MiniLM-L6-v2 vocabulary",
        "steps": args.steps,
        "batch_size": args.batch_size,
        "max_length": MAX_LENGTH,
        "learning_rate": 5e-4,
        "cocondenser_spans": list(args.spans),
        "seed": args.seed,
        "evaluation": "zero-shot, CLS pooling, exact search by inner product and by cosine, test split",
        "fine_tune": fine_tune_settings(args),
        "results": results,
        "machine": machine_info(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.output, json.dumps(output, indent=2) + "\n")  # read back by the next invocation


def method_label(method: str, spans: list[int]) -> str:
    """A method's name in the plots, with coCondenser's span lengths."""
    return f"{method} (spans {spans[0]}-{spans[1]})" if method == "cocondenser" else method


def plot_results(results: dict[str, dict], path: Path, steps: int, spans: list[int]) -> None:
    """Bars of zero-shot nDCG@10 per collection and method, one panel per similarity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in METHODS if any(m in rows for rows in results.values())]
    figure, axes = plt.subplots(1, len(SIMILARITIES), figsize=(10, 4), sharey=True)
    width = 0.8 / len(methods)
    for axis, similarity in zip(axes, SIMILARITIES, strict=True):
        for offset, method in enumerate(methods):
            # a run not yet measured gets no bar (NaN), not a bar of zero
            heights = [
                results[c].get(method, {}).get(similarity, {}).get("nDCG@10", float("nan")) for c in results
            ]
            positions = [i + (offset - (len(methods) - 1) / 2) * width for i in range(len(results))]
            axis.bar(
                positions,
                heights,
                width,
                label=method_label(method, spans),
                color=f"C{METHODS.index(method)}",
            )
        axis.set_xticks(range(len(results)), list(results))
        axis.set_title(f"{similarity.replace('_', ' ')}, {steps} steps")
    axes[0].set_ylabel("zero-shot nDCG@10 (test)")
    axes[-1].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_zero_shot_curves(results: dict[str, dict], path: Path, spans: list[int]) -> None:
    """Zero-shot nDCG@10 (inner product) against pre-training steps, one panel per collection; the
    random model is step 0 and a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for axis, (collection, rows) in zip(axes[0], results.items(), strict=True):
        start = rows.get("none", {}).get("inner_product", {}).get("nDCG@10")
        if start is not None:
            axis.axhline(start, color="grey", linestyle="--", label="none (random)")
        for method, row in rows.items():
            if "curve_nDCG@10" in row:
                curve = {int(step): value for step, value in row["curve_nDCG@10"].items()}
                if start is not None:
                    curve = {0: start, **curve}
                color = f"C{METHODS.index(method)}"  # one colour per method in every panel
                axis.plot(
                    list(curve),
                    list(curve.values()),
                    marker="o",
                    color=color,
                    label=method_label(method, spans),
                )
        axis.set_title(collection)
        axis.set_xlabel("pre-training steps")
        axis.legend(fontsize="small")
    axes[0][0].set_ylabel("zero-shot nDCG@10 (test, inner product)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_fine_tuned(results: dict[str, dict], path: Path, steps: int) -> None:
    """Bars of test nDCG@10 per method: zero-shot, after round 1 and after round 2 of the fine-tune,
    one panel per collection that was fine-tuned on."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tuned = {c: rows for c, rows in results.items() if any("fine_tune" in r for r in rows.values())}
    figure, axes = plt.subplots(1, len(tuned), figsize=(6 * len(tuned), 4), squeeze=False)
    stages = {"zero-shot": lambda r: r["inner_product"]["nDCG@10"],
              "round 1": lambda r: r["fine_tune"]["round1_nDCG@10"],
              "two rounds": lambda r: r["fine_tune"]["nDCG@10"]}  # fmt: skip
    width = 0.8 / len(stages)
    for axis, (collection, rows) in zip(axes[0], tuned.items(), strict=True):
        methods = [m for m in METHODS if "fine_tune" in rows.get(m, {})]
        for offset, (stage, value) in enumerate(stages.items()):
            positions = [i + (offset - (len(stages) - 1) / 2) * width for i in range(len(methods))]
            axis.bar(positions, [value(rows[m]) for m in methods], width, label=stage)
        axis.set_xticks(range(len(methods)), [f"{m}\n({steps} steps)" if m != "none" else m for m in methods])
        axis.set_title(f"{collection}: pre-trained, then fine-tuned")
    axes[0][0].set_ylabel("nDCG@10 (test)")
    axes[0][-1].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def run_name(method: str, args: argparse.Namespace) -> str:
    """The run folder of `method`: its steps and batch, and coCondenser's spans where not the default
    ("none" trains nothing: its folder holds only what is fine-tuned from the random model)."""
    if method == "none":
        return "none"
    spans = (
        f"-spans{args.spans[0]}-{args.spans[1]}"
        if method == "cocondenser" and tuple(args.spans) != DEFAULT_SPANS
        else ""
    )
    return f"{method}{spans}-{args.steps}x{args.batch_size}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data-root", type=Path, default=Path("../shared/data"))
    parser.add_argument("--collections", nargs="+", default=["vaswani", "cranfield"])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument(
        "--curve-every", type=int, default=0,
        help="keep a checkpoint every N steps and score each zero-shot (0: the final model only)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument(
        "--spans", type=int, nargs=2, default=list(DEFAULT_SPANS), metavar=("MIN", "MAX"),
        help="coCondenser's span lengths in tokens",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fine-tune", type=Path, default=None, metavar="RECIPE",
        help="fine-tune every model with this recipe afterwards (needs a train split)",
    )  # fmt: skip
    parser.add_argument(
        "--fine-tune-lr", type=float, default=None, help="the fine-tune's learning rate (default 1e-4)"
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, ... (auto: a GPU where there is one)")
    parser.add_argument("--runs", type=Path, default=Path("runs/small-bert"))
    parser.add_argument(
        "--output", type=Path, default=WORK / "pretrain_small_bert.json"
    )
    args = parser.parse_args()

    if args.fine_tune_lr is not None and args.fine_tune is None:
        parser.error("--fine-tune-lr sets the learning rate of --fine-tune RECIPE, which is not given")
    if args.fine_tune_lr is None:
        args.fine_tune_lr = 1e-4
    results = earlier_results(args)
    device = resolve_device(args.device)
    start_model = random_bert(args.runs / f"random-seed{args.seed}", args.seed)
    methods = [m for m in METHODS if m in args.methods]
    # every run's settings checked before the first starts: the benchmark takes hours on a CPU
    configs = {
        (name, method): pretrain_config(method, start_model, args.data_root / name, args)
        for name in args.collections
        for method in methods
        if method != "none"
    }
    if args.fine_tune:
        for name in args.collections:
            check_fine_tune(args.fine_tune, start_model, args.data_root / name, args.fine_tune_lr, args.runs)
    for name in args.collections:
        data = args.data_root / name
        dataset = Dataset.open(data)
        documents = list(dataset.iter_corpus())
        queries, qrels = dataset.split_queries("test")
        results.setdefault(name, {})
        for method in methods:
            began = time.perf_counter()
            row: dict = {}
            model = start_model
            output = args.runs / f"seed{args.seed}" / name / run_name(method, args)
            if method != "none":
                row = pretrain(configs[name, method], output)
                model = output / "model"
            for similarity, normalize in SIMILARITIES.items():
                row[similarity] = zero_shot(model, normalize, documents, queries, qrels, device)
            if method != "none" and args.curve_every:
                row["curve_nDCG@10"] = zero_shot_curve(
                    output, args.steps, args.curve_every, documents, queries, qrels, device
                )
            earlier = results[name].get(method, {})
            if "wall_seconds" in earlier and earlier.get("seconds") == row.get("seconds"):
                row["wall_seconds"] = earlier["wall_seconds"]  # only re-scored: keep the run's own time
            else:
                row["wall_seconds"] = round(time.perf_counter() - began, 1)
            results[name][method] = row
            if args.fine_tune:
                tuned = output.with_name(f"{output.name}-then-{args.fine_tune.stem}-lr{args.fine_tune_lr:g}")
                row["fine_tune"] = fine_tune(args.fine_tune, model, data, tuned, args.fine_tune_lr)
                compare_fine_tuned(results[name], qrels)
                plot_fine_tuned(
                    results, args.output.with_name(args.output.stem + "_fine_tune.png"), args.steps
                )
            print(name, method, json.dumps(row), flush=True)
            write_results(args, results)  # after each run: the whole benchmark takes hours on a CPU
            plot_results(results, args.output.with_suffix(".png"), args.steps, args.spans)
            if args.curve_every:
                plot_zero_shot_curves(
                    results, args.output.with_name(args.output.stem + "_curve.png"), args.spans
                )


if __name__ == "__main__":
    main()
