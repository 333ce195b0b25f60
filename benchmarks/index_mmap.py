"""What memory-mapping an index saves: resident memory after `SearchIndex.load` with and without `mmap`.

For each index folder given (built by `densekit index`), a fresh process loads it (read in, or
memory-mapped: faiss's IO_FLAG_MMAP for IVF, IO_FLAG_MMAP_IFC for flat and HNSW), then searches the
query vectors; it reports its anonymous and file-backed resident memory (RssAnon, RssFile in
/proc/self/status) before loading, after loading and after the search. File-backed pages are the
index file's, which the kernel may drop and read again; anonymous ones must stay in memory. Run from the
repository root, e.g. on the scale benchmark's indexes:

    R=runs/benchmarks/scale/100000/out
    nice -n 10 .venv/bin/python -m benchmarks.index_mmap $R/index-{flat,hnsw,ivfpq} --queries $R/queries.npy
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from benchmarks import WORK
from benchmarks.machine import machine_info

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
import numpy as np
from densekit.index import SearchIndex

def resident():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) / 1024 for key in ("RssAnon", "RssFile")}

folder, queries, mmap, k = sys.argv[1], np.load(sys.argv[2]), sys.argv[3] == "mmap", int(sys.argv[4])
before = resident()
start = time.perf_counter()
index = SearchIndex.load(folder, mmap=mmap)
load_s = time.perf_counter() - start
loaded = resident()
start = time.perf_counter()
index.search(queries, k)
search_s = time.perf_counter() - start
print(json.dumps({"before_mib": before, "loaded_mib": loaded, "searched_mib": resident(),
                  "load_s": load_s, "search_s": search_s, "rows": index.rows, "type": index.spec.type}))
"""


def measure(folder: Path, queries: Path, mmap: bool, k: int) -> dict:
    """One fresh process's resident memory around loading and searching `folder`."""
    argv = [sys.executable, "-c", CHILD, str(folder), str(queries), "mmap" if mmap else "read", str(k)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("indexes", type=Path, nargs="+")
    parser.add_argument("--queries", type=Path, required=True, help="a .npy of query vectors")
    parser.add_argument("--k", type=int, default=1000)
    parser.add_argument("--output", type=Path, default=WORK / "index_mmap.json")
    args = parser.parse_args()
    results = []
    for folder in args.indexes:
        for mmap in (False, True):
            row = {"index": str(folder), "mmap": mmap, **measure(folder, args.queries, mmap, args.k)}
            row["index_file_mib"] = round((folder / "index.faiss").stat().st_size / 2**20, 1)
            print(json.dumps(row), flush=True)
            results.append(row)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps({"machine": machine_info(), "k": args.k, "runs": results}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
