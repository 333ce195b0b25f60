"""The ANCE inferencer: newest checkpoint in, a new version of negatives out, again and again.

It reads the run's `config.yaml` for the corpus and the ANCE settings, waits for a checkpoint newer
than the one its last version came from, re-encodes the corpus with it, builds a flat index,
retrieves the top `ance.depth` documents for the training queries (all of them, or the next rotating
part), samples negatives with the positives excluded (and the other mining filters), and publishes
the result as the next version. It stops when the trainer leaves `OUT/ance/STOP`.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from densekit.configuration import load_config
from densekit.data.dataset import Dataset
from densekit.device import resolve_device
from densekit.errors import StateError
from densekit.mining.filters import choose_negatives
from densekit.mining.mine import dense_candidates
from densekit.models.encoder import DenseEncoder
from densekit.retrieval.memory_index import index_corpus
from densekit.training.ance.versions import NegativeVersions
from densekit.training.checkpoint import checkpoints
from densekit.training.config import TrainConfig
from densekit.training.trainer import CHECKPOINTS

log = logging.getLogger("densekit")


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[1])


def refresh(
    output: Path,
    config: TrainConfig,
    versions: NegativeVersions,
    checkpoint: Path,
    show_progress: bool = False,
) -> int:
    """Make and publish the version after the newest from `checkpoint`; returns its number."""
    began = time.perf_counter()
    previous = versions.latest()
    if previous is None:
        raise StateError(f"{versions.root} holds no version 0; the trainer publishes it when it starts")
    examples, _ = versions.load(previous)
    version = previous + 1
    settings = config.ance
    chosen = list(range(len(examples)))
    if settings.queries_per_refresh is not None and settings.queries_per_refresh < len(examples):
        start = ((version - 1) * settings.queries_per_refresh) % len(examples)
        chosen = [(start + i) % len(examples) for i in range(settings.queries_per_refresh)]
    device = resolve_device(config.device)
    encoder = DenseEncoder.load(checkpoint / "model").to(device)
    documents = list(Dataset.open(config.data.path).iter_corpus())
    texts = {doc.id: doc.full_text for doc in documents}
    index = index_corpus(
        encoder, documents, settings.batch_size, show_progress=show_progress, maxp=settings.maxp
    )
    subset = [examples[i] for i in chosen]
    ranked, positive_scores = dense_candidates(
        encoder, index, texts, subset, settings.depth, settings.batch_size, show_progress
    )
    mined, report = choose_negatives(subset, ranked, positive_scores, texts, settings.negatives)
    for i, example in zip(chosen, mined, strict=True):
        examples[i] = example
    meta = {
        "checkpoint": str(checkpoint),
        "checkpoint_step": _step_of(checkpoint),
        "queries_refreshed": len(chosen),
        "seconds": round(time.perf_counter() - began, 1),
        "negatives_written": report.sampled,
        "removed_positive": report.removed_positive,
        "queries_with_fewer_negatives": len(report.short_queries),
    }
    versions.publish(version, examples, meta)
    log.info("published ANCE version %d from %s in %.0f s", version, checkpoint.name, meta["seconds"])
    return version


def run_inferencer(
    output: Path,
    threads: int | None = None,
    show_progress: bool = False,
    once: bool = False,
    watch_parent: bool = False,
) -> None:
    """Refresh whenever the trainer under `output` writes a newer checkpoint, until it says stop.

    With `watch_parent` (a trainer's own inferencer), it also stops when the process that started it
    is gone.
    """
    output = Path(output)
    if threads:
        torch.set_num_threads(threads)
    config = load_config(output / "config.yaml", TrainConfig)
    versions = NegativeVersions(output)
    removed = versions.remove_partial()
    if removed:
        log.warning("removed %d partial versions left by an interrupted inferencer", removed)
    parent = os.getppid()
    done_step = -1
    latest = versions.latest()
    if latest is not None:
        done_step = versions.load(latest)[1].get("checkpoint_step", -1)
    while not versions.stop_file.exists():
        found = checkpoints(output / CHECKPOINTS)
        newest = found[-1] if found else None
        if newest is not None and _step_of(newest) > done_step:
            try:
                refresh(output, config, versions, newest, show_progress)
            except FileNotFoundError:
                log.info("%s was pruned while being read; taking the next one", newest.name)
                continue
            done_step = _step_of(newest)
            if once:
                return
            continue
        if watch_parent and os.getppid() != parent:
            log.warning("the process that started this inferencer is gone; stopping")
            return
        time.sleep(config.ance.poll_seconds)
