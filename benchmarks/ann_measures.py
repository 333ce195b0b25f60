"""What the approximate-search benchmarks (`ann_recall`, `wiki_ann`) measure alike: recall against exact
search, queries per second (all queries in one call, or a few a call on a set number of threads),
a sweep of an index's search parameter, and the recall/speed plot of such sweeps."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

NPROBES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
EF_SEARCHES = (10, 16, 32, 64, 128, 256, 512, 1024)
# (labels, queries a second) of an index searched with `queries`: what a sweep measures at each value
Measure = Callable[[Any, np.ndarray], tuple[np.ndarray, float]]


@contextlib.contextmanager
def search_threads(threads: int | None) -> Iterator[None]:
    """faiss and torch on `threads` threads inside the block (densekit searches a flat index in torch);
    None sets torch's to faiss's."""
    import faiss
    import torch

    saved = torch.get_num_threads(), faiss.omp_get_max_threads()
    torch.set_num_threads(threads or saved[1])
    if threads is not None:
        faiss.omp_set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        faiss.omp_set_num_threads(saved[1])


def timed_search(index: Any, queries: np.ndarray, k: int = 10, calls: int = 3) -> tuple[np.ndarray, float]:
    """The top `k` rows of each query and the queries per second of the fastest of `calls` searches, on
    faiss's threads: densekit searches a flat index in torch, which gets as many for the searches."""
    with search_threads(None):
        best = float("inf")
        for _ in range(calls):
            start = time.perf_counter()
            hits = index.search(queries, k)
            best = min(best, time.perf_counter() - start)
    return hits.labels, len(queries) / best


def queries_per_second(
    search: Callable[[np.ndarray], Any], queries: np.ndarray, batch: int, seconds: float
) -> float:
    """Queries a second of `search` given `batch` queries a call, through `queries` in order (from the
    first again after the last), after one call to warm up, for about `seconds` (at least one call)."""
    search(queries[:batch])
    done, first, start = 0, 0, time.perf_counter()
    while True:
        part = queries[first : first + batch]
        search(part)
        done += len(part)
        first = first + batch if first + batch < len(queries) else 0
        if time.perf_counter() - start >= seconds:
            return done / (time.perf_counter() - start)


def paired_speed(
    searches: dict[str, Callable[[np.ndarray], Any]],
    queries: np.ndarray,
    batch: int,
    threads: int,
    seconds: float,
    rounds: int,
) -> dict[str, Any]:
    """Each search's median queries a second over `rounds` alternating rounds (the order rotated each
    round, so that drift in a shared machine's speed falls on all alike), and for two searches the
    median of the first's per-round ratio to the second's."""
    names = list(searches)
    rates: dict[str, list[float]] = {name: [] for name in names}
    with search_threads(threads):
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                rates[name].append(queries_per_second(searches[name], queries, batch, seconds))
    result: dict[str, Any] = {f"{name}_qps": round(statistics.median(r), 1) for name, r in rates.items()}
    result["rounds"] = {name: [round(r, 1) for r in values] for name, values in rates.items()}
    if len(names) == 2:
        first, second = rates[names[0]], rates[names[1]]
        result["ratio"] = round(statistics.median(a / b for a, b in zip(first, second, strict=True)), 3)
    return result


def recall_against(found: np.ndarray, exact: np.ndarray) -> float:
    """Mean share of each query's exact top rows among `found`'s."""
    return float(
        np.mean(
            [
                len(np.intersect1d(f[f >= 0], e[e >= 0])) / len(e[e >= 0])
                for f, e in zip(found, exact, strict=True)
            ]
        )
    )


def sweep_values(index: Any) -> tuple[str, list[int]]:
    """The search parameter a sweep of a loaded densekit index varies, and its values: `nprobe` up to the
    index's lists (and all of them), or `ef_search`."""
    if index.spec.type == "ivfpq":
        values = [v for v in NPROBES if v <= index.spec.nlist] + [index.spec.nlist]
        return "nprobe", sorted(set(values))
    return "ef_search", list(EF_SEARCHES)


def sweep(index: Any, queries: np.ndarray, exact: np.ndarray, measure: Measure = timed_search) -> list[dict]:
    """Recall@10 against exact search and queries per second (`measure`) over `nprobe` or `ef_search`
    values (`sweep_values`); the index is set back to its spec's values after."""
    name, values = sweep_values(index)
    points = []
    for value in values:
        index.set_search_parameters(**{name: value})
        found, qps = measure(index, queries)
        points.append({name: value, "recall@10": recall_against(found, exact), "qps": qps})
    index.set_search_parameters()
    return points


def draw_sweeps(
    axis: Any,
    curves: dict[str, list[dict]],
    chosen: dict[str, tuple[float, float, str]],
    flat_qps: float,
    title: str,
    speed: str = "queries per second (k = 10, one call)",
) -> None:
    """On `axis`: each curve's recall@10 against queries per second (log scale), its points labelled
    with their parameter's value; each `chosen` point (queries per second, recall, label) as a star;
    flat's speed as a dashed line."""
    for (label, points), marker in zip(curves.items(), "osD^v<>p", strict=False):
        name = next(key for key in points[0] if key not in ("recall@10", "qps"))
        axis.plot([p["qps"] for p in points], [p["recall@10"] for p in points], marker=marker,
                  label=f"{label} ({name})")  # fmt: skip
        for p in points:
            axis.annotate(str(p[name]), (p["qps"], p["recall@10"]), fontsize=7)
    for qps, recall, label in chosen.values():
        axis.plot(qps, recall, "*", markersize=14, label=label)
    axis.axvline(flat_qps, color="grey", linestyle="--", label="flat (recall 1)")
    axis.set_xscale("log")
    axis.set_xlabel(speed)
    axis.set_ylabel("recall@10 against flat (test queries)")
    axis.set_title(title)
    axis.legend(fontsize=8)


def with_commands(lines: list[str], results: dict) -> str:
    """The markdown `lines` followed by the command of each run that wrote `results`, each once."""
    commands = [f"    {run['command']}" for run in results.get("runs", [])]
    heading = "Commands (each run that wrote these results):"
    return "\n".join([*lines, heading, "", *dict.fromkeys(commands)]) + "\n"
