"""Collections by name: `irds:<ir_datasets id>` and `hf:<Hugging Face dataset>` wherever a collection
folder is accepted, materialised once into a cached BEIR folder (docs/data.md).

`resolve_collection` turns a name into that folder and leaves every other path as it is; `Dataset.open`
and the command line call it, so every command and recipe takes a name. The folder is written
atomically under `collections_cache()` with densekit's manifest: its kind, its identity (the name and
what names the source's version: ir_datasets' recorded downloads, a hub revision, a local folder's
content), what it was read with, and its files' checksums. A later use reuses it only when the identity
matches and the files are unchanged (and no file was added); otherwise it is read again. The written
files are checked as any collection's are (ids, texts, judgements of known queries) before the folder
takes its place.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

from densekit.data import named_sources
from densekit.data.jsonl import iter_jsonl_corpus, read_jsonl_queries
from densekit.data.named_sources import HF, IRDS, Source, shown
from densekit.data.trec import check_judged_ids, read_judgements
from densekit.diagnostics import DataError, Diagnostics
from densekit.errors import DensekitError
from densekit.io.artefact import MANIFEST, artefact_dir, read_manifest, verify
from densekit.io.fingerprint import digest_of

log = logging.getLogger("densekit")

KIND = "named collection"
CACHE_VARIABLE = "DENSEKIT_CACHE"
_SCHEMES = (IRDS, HF)
_UNSAFE = re.compile(r"[^A-Za-z0-9.@-]+")
_NAME_CHARACTERS = 100  # a cache folder's name, well under the 255 bytes file systems allow


class CacheError(DensekitError, OSError):
    """densekit's cache of named collections cannot be written."""


def is_named(value: Path | str) -> bool:
    """True when `value` names a collection (`irds:...`, `hf:...`) and is not a path on disk."""
    text = str(value)
    scheme, _, rest = text.partition(":")
    # os.path's tests say False for a name too long to be a path, where Path's raise
    return scheme in _SCHEMES and bool(rest) and not os.path.exists(os.path.expanduser(text))


def collections_cache() -> Path:
    """Where named collections are materialised: `$DENSEKIT_CACHE/collections`, else under
    `$XDG_CACHE_HOME/densekit` or `~/.cache/densekit`."""
    root = os.environ.get(CACHE_VARIABLE)
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = str(Path(base) / "densekit")
    return Path(root).expanduser() / "collections"


def cached_folder(name: str) -> Path:
    """The cache folder of a collection name (readable: `irds/beir_nfcorpus_test`); a local folder's
    name is kept with a digest of its path, so two folders of one name do not share a copy. A long name
    is cut, with a digest of the whole, so the folder's name stays within what file systems allow."""
    scheme, _, reference = name.partition(":")
    local = Path(named_sources.split_revision(reference)[0]).expanduser()
    if scheme == HF and os.path.isdir(local):
        tag = _tag(str(local.resolve()))
        return collections_cache() / "hf-local" / f"{_slug(local.resolve().name)[:_NAME_CHARACTERS]}-{tag}"
    slug = _slug(reference)
    if len(slug) > _NAME_CHARACTERS:
        slug = f"{slug[:_NAME_CHARACTERS]}-{_tag(reference)}"
    return collections_cache() / scheme / slug


def _tag(text: str) -> str:
    return digest_of({"path": text}).split(":")[1][:10]


def _slug(text: str) -> str:
    """`text` as one plain folder name: other characters as `_`, never `.` or `..`."""
    return _UNSAFE.sub("_", text).strip("._") or "_"


def resolve_collection(value: Path | str) -> Path:
    """The collection folder `value` stands for: a name's cached BEIR folder (made now when there is no
    matching one), any other path as it is. A name that cannot be read is refused in one line."""
    if not is_named(value):
        return Path(value)
    name = str(value)
    folder = cached_folder(name)
    identity = _identity(name)
    if _reusable(folder, identity):
        log.debug("%s: reusing %s", shown(name), folder)
        return folder
    _check_writable(folder.parent, shown(name))  # before a library reads (and maybe downloads) it
    _materialise(_open_source(name), folder)
    return folder


def _check_writable(cache: Path, name: str) -> None:
    """Refuse in one line, naming the folder and the variable, a cache densekit cannot write in."""
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=cache).close()
    except OSError as err:
        raise _cache_error(name, cache, err) from None


def _cache_error(name: str, cache: Path, err: OSError) -> CacheError:
    where = os.environ.get(CACHE_VARIABLE)
    now = f"{CACHE_VARIABLE}={where}" if where else f"{CACHE_VARIABLE} is not set"
    return CacheError(
        f"{name}: densekit's cache cannot be written at {cache} ({err.strerror or _first(err)}; {now}): "
        f"set {CACHE_VARIABLE} to a folder densekit can write"
    )


def _first(err: BaseException) -> str:
    return (str(err).strip() or type(err).__name__).splitlines()[0]


def _identity(name: str) -> dict:
    scheme, _, reference = name.partition(":")
    if scheme == IRDS:
        return named_sources.irds_identity(reference)
    return named_sources.hf_identity(reference)


def _open_source(name: str) -> Source:
    scheme, _, reference = name.partition(":")
    if scheme == IRDS:
        return named_sources.irds_source(reference)
    return named_sources.hf_source(reference)


def _reusable(folder: Path, identity: dict) -> bool:
    """True when `folder` is a copy densekit made from this very source and its files are unchanged; a
    damaged or outdated copy is said so and made again."""
    manifest = read_manifest(folder) if folder.is_dir() else None
    if manifest is None or manifest.kind != KIND:
        return False  # absent, or not ours: `artefact_dir` refuses to replace what it did not make
    source = shown(identity["source"])
    if manifest.identity != identity:
        log.info("%s: the cached copy was made from another version of %s; reading it again", folder, source)
        return False
    try:
        verify(folder, manifest)
    except DataError as err:
        log.warning("%s; reading %s again", str(err).splitlines()[0], source)
        return False
    added = _unlisted(folder, manifest.checksums)
    if added:
        log.warning("%s: holds %s, which densekit did not write there (a copy holds only what it wrote); "
                    "reading %s again", folder, ", ".join(added[:5]), source)  # fmt: skip
        return False
    return True


def _unlisted(folder: Path, listed: dict[str, str]) -> list[str]:
    """The files under `folder` its manifest does not list (a split's judgements added by hand would
    otherwise be read as one of the source's)."""
    found = (p.relative_to(folder).as_posix() for p in folder.rglob("*") if not p.is_dir())
    return sorted(name for name in found if name not in listed and name != MANIFEST)


def _materialise(source: Source, folder: Path) -> None:
    """Write `source` as a BEIR folder at `folder`, atomically, checked before it takes the place."""
    log.info("%s: reading it with %s into %s", source.name, source.library, folder)
    counts: dict[str, int] = {}
    try:
        with artefact_dir(folder, KIND, source.identity, source.about) as tmp:
            with named_sources.quiet_library(source):
                counts = _write_beir(source, tmp)
            _check_written(tmp, folder)
    except FileExistsError as err:
        raise OSError(f"{source.name}: {err}; remove it or set {CACHE_VARIABLE} to another folder") from None
    except (DensekitError, ImportError):
        raise
    except Exception as err:  # the library failed while reading (a download, a parse): one line
        if isinstance(err, OSError) and _inside(err.filename, collections_cache()):
            raise _cache_error(source.name, folder.parent, err) from None  # writing the copy failed
        if source.library == "ir_datasets":
            raise OSError(named_sources.explain_irds_failure(source.name, err)) from None
        raise OSError(f"{source.name}: {source.library} could not read it: {named_sources._first_line(err)}"
                      ) from None  # fmt: skip
    log.info("%s: %s", source.name, ", ".join(f"{n:,} {what}" for what, n in counts.items()))


def _inside(filename: object, folder: Path) -> bool:
    """True when an error's file is under `folder`."""
    if not isinstance(filename, str | os.PathLike):
        return False
    return Path(filename).resolve().is_relative_to(folder.resolve())


def _write_beir(source: Source, folder: Path) -> dict[str, int]:
    """Write the corpus, the queries and each split's judgements in BEIR's layout; returns counts."""
    import json

    counts = {"documents": 0, "queries": 0}
    with (folder / "corpus.jsonl").open("w", encoding="utf-8") as out:
        for doc_id, title, text in source.documents():
            out.write(json.dumps({"_id": doc_id, "title": title, "text": text}, ensure_ascii=False) + "\n")
            counts["documents"] += 1
    with (folder / "queries.jsonl").open("w", encoding="utf-8") as out:
        for query_id, text in _once(source.queries()):
            out.write(json.dumps({"_id": query_id, "text": text}, ensure_ascii=False) + "\n")
            counts["queries"] += 1
    (folder / "qrels").mkdir()
    for split, judgements in source.judgements.items():
        with (folder / "qrels" / f"{split}.tsv").open("w", encoding="utf-8") as out:
            out.write("query-id\tcorpus-id\tscore\n")
            written = 0
            for query_id, doc_id, score in _once(judgements()):
                out.write(f"{query_id}\t{doc_id}\t{score}\n")
                written += 1
        counts[f"{split} judgements"] = written
    return counts


def _once(rows: Iterable[tuple]) -> Iterator[tuple]:
    """`rows` without exact repeats (a query listed in two splits of a `queries` config, a judgement
    given twice); rows that repeat an id with other values are kept, for the check to refuse."""
    seen: set[tuple] = set()
    for row in rows:
        if row not in seen:
            seen.add(row)
            yield row


def _check_written(folder: Path, final: Path) -> None:
    """Read the written files back with the readers every command uses: ids present, unique and
    whitespace-free, texts strings, judgements whole numbers of known queries; a judged document the
    corpus lacks is a warning, as it is to a search. Problems name the files as `final` will hold them."""
    try:
        _read_back(folder)
    except DataError as err:
        raise DataError([replace(p, path=final / p.path.relative_to(folder)) for p in err.problems]) from None


def _read_back(folder: Path) -> None:
    diagnostics = Diagnostics()
    doc_ids = {doc.id for doc in iter_jsonl_corpus(folder / "corpus.jsonl", diagnostics)}
    queries = read_jsonl_queries(folder / "queries.jsonl", diagnostics)
    for qrels in sorted((folder / "qrels").glob("*.tsv")):
        judgements = read_judgements(qrels, diagnostics)
        check_judged_ids(qrels, judgements, queries, "query_id", folder / "queries.jsonl", diagnostics)
        unknown = {j.doc_id for j in judgements} - doc_ids
        if unknown:
            log.warning("%s: %d judged document ids are not in the corpus", qrels.name, len(unknown))
