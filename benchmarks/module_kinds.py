"""Every module kind at the two-round recipe's budget, against the full fine-tune, on one collection.

Each kind runs `recipes/scifact-lora.yaml` with its `module:` section replaced (the full fine-tune
runs `recipes/scifact-two-round.yaml`): BM25 negatives, round 1, mining with the round-1 model, round
2, then test nDCG@10. Per kind it records round 1's and round 2's nDCG@10, the trainable parameters
and their share (as the training log states them), the final module's size on disk, the recipe
process's peak resident memory, the median seconds per training step and the wall time. A killed
run resumes (each recipe run resumes its steps; finished kinds are kept in the results file). Run
from the repository root (about 2 h a kind on a 2-core CPU, minutes on a GPU):

    .venv/bin/python -m benchmarks.module_kinds --data ../shared/data/scifact --runs runs/module-kinds
    .venv/bin/python -m benchmarks.module_kinds --kinds lora:5e-4 adapter:1e-3   # some kinds, own rates
    .venv/bin/python -m benchmarks.module_kinds --set model.path=BASE   # any recipe key, every kind
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from benchmarks import WORK
from benchmarks.machine import machine_info
from benchmarks.module_storage import folder_bytes

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
# Each kind with its default settings and the learning rate it trains at here: a module trains few
# values from a neutral start, so it takes larger steps than a full fine-tune (2e-5); the rates are
# the usual ones of each method's paper or peft's examples, not tuned on this data.
KINDS: dict[str, tuple[str | None, float]] = {
    "full": (None, 2.0e-5),
    "lora": ("{type: lora, name: m, rank: 16, alpha: 32}", 5.0e-4),
    # LoRA on every linear layer of a BERT block, the feed-forward's too, at half the rank
    "lora-all-linear": (
        "{type: lora, name: m, rank: 8, alpha: 16, target_modules: [query, key, value, "
        "attention.output.dense, intermediate.dense, output.dense]}",
        1.0e-3,
    ),
    "ia3": ("{type: ia3, name: m}", 3.0e-3),
    "prefix": ("{type: prefix, name: m}", 1.0e-2),
    "prompt": ("{type: prompt, name: m}", 3.0e-2),
    "adapter": ("{type: adapter, name: m}", 1.0e-3),
    "adapter-parallel": ("{type: adapter, name: m, placement: parallel}", 1.0e-3),
    "bitfit": ("{type: bitfit, name: m}", 1.0e-3),
    "sparse_diff": ("{type: sparse_diff, name: m}", 5.0e-4),
}
TRAINABLE = re.compile(r"trainable\s+([\d,]+)\s+parameters,\s+([\d.]+)%")  # the log may wrap lines


def recipe_command(kind: str, learning_rate: float, data: Path, out: Path, overrides: list[str]) -> list[str]:
    """The `densekit run` command line of `kind`'s two-round recipe."""
    module, _ = KINDS[kind]
    recipe = "scifact-two-round" if module is None else "scifact-lora"
    command = [sys.executable, "-m", "densekit", "run", str(ROOT / "recipes" / f"{recipe}.yaml"),
               "--out", str(out), "--no-progress", f"data.path={data}",
               f"train.learning_rate={learning_rate}", *overrides]  # fmt: skip
    return command if module is None else [*command, f"module={module}"]


def run_measured(command: list[str], log_file: Path) -> tuple[int, int]:
    """Run `command` with its output appended to `log_file`; its exit status and the peak resident
    memory in bytes of it and the processes it waited for (Linux's `wait4` reports both)."""
    with log_file.open("a", encoding="utf-8") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    return process.returncode, usage.ru_maxrss * 1024


def seconds_per_step(run: Path) -> float | None:
    """The median over a training run's log records of its batch size over the examples trained per
    second."""
    if not (run / "train_log.jsonl").is_file():
        return None
    batch_size = yaml.safe_load((run / "config.yaml").read_text())["optim"]["batch_size"]
    records = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines() if line]
    rates = [r["examples_per_s"] for r in records if r.get("examples_per_s")]
    return batch_size / statistics.median(rates) if rates else None


def ndcg(path: Path) -> float | None:
    """nDCG@10 of an evaluate step's output, when the step has run."""
    return json.loads(path.read_text())["nDCG@10"] if path.is_file() else None


def run_log(out: Path) -> Path:
    """The log file beside a kind's run folder (`lora-lr0.0005` -> `lora-lr0.0005.log`; a suffix
    would cut the learning rate at its dot, and two rates of one kind would share a log)."""
    return out.parent / f"{out.name}.log"


def measure_kind(kind: str, learning_rate: float, data: Path, runs: Path, overrides: list[str]) -> dict:
    """Run (or resume) `kind`'s recipe at `learning_rate` and read its figures from what the run wrote."""
    out = runs / f"{kind}-lr{learning_rate:g}"
    runs.mkdir(parents=True, exist_ok=True)
    log_file = run_log(out)
    start = time.perf_counter()
    status, peak = run_measured(recipe_command(kind, learning_rate, data, out, overrides), log_file)
    wall = time.perf_counter() - start
    if status != 0:
        raise SystemExit(f"{kind}: densekit run exited with {status}; see {log_file}")
    found = TRAINABLE.findall(log_file.read_text(encoding="utf-8"))
    trainable, share = (int(found[0][0].replace(",", "")), float(found[0][1])) if found else (None, 100.0)
    timings = out / "timings.json"
    return {
        "kind": kind,
        "learning_rate": learning_rate,
        "round1_ndcg@10": ndcg(out / "round1-test.json"),
        "round2_ndcg@10": ndcg(out / "test.json"),
        "trainable": trainable,
        "trainable_percent": share,
        "model_on_disk_mib": folder_bytes(out / "round2" / "model") / MIB,
        "peak_memory_gib": peak / 2**30,
        "seconds_per_step_round1": seconds_per_step(out / "round1"),
        "seconds_per_step_round2": seconds_per_step(out / "round2"),
        "wall_s_this_invocation": wall,
        "recipe_timings_s": json.loads(timings.read_text()) if timings.is_file() else {},
    }


def to_markdown(rows: list[dict]) -> str:
    """One table row per kind, with the full fine-tune's seconds per step as the unit where it ran (a
    dash where it did not)."""
    full = next((r for r in rows if r["kind"] == "full"), None)
    unit = full["seconds_per_step_round1"] if full else None
    lines = ["| kind | lr | round 1 | round 2 | trainable (share) | on disk | peak memory | s/step "
             "| vs full |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        step = r["seconds_per_step_round1"]
        trainable = "all" if r["trainable"] is None else f"{r['trainable']:,}"
        lines.append(
            f"| {r['kind']} | {r['learning_rate']:g} | {r['round1_ndcg@10']:.4f} | {r['round2_ndcg@10']:.4f} "
            f"| {trainable} ({r['trainable_percent']:.2f}%) | {r['model_on_disk_mib']:.2f} MiB "
            f"| {r['peak_memory_gib']:.1f} GiB | {step:.1f} | {f'{step / unit:.2f}' if unit else '—'} |"
        )
    return "\n".join(lines) + "\n"


def measured_rows(output: Path, data: Path, overrides: list[str]) -> list[dict]:
    """The rows an earlier invocation wrote to `output`, when it measured the same collection with the
    same overrides; rows of another collection or settings are never taken as this run's."""
    if not output.is_file():
        return []
    earlier = json.loads(output.read_text())
    if (earlier.get("data"), earlier.get("overrides")) != (str(data), overrides):
        raise SystemExit(
            f"error: {output} holds rows measured on {earlier.get('data')} with overrides "
            f"{earlier.get('overrides')}, not {data} with {overrides}: give another --output"
        )
    return earlier["rows"]


def parse_kind(text: str) -> tuple[str, float]:
    """`KIND` or `KIND:LEARNING_RATE`."""
    kind, _, rate = text.partition(":")
    if kind not in KINDS:
        raise argparse.ArgumentTypeError(f"unknown kind {kind!r}; known: {', '.join(KINDS)}")
    return kind, float(rate) if rate else KINDS[kind][1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=Path("../shared/data/scifact"))
    parser.add_argument("--runs", type=Path, default=Path("runs/module-kinds"))
    parser.add_argument(
        "--kinds", nargs="+", type=parse_kind, default=[(k, lr) for k, (_, lr) in KINDS.items()]
    )
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="KEY=VALUE", help="recipe overrides for every kind"
    )
    parser.add_argument("--note", default="", help="conditions of the run worth recording")
    parser.add_argument(
        "--output", type=Path, default=WORK / "module_kinds.json"
    )
    args = parser.parse_args()

    data = args.data.resolve()
    done = measured_rows(args.output, data, args.set)
    for kind, learning_rate in args.kinds:
        if any(r["kind"] == kind and r["learning_rate"] == learning_rate for r in done):
            print(f"{kind} at {learning_rate:g}: already measured in {args.output}")
            continue
        print(f"{kind} at {learning_rate:g}: running in {args.runs}", flush=True)
        done.append(measure_kind(kind, learning_rate, data, args.runs, args.set))
        result = {"benchmark": "module_kinds", "data": str(data), "overrides": args.set,
                  "note": args.note, "rows": done, "machine": machine_info()}  # fmt: skip
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        args.output.with_suffix(".md").write_text(to_markdown(done), encoding="utf-8")
        print(to_markdown(done), flush=True)


if __name__ == "__main__":
    main()
