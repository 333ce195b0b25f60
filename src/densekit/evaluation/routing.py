"""How a route uses its modules, per collection: the diagnostic a person looks at to see collapse.

For each collection's queries: each module's mean weight, the share of queries whose largest weight is
that module's, and the mean entropy of the weights. A module that is the top choice of nearly every
query of every collection (or of none) is reported as collapse, not hidden.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from densekit.plots import pyplot, save_png
from densekit.routing.route import Route

COLLAPSE_SHARE = 0.9


def route_usage(
    route: Route, collections: dict[str, tuple[list[str], str | None]], batch_size: int = 64
) -> dict:
    """Usage per collection (name -> (query texts, domain or None)) and the collapse findings."""
    modules = route.spec.modules
    rows: dict[str, Any] = {}
    tops = np.zeros(len(modules))
    for name, (texts, domain) in collections.items():
        weights = _weights(route, texts, domain, batch_size)
        top = np.bincount(weights.argmax(1), minlength=len(modules)) / len(texts)
        tops += np.bincount(weights.argmax(1), minlength=len(modules))
        # + 0.0 turns the -0.0 of one-hot rows into 0.0
        entropy = float(-(weights * np.log(np.clip(weights, 1e-12, None))).sum(1).mean()) + 0.0
        rows[name] = {
            "queries": len(texts),
            "mean_weight": dict(zip(modules, weights.mean(0).tolist(), strict=True)),
            "top_share": dict(zip(modules, top.tolist(), strict=True)),
            "entropy": entropy,
        }
    shares = dict(zip(modules, (tops / max(1, tops.sum())).tolist(), strict=True))
    collapse = [f"module {m!r} is the top choice of {s:.0%} of all queries"
                for m, s in shares.items() if s >= COLLAPSE_SHARE]  # fmt: skip
    collapse += [f"module {m!r} is never the top choice" for m, s in shares.items() if s == 0]
    return {"route": route.spec.type, "modules": modules, "max_entropy": math.log(len(modules)),
            "collections": rows, "collapse": collapse}  # fmt: skip


def _weights(route: Route, texts: list[str], domain: str | None, batch_size: int) -> np.ndarray:
    encoder = route.encoder
    token_ids = encoder.tokenize(texts, "query")
    out = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            inputs = encoder.pad(token_ids[start : start + batch_size])
            ids, mask = inputs["input_ids"].to(encoder.device), inputs["attention_mask"].to(encoder.device)
            domains = None if domain is None else [domain] * len(ids)
            out.append(route.weights(ids, mask, domains).float().cpu().numpy())
    return np.concatenate(out)


def plot_usage(report: dict, output: Path | str, identity: dict | None = None) -> Path:
    """A heat map: collections by modules, each cell the modules' mean weight on that collection; the
    file records `identity` (what made it)."""
    plt = pyplot()
    names, modules = list(report["collections"]), report["modules"]
    values = np.array([[report["collections"][n]["mean_weight"][m] for m in modules] for n in names])
    figure, axis = plt.subplots(figsize=(1.2 * len(modules) + 3, 0.6 * len(names) + 1.6))
    image = axis.imshow(values, vmin=0, vmax=1, cmap="viridis")
    axis.set_xticks(range(len(modules)), modules, rotation=30, ha="right")
    axis.set_yticks(range(len(names)), names)
    for i in range(len(names)):
        for j in range(len(modules)):
            axis.text(j, i, f"{values[i, j]:.2f}", ha="center", va="center",
                      color="white" if values[i, j] < 0.6 else "black")  # fmt: skip
    figure.colorbar(image, ax=axis, label="mean routing weight")
    axis.set_title(f"{report['route']} route: module weight per collection")
    return save_png(figure, output, record=True, identity=identity)
