"""Collections known by name, read through the libraries made for them: `ir_datasets` and Hugging Face
`datasets` (the BEIR and MTEB layouts).

Each reader gives a `Source`: what names its version (compared before a cached copy is reused), what
is recorded about it, and its documents, queries and judgements as plain tuples, read lazily (a
library may download its files only when they are first read). The libraries are optional (`pip
install 'densekit[data]'`) and imported only here, when a name is used.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import importlib.util
import json
import logging
import os
import socket
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from densekit.data import hf_local
from densekit.errors import DensekitError, StateError
from densekit.io.fingerprint import digest_of

IRDS, HF = "irds", "hf"
# The splits an ir_datasets id may end in; any other id's judgements are its `test` split.
_IRDS_SPLITS = ("train", "dev", "test", "validation")
_DEFAULT_SPLIT = "test"
_HF_QRELS_CONFIGS = ("default", "qrels")  # MTEB's config name for the judgements, and another in use
_BATCH = 1000
_SHOWN = 100  # the characters of a name a message shows
_PROBE_SECONDS = 3.0

Documents = Callable[[], Iterable[tuple[str, str, str]]]  # (id, title, text)
Queries = Callable[[], Iterable[tuple[str, str]]]  # (id, text)
Judgements = Callable[[], Iterable[tuple[str, str, int]]]  # (query id, document id, relevance)


class NamedCollectionError(DensekitError, ValueError):
    """A named collection that is not what densekit can read: no such id, another layout, other columns,
    judgements that are not whole numbers."""


@dataclass
class Source:
    """A named collection as a library reads it."""

    name: str
    library: str
    identity: dict[str, Any]
    about: dict[str, Any]
    documents: Documents
    queries: Queries
    judgements: dict[str, Judgements] = field(default_factory=dict)
    quiet: bool = False  # the library logs its retries itself: keep them off the console


def _library(module: str, name: str) -> Any:
    """Import an optional library, or say in one line which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        extra = "pip install 'densekit[data]'"
        raise StateError(f"{name}: reading it needs the {module} package: {extra}") from None


def shown(name: str) -> str:
    """`name` as messages show it: whole when short, else its start and its length."""
    return name if len(name) <= _SHOWN else f"{name[:_SHOWN]}... ({len(name)} characters)"


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "unknown"


# ir_datasets ----------------------------------------------------------------------------------------


def irds_split(dataset_id: str) -> str:
    """The split an ir_datasets id's judgements are written as: its last part when that names a split
    (`beir/nfcorpus/test`), otherwise `test`."""
    last = dataset_id.rsplit("/", 1)[-1]
    return last if "/" in dataset_id and last in _IRDS_SPLITS else _DEFAULT_SPLIT


def irds_identity(dataset_id: str) -> dict[str, Any]:
    """What names an ir_datasets collection's version without importing the library (which registers
    every dataset it knows): the id, and a digest of the downloads (addresses and MD5 sums) ir_datasets
    records for the id's family."""
    spec = importlib.util.find_spec("ir_datasets")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    if not folders:
        _library("ir_datasets", f"irds:{dataset_id}")  # says which extra brings it
    recorded = Path(folders[0]) / "etc" / "downloads.json" if folders else Path()
    family = dataset_id.split("/", 1)[0]
    downloads = json.loads(recorded.read_text(encoding="utf-8")).get(family, {}) if recorded.is_file() else {}
    digest = digest_of({"downloads": json.dumps(downloads, sort_keys=True)})
    return {"source": f"irds:{dataset_id}", "library": "ir_datasets", "downloads": digest}


def irds_source(dataset_id: str) -> Source:
    """The ir_datasets collection `dataset_id`; an unknown id, or one without documents or queries, is
    refused in one line."""
    name = shown(f"irds:{dataset_id}")
    irds = _library("ir_datasets", name)
    try:
        dataset = irds.load(dataset_id)
    except KeyError:
        raise NamedCollectionError(
            f"{name}: ir_datasets {_version('ir_datasets')} knows no dataset of that id (its ids are listed "
            "at https://ir-datasets.com)"
        ) from None
    lacking = [what for what, has in (("documents", dataset.has_docs()), ("queries", dataset.has_queries()))
               if not has]  # fmt: skip
    if lacking:
        raise NamedCollectionError(f"{name}: it has no {' and no '.join(lacking)}; name a dataset with both")
    judgements: dict[str, Judgements] = {}
    if dataset.has_qrels():
        judgements[irds_split(dataset_id)] = lambda: (
            (q.query_id, q.doc_id, int(q.relevance)) for q in dataset.qrels_iter()
        )
    about = {"library_version": _version("ir_datasets"), "home": str(irds.util.home_path())}
    return Source(name, "ir_datasets", irds_identity(dataset_id), about,
                  lambda: (_irds_document(d) for d in dataset.docs_iter()),
                  lambda: ((q.query_id, _irds_text(q)) for q in dataset.queries_iter()),
                  judgements, quiet=True)  # fmt: skip


def _irds_text(record: Any) -> str:
    """A record's `text` field where it has one, else the text ir_datasets builds from its fields."""
    text = getattr(record, "text", None)
    return text if isinstance(text, str) else record.default_text()


def _irds_document(doc: Any) -> tuple[str, str, str]:
    title = getattr(doc, "title", "")
    return doc.doc_id, title if isinstance(title, str) else "", _irds_text(doc)


def explain_irds_failure(name: str, err: Exception) -> str:
    """One line for an ir_datasets failure while reading: a download that could not be made (all its
    sources failed, or the network could not be reached) says so and where the files would be read
    from instead."""
    if (err.args and err.args[0] == "All download sources failed") or _network_failure(err):
        import ir_datasets

        return (f"{name}: ir_datasets could not download its files (no network?); put them under "
                f"IR_DATASETS_HOME ({ir_datasets.util.home_path()}) as docs/data.md says, or run where the "
                "network is reachable")  # fmt: skip
    return f"{name}: ir_datasets could not read it: {_first_line(err)}"


def _network_failure(err: BaseException) -> bool:
    """True when `err`, or an error it was raised from, is a connection that could not be made."""
    import requests  # ir_datasets downloads with it

    network = (ConnectionError, TimeoutError, socket.gaierror, requests.ConnectionError, requests.Timeout)
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        if isinstance(current, network):
            return True
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return False


# Hugging Face datasets --------------------------------------------------------------------------------


def split_revision(reference: str) -> tuple[str, str | None]:
    """`repo@revision` as its two parts; a local folder (which may hold an `@`) has no revision. Nothing
    before the `@` is refused (it would read the working folder)."""
    if os.path.isdir(os.path.expanduser(reference)) or "@" not in reference:  # False for a too long name
        return reference, None
    repo, revision = reference.rsplit("@", 1)
    if not repo:
        raise NamedCollectionError(f"{shown(f'hf:{reference}')}: no dataset is named before the '@'")
    return repo, revision or None


def _local(path: str) -> Path | None:
    folder = Path(path).expanduser()
    return folder.resolve() if os.path.isdir(folder) else None


def hf_identity(reference: str) -> dict[str, Any]:
    """What names a Hugging Face dataset's version: the name and revision asked for (`main` unless
    pinned), and for a local folder a digest of its files and of its `-qrels` sibling's, made once
    each is known to be a dataset whose files are its own (`hf_local`)."""
    repo, revision = split_revision(reference)
    identity: dict[str, Any] = {"source": f"hf:{reference}", "library": "datasets"}
    local = _local(repo)
    if local is None:
        return identity | {"revision": revision or "main"}
    name = shown(f"hf:{reference}")
    hf_local.check_dataset_folder(name, local)
    sibling = local.with_name(f"{local.name}-qrels")
    if sibling.is_dir():
        hf_local.check_dataset_folder(f"{name} (its judgements, {sibling.name})", sibling, needed=())
    files = {f"{local.name}/{k}": v for k, v in hf_local.folder_digests(local).items()}
    if sibling.is_dir():
        files |= {f"{sibling.name}/{k}": v for k, v in hf_local.folder_digests(sibling).items()}
    return identity | {"files": digest_of(files)}


def hf_source(reference: str) -> Source:
    """The Hugging Face dataset `reference` (a hub id, `id@revision`, or a local folder) in the BEIR
    layout (configs `corpus` and `queries`, judgements in the `<id>-qrels` dataset) or MTEB's (the
    judgements in its `default` config)."""
    name = shown(f"hf:{reference}")
    if _local(split_revision(reference)[0]) is None and not _offline():
        _check_hub_reachable(name)  # before importing datasets, which takes seconds
    datasets = _library("datasets", name)
    with _bars_on_a_terminal_only(datasets):
        return _hf_source(datasets, name, reference)


@contextlib.contextmanager
def _bars_on_a_terminal_only(datasets: Any) -> Iterator[None]:
    """No `datasets` progress bars while it loads, unless standard error is a terminal: a bar redrawn as
    lines would flood a log. Their state is put back after."""
    was_off = datasets.is_progress_bar_enabled() is False
    if not sys.stderr.isatty():
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()


def _hf_source(datasets: Any, name: str, reference: str) -> Source:
    repo, revision = split_revision(reference)
    local = _local(repo)
    path = str(local) if local is not None else repo
    call = functools.partial(_hf_call, name, local=local is not None)
    configs = call(lambda: datasets.get_dataset_config_names(path, revision=revision))
    missing = [c for c in ("corpus", "queries") if c not in configs]
    if missing:
        raise NamedCollectionError(
            f"{name}: not in the BEIR or MTEB layout: it has no {' or '.join(missing)} config "
            f"(its configs: {', '.join(configs) or 'none'})"
        )
    qrels_config = next((c for c in _HF_QRELS_CONFIGS if c in configs), None)
    qrels_path, qrels_name = (path, qrels_config) if qrels_config else (f"{path}-qrels", None)

    # datasets keys its own cache of a local folder by the configs' file patterns, not the files' content,
    # so an edited folder would come back as it was: a local folder is read afresh (it is only read when
    # its content changed, or there is no copy yet), and without checking its splits' sizes against
    # those datasets recorded of the folder's earlier content (another number of rows is refused)
    fresh = {"download_mode": "force_redownload", "verification_mode": "no_checks"}
    fresh = fresh if local is not None else {}

    def load(where: str, config: str | None, **options: Any) -> Any:
        options |= fresh
        return call(lambda: datasets.load_dataset(where, config, revision=revision, **options))

    corpus, queries = load(path, "corpus"), load(path, "queries")
    # BeIR's `-qrels` datasets are TSV files, whose column types datasets guesses: ids that look like
    # numbers ("01") would lose their form, so the ids are read as the strings they are
    typed = {} if qrels_config else {"features": datasets.Features(
        {"query-id": datasets.Value("string"), "corpus-id": datasets.Value("string"),
         "score": datasets.Value("float64")})}  # fmt: skip
    try:
        qrels = load(qrels_path, qrels_name, **typed)
    except OSError as err:
        where = "" if qrels_config else f" (a BEIR-layout dataset's judgements are read from {qrels_path})"
        raise OSError(f"{err}{where}") from None
    loaded = {"corpus": corpus, "queries": queries, "qrels": qrels}
    about = {
        "library_version": _version("datasets"),
        "qrels_from": qrels_path + (f" ({qrels_name})" if qrels_name else ""),
        "fingerprints": {f"{k}/{s}": d._fingerprint for k, parts in loaded.items() for s, d in parts.items()},
    }
    judgements = {split: (lambda part=part: _hf_judgements(name, part)) for split, part in qrels.items()}
    documents, query_rows = (lambda: _hf_documents(name, corpus)), (lambda: _hf_queries(name, queries))
    return Source(name, "datasets", hf_identity(reference), about, documents, query_rows, judgements)


def _hf_call(name: str, call: Callable[[], Any], local: bool) -> Any:
    """Run a `datasets` call, turning its failures (unknown name, hub not reachable, offline mode
    without a cached copy, a file it could not write) into one line; offline mode is recalled only
    for a dataset of the hub."""
    try:
        return call()
    except DensekitError:
        raise
    except Exception as err:  # datasets raises errors of its own kinds too (DatasetGenerationError)
        cause = _root_cause(err)
        why = _first_line(err)
        if cause is not err:
            why += f" ({cause.strerror or _first_line(cause)})" if isinstance(cause, OSError) else ""
        if isinstance(cause, OSError) and cause.errno == errno.ENAMETOOLONG:
            why += "; the folder's name makes datasets' cache file names too long: give it a shorter one"
        offline = " (HF_HUB_OFFLINE or HF_DATASETS_OFFLINE is set: only cached copies are read)"
        offline = offline if _offline() and not local else ""
        raise OSError(f"{name}: datasets could not load it: {why}{offline}") from None


def _root_cause(err: BaseException) -> BaseException:
    """The first error of the chain `err` was raised from."""
    seen = {id(err)}
    while err.__cause__ is not None and id(err.__cause__) not in seen:
        err = err.__cause__
        seen.add(id(err))
    return err


def _check_hub_reachable(name: str) -> None:
    """Refuse at once, with the way to read a cached copy, when the hub (or the proxy to it) cannot be
    reached: `huggingface_hub` would retry for about 25 seconds before failing. A connection is tried,
    as the hub's library offers no such check."""
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(endpoint.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        through = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        host, port = through.hostname or host, through.port or 80
    try:
        socket.create_connection((host, port), timeout=_PROBE_SECONDS).close()
    except OSError as err:
        reason = err.strerror or type(err).__name__
        raise NamedCollectionError(
            f"{name}: the Hugging Face hub cannot be reached ({host}:{port}: {reason}); to read the copy "
            "datasets keeps in its cache without asking the hub, set HF_HUB_OFFLINE=1"
        ) from None


def _offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))  # fmt: skip


def _columns(name: str, dataset_dict: Any, needed: Iterable[str], what: str) -> None:
    for split, part in dataset_dict.items():
        absent = [c for c in needed if c not in part.column_names]
        if absent:
            raise NamedCollectionError(
                f"{name}: its {what} ({split}) has no column {', '.join(absent)} "
                f"(its columns: {', '.join(part.column_names)})"
            )


def _hf_documents(name: str, corpus: Any) -> Iterator[tuple[str, str, str]]:
    """Every split's rows of a `corpus` config as (id, title, text); a missing title reads as empty."""
    _columns(name, corpus, ("_id", "text"), "corpus")
    for part in corpus.values():
        titled = "title" in part.column_names
        for batch in part.iter(batch_size=_BATCH):
            titles = batch["title"] if titled else [""] * len(batch["_id"])
            for doc_id, title, text in zip(batch["_id"], titles, batch["text"], strict=True):
                yield str(doc_id), title or "", text or ""


def _hf_queries(name: str, queries: Any) -> Iterator[tuple[str, str]]:
    """Every split's rows of a `queries` config as (id, text)."""
    _columns(name, queries, ("_id", "text"), "queries")
    for part in queries.values():
        for batch in part.iter(batch_size=_BATCH):
            for query_id, text in zip(batch["_id"], batch["text"], strict=True):
                yield str(query_id), text or ""


def _hf_judgements(name: str, part: Any) -> Iterator[tuple[str, str, int]]:
    """One split's judgements; a score that is not a whole number is refused."""
    needed = ("query-id", "corpus-id", "score")
    _columns(name, {"qrels": part}, needed, "judgements")
    for batch in part.iter(batch_size=_BATCH):
        for query, doc, score in zip(*(batch[c] for c in needed), strict=True):
            if float(score) != int(float(score)):
                where = f"{name}: query {query}, document {doc}"
                raise NamedCollectionError(f"{where}: score {score} is not a whole number")
            yield str(query), str(doc), int(float(score))


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]


@contextlib.contextmanager
def quiet_library(source: Source) -> Iterator[None]:
    """Keep a library's own log lines (retries, mirrors tried) off the console while it reads, and
    its progress bars too unless standard error is a terminal; its failure comes back as one line of
    ours."""
    if not source.quiet:
        yield
        return
    logging.disable(logging.WARNING)
    try:
        with contextlib.ExitStack() as stack:
            if not sys.stderr.isatty():  # ir_datasets' bars and the lines it writes past logging
                sink = stack.enter_context(open(os.devnull, "w", encoding="utf-8"))
                stack.enter_context(contextlib.redirect_stderr(sink))
            yield
    finally:
        logging.disable(logging.NOTSET)
