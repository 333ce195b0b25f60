"""The work length-grouped batching saves: passage tokens computed per epoch, random against grouped.

For each collection, pairs of random corpus passages stand for training groups (a positive and one
negative); a group's length is its longer passage's token count (all-MiniLM-L6-v2's tokenizer, max
length 256), and a batch of 32 groups is padded to its longest. The counts are exact, so free of timing
noise; a step's time on the CPU follows the tokens it computes. Run from the repository root:

    .venv/bin/python -m benchmarks.length_grouping_padding --data ../shared/data
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from benchmarks import WORK
from benchmarks.machine import machine_info
from densekit.data import Dataset
from densekit.models import resolve_model_path
from densekit.training.sampling import LengthGrouping, epoch_order


def padded_tokens(lengths: np.ndarray, batch: int, bucket_batches: int | None) -> int:
    """Tokens one epoch computes when each batch is padded to its longest group."""
    grouping = LengthGrouping(lengths, bucket_batches) if bucket_batches else None
    order = epoch_order(len(lengths), batch, 0, 42, grouping)
    batches = order[: len(lengths) // batch * batch].reshape(-1, batch)
    return int(sum(lengths[rows].max() * batch for rows in batches))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--collections", nargs="+", default=["scifact", "nfcorpus", "vaswani", "cranfield"])
    parser.add_argument("--groups", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--bucket-batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument(
        "--output", type=Path, default=WORK / "length_grouping_padding.json"
    )
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("sentence-transformers/all-MiniLM-L6-v2"))
    rows = []
    for name in args.collections:
        texts = [doc.full_text for doc in Dataset.open(args.data / name).iter_corpus()]
        counts = np.array(
            [len(ids) for ids in tokenizer(texts, truncation=True, max_length=args.max_length)["input_ids"]]
        )
        rng = np.random.default_rng(0)
        groups = np.maximum(rng.choice(counts, args.groups), rng.choice(counts, args.groups))
        row = {
            "collection": name,
            "passages_at_max_length": round(float((counts >= args.max_length).mean()), 3),
            "mean_passage_tokens": round(float(counts.mean()), 1),
            "real_tokens": int(groups.sum()),
            "padded_tokens_random": padded_tokens(groups, args.batch_size, None),
        }
        for bucket in args.bucket_batches:
            row[f"padded_tokens_grouped_{bucket}"] = padded_tokens(groups, args.batch_size, bucket)
        row["saved_grouped"] = {
            bucket: round(1 - row[f"padded_tokens_grouped_{bucket}"] / row["padded_tokens_random"], 3)
            for bucket in args.bucket_batches
        }
        print(json.dumps(row))
        rows.append(row)
    result = {
        "benchmark": "length_grouping_padding",
        "groups": args.groups,
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "collections": rows,
        "machine": machine_info(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
