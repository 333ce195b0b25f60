r"""Smaller vectors at the same quality, side by side: float32 flat, int8, binary, binary rescored at
several depths, IVF-PQ at its recall target, and sentence-transformers' `quantize_embeddings` with
`semantic_search_faiss` at the same rescore multipliers, in the same run, on the same vectors.

For each collection (`--collections`: the shared ones under `--shared`, their corpus encoded by
`--model` into `--work/NAME/embeddings` once: `encode_corpus` reuses a folder of the same model and
corpus) or size (`--sizes NAME=FOLDER` with `--embeddings`: a slice of `densekit slice` and an
embedding folder of `densekit encode` holding its passages, taken by id as `wiki_ann` does), the test
queries are encoded once (kept under `--work/queries`, named by the encoder and the texts) and every
method below is built from the same vectors:

- densekit's, built by `build_index` (what `densekit index` runs) into `--work/NAME/<method>` and
  searched with `SearchIndex.search` (what `densekit search` and `serve` run):
  `flat` (`--type flat`, float32), `int8` (`--type int8`, no rescoring), `binary` (`--type binary`,
  Hamming distance alone), `binary + int8 xN` (`--type binary --rescore N`: the top N x k by Hamming
  rescored with the float query against the int8 copy on disk), `binary + float32 xN` (`--rescore N
  --rescore-with float32`), `ivfpq` (`--type ivfpq --target-recall T`, the collection's own vectors
  held out, as `densekit index` does by default; where no setting meets T, the error is recorded and
  the index is built at its defaults); with `--binary-index hnsw ivf`, also `binary hnsw + int8 xN` and
  `binary ivf + int8 xN` (`--type binary --binary-index hnsw --rescore N`: the codes in faiss's
  `IndexBinaryHNSW` or `IndexBinaryIVF` at their defaults, for collections where scanning every code is
  slow; no sentence-transformers counterpart, whose search scans every code), the ivf ones once for
  each of `--nprobe`, with `--nlist` lists where given, once for each kind of `--ivf-centroids`
  (`... int8 centroids + int8 xN`: `--ivf-centroids int8`), and again with `--code-bits` bits a code;
- sentence-transformers' (`sentence_transformers.util.quantization`), as its documentation uses them: the
  corpus quantised by `quantize_embeddings` (`ubinary`; `uint8` with the corpus's ranges, its
  int8 for faiss), added to the faiss index `semantic_search_faiss` builds for that precision
  (`IndexBinaryFlat`; `IndexFlatIP`, which holds the 8-bit codes as float32), and searched with
  `semantic_search_faiss(..., corpus_index=..., rescore_multiplier=N)` (`st ubinary xN`, `st int8 xN`:
  the top N x k rescored with the float query against the codes it holds) or `rescore=False`
  (`st ubinary`, `st int8`).

For each method: the bytes a vector takes in RAM (densekit's, as its index records it: the codes, or
the whole index for flat and IVF-PQ; sentence-transformers', its faiss index's codes) and on disk (the
index's files with any rescoring copy; sentence-transformers' as `faiss.write_index` would save it),
the index's size, the resident memory its loading added, nDCG@10 of the test queries (each method's
own top 10, in its order) and its share of float32 flat's, recall@10 against flat's top 10; and
queries a second on 1 and 2 threads (`--threads`), one query a call and 32 (`--batches`), every method
timed in the same alternating rounds (median of `--rounds`, each about `--seconds` of searching) with
the load average (`os.getloadavg`) before and after each setting: the machine may be shared. densekit's
speed over sentence-transformers' at the same multiplier is the median of the per-round ratios.

Issue 64's goals are reported against, not asserted (`goals`): binary + int8 rescoring keeping >= 0.99
of flat's nDCG@10 with 1/32 of float32's RAM, on every collection (the smallest depth that does);
densekit's binary + rescoring at least as good as sentence-transformers' at the same multiplier and at
least as fast; each method's speed over flat's.

Results go to `--output` (JSON with each run's command and machine; a markdown table and the plot of
quality against RAM a vector beside it), saved after every stage; a stage already measured from the
same inputs is kept, so a killed run resumes. Run from the repository root:

    nice -n 10 .venv/bin/python -m benchmarks.compression \
        --output benchmarks/results/compression_collections.json
    # a wiki1m slice (`densekit slice`) with the whole corpus's vectors (`densekit encode`):
    nice -n 10 .venv/bin/python -m benchmarks.compression --sizes 100k=runs/wiki/data-wiki-100k \
        --embeddings runs/wiki/enc1m --output runs/benchmarks/compression_wiki.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import WORK
from benchmarks.ann_measures import paired_speed, recall_against, with_commands
from benchmarks.wiki_inputs import (
    MODEL,
    Ledger,
    Passages,
    array_digest,
    parse_sizes,
    resident_mib,
    setup_logging,
)

COLLECTIONS = ("scifact", "nfcorpus", "vaswani", "cranfield")
DEPTH = 10
MIB = 2**20
INDEX_FILES = ("index.faiss", "codes.faiss", "rescore.npy")  # an index folder's files searched (not ids)
GOAL_SHARE = 0.99  # issue 64: binary with rescoring keeps >= 0.99 of flat's nDCG@10 at 1/32 of its RAM
GOAL_SPEED = 10  # ... and, at wiki1m's 1M, answers >= 10x flat's queries a second


@dataclass(frozen=True)
class Method:
    """One way of storing and searching the vectors: densekit's index `kind` (flat, int8, binary,
    ivfpq) or sentence-transformers' precision (ubinary, uint8), rescoring `rescore` x k candidates
    (None: not rescored) against `rescore_with` (densekit's copy on disk)."""

    name: str
    library: str
    kind: str
    rescore: int | None = None
    rescore_with: str | None = None
    binary_index: str | None = None
    nprobe: int | None = None
    code_bits: int | None = None
    nlist: int | None = None
    ivf_centroids: str | None = None

    @property
    def folder_name(self) -> str:
        """Its index folder's name under the collection's work folder."""
        return self.name.replace(" + ", "-").replace(" ", "-")

    def spec(self) -> Any:
        """densekit's spec of the index (`densekit index --type ...`)."""
        from densekit.index import IndexSpec, QuantizedSpec

        if self.kind in ("flat", "ivfpq"):
            return IndexSpec(type=self.kind)
        given = {name: getattr(self, name) for name in ("nprobe", "nlist") if getattr(self, name) is not None}
        return QuantizedSpec(type=self.kind, rescore=self.rescore, rescore_with=self.rescore_with,
                             binary_index=self.binary_index, code_bits=self.code_bits,
                             ivf_centroids=self.ivf_centroids, **given)  # fmt: skip

    def command(self, target: float) -> str:
        """The `densekit index` or sentence-transformers call it stands for."""
        if self.library == "sentence-transformers":
            precision = "ubinary" if self.kind == "ubinary" else "uint8"
            rescore = f"rescore_multiplier={self.rescore}" if self.rescore else "rescore=False"
            return f"semantic_search_faiss(corpus_precision={precision!r}, {rescore})"
        options = f"--type {self.kind}"
        if self.binary_index:
            options += f" --binary-index {self.binary_index}"
        if self.nlist is not None:
            options += f" --nlist {self.nlist}"
        if self.nprobe is not None:
            options += f" --nprobe {self.nprobe}"
        if self.code_bits is not None:
            options += f" --code-bits {self.code_bits}"
        if self.ivf_centroids is not None:
            options += f" --ivf-centroids {self.ivf_centroids}"
        if self.kind == "ivfpq":
            options += f" --target-recall {target}"
        if self.rescore:
            options += f" --rescore {self.rescore}"
        if self.rescore_with == "float32":
            options += " --rescore-with float32"
        return f"densekit index {options}"


def methods(multipliers: list[int], skip: list[str], binary_indexes: tuple[str, ...] = (),
            nprobes: tuple[int, ...] = (), code_bits: tuple[int, ...] = (),
            ivf: dict[str, Any] | None = None) -> list[Method]:  # fmt: skip
    """Every method measured, in the table's order, less those named in `skip`; `binary_indexes`
    (hnsw, ivf) adds binary codes in that faiss index, rescored against int8 at each multiplier (a
    binary ivf index once for each of `nprobes`, where given, else at its default, with `ivf`'s
    `nlist` where given, and once for each of its `centroids` kinds, else faiss's binary ones; and once
    more for each of `code_bits`, codes of that many bits)."""
    ivf = ivf or {}
    found = [Method("flat", "densekit", "flat"), Method("int8", "densekit", "int8"),
             Method("binary", "densekit", "binary")]  # fmt: skip
    found += [Method(f"binary + int8 x{m}", "densekit", "binary", m, "int8") for m in multipliers]
    found += [Method(f"binary + float32 x{m}", "densekit", "binary", m, "float32") for m in multipliers]
    for structure in binary_indexes:
        nlist = ivf.get("nlist") if structure == "ivf" else None
        centroids = (ivf.get("centroids") or (None,)) if structure == "ivf" else (None,)
        for kind in centroids:
            for nprobe in (nprobes or (None,)) if structure == "ivf" else (None,):
                label = f"binary {structure}" + ("" if nlist is None else f" nlist {nlist}")
                label += "" if nprobe is None else f" nprobe {nprobe}"
                for bits in (None, *code_bits):
                    named = label + ("" if bits is None else f" {bits} bits")
                    named += " int8 centroids" if kind == "int8" else ""
                    found += [Method(f"{named} + int8 x{m}", "densekit", "binary", m, "int8", structure,
                                     nprobe, bits, nlist, kind) for m in multipliers]  # fmt: skip
    found.append(Method("ivfpq", "densekit", "ivfpq"))
    for kind, label in (("ubinary", "st ubinary"), ("uint8", "st int8")):
        found.append(Method(label, "sentence-transformers", kind))
        found += [Method(f"{label} x{m}", "sentence-transformers", kind, m) for m in multipliers]
    return [method for method in found if method.name not in skip]


class STIndex:
    """sentence-transformers' quantised corpus in the faiss index `semantic_search_faiss` builds for its
    precision, searched through `semantic_search_faiss` as its documentation does."""

    def __init__(self, method: Method, vectors: np.ndarray):
        import faiss
        from sentence_transformers.util.quantization import quantize_embeddings

        self.method = method
        self.ranges = None
        if method.kind == "uint8":  # the corpus's ranges, as densekit calibrates
            self.ranges = np.vstack([vectors.min(axis=0), vectors.max(axis=0)])
            codes = quantize_embeddings(vectors, precision="uint8", ranges=self.ranges)
            self.index = faiss.IndexFlatIP(vectors.shape[1])  # as semantic_search_faiss makes it
        else:
            codes = quantize_embeddings(vectors, precision="ubinary")
            self.index = faiss.IndexBinaryFlat(codes.shape[1] * 8)
        self.index.add(codes)

    def search(self, queries: np.ndarray, k: int = DEPTH) -> list[list[dict]]:
        """`semantic_search_faiss`'s results: per query, its top `k` as `{"corpus_id", "score"}`."""
        from sentence_transformers.util.quantization import semantic_search_faiss

        rescore = self.method.rescore
        results, _ = semantic_search_faiss(
            queries, corpus_index=self.index, top_k=k, ranges=self.ranges, rescore=rescore is not None,
            rescore_multiplier=rescore or 1, corpus_precision=self.method.kind,
        )  # fmt: skip
        return results

    def labels(self, queries: np.ndarray, k: int = DEPTH) -> np.ndarray:
        """The rows of each query's top `k`, best first (-1 for none)."""
        found = np.full((len(queries), k), -1, dtype=np.int64)
        for row, hits in enumerate(self.search(queries, k)):
            found[row, : len(hits)] = [hit["corpus_id"] for hit in hits]
        return found

    def memory(self) -> dict[str, Any]:
        """Its faiss index's codes in RAM, and what `faiss.write_index` would write."""
        import faiss

        rows = int(self.index.ntotal)
        serialize = faiss.serialize_index_binary if self.method.kind == "ubinary" else faiss.serialize_index
        ram, disk = rows * int(self.index.code_size), len(serialize(self.index))
        return {"ram_bytes": ram, "disk_bytes": disk, "ram_bytes_per_vector": ram / rows,
                "disk_bytes_per_vector": disk / rows}  # fmt: skip


def run_of(labels: np.ndarray, query_ids: list[str], doc_ids: list[str]) -> dict[str, dict[str, float]]:
    """Each query's documents in the order a method ranked them (scored by rank, so that ties in its
    own scores, Hamming distances among them, keep its order)."""
    return {query: {doc_ids[row]: float(DEPTH - rank) for rank, row in enumerate(found) if row >= 0}
            for query, found in zip(query_ids, labels, strict=True)}  # fmt: skip


class Target:
    """One collection or size: its vectors, test queries and judgements, and every method's stages."""

    def __init__(self, name: str, folder: Path, store: Any, passages: Passages, args: argparse.Namespace,
                 ledger: Ledger):  # fmt: skip
        from densekit.data.dataset import Dataset

        self.name, self.args, self.ledger, self.store = name, args, ledger, store
        dataset = Dataset.open(folder)
        self.work = args.work / name
        self.test_ids, self.test = passages.queries(dataset, "test")
        _, self.qrels = dataset.split_queries("test")
        self.doc_ids = store.ids()
        self.base = {
            "collection": dataset.fingerprint(),
            **passages.identity(),
            "test": array_digest(self.test),
        }
        self.results = ledger.data.setdefault("collections", {}).setdefault(name, {})
        self.results["collection"] = {
            "folder": str(folder), "documents": len(store), "dimension": store.dimension,
            "test_queries": len(self.test_ids),
        }  # fmt: skip
        self.exact_file = self.work / "exact-test.npy"  # flat's top 10, the reference of recall
        self.loaded: dict[str, Any] = {}
        self._vectors: np.ndarray | None = None

    @property
    def vectors(self) -> np.ndarray:
        """The corpus's vectors as one float32 array (sentence-transformers quantises them whole)."""
        if self._vectors is None:
            self._vectors = np.ascontiguousarray(self.store.vectors(), dtype=np.float32)
        return self._vectors

    def stage(self, entry: str, stage: str, inputs: dict, measure: Any, **kept: Any) -> dict:
        """A stage of one method's measurement."""
        return self.ledger.stage(("collections", self.name, entry, stage), inputs, measure, **kept)

    def run(self, chosen: list[Method]) -> None:
        """Every method's build and quality (flat first: the others are measured against it), then
        every method's speed in the same rounds."""
        from densekit.io.artefact import is_artefact

        made = {}
        for method in chosen:
            folder = self.work / method.folder_name
            inputs = {**self.base, "method": method.name, "target": self.args.target_recall}
            if method.library == "densekit":
                built = self.stage(method.name, "build", inputs, lambda m=method, f=folder: self.build(m, f),
                                   present=lambda f=folder: is_artefact(f, "index"))  # fmt: skip
            else:
                built = self.stage(method.name, "build", inputs, lambda m=method: self.build_st(m))
            made[method.name] = built["made_from"]
            quality_inputs = {"build": built["made_from"]}
            if method.name == "flat":
                self.stage(method.name, "quality", quality_inputs, lambda m=method: self.quality(m),
                           present=self.exact_file.is_file)  # fmt: skip
            else:
                quality_inputs["flat"] = self.results["flat"]["quality"]["made_from"]
                self.stage(method.name, "quality", quality_inputs, lambda m=method: self.quality(m))
        timing = {"methods": made, "threads": self.args.threads, "batches": self.args.batches,
                  "seconds": self.args.seconds, "rounds": self.args.rounds}  # fmt: skip
        self.ledger.stage(("collections", self.name, "speed"), timing, lambda: self.speed(chosen))
        self.loaded.clear()

    def index_of(self, method: Method) -> Any:
        """The method's loaded index (densekit's from its folder, sentence-transformers' built in
        memory), kept for the speed stage; the resident memory loading it added is recorded."""
        if method.name not in self.loaded:
            before = resident_mib()
            if method.library == "densekit":
                from densekit.index import SearchIndex

                index = SearchIndex.load(self.work / method.folder_name)
            else:
                index = STIndex(method, self.vectors)
            self.loaded[method.name] = (index, round(resident_mib() - before, 2))
        return self.loaded[method.name][0]

    def build(self, method: Method, folder: Path) -> dict:
        """densekit's index of the method, built as `densekit index` builds it (recall measured against
        exact search on 1,000 of the collection's own vectors; IVF-PQ meeting its target there)."""
        import json

        from densekit.index import build_index
        from densekit.index.memory import index_bytes
        from densekit.index.recall import RecallSettings, TargetUnreachable
        from densekit.io.artefact import read_manifest

        target = self.args.target_recall if method.kind == "ivfpq" else None
        start, error = time.perf_counter(), None
        try:
            build_index(self.store, method.spec(), folder, show_progress=False,
                        recall=RecallSettings(target=target), overwrite=True)  # fmt: skip
        except TargetUnreachable as err:  # recorded; built at its defaults
            error = str(err)
            build_index(self.store, method.spec(), folder, show_progress=False, recall=RecallSettings(),
                        overwrite=True)  # fmt: skip
        except ValueError as err:  # a collection too small for the index (IVF-PQ's training)
            return {"skipped": str(err)}
        seconds = time.perf_counter() - start
        about = read_manifest(folder).about  # type: ignore[union-attr]
        saved = json.loads((folder / "index.json").read_text(encoding="utf-8"))
        rows, disk = (
            len(self.store),
            sum((folder / n).stat().st_size for n in INDEX_FILES if (folder / n).exists()),
        )
        if "memory" in about:
            ram = about["memory"]["ram_bytes"]
        else:
            from densekit.index import IndexSpec

            ram = index_bytes(IndexSpec(**saved["spec"]), rows, self.store.dimension)
        recall = {key: value for key, value in (about.get("recall") or {}).items() if key != "rows"}
        return {
            "command": method.command(self.args.target_recall), "spec": saved["spec"],
            "build_s": round(seconds, 2), "at_build": recall, "target_error": error,
            "memory": {"ram_bytes": ram, "disk_bytes": disk, "ram_bytes_per_vector": ram / rows,
                       "disk_bytes_per_vector": disk / rows},
        }  # fmt: skip

    def build_st(self, method: Method) -> dict:
        """sentence-transformers' index of the method (built in memory: it has no folder of its own),
        its seconds and its bytes."""
        self.loaded.pop(method.name, None)
        start = time.perf_counter()
        index = self.index_of(method)
        return {"command": method.command(self.args.target_recall),
                "build_s": round(time.perf_counter() - start, 2), "memory": index.memory()}  # fmt: skip

    def labels(self, method: Method) -> np.ndarray:
        """The method's top 10 rows for each test query."""
        index = self.index_of(method)
        if method.library == "densekit":
            return index.search(self.test, DEPTH).labels
        return index.labels(self.test, DEPTH)

    def quality(self, method: Method) -> dict:
        """nDCG@10 of the test queries and recall@10 against flat's top 10 (flat's saved as the
        reference)."""
        from benchmarks.wiki_inputs import write_array
        from densekit.evaluation.measures import evaluate

        if "skipped" in self.results[method.name]["build"]:
            return {"skipped": self.results[method.name]["build"]["skipped"]}
        found = self.labels(method)
        if method.name == "flat":
            write_array(self.exact_file, found)
        run = run_of(found, self.test_ids, self.doc_ids)
        return {"nDCG@10": evaluate(self.qrels, run, ["nDCG@10"])["nDCG@10"],
                "recall@10": recall_against(found, np.load(self.exact_file)),
                "load_rss_mib": self.loaded[method.name][1]}  # fmt: skip

    def speed(self, chosen: list[Method]) -> dict:
        """Queries a second of every method at each number of threads and queries a call, all in the
        same alternating rounds, with the load average before and after each setting."""
        searches = {}
        for method in chosen:
            if "skipped" in self.results[method.name]["build"]:
                continue
            index = self.index_of(method)
            searches[method.name] = lambda q, i=index: i.search(q, DEPTH)
        result = {}
        for threads in self.args.threads:
            for batch in self.args.batches:
                before = os.getloadavg()
                measured = paired_speed(
                    searches, self.test, batch, threads, self.args.seconds, self.args.rounds
                )
                after = os.getloadavg()
                measured["load_average_before"] = [round(v, 2) for v in before]
                measured["load_average_after"] = [round(v, 2) for v in after]
                result[setting_name(threads, batch)] = measured
        return result


def setting_name(threads: int, batch: int) -> str:
    """A speed setting's key in the results."""
    return f"{threads} thread{'s' if threads > 1 else ''}, {batch} a call"


def entries(target: dict) -> dict[str, dict]:
    """A collection's methods' results, by name, in order."""
    return {name: result for name, result in target.items() if isinstance(result, dict) and "build" in result}


def settings(target: dict) -> dict[str, dict]:
    """A collection's speed measurements, by setting."""
    speed = target.get("speed", {})
    return {name: value for name, value in speed.items() if isinstance(value, dict) and "rounds" in value}


def ratio(measured: dict, first: str, second: str) -> float | None:
    """The median of `first`'s per-round speed over `second`'s (None where either was not timed)."""
    rounds = measured["rounds"]
    if first not in rounds or second not in rounds:
        return None
    return round(statistics.median(a / b for a, b in zip(rounds[first], rounds[second], strict=True)), 3)


def rivals(names: list[str]) -> dict[str, str]:
    """Each densekit method's sentence-transformers counterpart at the same rescore multiplier: binary
    (rescored against int8 or float32) against `st ubinary`, int8 against `st int8`; binary codes in an
    HNSW or IVF index have none (sentence-transformers' search scans every code)."""
    pairs = {}
    for name in names:
        if name.startswith(("st ", "binary hnsw", "binary ivf")):
            continue
        depth = name.rsplit(" x", 1)[1] if " x" in name else None
        if name.startswith("binary"):
            rival = "st ubinary" + (f" x{depth}" if depth else "")
        elif name == "int8":
            rival = "st int8"
        else:
            continue
        if rival in names:
            pairs[name] = rival
    return pairs


def derive(target: dict) -> None:
    """Add each method's share of flat's nDCG@10, its speed over flat's and over its
    sentence-transformers counterpart's, and the goals, to a collection's results."""
    found = entries(target)
    flat = found.get("flat", {}).get("quality", {}).get("nDCG@10")
    speeds = settings(target)
    pairs = rivals(list(found))
    for name, result in found.items():
        quality = result.get("quality", {})
        if flat and "nDCG@10" in quality:
            quality["share_of_flat"] = quality["nDCG@10"] / flat
        result["speed"] = {}
        for setting, measured in speeds.items():
            speed = {"qps": measured.get(f"{name}_qps"), "x_flat": ratio(measured, name, "flat")}
            if name in pairs:
                speed["x_rival"] = ratio(measured, name, pairs[name])
            result["speed"][setting] = speed
    target["goals"] = goals(target)


def goals(target: dict) -> dict[str, Any]:
    """Issue 64's goals for one collection: which binary + int8 depths keep >= 0.99 of flat's nDCG@10
    with 1/32 of float32's RAM, and densekit against sentence-transformers at each multiplier."""
    found = entries(target)
    if "flat" not in found or "quality" not in found["flat"]:
        return {}
    float32 = 4 * target["collection"]["dimension"]
    depths = {}
    for name, result in found.items():
        if name.startswith("binary + int8 x") and "share_of_flat" in result.get("quality", {}):
            ram = result["build"]["memory"]["ram_bytes_per_vector"]
            depths[int(name.rsplit("x", 1)[1])] = {
                "share_of_flat": round(result["quality"]["share_of_flat"], 4),
                "ram_fraction_of_float32": round(ram / float32, 5),
                "met": result["quality"]["share_of_flat"] >= GOAL_SHARE and ram <= float32 / 32,
            }
    met = sorted(depth for depth, value in depths.items() if value["met"])
    against = {}
    for name, rival in rivals(list(found)).items():
        ours, theirs = found[name].get("quality", {}), found[rival].get("quality", {})
        if "nDCG@10" not in ours or "nDCG@10" not in theirs:
            continue
        speeds = {setting: value.get("x_rival") for setting, value in found[name].get("speed", {}).items()}
        against[name] = {
            "rival": rival, "nDCG@10": round(ours["nDCG@10"], 4),
            "rival_nDCG@10": round(theirs["nDCG@10"], 4), "as_good": ours["nDCG@10"] >= theirs["nDCG@10"],
            "speed_over_rival": speeds,
            "as_fast_at": [setting for setting, x in speeds.items() if x is not None and x >= 1],
        }  # fmt: skip
    return {"binary_int8_rescoring_0.99": {"depths": depths, "smallest_met": met[0] if met else None},
            "against_sentence_transformers": against,
            "binary_share_ram_speed": every_goal(target)}  # fmt: skip


def every_goal(target: dict) -> dict[str, dict]:
    """Each of densekit's binary methods with rescoring (any index of the codes): its share of flat's
    nDCG@10, its RAM as a fraction of float32's, its least speed over flat's in the settings timed, and
    whether it meets all three goals (>= GOAL_SHARE, <= 1/32, >= GOAL_SPEED x in every setting)."""
    float32 = 4 * target["collection"]["dimension"]
    found = {}
    for name, result in entries(target).items():
        share = result.get("quality", {}).get("share_of_flat")
        if not name.startswith("binary") or " + int8 x" not in name or share is None:
            continue
        ram = result["build"]["memory"]["ram_bytes_per_vector"]
        speeds = [value.get("x_flat") for value in result.get("speed", {}).values()]
        least = min(speeds) if speeds and None not in speeds else None
        found[name] = {
            "share_of_flat": round(share, 4), "ram_bytes_per_vector": round(ram, 2),
            "ram_fraction_of_float32": round(ram / float32, 5), "least_x_flat": least,
            "met": share >= GOAL_SHARE and ram <= float32 / 32 and least is not None and least >= GOAL_SPEED,
        }  # fmt: skip
    return found


def table(results: dict) -> str:
    """The results as markdown: a table per collection, the goals, and the commands."""
    lines: list[str] = []
    for name, target in results.get("collections", {}).items():
        about = target["collection"]
        lines += [f"### {name}: {about['documents']:,} documents x {about['dimension']}, "
                  f"{about['test_queries']} test queries", ""]  # fmt: skip
        speeds = list(settings(target))
        heading = ["method", "RAM B/vector", "disk B/vector", "RAM MiB", "disk MiB", "nDCG@10",
                   "share of flat", "recall@10", *(f"q/s {s}" for s in speeds)]  # fmt: skip
        lines += ["| " + " | ".join(heading) + " |", "|" + "---|" * len(heading)]
        for method, result in entries(target).items():
            build, quality = result["build"], result.get("quality", {})
            if "skipped" in build:
                lines.append(f"| {method} | skipped: {build['skipped']} |" + " |" * (len(heading) - 2))
                continue
            memory, nan = build["memory"], float("nan")
            cells = [method + (" (target not met)" if build.get("target_error") else ""),
                     f"{memory['ram_bytes_per_vector']:,.0f}", f"{memory['disk_bytes_per_vector']:,.0f}",
                     f"{memory['ram_bytes'] / MIB:.2f}", f"{memory['disk_bytes'] / MIB:.2f}",
                     f"{quality.get('nDCG@10', nan):.4f}", f"{quality.get('share_of_flat', nan):.3f}",
                     f"{quality.get('recall@10', nan):.4f}"]  # fmt: skip
            for setting in speeds:
                speed = result.get("speed", {}).get(setting, {})
                rival = f"; {speed['x_rival']:.2f}x st" if speed.get("x_rival") is not None else ""
                cells.append(
                    f"{speed['qps']:,.0f} ({speed['x_flat']:.2f}x flat{rival})" if speed.get("qps") else ""
                )
            lines.append("| " + " | ".join(cells) + " |")
        loads = [f"{s}: {v['load_average_before'][0]:.2f} / {v['load_average_after'][0]:.2f}"
                 for s, v in settings(target).items()]  # fmt: skip
        if loads:
            lines += ["", "Load average (1 min) before / after each speed setting: " + "; ".join(loads) + "."]
        goal = target.get("goals", {}).get("binary_int8_rescoring_0.99")
        if goal and goal["depths"]:  # the flat scan of the codes measured
            smallest = goal["smallest_met"]
            verdict = f"met from x{smallest}." if smallest else "not met at any depth measured."
            lines += ["", f"Goal (binary + int8 rescoring >= {GOAL_SHARE} of flat's nDCG@10 at 1/32 of its "
                          f"RAM): {verdict}"]  # fmt: skip
        every = target.get("goals", {}).get("binary_share_ram_speed", {})
        if any(value["least_x_flat"] is not None for value in every.values()):
            met = [f"`{name}`" for name, value in every.items() if value["met"]]
            lines += ["", f"All three (>= {GOAL_SHARE} of flat's nDCG@10, <= 1/32 of its RAM, "
                          f">= {GOAL_SPEED}x its queries a second in every setting): "
                          f"{', '.join(met) or 'none'}."]  # fmt: skip
        lines.append("")
    return with_commands(lines, results)


MARKERS = {
    "flat": ("o", "black"), "int8": ("s", "tab:blue"), "binary": ("v", "tab:orange"),
    "binary + int8": ("^", "tab:green"), "binary + float32": ("D", "tab:olive"), "ivfpq": ("*", "tab:purple"),
    "st ubinary": ("x", "tab:red"), "st int8": ("+", "tab:brown"),
    "binary hnsw + int8": ("P", "tab:cyan"), "binary ivf + int8": ("X", "tab:pink"),
}  # fmt: skip


# where several families hold the same bytes a vector, each drawn a little aside (a factor of its bytes)
OFFSETS = {"binary + int8": 0.9, "st ubinary": 1.1, "st int8": 1.1, "int8": 1.0}


def family(name: str) -> str:
    """A method's family: its name without the rescore multiplier."""
    return name.rsplit(" x", 1)[0] if " x" in name else name


def plot(results: dict, output: Path) -> None:
    """Per collection, nDCG@10 as a share of flat's against RAM bytes a vector (log scale): a marker per
    method, each family's depths joined and labelled with their multiplier."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = {name: t for name, t in results.get("collections", {}).items() if "goals" in t}
    if not targets:
        return
    columns = min(2, len(targets))
    rows = -(-len(targets) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(7 * columns, 5 * rows), squeeze=False)
    for axis, (name, target) in zip(axes.flat, targets.items(), strict=False):
        groups: dict[str, list[tuple[float, float, str]]] = {}
        for method, result in entries(target).items():
            share = result.get("quality", {}).get("share_of_flat")
            if share is None or "memory" not in result["build"]:
                continue
            depth = method.rsplit(" x", 1)[1] if " x" in method else ""
            ram = result["build"]["memory"]["ram_bytes_per_vector"]
            groups.setdefault(family(method), []).append((ram, share, depth))
        for group, points in groups.items():
            marker, colour = MARKERS.get(group, ("o", None))
            offset = OFFSETS.get(group, 1.0)  # side by side where several hold the same bytes
            axis.plot([p[0] * offset for p in points], [p[1] for p in points], marker=marker, color=colour,
                      linestyle="-" if len(points) > 1 else "", label=group, markersize=8)  # fmt: skip
            left = offset < 1
            for ram, share, depth in points:
                if depth:
                    axis.annotate(f"x{depth}", (ram * offset, share), fontsize=7, color=colour,
                                  xytext=(-16 if left else 5, -3), textcoords="offset points")  # fmt: skip
        axis.axhline(GOAL_SHARE, color="grey", linestyle=":", label=f"{GOAL_SHARE} of flat")
        axis.axvline(target["collection"]["dimension"] / 8, color="grey", linestyle="--", linewidth=0.8,
                     label="1/32 of float32")  # fmt: skip
        axis.set_xscale("log")
        dimension = target["collection"]["dimension"]
        ticks = {dimension / 8: "binary", dimension: "int8", 4 * dimension: "float32"}
        axis.set_xticks(list(ticks), [f"{value:,.0f} B\n({name})" for value, name in ticks.items()])
        axis.minorticks_off()
        axis.set_xlabel("bytes of RAM a vector (log)")
        axis.set_ylabel("nDCG@10 / float32 flat's")
        about = target["collection"]
        axis.set_title(f"{name}: {about['documents']:,} documents, {about['test_queries']} test queries")
        axis.grid(alpha=0.3)
    for axis in list(axes.flat)[len(targets) :]:
        axis.set_visible(False)
    shown = {}  # every family drawn on any panel, once, below the panels (a legend inside hides points)
    for axis in axes.flat:
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
            shown.setdefault(label, handle)
    # as many columns as the longest label leaves room for (about 5.5 points a character at size 9, and
    # 40 for the marker), and the figure made taller by the legend's rows, so that none is cut off
    width = 7 * columns
    fits = int(width * 72 / (40 + 5.5 * max(map(len, shown))))
    columns_of_legend = max(1, min(5, 3 * columns, fits))
    legend_rows = -(-len(shown) // columns_of_legend)
    legend = 0.15 + 0.25 * legend_rows  # inches
    figure.set_size_inches(width, 5 * rows + legend)
    figure.legend(list(shown.values()), list(shown), loc="lower center", ncol=columns_of_legend, fontsize=9)
    figure.tight_layout(rect=(0, legend / (5 * rows + legend), 1, 1))
    figure.savefig(output.with_suffix(".png"), dpi=110)
    plt.close(figure)


def collection_store(name: str, folder: Path, args: argparse.Namespace) -> Any:
    """A shared collection's embeddings by `--model`, encoded into the work folder where missing (a
    folder of another model or corpus is refused by `encode_corpus`, never reused)."""
    from benchmarks.ann_recall import encode

    _, store = encode(args.model, folder, args.work / name / "embeddings", args.device, args.batch_size)
    return store


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--collections", nargs="*", help=f"shared collections (default, without --sizes: "
                        f"{' '.join(COLLECTIONS)})")  # fmt: skip
    parser.add_argument(
        "--shared", type=Path, default=Path("../shared/data"), help="where the collections are"
    )
    parser.add_argument("--sizes", nargs="*", default=[], help="NAME=FOLDER: a slice (densekit slice) or a "
                        "collection whose passages --embeddings holds")  # fmt: skip
    parser.add_argument(
        "--embeddings", type=Path, help="with --sizes: an embedding folder holding their passages"
    )
    parser.add_argument("--model", default=MODEL, help="the model that made (or makes) the embeddings")
    parser.add_argument("--device", default="auto", help="where the collections are encoded")
    parser.add_argument("--batch-size", type=int, default=128, help="texts encoded at once")
    parser.add_argument(
        "--work", type=Path, default=WORK / "compression", help="embeddings, indexes, queries"
    )
    parser.add_argument("--output", type=Path, help="the results' JSON (default: WORK/compression.json)")
    parser.add_argument("--rescore", type=int, nargs="+", default=[2, 4, 10, 25], help="rescore multipliers")
    parser.add_argument("--binary-index", nargs="*", default=[], choices=["hnsw", "ivf"],
                        help="also binary codes in faiss's HNSW or IVF index (large collections), rescored "
                        "against int8 at each --rescore multiplier")  # fmt: skip
    parser.add_argument("--nprobe", type=int, nargs="*", default=[],
                        help="binary ivf: lists probed, a method each (default: its own)")  # fmt: skip
    parser.add_argument("--code-bits", type=int, nargs="*", default=[],
                        help="with --binary-index: each binary hnsw or ivf method again with codes of "
                        "this many bits (densekit index --code-bits)")  # fmt: skip
    parser.add_argument("--nlist", type=int, help="binary ivf: its lists (default: its own)")
    parser.add_argument("--ivf-centroids", nargs="*", default=[], choices=["binary", "int8"],
                        help="binary ivf: each method once with centroids of each kind (densekit index "
                        "--ivf-centroids; default: binary)")  # fmt: skip
    parser.add_argument("--target-recall", type=float, default=0.95, help="IVF-PQ's target")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="queries a call")
    parser.add_argument("--seconds", type=float, default=1.0, help="searching timed per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of every method")
    parser.add_argument("--skip", nargs="*", default=[], help="methods left out (ivfpq, 'st int8 x2', ...)")
    args = parser.parse_args(argv)
    for name in ("nprobe", "nlist", "ivf_centroids"):
        if getattr(args, name) and "ivf" not in args.binary_index:
            option = "--" + name.replace("_", "-")
            parser.error(f"{option} sets binary ivf indexes: give --binary-index ivf with it")
    if "flat" in args.skip:
        parser.error("--skip flat: every method is measured against flat")
    if args.sizes and args.embeddings is None:
        parser.error("--sizes needs --embeddings: the passages' vectors are never encoded here")
    sizes = parse_sizes(args.sizes)
    collections = args.collections if args.collections is not None else ([] if sizes else list(COLLECTIONS))
    setup_logging()
    output = args.output or args.work / "compression.json"

    def derived(results: dict, where: tuple[str, ...]) -> None:
        for target in results.get("collections", {}).values():
            derive(target)
        output.with_suffix(".md").write_text(table(results), encoding="utf-8")
        if not where or where[-1] == "speed":
            plot(results, output)

    ledger = Ledger(output, "compression", sys.argv[1:] if argv is None else argv, derived)
    ledger.data["rescore_multipliers"] = args.rescore
    if args.code_bits and not args.binary_index:
        parser.error("--code-bits adds binary hnsw or ivf methods: give --binary-index with it")
    ivf = {"nlist": args.nlist, "centroids": tuple(args.ivf_centroids)}
    chosen = methods(args.rescore, args.skip, tuple(args.binary_index), tuple(args.nprobe),
                     tuple(args.code_bits), ivf)  # fmt: skip
    from densekit.data.dataset import Dataset

    for name in collections:
        folder = args.shared / name
        store = collection_store(name, folder, args)
        passages = Passages(store.folder, args.model, args.work, args.batch_size)
        Target(name, folder, store, passages, args, ledger).run(chosen)
    if sizes:
        passages = Passages(args.embeddings, args.model, args.work, args.batch_size)
        for name, folder in sizes.items():
            store = passages.of(name, Dataset.open(folder))
            Target(name, folder, store, passages, args, ledger).run(chosen)
    ledger.save()
    print(f"wrote {output}, {output.with_suffix('.md')} and {output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
