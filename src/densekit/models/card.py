"""What the cards of model, module and cross-encoder folders say: a summary, the base, the settings and
how to load the folder in densekit, sentence-transformers and PEFT (`densekit.io.model_card` writes
them).

Folder names and paths are anyone's text: the snippets take them as Python string literals (`repr`, so
a name holding a quote and a line break stays one string), and a local base or module folder is
written by its path from the folder that holds the card's folder, where the snippets run, never by the
machine's own absolute path."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from densekit.io.model_card import CardFacts, Usage, markdown_text

TAGS = ["densekit", "dense-retrieval"]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _is_local(source: str) -> bool:
    path = Path(source)
    return path.is_absolute() or path.exists()


def hub_id(source: str) -> str | None:
    """`source` when it names a model on the hub (a card's `base_model`), None for a local folder."""
    return None if _is_local(source) or not HUB_ID.fullmatch(source) else source


def seen_from(source: str, folder: Path) -> str:
    """Where the reader of `folder`'s card finds `source`, from the folder that holds `folder`: a hub id
    as it is, a local folder by its relative path from there."""
    if not _is_local(source):
        return source
    try:
        return Path(os.path.relpath(Path(source).resolve(), Path(folder).resolve().parent)).as_posix()
    except ValueError:  # on another drive (Windows): there is no relative path
        return Path(source).name


def encoder_card(folder: Path, source: str, settings: dict[str, Any], tied: bool) -> CardFacts:
    """The card of a dense encoder folder saved from `source`; a tied one is a sentence-transformers
    folder too."""
    name = Path(folder).name
    code = f"from densekit.models import DenseEncoder\n\nencoder = DenseEncoder.load({name!r})"
    usage = [Usage("densekit", code)]
    if tied:
        usage.append(Usage("sentence-transformers", _st_usage(name, settings)))
    towers = "one backbone for queries and passages" if tied else "a query tower and a passage tower"
    tags = [*TAGS, "sentence-transformers", "sentence-similarity", "feature-extraction"] if tied else [*TAGS]
    if settings.get("matryoshka_dims"):
        tags.append("matryoshka")
    summary = f"A dense retrieval encoder ({towers}) saved by densekit."
    if settings.get("variance_ordered"):
        summary += (" Its dimensions are ordered by `densekit rotate` on a corpus's vectors (by their "
                    "variance, or turned further by a ranking fit): its vectors cut to their first N "
                    "(`truncate_dim`) keep the most of them for any N.")  # fmt: skip
    return CardFacts(
        title=name,
        summary=summary,
        library_name="sentence-transformers" if tied else "densekit",
        tags=tags,
        pipeline_tag="sentence-similarity" if tied else "feature-extraction",
        details={"base model": seen_from(source, folder)},
        settings=settings,
        usage=usage,
        hub_base=hub_id(source),
    )


def _st_usage(name: str, settings: dict[str, Any]) -> str:
    code = f"from sentence_transformers import SentenceTransformer\n\nmodel = SentenceTransformer({name!r})\n"
    query = '"query"' if settings.get("query_prefix") else "None"
    code += f'vectors = model.encode(["a question"], prompt_name={query})'
    trained = settings.get("matryoshka_dims")
    if trained:  # Matryoshka: the first N dimensions, normalised again where the model normalises
        normalised = ", normalize_embeddings=True" if settings.get("normalize") else ""
        code += (
            f"\n\n# trained for {', '.join(map(str, trained))} dimensions (Matryoshka): smaller vectors\n"
            f'small = SentenceTransformer("{name}", truncate_dim={trained[-1]})\n'
            f'vectors = small.encode(["a question"], prompt_name={query}{normalised})'
        )
    return code


def module_card(
    folder: Path, spec: dict[str, Any], base: dict[str, str], settings: dict[str, Any]
) -> CardFacts:
    """The card of a module folder of `spec` on `base`; PEFT loads the towers saved in its layout."""
    folder = Path(folder)
    name, source = folder.name, seen_from(base["source"], folder)
    code = "from densekit.models import DenseEncoder\n\n"
    code += f"encoder = DenseEncoder.load({source!r}, module={name!r})"
    usage = [Usage("densekit", code)]
    peft_towers = sorted(p.parent for p in folder.glob("*adapter_config.json")) + sorted(
        p.parent for p in folder.glob("*/adapter_config.json")
    )
    for tower in peft_towers:
        place = tower.relative_to(folder).as_posix()
        target = name if place == "." else f"{name}/{place}"
        usage.append(Usage(
            "PEFT" if place == "." else f"PEFT ({place} tower)",
            "from peft import PeftModel\nfrom transformers import AutoModel\n\n"
            f"model = PeftModel.from_pretrained(AutoModel.from_pretrained({source!r}), {target!r})",
        ))  # fmt: skip
    kind, towers = (markdown_text(str(spec.get(key))) for key in ("type", "towers"))
    return CardFacts(
        title=name,
        summary=f"A {kind} module (towers: {towers}) for a dense retrieval encoder, saved by densekit; it "
        "loads only onto the base it was trained on.",
        library_name="peft" if peft_towers else "densekit",
        tags=[*TAGS, "module", str(spec.get("type")), *(["peft"] if peft_towers else [])],
        pipeline_tag="feature-extraction",
        details={"base model": source, "base weights": base["fingerprint"], "module": str(spec.get("name"))},
        settings={"module": spec, "encoder": settings},
        usage=usage,
        hub_base=hub_id(base["source"]),
    )


def cross_encoder_card(folder: Path, source: str, max_length: int) -> CardFacts:
    """The card of a cross-encoder (reranker) folder, which sentence-transformers' CrossEncoder loads."""
    name = Path(folder).name
    return CardFacts(
        title=name,
        summary="A cross-encoder (reranker) saved by densekit: it scores a query and a passage together.",
        library_name="sentence-transformers",
        tags=[*TAGS, "cross-encoder", "reranker", "text-ranking"],
        pipeline_tag="text-ranking",
        details={"base model": seen_from(source, folder)},
        settings={"max_length": max_length},
        hub_base=hub_id(source),
        usage=[
            Usage(
                "densekit",
                "from densekit.models.cross_encoder import CrossEncoder\n\n"
                f"model = CrossEncoder.load({name!r})",
            ),
            Usage(
                "sentence-transformers",
                f"from sentence_transformers import CrossEncoder\n\nmodel = CrossEncoder({name!r})\n"
                'scores = model.predict([("a question", "a passage")])',
            ),
        ],
    )


def route_card(folder: Path, description: dict[str, Any]) -> CardFacts:
    """The card of a route folder (`densekit-route.json` as `description`): a router among saved modules
    on one base, which densekit loads (with the module folders it names)."""
    name = Path(folder).name
    spec, base = description.get("spec", {}), description.get("base", {})
    modules = description.get("modules", {})
    domains = list(spec.get("domains") or {})[:1]  # a fixed route encodes a query of a domain it routes
    asked = f", domains={domains!r}" if domains else ""
    return CardFacts(
        title=name,
        summary=f"A {markdown_text(str(spec.get('type')))} route among {len(modules)} modules of a dense "
        "retrieval encoder, saved by densekit: each query is encoded by the modules its router picks. It "
        "needs the module folders it names and the base they were trained on.",
        library_name="densekit",
        tags=[*TAGS, "route", str(spec.get("type"))],
        pipeline_tag="feature-extraction",
        details={
            "base model": seen_from(str(base.get("source")), folder),
            "base weights": str(base.get("fingerprint")),
            **{f"module {m}": seen_from(str(v.get("folder")), folder) for m, v in modules.items()},
        },
        settings={"route": spec, "encoder": description.get("settings", {})},
        hub_base=hub_id(str(base.get("source"))),
        usage=[
            Usage(
                "densekit",
                "from densekit.routing.route import Route\n\n"
                f'route = Route.load({name!r})\nvectors = route.encode_queries(["a question"]{asked})',
            )
        ],
    )
