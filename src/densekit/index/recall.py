"""How much an approximate index finds of what exact search finds, measured when it is built.

Held-out queries (by default a seeded sample of the collection's own vectors, each query's own row left
out of both result lists; or the vectors of real queries encoded by the same model) are searched exactly
(inner product over every vector, read a batch at a time) and with the index. Recall@k is the share of
exact search's top k that the index's top k holds. A target recall@10 picks the smallest `nprobe` (IVF)
or `ef_search` (HNSW) that meets it, and, for IVF-PQ whose codes cannot meet it however many lists it
probes, re-ranks its candidates with the exact vectors (faiss's refine step), with the smallest
`k_factor` that meets it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import faiss
import numpy as np

from densekit.errors import DensekitError
from densekit.index.spec import MAX_EF, IndexSpec

RECALL_DEPTHS = (10, 100)  # recall@10 (the target's) and recall@100 are recorded
TARGET_DEPTH = RECALL_DEPTHS[0]
DEFAULT_QUERIES = 1000
MAX_K_FACTOR = 64  # re-ranking more than 64 x k candidates costs more than a flat search saves

Chunks = Callable[[], Iterable[tuple[int, np.ndarray]]]
log = logging.getLogger(__name__)


class TargetUnreachable(DensekitError, ValueError):
    """A recall target that no setting of the index reaches on the held-out queries."""


@dataclass
class RecallSettings:
    """What to measure at build: `queries` held-out vectors sampled from the collection (`seed`), or
    the given query `vectors` (made by the model that made the collection's, named by `source`, with
    `digest` their file's); `target` a recall@10 to meet."""

    target: float | None = None
    queries: int = DEFAULT_QUERIES
    seed: int = 0
    vectors: np.ndarray | None = None
    source: str | None = None
    digest: str | None = None

    def identity(self) -> dict[str, Any] | None:
        """What the index's identity records of a target (None without one): the chosen setting depends
        on the target and on the queries it was met on."""
        if self.target is None:
            return None
        sample = f"sample of {self.queries}, seed {self.seed}"
        return {"target": self.target, "queries": self.digest or sample}


@dataclass
class HeldOut:
    """Query vectors searched to measure recall; `own` holds each one's row in the index (left out of
    both result lists) when they were drawn from it."""

    vectors: np.ndarray
    own: np.ndarray | None
    source: str
    truth: dict[int, np.ndarray] = field(default_factory=dict)  # exact top rows, by depth


def gather_rows(chunks: Iterable[tuple[int, np.ndarray]], chosen: np.ndarray) -> np.ndarray:
    """The rows `chosen` (sorted) as one float32 array. `chunks` gives the rows in order as (first row,
    array), each let go before the next is read: picking rows out of one map of a whole file would leave
    every page readahead brought in counted as resident (13.5 GB at 8.8M vectors)."""
    picked = []
    for first, vectors in chunks:
        low, high = np.searchsorted(chosen, [first, first + len(vectors)])
        picked.append(np.array(vectors[chosen[low:high] - first], dtype=np.float32))
    return np.ascontiguousarray(np.concatenate(picked))


def held_out(settings: RecallSettings, chunks: Chunks, rows: int) -> HeldOut:
    """The queries recall is measured on: the given vectors, or a seeded sample of the rows (drawn with
    a generator of its own, apart from the training sample's)."""
    if settings.vectors is not None:
        vectors = np.ascontiguousarray(settings.vectors, dtype=np.float32)
        return HeldOut(vectors, None, settings.source or f"{len(vectors)} given query vectors")
    take = min(rows, settings.queries)
    own = np.sort(np.random.default_rng([settings.seed, 1]).choice(rows, size=take, replace=False))
    source = f"{take} of the collection's own vectors (seed {settings.seed}), each one's own row left out"
    return HeldOut(gather_rows(chunks(), own), own, source)


def exact_top(
    chunks: Chunks, queries: np.ndarray, depth: int, advance: Callable[[int], None] = lambda rows: None
) -> np.ndarray:
    """Each query's top `depth` rows by inner product over every vector, read a chunk at a time (faiss's
    exact k-NN per chunk, merged in a heap; `advance` is told the rows of each); -1 where there are
    fewer rows."""
    heap = faiss.ResultHeap(len(queries), depth, keep_max=True)
    for first, vectors in chunks():
        batch = np.ascontiguousarray(vectors, dtype=np.float32)
        scores, labels = faiss.knn(queries, batch, min(depth, len(batch)), metric=faiss.METRIC_INNER_PRODUCT)
        heap.add_result(scores, np.where(labels >= 0, labels + first, -1))
        advance(len(batch))
    heap.finalize()
    return heap.I


def _leave_out_own(labels: np.ndarray, own: np.ndarray | None, depth: int) -> list[np.ndarray]:
    """Each query's rows, its own (when it has one) and the padding left out, cut to `depth`."""
    kept = []
    for row, found in enumerate(labels):
        found = found[found >= 0]
        if own is not None:
            found = found[found != own[row]]
        kept.append(found[:depth])
    return kept


def search_exactly(held: HeldOut, chunks: Chunks, advance: Callable[[int], None] = lambda rows: None) -> None:
    """Search the held-out queries exactly, as deep as any recall is counted, once (`advance` is told the
    rows searched as it goes)."""
    if not held.truth:
        deepest = max(RECALL_DEPTHS) + (held.own is not None)
        held.truth[deepest] = exact_top(chunks, held.vectors, deepest, advance)


def truth_at(held: HeldOut, chunks: Chunks, depth: int) -> list[np.ndarray]:
    """Exact search's top `depth` rows for each held-out query (searched on first use)."""
    search_exactly(held, chunks)
    labels = next(iter(held.truth.values()))
    return _leave_out_own(labels, held.own, depth)


def recall_at(found: list[np.ndarray], truth: list[np.ndarray]) -> float | None:
    """The mean share of each query's exact top rows that `found` holds (None when no query has any)."""
    shares = [len(np.intersect1d(f, t)) / len(t) for f, t in zip(found, truth, strict=True) if len(t)]
    return float(np.mean(shares)) if shares else None


def search_deep_enough(index: faiss.Index, queries: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """faiss's search of `index`, except that HNSW keeps at least `depth` candidates: with a candidate
    list (`efSearch`) shorter than the results asked for, faiss returns fewer results than asked."""
    hnsw = getattr(index, "hnsw", None)
    if hnsw is not None and hnsw.efSearch < depth:
        parameters = faiss.SearchParametersHNSW()
        parameters.efSearch = depth
        return index.search(queries, depth, params=parameters)
    return index.search(queries, depth)


def search_recall(
    rows_of: Callable[[np.ndarray, int], np.ndarray], held: HeldOut, chunks: Chunks, depth: int
) -> float | None:
    """Recall@`depth` of a search that gives each query's top rows, best first (`rows_of(queries,
    depth)`; -1 for none), asked `depth` deep (one more where each query's own row is left out): a
    search may look at more candidates for a deeper search, so each depth is searched at its own."""
    labels = rows_of(held.vectors, depth + (held.own is not None))
    return recall_at(_leave_out_own(labels, held.own, depth), truth_at(held, chunks, depth))


def index_recall(index: faiss.Index, held: HeldOut, chunks: Chunks, depth: int) -> float | None:
    """Recall@`depth` of a faiss `index`, as it is set now (`search_recall`)."""
    rows = int(index.ntotal)
    return search_recall(
        lambda queries, deep: search_deep_enough(index, queries, min(rows, deep))[1], held, chunks, depth
    )


def set_parameters(index: faiss.Index, spec: IndexSpec) -> None:
    """Set the search parameters of `spec` on a built `index`."""
    space = faiss.ParameterSpace()
    if spec.type == "hnsw":
        space.set_index_parameter(index, "efSearch", spec.ef_search)
    elif spec.type == "ivfpq":
        space.set_index_parameter(index, "nprobe", spec.nprobe)
        if spec.refine_k_factor is not None:
            space.set_index_parameter(index, "k_factor_rf", spec.refine_k_factor)


def smallest_meeting(
    candidates: list[int],
    recall_of: Callable[[int], float | None],
    target: float,
    label: Callable[[int], str],
    largest_meets: bool = False,
) -> tuple[int | None, dict[int, float]]:
    """The smallest of the sorted `candidates` whose recall meets `target` (None when none can), and
    every recall measured on the way: positions 0, 1, 3, 7, ... until one meets it, then bisection
    between it and the last that did not. It is the smallest a sweep of every candidate finds where
    recall does not fall as the value grows, as more lists probed or candidates kept give (a value
    finding fewer than a smaller one, which product quantisation's approximate scores allow by a query
    or two, could hide a smaller value that meets the target). Each value tried is logged (`label` names
    it): at scale each is a search of every held-out query, minutes apart.

    The doubling gives up early where recall has stopped growing: once the last step gained no more
    than the one before it, and the larger of the two gains times the steps left to the largest
    candidate falls short of the target, no candidate meets it. Recall grows ever more slowly as the
    value doubles (each list probed or candidate kept is less likely than the last to hold a true
    neighbour); the larger gain is taken so that one step's noise, a query or two, does not end it.
    Without this, an IVF-PQ index whose codes cannot reach the target is searched at every doubling up
    to all its lists (8 minutes on 300,000 wiki1m vectors, most of them past recall's plateau). With
    `largest_meets` (the largest candidate is known to meet the target: a second choice at a setting
    the first met), it never gives up."""
    tried: dict[int, float] = {}

    def meets(position: int) -> bool:
        value = candidates[position]
        if value not in tried:
            tried[value] = recall_of(value) or 0.0
            log.info("%s: recall@10 %.4f (target %s)", label(value), tried[value], target)
        return tried[value] >= target

    below, step = -1, 1
    above = None
    gains: list[float] = []
    while above is None:
        position = min(below + step, len(candidates) - 1)
        if meets(position):
            above = position
        elif position == len(candidates) - 1:
            return None, tried
        else:
            if below >= 0:
                gains.append(tried[candidates[position]] - tried[candidates[below]])
            below, step = position, step * 2
            reached, left = tried[candidates[below]], _steps_left(below, step, len(candidates))
            if not largest_meets and _plateaued(gains, target - reached, left):
                log.info("%s: recall@10 %.4f gained %.4f and %.4f on the last two doublings; the %d left "
                         "to %s cannot reach %s at that rate: stopping", label(candidates[below]), reached,
                         gains[-2], gains[-1], left, candidates[-1], target)  # fmt: skip
                return None, tried
    while above - below > 1:
        middle = (below + above) // 2
        if meets(middle):
            above = middle
        else:
            below = middle
    return candidates[above], tried


def _steps_left(below: int, step: int, count: int) -> int:
    """How many more values the doubling of `smallest_meeting` would try, the last candidate included."""
    steps = 0
    while True:
        steps += 1
        position = below + step
        if position >= count - 1:
            return steps
        below, step = position, step * 2


def _plateaued(gains: list[float], gap: float, steps_left: int) -> bool:
    """Whether recall, which gained `gains` on successive doublings, cannot close `gap` in `steps_left`
    more: the last gain no larger than the one before (growth slowing), and the larger of the two, taken
    at every step left, short of `gap`."""
    return len(gains) >= 2 and gains[-1] <= gains[-2] and max(gains[-2], 0.0) * steps_left < gap


def candidates_of(spec: IndexSpec, rows: int) -> tuple[str, list[int]]:
    """The search parameter a target chooses for a resolved `spec`, and its values, smallest first:
    `nprobe` 1 to nlist; `ef_search` from the target's depth (a shorter candidate list is searched as
    one of that depth: `search_deep_enough`) to the rows held, at most `MAX_EF`."""
    if spec.type == "ivfpq":
        assert spec.nlist is not None, "spec not resolved"
        return "nprobe", list(range(1, spec.nlist + 1))
    return "ef_search", list(range(TARGET_DEPTH, max(TARGET_DEPTH, min(rows, MAX_EF)) + 1))


@dataclass
class Chosen:
    """What a target chose: the spec with its search parameters, the recall of each value tried, and
    the best recall@10 reached where none met the target."""

    spec: Any  # the backend's
    tried: dict[str, dict[int, float]]
    best: float | None = None
    where: str = ""


def choose_parameter(
    index: faiss.Index, spec: IndexSpec, held: HeldOut, chunks: Chunks, target: float
) -> Chosen:
    """The smallest `nprobe` or `ef_search` of `spec`'s index meeting `target` recall@10; `best` and
    `where` say what the largest reached when none meets it."""
    name, values = candidates_of(spec, int(index.ntotal))

    def recall_of(value: int) -> float | None:
        set_parameters(index, spec.updated(**{name: value}))
        return index_recall(index, held, chunks, TARGET_DEPTH)

    reranking = "" if spec.refine_k_factor is None else f", re-ranking {spec.refine_k_factor} x k"
    value, tried = smallest_meeting(values, recall_of, target, lambda value: f"{name} {value}{reranking}")
    if value is None:
        best = max(tried, key=lambda tried_value: tried[tried_value])
        return Chosen(spec, {name: tried}, tried[best], f"--{name.replace('_', '-')} {best}")
    return Chosen(spec.updated(**{name: value}), {name: tried})


def choose_refined(
    index: faiss.Index, spec: IndexSpec, held: HeldOut, chunks: Chunks, target: float
) -> Chosen:
    """For an IVF-PQ index wrapped in faiss's re-ranking (`IndexRefineFlat`): the smallest `nprobe`
    meeting `target` when `MAX_K_FACTOR` x k candidates are re-ranked, then the smallest `k_factor` at
    that `nprobe`."""
    widest = spec.updated(refine_k_factor=MAX_K_FACTOR)
    probed = choose_parameter(index, widest, held, chunks, target)
    if probed.best is not None:
        probed.where = f"{probed.where} and re-ranking {MAX_K_FACTOR} x k candidates with the exact vectors"
        return probed

    def recall_of(k_factor: int) -> float | None:
        set_parameters(index, probed.spec.updated(refine_k_factor=k_factor))
        return index_recall(index, held, chunks, TARGET_DEPTH)

    nprobe = probed.spec.nprobe
    k_factor, tried = smallest_meeting(
        list(range(1, MAX_K_FACTOR + 1)), recall_of, target,
        lambda k: f"nprobe {nprobe}, refine_k_factor {k}", largest_meets=True,
    )  # fmt: skip
    assert k_factor is not None, "the widest re-ranking met the target at this nprobe"
    return Chosen(probed.spec.updated(refine_k_factor=k_factor), {**probed.tried, "refine_k_factor": tried})


def measured(index: faiss.Index, spec: IndexSpec, held: HeldOut, chunks: Chunks) -> dict[str, Any]:
    """Recall@10 and @100 of `index` searched with `spec`'s parameters, and what they were measured on."""
    set_parameters(index, spec)
    names = {"ivfpq": ["nprobe", "refine_k_factor"], "hnsw": ["ef_search"]}[spec.type]
    recalls = {f"recall@{depth}": index_recall(index, held, chunks, depth) for depth in RECALL_DEPTHS}
    parameters = {name: getattr(spec, name) for name in names if getattr(spec, name) is not None}
    return recall_record(recalls, parameters, held)


def recall_record(
    recalls: dict[str, float | None], parameters: dict[str, Any], held: HeldOut
) -> dict[str, Any]:
    """What an index's manifest records of its recall: `recalls` by depth, the search `parameters` they
    were measured with, and the held-out queries (their rows, where drawn from the collection)."""
    record = {**recalls, "parameters": parameters, "queries": len(held.vectors), "held_out": held.source}
    if held.own is not None:  # which rows, so that anyone can count again
        record["rows"] = held.own.tolist()
    return record


def exact_record() -> dict[str, Any]:
    """What a flat index records: it is exact search, so it finds all that exact search finds."""
    return {f"recall@{depth}": 1.0 for depth in RECALL_DEPTHS} | {"exact": True}


def unreachable(target: float, chosen: Chosen, held: HeldOut, advice: str) -> TargetUnreachable:
    """The one-line error for a target no setting meets."""
    return TargetUnreachable(
        f"--target-recall {target}: the best recall@10 reached on {len(held.vectors)} held-out queries was "
        f"{chosen.best:.4f} ({chosen.where}); {advice}"
    )


def chunk_reader(parts: Iterable[Any], add_batch: int) -> Chunks:
    """A function giving the rows of embedding `parts` in order as (first row, array), `add_batch` at a
    time, each read through a memory map of its own."""

    def chunks() -> Iterator[tuple[int, np.ndarray]]:
        offset = 0
        for part in parts:
            for start, vectors in part.row_chunks(add_batch):
                yield offset + start, vectors
            offset += int(part.meta["rows"])

    return chunks


def recall_words(measured: dict[str, Any] | None) -> str:
    """What `densekit index` prints of an index's recall after its folder's name: recall@10 and @100,
    what they were measured on, the search setting and the target met (nothing when not measured)."""
    if not measured or measured.get("exact"):
        return " (flat: exact search)" if measured else ""
    settings = ", ".join(f"{name} {'none' if value is None else value}"
                         for name, value in measured["parameters"].items())  # fmt: skip
    found = ", ".join(f"{key} {value:.4f}" for key, value in measured.items()
                      if key.startswith("recall@") and value is not None)  # fmt: skip
    target = f", meeting --target-recall {measured['target']}" if measured.get("target") is not None else ""
    return f" ({found} against exact search on {measured['held_out']}; {settings}{target})"
