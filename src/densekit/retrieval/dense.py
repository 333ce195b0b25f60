"""Whether an encoder may search an index: same dimension, weights, module, passage settings, corpus."""

from __future__ import annotations

import logging

from densekit.data.dataset import Dataset
from densekit.errors import InputError
from densekit.index.base import SearchIndex
from densekit.models.encoder import OWN, DenseEncoder, ModuleChoice

log = logging.getLogger("densekit")


# Settings that shape passage vectors; the query-side ones may be changed at search time.
_PASSAGE_SETTINGS = ("pooling", "normalize", "passage_max_length", "passage_prefix", "tied", "dimensions")


def check_compatible(
    encoder: DenseEncoder, index: SearchIndex, dataset: Dataset | None = None, module: ModuleChoice = OWN
) -> None:
    """Fail when `encoder` with `module` cannot search `index`: another dimension, or, for a saved
    index, other weights or passage settings than those that made it, or (given `dataset`) another
    corpus."""
    if encoder.dimension != index.dimension:
        cut = f" (--dimensions {encoder.config.dimensions})" if encoder.config.dimensions else ""
        if index.dimension > encoder.width:
            fix = f"more than the {encoder.width} this model makes: it holds another model's vectors"
        elif index.dimension == encoder.width:
            fix = "search it without --dimensions"
        else:
            fix = f"search it with --dimensions {index.dimension}, as its passages were encoded"
        raise InputError(
            f"the encoder makes {encoder.dimension}-dimensional vectors{cut}; {index.folder} holds "
            f"{index.dimension}-dimensional ones: {fix}"
        )
    if index.identity is not None:
        check_passages_made_by(encoder, index.identity["embeddings"], f"{index.folder} was built", dataset,
                               module)  # fmt: skip


def check_passages_made_by(
    encoder: DenseEncoder, made: dict, what: str, dataset: Dataset | None = None, module: ModuleChoice = OWN
) -> None:
    """Fail unless the embeddings whose identity is `made` hold the passages `encoder` makes with
    `module` (by default its own): the same
    weights on the passage side (its module, if any) and passage settings, and (given `dataset`) its
    corpus. `what` begins each message ("runs/index was built")."""
    if made["model"]["weights"] != encoder.passage_fingerprint(module):
        made_with, used = made["model"].get("module"), encoder.passage_module(module)
        if made_with != used:
            raise InputError(
                f"{what} with {_module_words(made_with)}, and this encoder encodes "
                f"passages with {_module_words(used)}; search with the module that made it (--module), or "
                "encode and index the corpus again"
            )
        if used is not None:  # the same module name, other weights: the module's, not the base's
            module = encoder.attached[used]
            where = f"loaded from {module.folder}" if module.folder is not None else "made in this process"
            raise InputError(
                f"{what} with a module {used!r} of other weights than the module {used!r} on this encoder "
                f"({where}); search with the module folder that made it, or encode and index the corpus again"
            )
        raise InputError(
            f"{what} from the embeddings of other model weights than {encoder.source}'s; "
            "search it with the model that made it, or encode and index the corpus again"
        )
    saved = made["model"]["settings"]
    changed = [f"{k} {saved.get(k)!r} there, {getattr(encoder.config, k)!r} here"
               for k in _PASSAGE_SETTINGS if saved.get(k) != getattr(encoder.config, k)]  # fmt: skip
    if changed:
        raise InputError(
            f"{what} from passages encoded with other settings ({'; '.join(changed)}); "
            "use the same settings or encode the corpus again"
        )
    if dataset is not None and made["corpus"] != dataset.corpus_digest():
        raise InputError(
            f"{what} from another corpus than {dataset.corpus_path} (its bytes differ); "
            "index this corpus, or search the collection the index was made from"
        )


def _module_words(name: str | None) -> str:
    return "the base model alone (no module, or a query-only one)" if name is None else f"module {name!r}"
