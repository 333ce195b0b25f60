"""Figures: matplotlib without a display, saved atomically as PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from densekit.io.artefact import write_file_manifest
from densekit.io.atomic import atomic_file

PLOT_KIND = "plot"


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(
    figure: Any, output: Path | str, record: bool = False, identity: dict[str, Any] | None = None
) -> Path:
    """Save `figure` to `output` atomically and close it; with `record`, mark the file as a plot
    densekit wrote from `identity` (a file output the same command may replace next time)."""
    plt = pyplot()
    figure.tight_layout()
    with atomic_file(output, "wb", encoding=None) as handle:
        figure.savefig(handle, format="png", dpi=100)
    plt.close(figure)
    if record:
        write_file_manifest(output, PLOT_KIND, identity or {})
    return Path(output)
