"""Bytes on disk: a multi-domain run's modules, routes and hypernetwork against full fine-tuned copies.

A full fine-tune stores a whole model per domain; a modular system stores the base once and, per
domain, a module (plus a router, or a hypernetwork, shared by all). The full copy is measured as
densekit saves one (`DenseEncoder.save` of the base, in this run). Run from the repository root after
`densekit run recipes/multi-domain.yaml --out runs/multi-domain`:

    .venv/bin/python -m benchmarks.module_storage --run runs/multi-domain
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks import WORK
from benchmarks.machine import machine_info
from densekit.models import DenseEncoder

MIB = 2**20
# the run's folders, by what they are
MODULES = {
    "SciFact module": "scifact-module/model",
    "NFCorpus module": "nfcorpus-module/model",
    "multi-task module": "multitask-module/model",
    "averaged module": "averaged-module",
    "hypernetwork's SciFact module": "hyper-scifact",
    "hypernetwork's NFCorpus module": "hyper-nfcorpus",
}
SHARED = {
    "fixed route": "fixed-route",
    "soft router": "soft-route/model",
    "top-1 router": "top-k-route/model",
    "fusion": "fusion-route/model",
    "hypernetwork": "hypernetwork/model",
}


def folder_bytes(folder: Path) -> int:
    """The size of every file under `folder` (links not followed into other folders)."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", type=Path, default=Path("runs/multi-domain"))
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument(
        "--output", type=Path, default=WORK / "module_storage.json"
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        DenseEncoder.load(args.model).save(Path(tmp) / "full")
        full = folder_bytes(Path(tmp) / "full")
    sizes = {name: folder_bytes(args.run / path) for name, path in {**MODULES, **SHARED}.items()
             if (args.run / path).is_dir()}  # fmt: skip
    domains = ["SciFact module", "NFCorpus module"]
    systems = {
        "2 full fine-tuned copies": 2 * full,
        "2 domain modules + fixed route": sum(sizes[d] for d in domains) + sizes.get("fixed route", 0),
        "2 domain modules + soft router": sum(sizes[d] for d in domains) + sizes.get("soft router", 0),
        "hypernetwork (both domains)": sizes.get("hypernetwork", 0),
    }
    result = {
        "benchmark": "module_storage",
        "run": str(args.run),
        "full_copy_bytes": full,
        "folders_bytes": sizes,
        "systems_bytes": systems,
        "share_of_full_copies": {k: v / systems["2 full fine-tuned copies"] for k, v in systems.items()},
        "machine": machine_info(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"a full copy: {full / MIB:.2f} MiB")
    for name, size in {**sizes, **systems}.items():
        print(f"{name:40s} {size / MIB:9.3f} MiB  {size / full:8.4f} of a full copy")


if __name__ == "__main__":
    main()
