"""Model cards: the `README.md` of a saved model, module or route folder, in Hugging Face's card format.

The card is written from what densekit recorded: the folder's manifest (its base model, weights'
fingerprint, settings) when the folder is saved, and, for a model a training run exports, the run's
manifest (its config, its inputs' digests), their sizes and the scores the run measured. The YAML header
(library_name, base_model, tags, datasets where known, model-index where there are scores) and the file
are huggingface_hub's `ModelCard` and `ModelCardData`; the Markdown body is densekit's.

The card is written after the folder's checksums and is never part of them (`densekit.io.readme`), so
editing it never makes the folder fail its check. densekit writes `README.md` only where there is none
or where the one there is its own (it carries `CARD_MARK`): a README a person wrote is kept, also when
densekit replaces the folder around it (`artefact_dir` keeps it).

Whatever the card says of names and paths (a folder's name, a base's path, a config's values) is text
anyone may have chosen: prose shows it escaped (`markdown_text`), code blocks are fenced longer than any
run of backticks they hold, and the Python snippets take it as string literals (`repr`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from densekit.io.artefact import read_manifest
from densekit.io.atomic import write_text_atomic
from densekit.io.readme import CARD_FILE, CARD_MARK, is_densekit_card

TRAINING_HEADING = "## Training"
# What Markdown or the HTML in it could read as syntax, anywhere in a line: written as HTML entities
# (`<`, `>`, `&`: no tag, comment or entity of a name's own) or escaped with a backslash.
_ENTITIES = {"<": "&lt;", ">": "&gt;", "&": "&amp;"}
_MARKUP = re.compile(r"[<>&\\`*_\[\]{}|#~$!]")
HF_DATASET = re.compile(r"^hf:([\w.-]+/[\w.-]+)")


@dataclass
class Usage:
    """How to load the folder with one library: its name and a Python snippet."""

    library: str
    code: str


@dataclass
class CardFacts:
    """What a saved folder's card says of it, beside its manifest: `summary` is Markdown (its names
    escaped by the caller), the other texts are shown as they are; `hub_base` is the base's hub id
    (none for a local folder, whose path is the machine's own)."""

    title: str
    summary: str
    library_name: str
    tags: list[str]
    details: dict[str, str] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)
    usage: list[Usage] = field(default_factory=list)
    pipeline_tag: str | None = None
    hub_base: str | None = None


@dataclass
class Score:
    """A score a run measured: the measure, its value, on which split of which collection, at which
    step, by which command."""

    metric: str
    value: float
    collection: str
    split: str
    step: int
    command: str


@dataclass
class InputFacts:
    """One input of a training run: its config key, its path (or hub id), its digest and its size."""

    key: str
    path: str
    digest: str
    size: str


@dataclass
class TrainingFacts:
    """What a training run records of itself, for the cards of the models it exports."""

    command: str
    config_yaml: str
    inputs: list[InputFacts]
    scores: list[Score] = field(default_factory=list)


def markdown_text(text: str) -> str:
    """`text` as Markdown prose shows it, character for character, on one line: characters that do not
    print (line breaks, other controls, bidirectional overrides) as Python writes them escaped (`\\n`),
    `<`, `>` and `&` as HTML entities, and the rest of Markdown's syntax escaped with a backslash."""
    visible = "".join(char if char.isprintable() else ascii(char)[1:-1] for char in text)
    return _MARKUP.sub(lambda m: _ENTITIES.get(m.group(), "\\" + m.group()), visible)


def fenced(language: str, code: str) -> list[str]:
    """`code` as a Markdown code block: fenced with more backticks than any run of them in it, so no
    line of it ends the block early."""
    longest = max((len(run) for run in re.findall("`+", code)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + language, code, fence]


def write_model_card(folder: Path | str, facts: CardFacts) -> bool:
    """Write the card of the folder densekit just saved, atomically; False (nothing written) when a
    README that is not densekit's is there."""
    from huggingface_hub import ModelCard, ModelCardData

    folder = Path(folder)
    path = folder / CARD_FILE
    if path.exists() and not is_densekit_card(folder):
        return False
    manifest = read_manifest(folder)
    data = ModelCardData(
        library_name=facts.library_name,
        base_model=facts.hub_base,
        tags=facts.tags,
        pipeline_tag=facts.pipeline_tag,
    )
    body = [CARD_MARK, "", f"# {markdown_text(facts.title)}", "", facts.summary, "", "## Model", ""]
    rows = dict(facts.details)
    if manifest is not None:
        rows.update({"densekit": manifest.densekit, "made by densekit as": manifest.kind})
        plain = {k: v for k, v in manifest.identity.items() if not isinstance(v, dict)}
        rows.update({f"identity: {k}": v for k, v in plain.items()})
    body += _table(("", ""), rows.items())
    if facts.settings:
        body += ["", "Settings:", "", *fenced("json", json.dumps(facts.settings, indent=2))]
    body += ["", "## Use it", ""]
    for usage in facts.usage:
        body += [f"### {markdown_text(usage.library)}", "", *fenced("python", usage.code.strip()), ""]
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body).rstrip() + "\n")
    write_text_atomic(path, str(card))
    return True


def add_training(folder: Path | str, training: TrainingFacts) -> bool:
    """Add what the run that exported the folder records (its command, config, inputs with their
    digests and sizes, and its scores) to densekit's card there; False when the card is not
    densekit's."""
    from huggingface_hub import EvalResult, ModelCard

    folder = Path(folder)
    if not is_densekit_card(folder):
        return False
    card = ModelCard.load(folder / CARD_FILE)
    datasets = sorted({m.group(1) for i in training.inputs if (m := HF_DATASET.match(i.path))})
    if datasets:
        card.data.datasets = datasets
    if training.scores:
        card.data.model_name = folder.resolve().name
        card.data.eval_results = [
            EvalResult(
                task_type="Retrieval", dataset_type=s.collection, dataset_name=s.collection,
                dataset_split=s.split, metric_type=s.metric, metric_value=s.value,
                metric_name=f"{s.metric} at step {s.step}",
            )
            for s in training.scores
        ]  # fmt: skip
    text = card.text.split(f"\n{TRAINING_HEADING}\n")[0].rstrip()
    card.text = text + "\n\n" + "\n".join(_training_section(training)) + "\n"
    write_text_atomic(folder / CARD_FILE, str(card))
    return True


def _training_section(training: TrainingFacts) -> list[str]:
    lines = [TRAINING_HEADING, "", f"Made by `{training.command}`. Its inputs, as the run recorded them:", ""]
    inputs = [(i.key, i.path, i.digest, i.size) for i in training.inputs]
    lines += _table(("input", "path", "digest", "size"), inputs)
    if training.scores:
        scores = [(s.metric, f"{s.value:.4f}", s.collection, s.split, str(s.step), s.command)
                  for s in training.scores]  # fmt: skip
        lines += ["", "Scores it measured:", ""]
        lines += _table(("measure", "value", "collection", "split", "step", "command"), scores)
    lines += ["", "Its config:", "", *fenced("yaml", training.config_yaml.rstrip())]
    return lines


def _cell(value: Any) -> str:
    """A value as a Markdown table cell."""
    return markdown_text(value if isinstance(value, str) else json.dumps(value))


def _table(header: tuple[str, ...], rows: Any) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def input_size(path: Path | str) -> str:
    """A training input's size in words: a file's bytes (and lines, for JSONL and TSV), a folder's
    bytes and files; empty for a name that is not on disk (a hub id)."""
    path = Path(path)
    if path.is_file():
        size = path.stat().st_size
        if path.suffix in (".jsonl", ".tsv"):
            with path.open("rb") as handle:
                lines = sum(1 for _ in handle)
            return f"{lines:,} lines, {_bytes(size)}"
        return _bytes(size)
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file()]
        return f"{len(files):,} files, {_bytes(sum(p.stat().st_size for p in files))}"
    return ""


def _bytes(size: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:,} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    return str(size)
