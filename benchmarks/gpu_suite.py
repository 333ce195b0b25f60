"""densekit on a GPU, every measurement in one command: the device-dependent tests, a fine-tune whose
loss curve must follow the CPU's, training throughput against sentence-transformers' trainer, training
MFU at BERT-base's shape, encoding against sentence-transformers' `encode`, the rate wiki1m would encode
at, exact search on the GPU against the CPU, ANCE's trainer beside its inferencer, and GradCache's peak
memory. One results file holds the machine, the command and each part's figures; each part runs under
its own time budget and guard, so a part that fails or overruns is recorded (with the end of its
traceback) and the rest still run, and the file is rewritten after each part.

On a lent GPU machine, from the repository root, after `bash benchmarks/gpu_prepare.sh` here:

    bash benchmarks/gpu_device.sh        # the device call's command; carry .whl and .dkdata

Here, every part on tiny shapes in a couple of minutes (benchmarks/tests/test_gpu_suite.py runs it):

    .venv/bin/python -m benchmarks.gpu_suite --device cpu --smoke

The CPU reference of the fine-tune's loss curve (float32, about 40 minutes on a 2-core CPU; committed
as benchmarks/results/gpu_suite_reference_curve.json):

    .venv/bin/python -m benchmarks.gpu_suite --device cpu --make-reference
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import WORK, gpu_infer, gpu_train
from benchmarks.gpu_inputs import (
    BERT_BASE,
    INPUTS_FILE,
    MINILM,
    MINILM_FILES,
    TINY_BERT_BASE,
    TINY_MINILM,
    TRAIN_FILE,
    WIKI_SAMPLE,
    Shape,
    build_model,
    prepare,
)
from benchmarks.gpu_train import CURVE, CURVE_WINDOW, Run
from benchmarks.machine import machine_info

REFERENCE = Path("benchmarks/results/gpu_suite_reference_curve.json")
MINILM_NAME = "sentence-transformers/all-MiniLM-L6-v2"
# Dense bf16 peaks (no sparsity) from NVIDIA's data sheets, by what torch.cuda.get_device_name says.
DENSE_BF16_TFLOPS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4),
                     ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0))  # fmt: skip
GOALS = {  # issue 66's goals on the lent card: (part, figure, relation, target)
    "training throughput >= 1.2x sentence-transformers' trainer":
        ("train_throughput", "lowest_ratio", ">=", 1.2),
    "training MFU >= 35% of the dense bf16 peak at BERT-base's shape":
        ("mfu", "best_mfu_of_peak", ">=", 0.35),
    "encoding >= 1.0x sentence-transformers in bf16": ("encode", "lowest_ratio", ">=", 1.0),
    "ANCE trainer with its inferencer >= 0.8x the trainer alone": ("ance", "ratio", ">=", 0.8),
    "GradCache at batch 512 within 1.3x the peak memory of batch 32":
        ("grad_cache_memory", "ratio", "<=", 1.3),
    "bf16 GradCache fine-tune follows the CPU's float32 loss curve":
        ("fine_tune_curve", "within_tolerance", "==", True),
}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """The sizes of every part: the lent GPU's, or the smoke run's tiny ones."""

    minilm: Shape
    bert_base: Shape
    curve_steps: int
    curve_batch: int
    curve_chunk: int
    curve_window: int
    throughput: list[Run]
    mfu: list[Run]
    matmul: int
    encode_docs: int | None  # SciFact's and the wiki sample's passages encoded at most (None: all)
    encode_batch: int
    encode_length: int
    encode_rounds: int
    search_rows: int
    search_dimension: int
    search_queries: int
    search_ks: list[int]
    ance: Run
    memory: dict[str, Run]
    budgets: dict[str, int] = field(default_factory=dict)


DEVICE_PLAN = Plan(
    minilm=MINILM, bert_base=BERT_BASE,
    curve_steps=CURVE["steps"], curve_batch=CURVE["batch"], curve_chunk=CURVE["chunk"],
    curve_window=CURVE_WINDOW,
    throughput=[Run(batch, length, length, steps=30) for batch in (32, 128) for length in (64, 256)],
    mfu=[Run(batch, 256, 256, steps=20) for batch in (32, 128)], matmul=8192,
    encode_docs=None, encode_batch=128, encode_length=256, encode_rounds=3,
    search_rows=1_000_000, search_dimension=384, search_queries=1000, search_ks=[10, 100],
    ance=Run(32, 64, 256, steps=400, log_every=10, checkpoint_every=50),
    memory={"batch 32": Run(32, 64, 256, steps=2, log_every=1),
            "batch 512, GradCache chunks of 32":
                Run(512, 64, 256, steps=2, log_every=1, grad_cache_chunk=32)},
    budgets={"machine": 30, "cuda_tests": 150, "fine_tune_curve": 120, "train_throughput": 120, "mfu": 60,
             "encode": 90, "wiki_encode_rate": 30, "exact_search": 60, "grad_cache_memory": 60, "ance": 120},
)  # fmt: skip
SMOKE_PLAN = Plan(
    minilm=TINY_MINILM, bert_base=TINY_BERT_BASE,
    curve_steps=10, curve_batch=8, curve_chunk=4, curve_window=5,
    throughput=[Run(8, 16, 16, steps=6, log_every=2)],
    mfu=[Run(8, 32, 32, steps=6, log_every=2)], matmul=256,
    encode_docs=96, encode_batch=32, encode_length=64, encode_rounds=1,
    search_rows=20_000, search_dimension=32, search_queries=50, search_ks=[10],
    ance=Run(8, 16, 32, steps=6, log_every=2, checkpoint_every=3),
    memory={"batch 8": Run(8, 16, 32, steps=2, log_every=1),
            "batch 32, GradCache chunks of 8": Run(32, 16, 32, steps=2, log_every=1, grad_cache_chunk=8)},
    # guards against a hang, not timings: a 2-core CPU shared with other work runs a part in 10-60 s
    budgets={"machine": 60, "cuda_tests": 240, "fine_tune_curve": 120, "train_throughput": 120,
             "mfu": 120, "encode": 120, "wiki_encode_rate": 60, "exact_search": 60,
             "grad_cache_memory": 120, "ance": 120},
)  # fmt: skip


class PartTimeout(Exception):
    """A part ran past its time budget."""


@contextlib.contextmanager
def time_budget(seconds: int) -> Iterator[None]:
    """Raise PartTimeout in the main thread once `seconds` have passed (at the next Python instruction:
    a long call into torch ends first)."""

    def expire(signum, frame):
        raise PartTimeout(f"ran past its budget of {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(max(1, seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Context:
    """What the parts share: the device, the plan, where the inputs are and where to work."""

    device: str
    plan: Plan
    scifact: Path
    inputs: Path
    work: Path
    reference: Path
    models: dict[tuple[str, bool, int], tuple[Path, str]] = field(default_factory=dict)

    @property
    def train(self) -> Path:
        return self.inputs / TRAIN_FILE

    def model(self, shape: Shape, dropout: bool = True, seed: int = 0) -> tuple[Path, str]:
        """A sentence-transformers folder of `shape` with seeded random weights, and their checksum."""
        key = (shape.name, dropout, seed)
        if key not in self.models:
            folder = (
                self.work
                / "models"
                / f"{shape.hidden}x{shape.layers}-{'dropout' if dropout else 'still'}-{seed}"
            )
            checksum = build_model(self.inputs / MINILM_FILES, shape, folder, seed, 512, dropout)
            self.models[key] = (folder, checksum)
        return self.models[key]


def part_machine(ctx: Context) -> dict:
    """The GPU, the attention kernels transformers chose, the libraries."""
    import torch
    import transformers

    from densekit.models import DenseEncoder

    model, _ = ctx.model(ctx.plan.minilm)
    encoder = DenseEncoder.load(model)
    result: dict[str, Any] = {
        "attn_implementation": encoder.query_backbone.config._attn_implementation,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    if ctx.device != "cpu":
        props = torch.cuda.get_device_properties(0)
        result.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                      multiprocessors=props.multi_processor_count, capability=f"{props.major}.{props.minor}",
                      cuda=torch.version.cuda, bf16_supported=torch.cuda.is_bf16_supported(),
                      dense_bf16_peak_tflops=dense_bf16_peak(props.name))  # fmt: skip
    return result


def dense_bf16_peak(name: str) -> float | None:
    """The card's dense bf16 peak in TFLOP/s, from its name (None for a card not listed)."""
    return next((peak for key, peak in DENSE_BF16_TFLOPS if key in name), None)


def part_cuda_tests(ctx: Context) -> dict:
    """tests/test_cuda.py on the device, in a process of its own (`pytest --device`). It runs in a folder
    holding the carried tokenizer as `sentence-transformers/all-MiniLM-L6-v2`, which the tests' tiny
    models take theirs from (an existing folder wins over the bundled model, which a GPU machine has
    not)."""
    root = Path(__file__).resolve().parents[1]
    folder = ctx.work / "pytest"
    shutil.copytree(ctx.inputs / MINILM_FILES, folder / MINILM_NAME, dirs_exist_ok=True)
    report = ctx.work / "cuda_tests.xml"
    command = [sys.executable, "-m", "pytest", str(root / "tests" / "test_cuda.py"), "--rootdir", str(root),
               "-c", str(root / "pyproject.toml"), "--device", ctx.device, "-m", "cuda", "-q",
               "-p", "no:cacheprovider", "-p", "no:randomly", "-rfEs", f"--junitxml={report}"]  # fmt: skip
    budget = ctx.plan.budgets["cuda_tests"] - 5
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=budget)
    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    failed = [case.get("name") for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]  # fmt: skip
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    result = {"command": " ".join(command[1:]), "cwd": str(folder), **counts, "passed": passed,
              "failed": failed}  # fmt: skip
    if done.returncode != 0:
        result["output_tail"] = done.stdout[-3000:] + done.stderr[-1000:]
        raise PartFailed(
            f"pytest exited {done.returncode}: {len(failed)} failed ({', '.join(failed)})", result
        )
    return result


class PartFailed(Exception):
    """A part that ran but whose check failed; carries the figures it has."""

    def __init__(self, message: str, result: dict):
        super().__init__(message)
        self.result = result


def part_fine_tune_curve(ctx: Context) -> dict:
    """The GradCache fine-tune in bf16, and in float32, on the device against the CPU's float32 curve of
    the same start and batches: the committed reference when it was made from the same weights, data and
    run, else (a smoke run, or a reference that differs) a float32 run on this device, and then the part
    fails unless it is a smoke run. float32 must follow the CPU's curve closely (only the order of
    additions differs), bf16 within its own tolerance (`CURVE_TOLERANCE`)."""
    plan = ctx.plan
    model, checksum = ctx.model(plan.minilm, dropout=False, seed=CURVE["model_seed"])
    identity = gpu_train.reference_identity(
        checksum, ctx.train, plan.curve_steps, plan.curve_batch, plan.curve_chunk
    )
    reference = json.loads(ctx.reference.read_text()) if ctx.reference.is_file() else {}
    differs = [key for key in identity if reference.get(key) != identity[key]]
    source = f"{ctx.reference} (CPU, float32)"
    precisions = ["bf16", "float32"]
    if differs:
        reference = make_reference(ctx, model, identity, "float32", ctx.work / "curve-reference")
        source = f"this run, {ctx.device}, float32 ({ctx.reference} differs in {', '.join(differs)})"
        precisions = ["bf16"]  # float32 here would be the reference itself
    result: dict[str, Any] = {**identity, "reference_source": source}
    for precision in precisions:
        folder = ctx.work / f"curve-{precision}"
        losses = gpu_train.curve_run(model, ctx.scifact, ctx.train, ctx.device, precision, plan.curve_steps,
                                     plan.curve_batch, folder, plan.curve_chunk)  # fmt: skip
        compared = gpu_train.compare_curves(
            losses, reference["losses"], CURVE_TOLERANCE[precision], plan.curve_window
        )
        result[precision] = {"losses": [round(x, 5) for x in losses], **compared}
    result["within_tolerance"] = all(result[p]["within_tolerance"] for p in precisions)
    if differs and ctx.plan is not SMOKE_PLAN:
        raise PartFailed(f"the committed reference differs in {', '.join(differs)}", result)
    if not result["within_tolerance"]:
        gaps = {p: result[p]["largest_gap"] for p in precisions}
        raise PartFailed(f"a window's mean loss lies too far from the reference's: {gaps}", result)
    return result


def make_reference(ctx: Context, model: Path, identity: dict, precision: str, work: Path) -> dict:
    """The fine-tune's per-step losses on this device at `precision`."""
    plan = ctx.plan
    losses = gpu_train.curve_run(model, ctx.scifact, ctx.train, ctx.device, precision, plan.curve_steps,
                                 plan.curve_batch, work, plan.curve_chunk)  # fmt: skip
    return {**identity, "precision": precision, "device": ctx.device, "losses": [round(x, 6) for x in losses]}


# How far a run's 20-step mean loss may lie from the CPU's float32 curve. float32 on a GPU differs only
# in the order of additions, which a run without dropout on the same batches keeps far below 0.01. bf16
# rounds every product's inputs to 8 bits of mantissa: on one batch it moved the loss by up to 2%
# (tests/test_training.py), about 0.07 nats at this run's start (3.36); a window's mean of 20 steps
# averages that down, so 0.05 leaves room for bf16 and still fails a run whose gradient is wrong (the
# reference falls by far more than that over 200 steps: benchmarks/README.md).
CURVE_TOLERANCE = {"float32": 0.01, "bf16": 0.05}


def part_train_throughput(ctx: Context) -> dict:
    model, _ = ctx.model(ctx.plan.minilm)
    return gpu_train.throughput(model, ctx.scifact, ctx.train, ctx.device, ctx.plan.throughput, ctx.work)


def part_mfu(ctx: Context) -> dict:
    import torch

    model, _ = ctx.model(ctx.plan.bert_base)
    name = torch.cuda.get_device_name(0) if ctx.device != "cpu" else ""
    matmul = gpu_train.matmul_tflops(ctx.device, ctx.plan.matmul)
    return gpu_train.mfu(model, ctx.plan.bert_base, ctx.scifact, ctx.train, ctx.device, ctx.plan.mfu,
                         ctx.work, dense_bf16_peak(name), matmul)  # fmt: skip


def part_encode(ctx: Context) -> dict:
    plan = ctx.plan
    models = {shape.name: ctx.model(shape)[0] for shape in (plan.minilm, plan.bert_base)}
    data = ctx.scifact
    if plan.encode_docs is not None:
        documents = [json.loads(line) for line in (ctx.scifact / "corpus.jsonl").open(encoding="utf-8")]
        data = gpu_infer.beir_folder(documents[: plan.encode_docs], ctx.work / "encode-corpus")
    return gpu_infer.encoding(models, data, ctx.device, plan.encode_batch, plan.encode_length,
                              plan.encode_rounds, ctx.work / "encode")  # fmt: skip


def part_wiki_encode_rate(ctx: Context) -> dict:
    model, _ = ctx.model(ctx.plan.minilm)
    return gpu_infer.wiki_rate(model, ctx.inputs / WIKI_SAMPLE, ctx.device, ctx.plan.encode_batch,
                               ctx.plan.encode_length, ctx.work, ctx.plan.encode_docs)  # fmt: skip


def part_exact_search(ctx: Context) -> dict:
    plan = ctx.plan
    threads = 1 if plan is SMOKE_PLAN else os.cpu_count() or 1
    return gpu_infer.exact_search(plan.search_rows, plan.search_dimension, plan.search_queries,
                                  plan.search_ks, ctx.device, threads)  # fmt: skip


def part_grad_cache_memory(ctx: Context) -> dict:
    model, _ = ctx.model(ctx.plan.minilm)
    return gpu_train.peak_memory(model, ctx.scifact, ctx.train, ctx.device, ctx.plan.memory, ctx.work)


def part_ance(ctx: Context) -> dict:
    model, _ = ctx.model(ctx.plan.minilm)
    return gpu_train.ance_ratio(model, ctx.scifact, ctx.train, ctx.device, ctx.plan.ance, ctx.work)


PARTS: dict[str, Callable[[Context], dict]] = {
    "machine": part_machine,
    "cuda_tests": part_cuda_tests,
    "fine_tune_curve": part_fine_tune_curve,
    "train_throughput": part_train_throughput,
    "mfu": part_mfu,
    "encode": part_encode,
    "wiki_encode_rate": part_wiki_encode_rate,
    "exact_search": part_exact_search,
    "grad_cache_memory": part_grad_cache_memory,
    "ance": part_ance,
}


def run_part(name: str, ctx: Context, budget: int, fail: bool) -> dict:
    """One part under its budget: its figures, or its error and the end of its traceback."""
    started = time.perf_counter()
    entry: dict[str, Any] = {"budget_s": budget}
    try:
        with time_budget(budget):
            if fail:
                raise RuntimeError("failure injected by --fail-part")
            entry["result"] = PARTS[name](ctx)
        entry["ok"] = True
    except Exception as err:  # recorded; the next part runs
        entry.update(ok=False, error=f"{type(err).__name__}: {err}",
                     traceback=traceback.format_exception(err)[-6:])  # fmt: skip
        if isinstance(err, PartFailed):
            entry["result"] = err.result
    entry["seconds"] = round(time.perf_counter() - started, 1)
    release(ctx.device)
    return entry


def release(device: str) -> None:
    """Free what a part left, so the next starts clean (and GPU peaks are the next part's own)."""
    gc.collect()
    if device != "cpu":
        import torch

        torch.cuda.empty_cache()


def goals(parts: dict[str, dict]) -> dict[str, dict]:
    """Each goal of issue 66 with the figure measured for it and whether it is met (None: not measured)."""
    checks = {"==": lambda a, b: a == b, ">=": lambda a, b: a >= b, "<=": lambda a, b: a <= b}
    found = {}
    for goal, (part, key, relation, target) in GOALS.items():
        value = (parts.get(part, {}).get("result") or {}).get(key)
        met = None if value is None else bool(checks[relation](value, target))
        found[goal] = {
            "part": part,
            "figure": key,
            "value": value,
            "target": f"{relation} {target}",
            "met": met,
        }
    return found


def smoke_inputs(shared: Path, wiki_corpus: Path | None, work: Path) -> Path:
    """The carried inputs, made small from the shared data (a smoke run with none prepared): the first
    48 passages of `wiki_corpus` (default wiki1m's)."""
    inputs = work / "inputs"
    if not (inputs / INPUTS_FILE).is_file():
        prepare(shared, inputs, wiki_corpus, wiki_sample=48, wiki_first=True)
    return inputs


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default=None, help="cuda (default when torch sees a GPU) or cpu")
    parser.add_argument("--smoke", action="store_true", help="every part on tiny shapes (checks the suite)")
    parser.add_argument(
        "--data",
        type=Path,
        default=Path(".dkdata"),
        help="holds scifact/ and gpu_suite/ (benchmarks/gpu_prepare.sh makes them)",
    )
    parser.add_argument(
        "--shared",
        type=Path,
        default=Path("../shared/data"),
        help="a smoke run without --data's inputs prepares small ones from here",
    )
    parser.add_argument(
        "--wiki-corpus",
        type=Path,
        default=None,
        help="the passages a smoke run's wiki sample is taken from (default wiki1m's)",
    )
    parser.add_argument("--output", type=Path, default=WORK / "gpu_suite.json")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated, from: " + ", ".join(PARTS))
    parser.add_argument(
        "--deadline-s",
        type=int,
        default=None,
        help="stop starting parts once this many seconds have passed (default 480 on a GPU)",
    )
    parser.add_argument(
        "--reference",
        type=Path,
        default=None,
        help=f"the CPU's float32 loss curve to compare with (default: {REFERENCE}); with --make-reference, "
        "where to write one (given explicitly, so the committed curve is replaced only when asked)",
    )
    parser.add_argument(
        "--make-reference",
        choices=["float32", "bf16"],
        default=None,
        help="write this device's loss curve of the fine-tune at this precision to --reference "
        "and stop (float32 on the CPU: the committed reference)",
    )
    parser.add_argument("--fail-part", default=None, help="make this part fail (to check the guard)")
    args = parser.parse_args(argv)

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    plan = SMOKE_PLAN if args.smoke else DEVICE_PLAN
    if args.smoke:  # tiny shapes run fastest on one thread, and do not fight the CPU's other work for cores
        os.environ["OMP_NUM_THREADS"] = "1"  # for the processes it starts (tests, ANCE's inferencer)
        torch.set_num_threads(1)
    chosen = [name.strip() for name in args.parts.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(PARTS))
    if unknown or (args.fail_part and args.fail_part not in PARTS):
        parser.error(f"unknown part {', '.join(unknown) or args.fail_part}: choose from {', '.join(PARTS)}")
    deadline = args.deadline_s if args.deadline_s is not None else (None if device == "cpu" else 480)
    with tempfile.TemporaryDirectory(prefix="gpu-suite-") as scratch:
        work = args.work or Path(scratch)
        inputs = args.data / "gpu_suite"
        scifact = args.data / "scifact"
        if args.smoke and not (inputs / INPUTS_FILE).is_file():
            inputs, scifact = smoke_inputs(args.shared, args.wiki_corpus, work), args.shared / "scifact"
        if args.make_reference and args.reference is None:
            parser.error("--make-reference writes a curve: name its file with --reference")
        ctx = Context(device, plan, scifact, inputs, work, args.reference or REFERENCE)
        if args.make_reference:
            return write_reference(ctx, ctx.reference, args.make_reference)
        return run_suite(ctx, chosen, args.fail_part, deadline, args.output, argv)


def run_suite(ctx: Context, chosen: list[str], fail_part: str | None, deadline: int | None, output: Path,
              argv: list[str] | None) -> dict:  # fmt: skip
    """Every chosen part in turn, the results file rewritten after each."""
    from densekit.io.atomic import write_text_atomic

    started = time.perf_counter()
    command = " ".join(["python -m benchmarks.gpu_suite", *(sys.argv[1:] if argv is None else argv)])
    results: dict[str, Any] = {"benchmark": "gpu_suite", "command": command, "device": ctx.device,
                               "smoke": ctx.plan is SMOKE_PLAN, "machine": machine_info(),
                               "parts": {}}  # fmt: skip
    for name in chosen:
        budget = ctx.plan.budgets[name]
        if deadline is not None:
            left = int(deadline - (time.perf_counter() - started))
            if left < 10:
                results["parts"][name] = {"ok": False, "error": f"not started: {deadline} s deadline reached"}
                continue
            budget = min(budget, left)
        print(f"[gpu suite] {name} (budget {budget} s)", flush=True)
        results["parts"][name] = entry = run_part(name, ctx, budget, name == fail_part)
        print(
            f"[gpu suite] {name}: {'ok' if entry['ok'] else entry['error']} in {entry['seconds']} s",
            flush=True,
        )
        results["goals"] = goals(results["parts"])
        results["seconds"] = round(time.perf_counter() - started, 1)
        write_text_atomic(output, json.dumps(results, indent=2) + "\n")
    failed = [name for name, entry in results["parts"].items() if not entry["ok"]]
    print(json.dumps({"failed": failed, "goals": {g: v["met"] for g, v in results["goals"].items()},
                      "seconds": results["seconds"], "output": str(output)}, indent=2))  # fmt: skip
    return results


def write_reference(ctx: Context, path: Path, precision: str) -> dict:
    """The loss curve of the device plan's fine-tune on this machine at `precision`, written to `path`."""
    from densekit.io.atomic import write_text_atomic

    plan = ctx.plan
    model, checksum = ctx.model(plan.minilm, dropout=False, seed=CURVE["model_seed"])
    identity = gpu_train.reference_identity(
        checksum, ctx.train, plan.curve_steps, plan.curve_batch, plan.curve_chunk
    )
    started = time.perf_counter()
    reference = make_reference(ctx, model, identity, precision, ctx.work / "reference")
    command = " ".join(["python -m benchmarks.gpu_suite", *sys.argv[1:]])
    means = gpu_train.window_means(reference["losses"], plan.curve_window)
    reference.update(command=command, seconds=round(time.perf_counter() - started), machine=machine_info(),
                     window_means=[round(x, 4) for x in means])  # fmt: skip
    write_text_atomic(path, json.dumps(reference, indent=2) + "\n")
    print(json.dumps({k: reference[k] for k in ("window_means", "seconds")}))
    return reference


if __name__ == "__main__":
    main()
