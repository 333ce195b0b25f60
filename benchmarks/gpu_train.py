"""The GPU suite's training parts (`benchmarks/gpu_suite.py`): the fine-tune whose loss curve is compared
with the CPU's, throughput against sentence-transformers' trainer, MFU, ANCE's trainer beside its
inferencer, and GradCache's peak memory. Each runs densekit's own `run_training`, the path
`densekit train` takes, and reads its training log."""

from __future__ import annotations

import itertools
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu_inputs import Shape, file_sha256
from densekit.configuration import validate_config
from densekit.data import Dataset
from densekit.data.examples import read_examples, write_examples
from densekit.training.config import TrainConfig
from densekit.training.fine_tuning import run_training

# The fine-tune whose loss curve a GPU run (bf16, GradCache) must follow from the CPU's (float32): the
# same seeded model without dropout, the same batches in the same order, so that only the arithmetic
# differs. The learning rate is high enough for a random model's loss to fall well away from chance.
CURVE = {"steps": 200, "batch": 16, "query_length": 32, "passage_length": 64, "chunk": 8,
         "learning_rate": 1e-4, "seed": 42, "model_seed": 1234}  # fmt: skip
CURVE_WINDOW = 20  # steps per mean compared (one batch's loss moves with its queries; a window's less)


@dataclass(frozen=True)
class Run:
    """A training run's settings that the parts vary."""

    batch: int
    query_length: int
    passage_length: int
    steps: int
    precision: str = "bf16"
    learning_rate: float = 2e-5
    log_every: int = 5
    grad_cache_chunk: int | None = None
    checkpoint_every: int = 10**6
    seed: int = 42


def train_config(model: Path, data: Path, train: Path, device: str, run: Run, **sections: Any) -> TrainConfig:
    """The config of a contrastive run of `model` on `train` (one BM25 negative a query, in-batch
    negatives, temperature 0.05: sentence-transformers' MultipleNegativesRankingLoss at scale 20)."""
    tree: dict[str, Any] = {
        "model": {"path": str(model), "query_max_length": run.query_length,
                  "passage_max_length": run.passage_length},
        "data": {"path": str(data), "train": str(train), "group_size": 2},
        "loss": {"temperature": 0.05},
        "optim": {"learning_rate": run.learning_rate, "max_steps": run.steps, "batch_size": run.batch,
                  "warmup_ratio": 0.1, "precision": run.precision},
        "grad_cache": {"enabled": run.grad_cache_chunk is not None, "chunk_size": run.grad_cache_chunk or 32},
        "checkpoint": {"every": run.checkpoint_every, "keep": 2},
        "log_every": run.log_every,
        "device": device,
        "seed": run.seed,
    }  # fmt: skip
    for section, values in sections.items():
        tree.setdefault(section, {}).update(values)
    return validate_config(tree, TrainConfig, "gpu suite")


def log_records(output: Path) -> list[dict]:
    """The step records of a run's training log (evaluations left out)."""
    lines = (output / "train_log.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def steady_rate(records: list[dict], batch: int) -> float:
    """Queries a second from the first log line to the last: the steps before the first line (CUDA's
    first kernels, allocations) are left out."""
    first, last = records[0], records[-1]
    return (last["step"] - first["step"]) * batch / (last["elapsed_s"] - first["elapsed_s"])


def densekit_rate(model: Path, data: Path, train: Path, device: str, run: Run, output: Path) -> float:
    """densekit's training queries a second."""
    run_training(train_config(model, data, train, device, run), output, show_progress=False)
    return steady_rate(log_records(output), run.batch)


def triplets(data: Path, train: Path) -> dict[str, list[str]]:
    """Each example's query, first positive and first negative: what both trainers train on."""
    texts = {doc.id: doc.full_text for doc in Dataset.open(data).iter_corpus()}
    examples = read_examples(train)
    return {"anchor": [e.query for e in examples], "positive": [texts[e.positives[0]] for e in examples],
            "negative": [texts[e.negatives[0]] for e in examples]}  # fmt: skip


def sentence_transformers_rate(model: Path, rows: dict[str, list[str]], device: str, run: Run,
                               output: Path) -> dict[str, Any]:  # fmt: skip
    """sentence-transformers' trainer on the same triplets (cycled to fill every step), timed from the
    same step as densekit's first log line: queries a second, and its optimizer."""
    import torch
    from datasets import Dataset as HFDataset
    from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer, losses
    from sentence_transformers.training_args import SentenceTransformerTrainingArguments
    from transformers import TrainerCallback

    st_model = SentenceTransformer(str(model), device=device)
    st_model.max_seq_length = max(run.query_length, run.passage_length)
    count = run.steps * run.batch
    dataset = HFDataset.from_dict({k: [v[i % len(v)] for i in range(count)] for k, v in rows.items()})
    args = SentenceTransformerTrainingArguments(
        output_dir=str(output), per_device_train_batch_size=run.batch, learning_rate=run.learning_rate,
        warmup_ratio=0.1, max_steps=run.steps, save_strategy="no", logging_steps=10**6, report_to="none",
        seed=run.seed, dataloader_drop_last=True, use_cpu=device == "cpu", bf16=run.precision == "bf16",
    )  # fmt: skip
    step_ends: dict[int, float] = {}

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if device != "cpu":
                torch.cuda.synchronize()
            step_ends[state.global_step] = time.perf_counter()

    trainer = SentenceTransformerTrainer(
        model=st_model, args=args, train_dataset=dataset,
        loss=losses.MultipleNegativesRankingLoss(st_model, scale=20.0), callbacks=[StepClock()],
    )  # fmt: skip
    trainer.train()
    first = run.log_every
    rate = (run.steps - first) * run.batch / (step_ends[run.steps] - step_ends[first])
    return {"queries_per_s": rate, "optimizer": str(args.optim)}


def throughput(model: Path, data: Path, train: Path, device: str, runs: list[Run], work: Path) -> dict:
    """densekit's trainer against sentence-transformers', each (batch, length) in turn, bf16."""
    rows = triplets(data, train)
    results = []
    for index, run in enumerate(runs):
        folder = work / f"throughput-{index}"
        ours = densekit_rate(model, data, train, device, run, folder / "densekit")
        theirs = sentence_transformers_rate(model, rows, device, run, folder / "st")
        results.append({"batch": run.batch, "length": run.query_length, "steps": run.steps,
                        "densekit_queries_per_s": round(ours, 2),
                        "sentence_transformers_queries_per_s": round(theirs["queries_per_s"], 2),
                        "sentence_transformers_optimizer": theirs["optimizer"],
                        "ratio": round(ours / theirs["queries_per_s"], 3)})  # fmt: skip
    return {
        "runs": results,
        "lowest_ratio": min(r["ratio"] for r in results),
        "precision": "bf16",
        "group": "query + positive + 1 BM25 negative, in-batch negatives",
    }


def long_examples(data: Path, train: Path, model: Path, length: int, output: Path) -> int:
    """Write to `output` the examples whose positive and negative both fill `length` tokens, each with its
    positive's text as the query, so that every text of every batch is `length` tokens (the shape MFU is
    counted at); returns how many there are."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    texts = {doc.id: doc.full_text for doc in Dataset.open(data).iter_corpus()}
    kept = []
    for example in read_examples(train):
        pair = [texts[example.positives[0]], texts[example.negatives[0]]]
        if min(len(ids) for ids in tokenizer(pair)["input_ids"]) >= length:
            kept.append(example.model_copy(update={"query": pair[0]}))
    write_examples(output, kept)
    return len(kept)


def mfu(model: Path, shape: Shape, data: Path, train: Path, device: str, runs: list[Run], work: Path,
        peak_tflops: float | None, matmul_tflops: float) -> dict:  # fmt: skip
    """Training's model FLOPs utilisation at `shape`, every text `length` tokens: the FLOPs the model's
    products need (3x the forward pass's) over the time, against the card's dense peak and the large
    matrix product measured in this run."""
    length = runs[0].passage_length
    long_train = work / "long_train.jsonl"
    examples = long_examples(data, train, model, length, long_train)
    results = []
    for index, run in enumerate(runs):
        if examples < run.batch:
            raise RuntimeError(
                f"only {examples} examples fill {length} tokens, fewer than a batch of {run.batch}"
            )
        rate = densekit_rate(model, data, long_train, device, run, work / f"mfu-{index}")
        tflops = rate * 3 * length * 3 * shape.flops_per_token(length) / 1e12
        results.append({"batch": run.batch, "queries_per_s": round(rate, 2), "model_tflops": round(tflops, 1),
                        "mfu_of_peak": None if peak_tflops is None else round(tflops / peak_tflops, 3),
                        "of_measured_matmul": round(tflops / matmul_tflops, 3)})  # fmt: skip
    return {"shape": shape.name, "length": length, "examples": examples, "runs": results,
            "peak_tflops": peak_tflops, "matmul_tflops": round(matmul_tflops, 1),
            "best_mfu_of_peak": max((r["mfu_of_peak"] or 0) for r in results) or None}  # fmt: skip


def matmul_tflops(device: str, size: int, repeats: int = 10) -> float:
    """A `size`-cubed matrix product's rate: bf16 on a GPU, float32 on a CPU (which has no bf16 peak)."""
    import torch

    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    if device != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device != "cpu":
        torch.cuda.synchronize()
    return 2 * size**3 * repeats / (time.perf_counter() - start) / 1e12


def curve_run(model: Path, data: Path, train: Path, device: str, precision: str, steps: int, batch: int,
              output: Path, chunk: int) -> list[float]:  # fmt: skip
    """The per-step losses of the fine-tune CURVE describes (steps and batch as given)."""
    run = Run(batch=batch, query_length=CURVE["query_length"], passage_length=CURVE["passage_length"],
              steps=steps, precision=precision, learning_rate=CURVE["learning_rate"], log_every=1,
              grad_cache_chunk=chunk, seed=CURVE["seed"])  # fmt: skip
    run_training(train_config(model, data, train, device, run), output, show_progress=False)
    return [r["loss"] for r in log_records(output)]


def window_means(losses: list[float], window: int) -> list[float]:
    """The mean loss of each run of `window` steps."""
    return [statistics.fmean(losses[i : i + window]) for i in range(0, len(losses) - window + 1, window)]


def compare_curves(ours: list[float], reference: list[float], tolerance: float, window: int) -> dict:
    """Whether every window's mean loss is within `tolerance` of the reference's, and by how much."""
    if len(ours) != len(reference):
        raise ValueError(f"{len(ours)} steps against the reference's {len(reference)}")
    a, b = window_means(ours, window), window_means(reference, window)
    gaps = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return {"window": window, "windows": [round(x, 4) for x in a],
            "reference_windows": [round(x, 4) for x in b], "largest_gap": round(max(gaps), 4),
            "tolerance": tolerance, "within_tolerance": max(gaps) <= tolerance,
            "fell_by": round(a[0] - a[-1], 4), "reference_fell_by": round(b[0] - b[-1], 4)}  # fmt: skip


def ance_ratio(model: Path, data: Path, train: Path, device: str, run: Run, work: Path) -> dict:
    """Training queries a second with ANCE's local inferencer refreshing negatives beside the trainer,
    against the same run without it (the same checkpoints, written as often), over the windows after
    the first fifth of the steps (the inferencer's start)."""
    ance = {"enabled": True, "inferencer": "local", "depth": 100, "batch_size": 256, "poll_seconds": 0.5,
            "negatives": {"first_rank": 1, "last_rank": 100, "count": 1}}  # fmt: skip
    rates = {}
    for name, sections in (("alone", {}), ("with_inferencer", {"ance": ance})):
        output = work / f"ance-{name}"
        run_training(train_config(model, data, train, device, run, **sections), output, show_progress=False)
        records = log_records(output)
        rates[name] = window_rates(records, run.batch, run.steps // 5)
        if name == "with_inferencer":
            versions = max(r.get("ance_version", 0) for r in records)
            gaps = [r["ance_async_gap"] for r in records if r.get("ance_version", 0) > 0]
    alone, beside = statistics.median(rates["alone"]), statistics.median(rates["with_inferencer"])
    return {"queries_per_s_alone": round(alone, 2), "queries_per_s_with_inferencer": round(beside, 2),
            "ratio": round(beside / alone, 3), "versions_published": int(versions),
            "mean_async_gap_steps": round(statistics.fmean(gaps), 1) if gaps else None,
            "steps": run.steps, "checkpoint_every": run.checkpoint_every, "batch": run.batch}  # fmt: skip


def window_rates(records: list[dict], batch: int, after_step: int) -> list[float]:
    """Queries a second of each log window that starts after `after_step`."""
    pairs = itertools.pairwise(records)
    return [(b["step"] - a["step"]) * batch / (b["elapsed_s"] - a["elapsed_s"])
            for a, b in pairs if a["step"] >= after_step]  # fmt: skip


def peak_memory(model: Path, data: Path, train: Path, device: str, runs: dict[str, Run], work: Path) -> dict:
    """Peak memory of a few training steps of each run: the GPU's allocated bytes, or on a CPU the
    process's peak resident set (reset before each run)."""
    import gc

    import torch

    peaks = {}
    for name, run in runs.items():
        gc.collect()
        if device != "cpu":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets the peak resident set (Linux)
        run_training(
            train_config(model, data, train, device, run), work / f"memory-{name}", show_progress=False
        )
        peaks[name] = torch.cuda.max_memory_allocated() if device != "cpu" else _peak_rss()
    plain, cached = peaks.values()
    return {"runs": {name: {"batch": run.batch, "grad_cache_chunk": run.grad_cache_chunk,
                            "peak_mib": round(peaks[name] / 2**20, 1)} for name, run in runs.items()},
            "measure": "torch.cuda.max_memory_allocated" if device != "cpu" else "peak resident set",
            "ratio": round(cached / plain, 3)}  # fmt: skip


def _peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reference_identity(model_checksum: str, train: Path, steps: int, batch: int, chunk: int) -> dict:
    """What a curve depends on besides the device and precision: the starting weights, the data, the run."""
    return {"initial_weights_sha256": model_checksum, "train_sha256": file_sha256(train),
            "curve": {**CURVE, "steps": steps, "batch": batch, "chunk": chunk}}  # fmt: skip
