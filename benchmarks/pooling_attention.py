"""The cheapest masked mean pool and attention on this CPU, measured (issue 25).

Masked mean pooling of a (batch, tokens, 384) float32 tensor, three ways that give the same vectors:
broadcast multiply and sum (densekit's `pool`), a batched matrix product of the mask with the states,
and einsum. Attention: all-MiniLM-L6-v2's forward pass over real SciFact passages with transformers'
eager attention against PyTorch's scaled_dot_product_attention ("sdpa", transformers' default), in
float32, on a batch padded to 256 tokens and on a batch of mixed lengths. Each variant is timed in
alternating rounds (the order rotated each round) and reported as the median; pooling's share of a
whole forward pass is reported beside it.

    python -m benchmarks.pooling_attention --data ../shared/data/scifact --rounds 5
"""

from __future__ import annotations

import json
import statistics
import time

import torch
from transformers import AutoModel, AutoTokenizer

from benchmarks import rounds_parser
from benchmarks.machine import machine_info
from densekit.data.dataset import Dataset
from densekit.io.atomic import write_text_atomic
from densekit.models.hub import resolve_model_path
from densekit.models.pooling import pool


def _mean_bmm(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.to(hidden.dtype).unsqueeze(1)  # (batch, 1, tokens)
    return torch.bmm(weights, hidden).squeeze(1) / weights.sum(-1).clamp(min=1e-9)


def _mean_einsum(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    weights = mask.to(hidden.dtype)
    return torch.einsum("bt,btd->bd", weights, hidden) / weights.sum(-1, keepdim=True).clamp(min=1e-9)


def _timed(function, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        function()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    """Time the variants and write the JSON."""
    args = rounds_parser(__doc__, "pooling_attention.json").parse_args()
    torch.manual_seed(0)
    folder = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    models = {
        name: AutoModel.from_pretrained(folder, attn_implementation=name).eval() for name in ("eager", "sdpa")
    }
    corpus = Dataset.open(args.data).iter_corpus()
    documents = [next(corpus).full_text for _ in range(2 * args.batch)]
    full = tokenizer(documents[: args.batch], truncation=True, max_length=256, padding="max_length",
                     return_tensors="pt")  # fmt: skip
    lengths = [8 + (i * 248) // (args.batch - 1) for i in range(args.batch)]  # 8 to 256 tokens, mixed
    cut = [" ".join(d.split()[:n]) for d, n in zip(documents[args.batch :], lengths, strict=True)]
    mixed = tokenizer(cut, truncation=True, max_length=256, padding=True, return_tensors="pt")
    batches = {"padded to 256": full, "mixed lengths": mixed}

    with torch.inference_mode():
        hidden = models["sdpa"](**full).last_hidden_state
        reference = pool(hidden, full["attention_mask"], "mean")
        pools = {"multiply-sum (densekit)": lambda: pool(hidden, full["attention_mask"], "mean"),
                 "bmm": lambda: _mean_bmm(hidden, full["attention_mask"]),
                 "einsum": lambda: _mean_einsum(hidden, full["attention_mask"])}  # fmt: skip
        agreement = {name: float((function() - reference).abs().max()) for name, function in pools.items()}
        agreement_eager = {
            label: float((models["eager"](**b).last_hidden_state - models["sdpa"](**b).last_hidden_state)
                         .abs().max())
            for label, b in batches.items()
        }  # fmt: skip
        pool_times: dict[str, list[float]] = {name: [] for name in pools}
        forward_times: dict[str, list[float]] = {f"{m} / {b}": [] for m in models for b in batches}
        for round_number in range(args.rounds):
            names = list(pools)
            for name in names[round_number % len(names) :] + names[: round_number % len(names)]:
                pool_times[name].append(_timed(pools[name], 200))
            keys = list(forward_times)
            for key in keys[round_number % len(keys) :] + keys[: round_number % len(keys)]:
                model_name, batch_name = key.split(" / ")
                forward_times[key].append(
                    _timed(lambda m=models[model_name], b=batches[batch_name]: m(**b), 1)
                )
            print(f"round {round_number + 1} of {args.rounds} done", flush=True)

    pools_ms = {name: statistics.median(times) * 1000 for name, times in pool_times.items()}
    forward_ms = {key: statistics.median(times) * 1000 for key, times in forward_times.items()}
    summary = {
        "pool_ms": pools_ms,
        "pool_share_of_forward": pools_ms["multiply-sum (densekit)"] / forward_ms["sdpa / padded to 256"],
        "forward_ms": forward_ms,
        "sdpa_speed_over_eager": {b: forward_ms[f"eager / {b}"] / forward_ms[f"sdpa / {b}"] for b in batches},
        "max_difference": {"pooling": agreement, "eager_vs_sdpa_states": agreement_eager},
    }
    print(json.dumps(summary, indent=2))
    result = {
        "command": f"python -m benchmarks.pooling_attention --data {args.data} --batch {args.batch} "
        f"--rounds {args.rounds}",
        "summary": summary,
        "machine": machine_info(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.output, json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
