"""`densekit train`, `train-cross-encoder`, `mine`, `pretrain` and `ance-infer`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from densekit.cli.options import (
    BatchOpt,
    DataDirArg,
    DeviceOpt,
    ModuleOpt,
    OverwriteOpt,
    ProgressOpt,
    RemoteCodeOpt,
    TorchPrecisionOpt,
)
from densekit.errors import SettingError
from densekit.limits import MAX_RUN_DEPTH

ResumeOpt = Annotated[
    bool,
    typer.Option(help="Continue the run in --out from its newest checkpoint (same config and inputs)."),
]
OverridesArg = Annotated[
    list[str] | None, typer.Argument(help="Config overrides as section.key=value, e.g. optim.epochs=3.")
]
ReportToOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--report-to",
        metavar="TRACKER",
        help="Send the training log's scalars and the config to tensorboard, mlflow or wandb (repeat it, or "
        "separate names by commas; 'none' for none); sets report_to. Each tracker is an optional extra of "
        "its name (docs/training.md).",
    ),
]


def report_to_override(names: list[str] | None) -> list[str]:
    """`--report-to` as a `report_to=[...]` config override; none when the option is not given. An
    empty name (`--report-to ''`, `mlflow,`) is refused: it is a slip, and 'none' says none."""
    if names is None:
        return []
    chosen = [part.strip() for name in names for part in name.split(",")]
    if "" in chosen:
        given = ", ".join(repr(name) for name in names)
        raise SettingError(
            f"--report-to {given}: an empty tracker name; give tensorboard, mlflow, wandb or none"
        )
    chosen = [name for name in chosen if name != "none"]
    return [f"report_to=[{','.join(chosen)}]"]


def train(
    config: Annotated[
        Path, typer.Argument(help="A YAML training config (see recipes/ and docs/training.md).")
    ],
    out: Annotated[Path, typer.Option("--out", help="Where checkpoints, logs and the final model go.")],
    overrides: OverridesArg = None,
    resume: ResumeOpt = False,
    overwrite: OverwriteOpt = False,
    grad_cache: Annotated[
        bool | None,
        typer.Option("--grad-cache/--no-grad-cache", help="Gradient caching (grad_cache.enabled)."),
    ] = None,
    chunk_size: Annotated[
        int | None, typer.Option(help="Texts per GradCache chunk (grad_cache.chunk_size).")
    ] = None,
    report_to: ReportToOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Fine-tune a dense encoder contrastively (InfoNCE, in-batch + hard negatives).

    An --out folder that holds this run already needs --resume (continue) or --overwrite (start
    again); one holding another run or files densekit did not make is refused.
    Several processes: `torchrun --nproc_per_node N -m densekit train CONFIG --out DIR`.
    """
    from densekit.configuration import load_config
    from densekit.training.config import TrainConfig
    from densekit.training.fine_tuning import run_training

    extra = list(overrides or [])
    if grad_cache is not None:
        extra.append(f"grad_cache.enabled={str(grad_cache).lower()}")
    if chunk_size is not None:
        extra.append(f"grad_cache.chunk_size={chunk_size}")
    extra += report_to_override(report_to)
    run_training(
        load_config(config, TrainConfig, extra), out, resume=resume, show_progress=progress,
        overwrite=overwrite,
    )  # fmt: skip


def train_cross_encoder(
    config: Annotated[Path, typer.Argument(help="A YAML cross-encoder config (see docs/reranking.md).")],
    out: Annotated[Path, typer.Option("--out", help="Where checkpoints, logs and the cross-encoder go.")],
    overrides: OverridesArg = None,
    resume: ResumeOpt = False,
    overwrite: OverwriteOpt = False,
    report_to: ReportToOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Train a cross-encoder (reranker) on training examples: a listwise softmax over each query's
    positive and hard negatives. The model is saved to OUT/model, a folder sentence-transformers'
    CrossEncoder loads. --resume and --overwrite are those of `densekit train`.
    """
    from densekit.configuration import load_config
    from densekit.training.config import CrossEncoderTrainConfig
    from densekit.training.fine_tuning import run_cross_encoder_training

    extra = list(overrides or []) + report_to_override(report_to)
    run_cross_encoder_training(
        load_config(config, CrossEncoderTrainConfig, extra), out, resume=resume, show_progress=progress,
        overwrite=overwrite,
    )  # fmt: skip


def mine(
    data_dir: DataDirArg,
    output: Annotated[Path, typer.Option("--output", "-o", help="The training file to write (JSONL).")],
    split: Annotated[
        str | None, typer.Option(help="The qrels split whose queries are mined for (default: train).")
    ] = None,
    examples: Annotated[
        Path | None,
        typer.Option(
            help="Mine for the queries and positives of this training file instead of a split's "
            "judgements (e.g. `densekit pseudo-queries`); its negatives are replaced."
        ),
    ] = None,
    source: Annotated[
        str, typer.Option(help="bm25, dense (needs --model), or none (judged positives only).")
    ] = "bm25",
    model: Annotated[str | None, typer.Option(help="Model for dense mining (folder or hub id).")] = None,
    module: ModuleOpt = None,
    index: Annotated[
        Path | None,
        typer.Option(
            help="A `densekit index` folder built with --model (default: encode the corpus in memory)."
        ),
    ] = None,
    ranks: Annotated[
        str,
        typer.Option(
            help=f"Rank range negatives come from, as first-last (1-based, last at most {MAX_RUN_DEPTH:,})."
        ),
    ] = "10-200",
    count: Annotated[int, typer.Option(min=1, help="Negatives sampled per query.")] = 30,
    margin: Annotated[
        float | None, typer.Option(help="Drop candidates scoring above (positive - margin).")
    ] = None,
    relative_margin: Annotated[
        float | None,
        typer.Option(help="Drop candidates above the positive less (1 - this) of its size, e.g. 0.95."),
    ] = None,
    keep_identical: Annotated[
        bool, typer.Option(help="Keep candidates whose text equals a positive's.")
    ] = False,
    min_relevance: Annotated[int, typer.Option(help="Judgements at least this relevant are positives.")] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the sampling.")] = 42,
    domain: Annotated[
        str | None, typer.Option(help="The collection's domain, written into every example (routing).")
    ] = None,
    batch_size: BatchOpt = 64,
    device: DeviceOpt = "auto",
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """Build training examples from judgements (or an examples file), with hard negatives mined by BM25
    or a dense model.

    Writes the file atomically and a report of what each filter removed beside it (FILE.report.json);
    files mined with other settings or inputs are replaced only with --overwrite.
    """
    from rich.console import Console

    from densekit.data.dataset import Dataset
    from densekit.device import resolve_device
    from densekit.mining.filters import MiningSettings
    from densekit.mining.mine import mine as run_mine
    from densekit.models import DenseEncoder

    first, sep, last = ranks.partition("-")
    if not sep or not first.isdigit() or not last.isdigit():
        raise SettingError(f"--ranks {ranks!r} is not of the form first-last, e.g. 10-200")
    if not 1 <= int(first) <= int(last) <= MAX_RUN_DEPTH:
        raise SettingError(f"--ranks {ranks}: give 1 <= first <= last <= {MAX_RUN_DEPTH}")
    settings = MiningSettings(
        first_rank=int(first), last_rank=int(last), count=count, margin=margin,
        relative_margin=relative_margin, exclude_identical=not keep_identical, seed=seed,
    )  # fmt: skip
    if examples is not None and (split is not None or min_relevance != 1):
        raise SettingError(
            "--examples gives the queries and positives: --split and --min-relevance do not apply"
        )
    if source == "dense" and model is None:
        raise SettingError("--source dense needs --model")
    if module is not None and model is None:
        raise SettingError("--module needs --model, its base")
    encoder = (
        DenseEncoder.load(model, module=module).to(resolve_device(device)) if source == "dense" else None
    )
    report = run_mine(
        Dataset.open(data_dir),
        split or "train",
        output,
        source,
        settings,
        encoder,
        index,
        min_relevance,
        batch_size,
        progress,  # type: ignore[arg-type]
        domain,
        examples,
        overwrite,
    )
    Console(stderr=True).print_json(data=report)


def score(
    model: Annotated[
        str, typer.Argument(help="The teacher: a cross-encoder folder (or hub id) with its trained head.")
    ],
    examples: Annotated[Path, typer.Argument(help="Training examples (JSONL), e.g. from `densekit mine`.")],
    data_dir: DataDirArg,
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The scored examples to write (JSONL, a new file).")
    ],
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Pairs scored per batch.")] = 32,
    chunk: Annotated[
        int, typer.Option("--chunk", min=1, help="Examples scored between two saves of the progress.")
    ] = 64,
    max_length: Annotated[int | None, typer.Option("--max-length", min=8, help="Tokens per pair.")] = None,
    device: DeviceOpt = "auto",
    precision: TorchPrecisionOpt = "float32",
    trust_remote_code: RemoteCodeOpt = False,
    overwrite: OverwriteOpt = False,
    progress: ProgressOpt = True,
) -> None:
    """Add a teacher's scores to training examples: the cross-encoder's score of each query with every
    positive and negative, in `teacher_scores`, for distillation (loss.distillation). A killed run
    continues where it stopped when run again with the same arguments.
    """
    from densekit.data.dataset import Dataset
    from densekit.device import autocast, resolve_device
    from densekit.mining.teacher import score_examples
    from densekit.models.cross_encoder import CrossEncoder

    target = resolve_device(device)
    autocast(target, precision)  # type: ignore[arg-type]  # refuses fp16 on a CPU before any work
    teacher = CrossEncoder.load(model, max_length, trust_remote_code, require_head=True).to(target)
    score_examples(
        teacher, examples, Dataset.open(data_dir), output, batch_size, chunk, progress,
        precision=precision, overwrite=overwrite,  # type: ignore[arg-type]
    )  # fmt: skip


def pretrain(
    config: Annotated[Path, typer.Argument(help="A YAML pre-training config (see docs/pretraining.md).")],
    out: Annotated[Path, typer.Option("--out", help="Where checkpoints, logs and the encoder go.")],
    overrides: OverridesArg = None,
    method: Annotated[
        str | None, typer.Option(help="condenser, cocondenser, retromae or mlm (overrides the config's).")
    ] = None,
    resume: ResumeOpt = False,
    overwrite: OverwriteOpt = False,
    report_to: ReportToOpt = None,
    progress: ProgressOpt = True,
) -> None:
    """Pre-train an encoder for retrieval (Condenser, coCondenser, RetroMAE; MLM as a baseline).

    The encoder without its pre-training heads is saved to OUT/model, ready for `densekit train`.
    --resume and --overwrite are those of `densekit train`.
    """
    from densekit.configuration import load_config
    from densekit.pretraining.config import PretrainConfig
    from densekit.pretraining.run import run_pretraining

    extra = list(overrides or []) + ([f"method={method}"] if method else []) + report_to_override(report_to)
    run_pretraining(
        load_config(config, PretrainConfig, extra), out, resume=resume, show_progress=progress,
        overwrite=overwrite,
    )  # fmt: skip


def ance_infer(
    out: Annotated[
        Path, typer.Argument(help="The output folder of an ANCE training run (shared with the trainer).")
    ],
    threads: Annotated[int | None, typer.Option(help="torch threads for encoding.")] = None,
    once: Annotated[bool, typer.Option(help="Publish one version, then exit.")] = False,
    watch_parent: Annotated[bool, typer.Option(help="Stop when the starting process is gone.")] = False,
    progress: ProgressOpt = True,
) -> None:
    """Run an ANCE inferencer: re-encode the corpus with each new checkpoint and publish fresh negatives.

    A trainer with `ance.inferencer: local` starts one itself; with `external`, start them here, on
    this or other machines that share OUT. Stops when the trainer ends.
    """
    from densekit.training.ance.inferencer import run_inferencer

    run_inferencer(out, threads, progress, once, watch_parent)


def register(app: typer.Typer) -> None:
    """Add these sub-commands to `app`."""
    app.command("train")(train)
    app.command("train-cross-encoder")(train_cross_encoder)
    app.command("mine")(mine)
    app.command("score")(score)
    app.command("pretrain")(pretrain)
    app.command("ance-infer")(ance_infer)
