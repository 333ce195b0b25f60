"""The search service under load on loopback, as a ratio to its own model measured in the same run, and
its OpenAI embeddings endpoint beside a peer's (Infinity) on the same model, inputs and load.

In one run:

1. The model alone, in this process, with the threads the service encodes with: the test queries of
   DATA tokenised and run through the model one a call (its single-query time) and length-sorted in
   batches of `--model-batch` (its batched throughput and CPU a query); measured before the services
   start and again after they stop, and the better of the two, figure by figure, taken as the model's
   own (the lower CPU and p50, the higher rate): a measurement upset by something else on the machine
   cannot flatter the service's ratios.
2. `densekit serve MODEL INDEX --corpus DATA` as a separate process, sent the test queries as
   single-query `/search` requests at each concurrency (1, 8, 32, 128 by default), each timed: queries/s,
   p50/p99, errors (an HTTP error other than 429), lost requests (no HTTP answer), 429s (each retried
   after its Retry-After, so every query is answered in the end), the server process's own CPU time a
   query, and each row as a ratio to the model alone (CPU a query, queries/s, and at concurrency 1 the
   p50 beside the model's single-query time).
3. With `--infinity PATH` (the `infinity_emb` of the environment Infinity is installed in, not
   densekit's: benchmarks/README.md), Infinity on the same model folder beside the service, and both
   `/v1/embeddings` endpoints driven with the same single-query requests at each concurrency, the two
   alternating: queries/s, p50/p99 and server CPU a query each, and densekit's as a ratio to Infinity's.

The load generator is an HTTP/1.1 client over asyncio streams in this one process, one kept-alive
connection per concurrent client, whose own CPU time is reported with each row, so that the server's
share of the machine is what it took. With --overload-queue N, a second service with
`--max-queued N --max-queries N` takes the highest concurrency to count the 429 path; with --screenshot,
the search page is saved as PNG.

    python -m benchmarks.serving --index runs/scifact-index --data ../shared/data/scifact \\
        --infinity /tmp/infinity-venv/bin/infinity_emb --output benchmarks/results/serving.json

Results go to WORK/serving.json (`--work`, default runs/benchmarks/serving) unless --output names a file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from benchmarks import WORK
from benchmarks.machine import machine_info
from densekit.data.dataset import Dataset
from densekit.io.atomic import write_text_atomic
from densekit.models.hub import resolve_model_path
from densekit.retrieval.retriever import Retriever

TOKEN = "benchmark-token"
INFINITY_NAME = "peer-model"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_average() -> list[float]:
    """The machine's 1, 5 and 15 minute load averages now (Linux's /proc/loadavg)."""
    return [float(value) for value in Path("/proc/loadavg").read_text().split()[:3]]


@dataclass
class Server:
    """A server process under test and the URL it answers on."""

    name: str
    process: subprocess.Popen
    url: str
    embeddings_model: str
    log: Path

    def stop(self) -> None:
        """Stop it and wait until it has exited."""
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _started(name: str, command: list[str], port: int, log: Path, environment: dict, model: str) -> Server:
    """`command` in its own process (output to `log`), once its /health answers."""
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=environment)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1800):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return Server(name, process, url, model, log)
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"{name} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"{name} did not answer /health")


def _environment(threads: int | None) -> dict:
    """This process's environment, with OMP_NUM_THREADS set to `threads` where given."""
    environment = dict(os.environ)
    if threads is not None:
        environment["OMP_NUM_THREADS"] = str(threads)
    return environment


def start_service(args: argparse.Namespace, folder: Path, *extra: str) -> Server:
    """`densekit serve` in its own process (with `extra` options), once /health answers."""
    port = _free_port()
    command = [sys.executable, "-m", "densekit", "serve", args.model, str(args.index),
               "--corpus", str(args.data), "--port", str(port), "--api-key-file", str(folder / "key"),
               "--device", "cpu", "--served-model-name", "densekit", *args.serve_args, *extra]  # fmt: skip
    return _started("densekit", command, port, folder / "densekit.log", _environment(args.threads),
                    "densekit:query")  # fmt: skip


def start_infinity(args: argparse.Namespace, model_folder: str, folder: Path) -> Server:
    """Infinity (`infinity_emb v2`, its torch engine on the CPU) on the same model folder, with the
    same token, its routes under /v1 as OpenAI's (its /health stays where it was)."""
    port = _free_port()
    command = [str(args.infinity), "v2", "--model-id", model_folder, "--served-model-name", INFINITY_NAME,
               "--engine", "torch", "--device", "cpu", "--port", str(port), "--url-prefix", "/v1",
               "--api-key", TOKEN, "--no-vector-disk-cache", "--log-level", "warning",
               *args.infinity_args]  # fmt: skip
    environment = _environment(args.threads) | {"HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
                                                "DO_NOT_TRACK": "1"}  # fmt: skip
    return _started("infinity", command, port, folder / "infinity.log", environment, INFINITY_NAME)


def cpu_seconds(pid: int) -> float:
    """User and system CPU time process `pid` and the processes it started have used so far (Linux)."""
    total = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        if int(stat.parent.name) == pid or int(fields[1]) == pid:  # fields[1]: the parent's pid
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@dataclass
class Tally:
    """What a load run's clients saw."""

    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    lost: int = 0
    refused: int = 0


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes,
                    body: bytes) -> tuple[int, dict[bytes, bytes], bytes]:  # fmt: skip
    """One request on a kept-alive connection: its status, headers (lower-cased names) and body."""
    writer.write(head + str(len(body)).encode() + b"\r\n\r\n" + body)
    status = int((await reader.readline()).split()[1])
    headers: dict[bytes, bytes] = {}
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, await reader.readexactly(int(headers.get(b"content-length", b"0")))


async def load(url: str, path: str, bodies: list[bytes], concurrency: int,
               answered: Callable[[bytes], bool], server_pid: int | None = None) -> dict:  # fmt: skip
    """Every body POSTed once to `url + path`, `concurrency` clients each on a kept-alive connection
    taking the next body when answered; a 429 is retried after its Retry-After until answered.

    A hand-written HTTP/1.1 client: the work is one fixed kind of request, and httpx's client spent as
    much CPU a request as the service's own HTTP handling (it took most of the machine at 128)."""
    host, port = url.removeprefix("http://").split(":")
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nContent-Length: ").encode()
    tally = Tally()
    queue = list(reversed(bodies))

    async def client() -> None:
        connection = None
        while queue:
            body = queue.pop()
            start = time.perf_counter()
            while True:
                try:
                    if connection is None:
                        connection = await asyncio.open_connection(host, int(port))
                    status, headers, answer = await asyncio.wait_for(_exchange(*connection, head, body), 300)
                except (OSError, asyncio.IncompleteReadError, TimeoutError, ValueError, IndexError):
                    tally.lost += 1
                    connection = None
                    break
                if headers.get(b"connection") == b"close":
                    connection = None
                if status == 429:
                    tally.refused += 1
                    await asyncio.sleep(float(headers.get(b"retry-after", b"1")))
                    continue
                if status == 200 and answered(answer):
                    tally.latencies.append(time.perf_counter() - start)
                else:
                    tally.errors += 1
                break
        if connection is not None:
            connection[1].close()

    loads = load_average()
    server_before = cpu_seconds(server_pid) if server_pid else 0.0
    client_before = time.process_time()
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    server_cpu = cpu_seconds(server_pid) - server_before if server_pid else None
    client_cpu = time.process_time() - client_before
    return _row(concurrency, len(bodies), tally, wall, server_cpu, client_cpu, loads)


def _row(concurrency: int, requests: int, tally: Tally, wall: float, server_cpu: float | None,
         client_cpu: float, loads: list[float]) -> dict:  # fmt: skip
    ms = np.array(tally.latencies) * 1000 if tally.latencies else np.array([np.nan])
    row = {
        "concurrency": concurrency, "requests": requests, "answered": len(tally.latencies),
        "errors": tally.errors, "lost": tally.lost, "429s": tally.refused,
        "p50_ms": round(float(np.percentile(ms, 50)), 1), "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "queries_per_s": round(len(tally.latencies) / wall, 1), "wall_s": round(wall, 2),
        "load_generator_cpu_s": round(client_cpu, 2), "load_average_at_start": loads,
    }  # fmt: skip
    if server_cpu is not None:
        cores = os.cpu_count() or 1
        row["server_cpu_s"] = round(server_cpu, 2)
        row["server_cpu_share_of_machine"] = round(server_cpu / (wall * cores), 3)
        row["server_cpu_ms_per_query"] = round(1000 * server_cpu / max(len(tally.latencies), 1), 2)
    return row


def _hits_answered(k: int) -> Callable[[bytes], bool]:
    return lambda body: len(json.loads(body)["results"][0]) == k


def _embedding_answered(body: bytes) -> bool:
    return len(json.loads(body)["data"]) == 1


def model_alone(retriever: Retriever, queries: list[str], batch: int) -> dict:
    """`_model_alone` on a thread of its own, as the service encodes (its batcher's one thread): OpenMP
    keeps a team of threads per calling thread, and how long idle ones spin depends on how many there
    are (on a busy 2-core machine, called from the main thread alone, the same encoding took up to 10x
    the CPU)."""
    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(_model_alone, retriever, queries, batch).result()


def _model_alone(retriever: Retriever, queries: list[str], batch: int) -> dict:
    """The service's model in this process, with this process's threads: tokenise and forward one query
    a call, then all of them sorted by length in batches of `batch` rows (the issue's reference, "the
    model alone"), then all of them through `embed_texts` as densekit batches them (sorted, at most
    `batch` a pass, cut where padding costs more than a pass); queries/s, CPU a query (this process's,
    its compute threads included) and the single-query p50."""
    import torch

    from densekit.encoding.embed import embed_texts

    encoder = retriever.encoder
    embed_texts(encoder, queries[:batch], "query", batch)  # warm up
    single: list[float] = []
    cpu, start = time.process_time(), time.perf_counter()
    for text in queries:
        began = time.perf_counter()
        embed_texts(encoder, [text], "query", 1)
        single.append(time.perf_counter() - began)
    single_wall, single_cpu = time.perf_counter() - start, time.process_time() - cpu
    cpu, start = time.process_time(), time.perf_counter()
    token_ids = encoder.tokenize(queries, "query")
    order = np.argsort([-len(ids) for ids in token_ids], kind="stable")
    with torch.inference_mode():
        for first in range(0, len(order), batch):
            inputs = encoder.pad([token_ids[i] for i in order[first : first + batch]])
            encoder(inputs["input_ids"], inputs["attention_mask"], side="query")
    batched_wall, batched_cpu = time.perf_counter() - start, time.process_time() - cpu
    cpu, start = time.process_time(), time.perf_counter()
    embed_texts(encoder, queries, "query", batch)
    cut_wall, cut_cpu = time.perf_counter() - start, time.process_time() - cpu
    n = len(queries)
    return {
        "single_queries_per_s": round(n / single_wall, 1),
        "single_cpu_ms_per_query": round(1000 * single_cpu / n, 2),
        "single_p50_ms": round(1000 * float(np.median(single)), 2),
        f"batched_{batch}_queries_per_s": round(n / batched_wall, 1),
        f"batched_{batch}_cpu_ms_per_query": round(1000 * batched_cpu / n, 2),
        f"cut_{batch}_queries_per_s": round(n / cut_wall, 1),
        f"cut_{batch}_cpu_ms_per_query": round(1000 * cut_cpu / n, 2),
        "load_average_at_start": load_average(),
    }


def in_process(retriever: Retriever, queries: list[str], k: int) -> dict:
    """`Retriever.search` in this process: one query a call, and 32 a call."""
    retriever.search(queries[:8], k=k)  # warm up
    figures = {}
    for batch in (1, 32):
        cpu, start = time.process_time(), time.perf_counter()
        for i in range(0, len(queries), batch):
            retriever.search(queries[i : i + batch], k=k)
        wall, used = time.perf_counter() - start, time.process_time() - cpu
        figures[f"batch_{batch}_queries_per_s"] = round(len(queries) / wall, 1)
        figures[f"batch_{batch}_cpu_ms_per_query"] = round(1000 * used / len(queries), 2)
    return figures


def _best_model(first: dict, second: dict) -> dict:
    """The better of the model's two measurements, figure by figure: the higher rate, the lower CPU
    time and p50."""
    return {key: (max if key.endswith("_queries_per_s") else min)(first[key], second[key])
            for key in first if key != "load_average_at_start"}  # fmt: skip


def against_model(rows: list[dict], model: dict, batch: int) -> None:
    """Each service row as a ratio to the model alone (in place): to its sorted batches of `batch` (the
    issue's reference) and to densekit's own batching of all the queries at once (`_vs_model_cut`)."""
    cpu, rate = model[f"batched_{batch}_cpu_ms_per_query"], model[f"batched_{batch}_queries_per_s"]
    cut_cpu, cut_rate = model[f"cut_{batch}_cpu_ms_per_query"], model[f"cut_{batch}_queries_per_s"]
    for row in rows:
        row["cpu_vs_model"] = round(row["server_cpu_ms_per_query"] / cpu, 2)
        row["queries_per_s_vs_model"] = round(row["queries_per_s"] / rate, 2)
        row["cpu_vs_model_cut"] = round(row["server_cpu_ms_per_query"] / cut_cpu, 2)
        row["queries_per_s_vs_model_cut"] = round(row["queries_per_s"] / cut_rate, 2)
        if row["concurrency"] == 1:
            row["p50_minus_model_single_ms"] = round(row["p50_ms"] - model["single_p50_ms"], 1)


def embeddings_race(servers: list[Server], queries: list[str], levels: list[int]) -> dict[str, list[dict]]:
    """Both servers' /v1/embeddings at each concurrency, one single-text request a query, alternating
    which goes first; each server's CPU measured on its own process."""
    rows: dict[str, list[dict]] = {server.name: [] for server in servers}
    for number, concurrency in enumerate(levels):
        for server in servers if number % 2 == 0 else reversed(servers):
            model = server.embeddings_model
            bodies = [json.dumps({"input": [text], "model": model}).encode() for text in queries]
            row = asyncio.run(load(server.url, "/v1/embeddings", bodies, concurrency, _embedding_answered,
                                   server.process.pid))  # fmt: skip
            rows[server.name].append(row)
    return rows


def peer_ratios(ours: list[dict], peer: list[dict]) -> list[dict]:
    """densekit's /v1/embeddings figures as ratios to the peer's, concurrency by concurrency."""
    return [
        {"concurrency": a["concurrency"],
         "queries_per_s_ratio": round(a["queries_per_s"] / b["queries_per_s"], 2),
         "p50_ratio": round(a["p50_ms"] / b["p50_ms"], 2),
         "cpu_ms_per_query_ratio": round(a["server_cpu_ms_per_query"] / b["server_cpu_ms_per_query"], 2)}
        for a, b in zip(ours, peer, strict=True)
    ]  # fmt: skip


# The service's stages, each marked by frames of its code: a py-spy sample is put in the stage of the
# innermost frame that holds one of the marks of a stage before HTTP's, or, where none does, of HTTP or
# the event loop (the framework's frames wrap everything: pydantic writing a response is its building).
STAGES = [
    ("waiting", ["select (selectors.py", "wait (threading.py", "_worker (concurrent/futures/thread.py",
                 "get (queue.py"]),
    ("tokenisation", ["tokenize (densekit/models/encoder.py", "tokenization_utils", "tokenizers"]),
    ("padding", ["pad (densekit/models/encoder.py"]),
    ("forward", ["encode_with (densekit/models/encoder.py", "/torch/", "onnxruntime"]),
    ("index search", ["search_run (densekit/index", "faiss", "search (densekit/index"]),
    ("document lookup", ["get_many (densekit/retrieval/documents.py", "sqlite3"]),
    ("response building", ["serialize_response", "SearchResponse", "HitOut", "embeddings_response",
                           "embeddings_body", "search_response", "jsonable_encoder", "render (starlette",
                           "hits (densekit/retrieval/retriever.py"]),
    ("queueing and thread hops", ["to_thread", "run_in_executor", "concurrent/futures", "asyncio/queues.py",
                                  "densekit/serving/batcher", "wait_for (asyncio", "threading.py", "anyio/"]),
    ("HTTP parsing and validation", ["h11", "uvicorn/", "httptools", "starlette/", "fastapi/", "pydantic",
                                     "densekit/serving/", "prometheus"]),
    ("event loop", ["asyncio/"]),
]
UNSEEN = "forward: threads py-spy does not see (OpenMP's)"


GENERIC = ("HTTP parsing and validation", "event loop")


def _stage(frames: list[str]) -> str:
    for stages in ([s for s in STAGES if s[0] not in GENERIC], [s for s in STAGES if s[0] in GENERIC]):
        for frame in reversed(frames):
            for stage, marks in stages:
                if any(mark in frame for mark in marks):
                    return stage
    return "other"


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds each thread of process `pid` has used so far, by thread id (Linux's /proc)."""
    used = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            used[stat.parent.name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return used


def stage_breakdown(samples: Path, cpu: dict[str, float], queries: int) -> dict[str, float]:
    """CPU ms a query by stage: each thread's CPU split as its py-spy samples outside `waiting` are;
    threads py-spy does not see (OpenMP's compute threads) count as the forward pass. `samples` is
    py-spy's raw output (`--threads --idle --format raw`): one stack a line, its thread first."""
    by_thread: dict[str, dict[str, int]] = {}
    for line in samples.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():  # py-spy reads a stack as it changes: once in a while a line is garbled
            continue
        frames = stack.split(";")
        thread = frames[0].split("(")[1].split(")")[0] if "(" in frames[0] else frames[0]
        stage = _stage(frames[1:])
        by_thread.setdefault(thread, {})
        by_thread[thread][stage] = by_thread[thread].get(stage, 0) + int(count)
    stages: dict[str, float] = {}
    for thread, seconds in cpu.items():
        counts = {k: v for k, v in by_thread.get(thread, {}).items() if k != "waiting"}
        total = sum(counts.values())
        split = {k: v / total for k, v in counts.items()} if total else {UNSEEN if thread not in by_thread
                                                                         else "other": 1.0}  # fmt: skip
        for stage, share in split.items():
            stages[stage] = stages.get(stage, 0.0) + 1000 * seconds * share / queries
    return {k: round(v, 2) for k, v in sorted(stages.items(), key=lambda kv: -kv[1])}


async def profiled_load(py_spy: str, folder: Path, url: str, path: str, bodies: list[bytes], concurrency: int,
                        answered: Callable[[bytes], bool], pid: int) -> dict:  # fmt: skip
    """`load`, with py-spy sampling the server and its threads' CPU counted, the row's `profile` the CPU
    ms a query each stage took."""
    samples = folder / f"py-spy-search-{concurrency}.txt"
    spy = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--idle", "--threads", "--nonblocking",
                            "--rate", "200", "--format", "raw", "-o", str(samples)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    await asyncio.sleep(1.0)  # py-spy attached
    before = thread_cpu(pid)
    row = await load(url, path, bodies, concurrency, answered, pid)
    after = thread_cpu(pid)
    spy.send_signal(signal.SIGINT)
    spy.wait(timeout=120)
    used = {tid: after[tid] - before.get(tid, 0.0) for tid in after if after[tid] > before.get(tid, 0.0)}
    row["profile_cpu_ms_per_query"] = stage_breakdown(samples, used, max(row["answered"], 1))
    return row


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


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--index", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--requests", type=int, default=300, help="queries sent at each concurrency")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 128])
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for the servers and torch threads for "
                        "the model alone (default: torch's own, one a core)")  # fmt: skip
    parser.add_argument("--model-batch", type=int, default=32, help="the model-alone batch size")
    parser.add_argument("--serve-args", type=shlex.split, default=[], help="more options for `densekit "
                        "serve`, as one string: --serve-args='--max-wait-ms 0 --precision bf16'")  # fmt: skip
    parser.add_argument("--infinity", type=Path, help="the infinity_emb executable of Infinity's own "
                        "environment: also race both /v1/embeddings endpoints")  # fmt: skip
    parser.add_argument("--infinity-args", type=shlex.split, default=[], help="more options for Infinity")
    parser.add_argument("--overload-queue", type=int, help="also run the highest concurrency against a "
                        "service with --max-queued set to this, to count 429s")  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="sample the service's /search rows with "
                        "py-spy (beside this Python) and split its CPU a query by stage")  # fmt: skip
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--screenshot", type=Path, help="save the search page here (PNG)")
    parser.add_argument("--work", type=Path, default=WORK / "serving", help="where results go "
                        "(serving.json) unless --output is given")  # fmt: skip
    parser.add_argument("--output", type=Path, help="the results file (committed results: "
                        "benchmarks/results/serving.json)")  # fmt: skip
    return parser.parse_args()


def main() -> None:
    """Run the load test and write the results file."""
    args = _arguments()
    output = args.output or args.work / "serving.json"
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    queries_by_id, _ = Dataset.open(args.data).split_queries("test")
    texts = list(queries_by_id.values())
    queries = (texts * (args.requests // len(texts) + 1))[: args.requests]
    retriever = Retriever.open(args.model, args.index, args.data, device="cpu")
    model_first = model_alone(retriever, queries, args.model_batch)
    with tempfile.TemporaryDirectory() as name:
        folder = Path(name)
        (folder / "key").write_text(TOKEN + "\n")
        served, embeddings, info, first_hit, overload = _services(args, retriever, folder, queries, texts)
    model_second = model_alone(retriever, queries, args.model_batch)
    own = in_process(retriever, queries, args.k)
    model = _best_model(model_first, model_second)
    against_model(served, model, args.model_batch)
    result = {
        "command": " ".join(["python -m benchmarks.serving", *sys.argv[1:]]),
        "machine": machine_info(),
        "model": args.model, "index": str(args.index), "data": str(args.data), "k": args.k,
        "threads": info.get("threads"), "service_info": info,
        "model_alone": {"before_services": model_first, "after_services": model_second, "best": model},
        "service": served, "overload": overload, "in_process": own, "embeddings": embeddings,
        "screenshot": {"path": str(args.screenshot), "query": texts[0], "first_hit": first_hit}
        if args.screenshot else None,
    }  # fmt: skip
    write_text_atomic(output, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    print(f"written to {output}", file=sys.stderr)


async def _search_row(args: argparse.Namespace, folder: Path, service: Server, bodies: list[bytes],
                      concurrency: int) -> dict:  # fmt: skip
    """The /search row at `concurrency`, profiled with --profile."""
    answered = _hits_answered(args.k)
    if not args.profile:
        return await load(service.url, "/search", bodies, concurrency, answered, service.process.pid)
    py_spy = str(Path(sys.executable).parent / "py-spy")
    kept = (args.output or args.work / "serving.json").parent  # the samples, beside the results
    kept.mkdir(parents=True, exist_ok=True)
    return await profiled_load(py_spy, kept, service.url, "/search", bodies, concurrency, answered,
                               service.process.pid)  # fmt: skip


def _services(args: argparse.Namespace, retriever: Retriever, folder: Path, queries: list[str],
              texts: list[str]) -> tuple[list[dict], dict | None, dict, str | None, dict | None]:  # fmt: skip
    """The service's /search rows, the /v1/embeddings race (with --infinity), the service's /info, the
    screenshot's first hit and the overload row."""
    search_bodies = [json.dumps({"query": text, "k": args.k}).encode() for text in queries]
    service = start_service(args, folder)
    peer = start_infinity(args, resolve_model_path(args.model), folder) if args.infinity else None
    try:
        info = httpx.get(f"{service.url}/info", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        asyncio.run(load(service.url, "/search", search_bodies[:32], 4, _hits_answered(args.k)))  # warm up
        served = [asyncio.run(_search_row(args, folder, service, search_bodies, c)) for c in args.concurrency]
        embeddings = None
        if peer is not None:
            rows = embeddings_race([service, peer], queries, args.concurrency)
            embeddings = {"densekit": rows["densekit"], "infinity": rows["infinity"],
                          "densekit_vs_infinity": peer_ratios(rows["densekit"], rows["infinity"]),
                          "infinity_args": args.infinity_args}  # fmt: skip
        first_hit = screenshot(service.url, texts[0], args.screenshot) if args.screenshot else None
    finally:
        service.stop()
        if peer is not None:
            peer.stop()
    overload = None
    if args.overload_queue:
        queue = str(args.overload_queue)
        service = start_service(args, folder, "--max-queued", queue, "--max-queries", queue)
        try:
            asyncio.run(load(service.url, "/search", search_bodies[:16], 4, _hits_answered(args.k)))
            overload = asyncio.run(load(service.url, "/search", search_bodies, max(args.concurrency),
                                        _hits_answered(args.k), service.process.pid))  # fmt: skip
            overload["max_queued"] = args.overload_queue
        finally:
            service.stop()
    return served, embeddings, info, first_hit, overload


if __name__ == "__main__":
    main()
