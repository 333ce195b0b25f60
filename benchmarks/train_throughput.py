"""Training throughput: densekit's trainer against sentence-transformers' trainer, same run.

Both fine-tune all-MiniLM-L6-v2 on the same SciFact training triplets (query, positive, one BM25
negative), with the same batch of 32 queries, max length 256 for every text, InfoNCE at temperature
0.05 (MultipleNegativesRankingLoss with scale 20 on normalised embeddings), AdamW at lr 2e-5,
float32, for the same number of steps, in alternating rounds. Throughput is training queries per
second in the steady state: from the end of the first step (warm-up) to the end of the last, timed
the same way for both (each trainer's own step-end timestamps); the ratio is densekit's median over
sentence-transformers'. densekit also runs with length-grouped batches (`data.length_grouping`), and
the passage tokens a whole epoch pads to are counted for random and grouped batches (the work saved,
free of timing noise). Both trainers also run under bf16 autocast (densekit's `optim.precision: bf16`,
the trainer's `bf16=True`); `--bf16-rounds 1` times it once, where a CPU without bf16 instructions
emulates it slowly. Run from the repository root:

    .venv/bin/python -m benchmarks.train_throughput --data ../shared/data/scifact --steps 10 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import WORK
from benchmarks.length_grouping_padding import padded_tokens
from benchmarks.machine import machine_info
from densekit.configuration import validate_config
from densekit.data import Dataset
from densekit.data.examples import read_examples
from densekit.mining.filters import MiningSettings
from densekit.mining.mine import mine
from densekit.models import resolve_model_path
from densekit.training.config import TrainConfig
from densekit.training.fine_tuning import run_training

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def steady_rate(step_ends: list[float], batch: int) -> float:
    """Queries per second between the end of the first step and the end of the last."""
    return (len(step_ends) - 1) * batch / (step_ends[-1] - step_ends[0])


def ratio(ours: list[float], theirs: list[float]) -> float | None:
    """The ratio of the medians of two lists of rates (None when either is empty)."""
    return round(statistics.median(ours) / statistics.median(theirs), 3) if ours and theirs else None


def densekit_round(
    data: Path,
    train_file: Path,
    steps: int,
    batch: int,
    output: Path,
    length_grouping: int | None = None,
    precision: str = "float32",
) -> float:
    """Queries per second of one densekit training run in its steady state."""
    config = validate_config(
        {
            "model": {"path": MODEL, "query_max_length": 256, "passage_max_length": 256},
            "data": {
                "path": str(data),
                "train": str(train_file),
                "group_size": 2,
                "length_grouping": length_grouping,
            },
            "loss": {"temperature": 0.05},
            "optim": {
                "learning_rate": 2e-5,
                "max_steps": steps,
                "batch_size": batch,
                "warmup_ratio": 0.1,
                "precision": precision,
            },
            "checkpoint": {"every": 10**6},
            "log_every": 1,
            "device": "cpu",
        },
        TrainConfig,
        "benchmark",
    )
    run_training(config, output, show_progress=False)
    records = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    return steady_rate([r["elapsed_s"] for r in records], batch)


def sentence_transformers_round(
    triplets: dict[str, list[str]], steps: int, batch: int, output: Path, bf16: bool = False
) -> float:
    """Queries per second of one sentence-transformers training run in its steady state."""
    from datasets import Dataset as HFDataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, losses
    from sentence_transformers.training_args import SentenceTransformerTrainingArguments
    from transformers import TrainerCallback

    model = SentenceTransformer(resolve_model_path(MODEL), device="cpu")
    model.max_seq_length = 256
    rows = steps * batch
    dataset = HFDataset.from_dict({k: v[:rows] for k, v in triplets.items()})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(output), per_device_train_batch_size=batch, learning_rate=2e-5, warmup_ratio=0.1,
        max_steps=steps, save_strategy="no", logging_steps=10**6, report_to="none", seed=42,
        dataloader_drop_last=True, use_cpu=True, bf16=bf16,
    )  # fmt: skip
    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    trainer = SentenceTransformerTrainer(
        model=model,
        args=args,
        train_dataset=dataset,
        loss=losses.MultipleNegativesRankingLoss(model, scale=20.0),
        callbacks=[StepClock()],
    )
    trainer.train()
    return steady_rate(step_ends, batch)


def padded_passage_tokens(passages: list[list[str]], batch: int, length_grouping: int | None) -> int:
    """Passage tokens one epoch computes (each batch padded to its longest passage), random or grouped."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(MODEL))
    lengths = np.array(
        [max(len(ids) for ids in tokenizer(group, truncation=True, max_length=256)["input_ids"])
         for group in passages]
    )  # fmt: skip
    return padded_tokens(lengths, batch, length_grouping) * len(passages[0])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=Path("../shared/data/scifact"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--length-grouping", type=int, default=8, help="batches per length bucket of the grouped runs"
    )
    parser.add_argument(
        "--bf16-rounds",
        type=int,
        default=None,
        help="run both trainers under bf16 autocast too in the first K rounds (default: every round)",
    )
    parser.add_argument(
        "--output", type=Path, default=WORK / "train_throughput.json"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    dataset = Dataset.open(args.data)
    texts = {doc.id: doc.full_text for doc in dataset.iter_corpus()}
    ours, grouped, theirs, ours_bf16, theirs_bf16 = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        train_file = Path(tmp) / "train.jsonl"
        mine(
            dataset,
            "train",
            train_file,
            "bm25",
            MiningSettings(first_rank=1, last_rank=30, count=1),
            show_progress=False,
        )
        examples = read_examples(train_file)
        # the same rows in the same order for both trainers: each example's first positive and negative
        triplets = {
            "anchor": [e.query for e in examples],
            "positive": [texts[e.positives[0]] for e in examples],
            "negative": [texts[e.negatives[0]] for e in examples],
        }
        bf16_rounds = args.rounds if args.bf16_rounds is None else args.bf16_rounds
        for round_index in range(args.rounds):
            folder = Path(tmp) / f"round{round_index}"
            theirs.append(sentence_transformers_round(triplets, args.steps, args.batch_size, folder / "st"))
            ours.append(densekit_round(args.data, train_file, args.steps, args.batch_size, folder / "dk"))
            grouped.append(
                densekit_round(
                    args.data, train_file, args.steps, args.batch_size, folder / "dk-grouped",
                    args.length_grouping,
                )
            )  # fmt: skip
            line = (
                f"round {round_index}: densekit {ours[-1]:.2f} queries/s, length-grouped {grouped[-1]:.2f}, "
                f"sentence-transformers {theirs[-1]:.2f}"
            )
            if round_index < bf16_rounds:
                theirs_bf16.append(
                    sentence_transformers_round(
                        triplets, args.steps, args.batch_size, folder / "st-bf16", bf16=True
                    )
                )
                ours_bf16.append(
                    densekit_round(
                        args.data, train_file, args.steps, args.batch_size, folder / "dk-bf16",
                        precision="bf16",
                    )
                )  # fmt: skip
                line += f"; bf16: densekit {ours_bf16[-1]:.2f}, sentence-transformers {theirs_bf16[-1]:.2f}"
            print(line, flush=True)
        passages = [[texts[e.positives[0]], texts[e.negatives[0]]] for e in examples]
        tokens_random = padded_passage_tokens(passages, args.batch_size, None)
        tokens_grouped = padded_passage_tokens(passages, args.batch_size, args.length_grouping)

    result = {
        "benchmark": "train_throughput",
        "command": " ".join(["python -m benchmarks.train_throughput", *sys.argv[1:]]),
        "model": MODEL,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "group": "query + positive + 1 BM25 negative, in-batch negatives",
        "max_length": 256,
        "densekit_queries_per_s": [round(x, 3) for x in ours],
        "sentence_transformers_queries_per_s": [round(x, 3) for x in theirs],
        "ratio_of_medians": ratio(ours, theirs),
        "length_grouping": args.length_grouping,
        "densekit_length_grouped_queries_per_s": [round(x, 3) for x in grouped],
        "length_grouped_ratio_of_medians": ratio(grouped, theirs),
        "densekit_bf16_queries_per_s": [round(x, 3) for x in ours_bf16],
        "sentence_transformers_bf16_queries_per_s": [round(x, 3) for x in theirs_bf16],
        "bf16_ratio_of_medians": ratio(ours_bf16, theirs),
        "bf16_ratio_to_sentence_transformers_bf16": ratio(ours_bf16, theirs_bf16),
        "padded_passage_tokens_per_epoch": {"random": tokens_random, "length_grouped": tokens_grouped},
        "machine": machine_info(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    shown = ("ratio_of_medians", "length_grouped_ratio_of_medians", "bf16_ratio_of_medians",
             "bf16_ratio_to_sentence_transformers_bf16", "padded_passage_tokens_per_epoch")  # fmt: skip
    print(json.dumps({k: result[k] for k in shown}))


if __name__ == "__main__":
    main()
