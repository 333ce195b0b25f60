"""The search service under load on loopback, against the same Retriever called in-process.

Starts `densekit serve MODEL INDEX --corpus DATA` as a separate process with a token, sends the test
queries of DATA as single-query requests at each concurrency (1, 8, 32, 128 by default), each request
timed, and reports per concurrency: queries/s, p50/p99 latency, errors (an HTTP error other than 429),
lost requests (no HTTP answer at all: a dropped connection or a client timeout), 429s (each retried
after the service's Retry-After, so every query is answered in the end), the server process's own CPU
time and share of the machine (so the load generator's is not counted against it), and the ratio to
`Retriever.search` called in-process on the same queries one at a time and in batches of 32. With
--overload-queue N, a second service with `--max-queued N --max-queries N` takes the highest concurrency
(its single-query requests fit any queue), to count the 429 path. Also takes the screenshot of the
search page for docs/ (with --screenshot).

    python -m benchmarks.serving --model sentence-transformers/all-MiniLM-L6-v2 \\
        --index runs/bench/scifact/index --data ../shared/data/scifact --requests 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from benchmarks.machine import machine_info
from densekit.data.dataset import Dataset
from densekit.io.atomic import write_text_atomic
from densekit.retrieval.retriever import Retriever

TOKEN = "benchmark-token"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_service(args: argparse.Namespace, key_file: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """`densekit serve` in its own process (with `extra` options), once /health answers."""
    port = _free_port()
    command = [sys.executable, "-m", "densekit", "serve", args.model, str(args.index),
               "--corpus", str(args.data), "--port", str(port), "--api-key-file", str(key_file),
               "--device", "cpu", *extra]  # fmt: skip
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            if process.poll() is not None:
                raise SystemExit("the service did not start") from None
            time.sleep(0.2)
    raise SystemExit("the service did not answer /health")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time process `pid` has used so far (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(url: str, queries: list[str], concurrency: int, k: int, server_pid: int | None = None) -> dict:
    """Every query once as its own request, `concurrency` in flight at a time; a 429 is retried after
    its Retry-After until answered."""
    latencies: list[float] = []
    errors = lost = refused = 0
    next_query = 0
    headers = {"Authorization": f"Bearer {TOKEN}"}

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_query, errors, lost, refused
        while next_query < len(queries):
            text = queries[next_query]
            next_query += 1
            start = time.perf_counter()
            while True:
                try:
                    response = await client.post(
                        f"{url}/search", json={"query": text, "k": k}, headers=headers
                    )
                except httpx.HTTPError:
                    lost += 1
                    break
                if response.status_code == 429:
                    refused += 1
                    await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
                    continue
                if response.status_code == 200 and len(response.json()["results"][0]) == k:
                    latencies.append(time.perf_counter() - start)
                else:
                    errors += 1
                break

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        server_before = cpu_seconds(server_pid) if server_pid else 0.0
        client_before = sum(os.times()[:2])
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - start
        server_cpu = cpu_seconds(server_pid) - server_before if server_pid else None
        client_cpu = sum(os.times()[:2]) - client_before
    ms = np.array(latencies) * 1000 if latencies else np.array([np.nan])
    cores = os.cpu_count() or 1
    row = {
        "concurrency": concurrency, "requests": len(queries), "answered": len(latencies), "errors": errors,
        "lost": lost, "429s": refused,
        "p50_ms": round(float(np.percentile(ms, 50)), 1), "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "queries_per_s": round(len(latencies) / wall, 1), "wall_s": round(wall, 2),
        "client_cpu_s": round(client_cpu, 2),
    }  # fmt: skip
    if server_cpu is not None:
        row["server_cpu_s"] = round(server_cpu, 2)
        row["server_cpu_share_of_machine"] = round(server_cpu / (wall * cores), 3)
        row["server_cpu_ms_per_query"] = round(1000 * server_cpu / max(len(latencies), 1), 1)
    return row


def in_process(args: argparse.Namespace, queries: list[str]) -> dict:
    """`Retriever.search` in this process: one query a call, and 32 a call."""
    retriever = Retriever.open(args.model, args.index, args.data, device="cpu")
    retriever.search(queries[:8], k=args.k)  # warm up
    figures = {}
    for batch in (1, 32):
        start = time.perf_counter()
        for i in range(0, len(queries), batch):
            retriever.search(queries[i : i + batch], k=args.k)
        figures[f"batch_{batch}_queries_per_s"] = round(len(queries) / (time.perf_counter() - start), 1)
    return figures


def screenshot(url: str, query: str, output: Path) -> str:
    """The search page after searching `query`, saved as PNG; returns the first hit's id."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,1000"):
        options.add_argument(argument)
    browser = webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=options)
    try:
        browser.get(url + "/")
        browser.find_element(By.ID, "token").send_keys(TOKEN)
        browser.find_element(By.ID, "query").send_keys(query)
        browser.find_element(By.ID, "go").click()
        first = WebDriverWait(browser, 60).until(
            expected_conditions.presence_of_element_located((By.CSS_SELECTOR, "li.hit"))
        )
        time.sleep(0.5)  # the info line loads after the hits
        output.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(output))
        return first.get_attribute("data-id")
    finally:
        browser.quit()


def main() -> None:
    """Run the load test and write the results file."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--index", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=300, help="queries sent at each concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--serve-args", type=shlex.split, default=[], help="more options for `densekit "
                        "serve`, as one string: --serve-args='--max-wait-ms 0 --precision bf16'")  # fmt: skip
    parser.add_argument("--overload-queue", type=int, help="also run the highest concurrency against a "
                        "service with --max-queued set to this, to count 429s")  # fmt: skip
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--screenshot", type=Path, help="save the search page here (PNG)")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/serving.json"))
    args = parser.parse_args()

    queries_by_id, _ = Dataset.open(args.data).split_queries("test")
    texts = list(queries_by_id.values())
    queries = (texts * (args.requests // len(texts) + 1))[: args.requests]
    with tempfile.TemporaryDirectory() as folder:
        key_file = Path(folder) / "key"
        key_file.write_text(TOKEN + "\n")
        process, url = start_service(args, key_file, *args.serve_args)
        try:
            info = httpx.get(f"{url}/info", headers={"Authorization": f"Bearer {TOKEN}"}).json()
            asyncio.run(load(url, queries[:16], 4, args.k))  # warm up
            served = [asyncio.run(load(url, queries, c, args.k, process.pid)) for c in args.concurrency]
            first_hit = screenshot(url, texts[0], args.screenshot) if args.screenshot else None
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
        overload = None
        if args.overload_queue:
            process, url = start_service(
                args,
                key_file,
                *args.serve_args,
                "--max-queued",
                str(args.overload_queue),
                "--max-queries",
                str(args.overload_queue),
            )
            try:
                asyncio.run(load(url, queries[:16], 4, args.k))
                overload = asyncio.run(load(url, queries, max(args.concurrency), args.k, process.pid))
                overload["max_queued"] = args.overload_queue
            finally:
                process.send_signal(signal.SIGTERM)
                process.wait(timeout=60)
    own = in_process(args, queries)
    one = served[0]["queries_per_s"]
    for row in served:
        row["vs_concurrency_1"] = round(row["queries_per_s"] / one, 2)
        row["vs_in_process_one_at_a_time"] = round(row["queries_per_s"] / own["batch_1_queries_per_s"], 2)
    result = {
        "command": " ".join(["python -m benchmarks.serving", *sys.argv[1:]]),
        "machine": machine_info(),
        "model": args.model, "index": str(args.index), "data": str(args.data), "k": args.k,
        "service_precision": {key: info[key] for key in ("query_precision", "precision_reason", "backend")},
        "service": served, "overload": overload, "in_process": own,
        "screenshot": {"path": str(args.screenshot), "query": texts[0], "first_hit": first_hit}
        if args.screenshot else None,
        "threads": os.cpu_count(),
    }  # fmt: skip
    write_text_atomic(args.output, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
