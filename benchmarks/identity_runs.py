r"""The artefacts a refactor must leave byte-identical (issue 65): densekit from one checkout run on the
four shared collections with a seeded tiny random BERT, in one process, into one folder that
`benchmarks/identity_compare.py` compares with another checkout's.

Parts (`--parts`, all by default), each under `OUT/<part>/`:

- `collections`: on SciFact, NFCorpus, Vaswani and Cranfield (read in place from `--data`), the
  README's commands: bm25, encode, index (flat), search, evaluate (of both runs);
- `quickstart`: `densekit quickstart` on Cranfield, its model swapped for the tiny one;
- `two-round`: `recipes/scifact-two-round.yaml`, copied into OUT, with the tiny model and every train
  step stopped after `--max-steps` steps (`steps.<name>.config.optim.max_steps`);
- `multi-domain`: `recipes/multi-domain.yaml` the same way (`--benchmark-k K`: its ten benchmark steps'
  runs K deep, not 1,000; reading and writing those runs is most of this part's time).

Every command goes through densekit's own command line (its typer app, called in this process with
the arguments `densekit` would get), so torch is imported once; torch, faiss and the tokenizers run on
one thread and Python's string hashing is fixed (the script starts itself again with
`PYTHONHASHSEED=0`), so two runs of the same code give the same bytes. The checkout's `src/` is put
first on `sys.path`, and the densekit imported is checked to be that one. `OUT/_identity_run.json`
records the checkout, the model, the data and each step's seconds. Run from the repository root:

    B="nice -n 19 .venv/bin/python -m benchmarks.identity_runs"
    $B --src /work/wt-before --out /work/ident/before --make-model /work/ident/tiny-bert
    $B --src . --out /work/ident/after --model /work/ident/tiny-bert
    .venv/bin/python -m benchmarks.identity_compare /work/ident/before /work/ident/after
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PARTS = ("collections", "quickstart", "two-round", "multi-domain")
COLLECTIONS = ("scifact", "nfcorpus", "vaswani", "cranfield")
RECIPES = {"two-round": "scifact-two-round.yaml", "multi-domain": "multi-domain.yaml"}
RECORD = "_identity_run.json"
DEFAULT_DATA = Path("../shared/data")  # from the repository root, as every benchmark reads it
MINILM = "sentence-transformers/all-MiniLM-L6-v2"
# what the script's first process sets before it starts itself again: one thread everywhere, fixed
# string hashing (set and dict orders of strings), nothing asked of the hub
FIXED_ENVIRONMENT = {
    "PYTHONHASHSEED": "0",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}


class Clock:
    """Seconds since the run began, printed before each line of progress."""

    def __init__(self) -> None:
        self.began = time.perf_counter()
        self.steps: dict[str, float] = {}

    def say(self, line: str) -> None:
        """Print `line` after the elapsed seconds."""
        print(f"[{time.perf_counter() - self.began:7.1f} s] {line}", flush=True)

    def step(self, name: str, action: Callable[[], Any]) -> Any:
        """Run `action` as the step `name`, printing and recording how long it took."""
        self.say(f"{name} ...")
        started = time.perf_counter()
        result = action()
        self.steps[name] = round(time.perf_counter() - started, 2)
        self.say(f"{name}: {self.steps[name]:.1f} s")
        return result


def fix_environment() -> None:
    """Start this script again with `FIXED_ENVIRONMENT` unless it already runs with it (Python reads
    PYTHONHASHSEED only when it starts)."""
    if all(os.environ.get(key) == value for key, value in FIXED_ENVIRONMENT.items()):
        return
    sys.stdout.flush()
    os.execve(sys.executable, list(sys.orig_argv), {**os.environ, **FIXED_ENVIRONMENT})


def import_densekit(src: Path) -> Any:
    """Import densekit from `src/src` (first on `sys.path`) and set torch and faiss to one thread;
    refused when another copy would be imported."""
    sys.path.insert(0, str(src / "src"))
    import densekit

    where = Path(densekit.__file__).resolve()
    if not where.is_relative_to((src / "src").resolve()):
        raise SystemExit(f"densekit was imported from {where}, not from {src / 'src'}")
    import faiss
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    faiss.omp_set_num_threads(1)
    return densekit


def make_model(path: Path, seed: int = 0, hidden: int = 32, layers: int = 2) -> Path:
    """Save a randomly initialised small BERT (seeded) with the bundled MiniLM tokenizer at `path`,
    as the tests' `tiny_bert` does, with positions for 512 tokens (the recipes' passages take 256)."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    from densekit.models.hub import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(MINILM))
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=hidden * 2,
        max_position_embeddings=512,
    )
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def cli_runner() -> Callable[..., None]:
    """A function running `densekit ARGS` in this process, raising what the command raises."""
    from typer.main import get_command

    from densekit.cli.main import app

    command = get_command(app)

    def densekit(*args: Any) -> None:
        command.main(args=[str(a) for a in args], prog_name="densekit", standalone_mode=False)

    return densekit


def run_collections(densekit: Callable[..., None], clock: Clock, data: Path, model: Path, out: Path) -> None:
    """The README's commands on each shared collection, into `out/<collection>`."""
    for name in COLLECTIONS:
        d, o = data / name, out / name
        o.mkdir(parents=True)
        steps: list[tuple[str, tuple[Any, ...]]] = [
            ("bm25", ("bm25", d, "--split", "test", "-o", o / "bm25.trec")),
            ("evaluate bm25", ("evaluate", d / "qrels/test.tsv", o / "bm25.trec", "--json", o / "bm25.json")),
            ("encode", ("encode", model, d, "-o", o / "emb", "--no-progress")),
            ("index", ("index", o / "emb", "-o", o / "index", "--type", "flat", "--no-progress")),
            (
                "search",
                ("search", model, o / "index", d, "--split", "test", "-o", o / "dense.trec", "--no-progress"),
            ),
            ("evaluate", ("evaluate", d / "qrels/test.tsv", o / "dense.trec", "--json", o / "dense.json")),
        ]
        for step, args in steps:
            clock.step(f"collections/{name}/{step}", lambda args=args: densekit(*args))


def run_quickstart(densekit: Callable[..., None], clock: Clock, data: Path, model: Path, out: Path) -> None:
    """`densekit quickstart` on Cranfield, its model the tiny one (the command has no model option:
    `densekit.quickstart.run_quickstart` is given it while the command runs)."""
    import densekit.quickstart as quickstart

    original = quickstart.run_quickstart

    def with_model(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **{**kwargs, "model": str(model)})

    quickstart.run_quickstart = with_model
    try:
        args = ("quickstart", "--data", data / "cranfield", "--out", out / "cranfield", "--device", "cpu")
        clock.step("quickstart/cranfield", lambda: densekit(*args, "--no-progress"))
    finally:
        quickstart.run_quickstart = original


def recipe_overrides(
    recipe: Path, data: Path, model: Path, max_steps: int, benchmark_k: int | None = None
) -> list[str]:
    """The overrides running `recipe` on the tiny model, its data read from `data`, every train step
    stopped after `max_steps` steps, every benchmark step's runs `benchmark_k` deep when given."""
    import yaml

    tree = yaml.safe_load(recipe.read_text(encoding="utf-8"))
    overrides = [f"model.path={model}"]
    for key, value in tree["data"].items():
        if isinstance(value, str) and value.startswith("../shared/data/"):
            overrides.append(f"data.{key}={data / Path(value).name}")
    for name, step in tree["steps"].items():
        if step.get("type") == "train":
            overrides.append(f"steps.{name}.config.optim.max_steps={max_steps}")
        if step.get("type") == "benchmark" and benchmark_k is not None:
            overrides.append(f"steps.{name}.k={benchmark_k}")
    return overrides


def run_recipe(
    densekit: Callable[..., None],
    clock: Clock,
    source: Path,
    data: Path,
    model: Path,
    out: Path,
    max_steps: int,
    benchmark_k: int | None,
) -> None:
    """The recipe `source`, copied into `out`, run into `out/run` with `recipe_overrides`."""
    out.mkdir(parents=True)
    recipe = out / source.name
    recipe.write_bytes(source.read_bytes())
    overrides = recipe_overrides(recipe, data, model, max_steps, benchmark_k)
    clock.say(f"{out.name}: densekit run {recipe.name} " + " ".join(overrides))
    run = ("run", recipe, "--out", out / "run", "--device", "cpu", "--no-progress", *overrides)
    clock.step(f"{out.name}/run", lambda: densekit(*run))


def git_commit(src: Path) -> str | None:
    """The commit checked out at `src`, or None."""
    done = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run the parts asked for; exit 1 when one failed."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--src", type=Path, required=True, help="the densekit checkout to run")
    parser.add_argument("--out", type=Path, required=True, help="a new or empty folder for the artefacts")
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--make-model", type=Path, help="write the seeded tiny BERT here (a new folder), use it"
    )
    model.add_argument("--model", type=Path, help="a tiny BERT --make-model wrote")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--max-steps", type=int, default=3, help="steps of each recipe's train steps")
    parser.add_argument(
        "--benchmark-k",
        type=int,
        help="depth of the multi-domain recipe's benchmark runs (default: the recipe's, 1,000); reading and "
        "writing those runs is most of that part's time",
    )
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared collections")
    args = parser.parse_args(argv)
    fix_environment()

    src, out, data = args.src.resolve(), args.out.resolve(), args.data.resolve()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: give a new folder")
    target = (args.make_model or args.model).resolve()
    if args.make_model and args.make_model.exists():
        raise SystemExit(f"{args.make_model} exists: give --model to use it, or a new folder")
    clock = Clock()
    clock.step("import densekit and torch", lambda: import_densekit(src))
    if args.make_model:
        clock.step("make the tiny model", lambda: make_model(target))
    densekit = cli_runner()
    out.mkdir(parents=True, exist_ok=True)
    failed: list[str] = []
    for part in args.parts:
        try:
            if part == "collections":
                run_collections(densekit, clock, data, target, out / part)
            elif part == "quickstart":
                run_quickstart(densekit, clock, data, target, out / part)
            else:
                source = src / "recipes" / RECIPES[part]
                run_recipe(
                    densekit, clock, source, data, target, out / part, args.max_steps, args.benchmark_k
                )
        except Exception:  # one part's failure is reported, the others still run
            traceback.print_exc()
            clock.say(f"{part}: FAILED")
            failed.append(part)
    record = {
        "src": str(src),
        "commit": git_commit(src),
        "out": str(out),
        "model": str(target),
        "data": str(data),
        "parts": args.parts,
        "max_steps": args.max_steps,
        "benchmark_k": args.benchmark_k,
        "failed": failed,
        "timings": clock.steps,
    }
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    clock.say(f"done{': FAILED ' + ', '.join(failed) if failed else ''}; {out}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
