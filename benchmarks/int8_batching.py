"""Whether a passage's vector depends on the passages batched with it, per ONNX Runtime precision.

Dynamic int8 quantisation scales each batch's activations by that batch's range, so an int8 vector
can change with its batch; float32 should not. Encodes a corpus's first N passages through
`densekit encode`'s ONNX export (`use_backend`), each alone and all N in one padded batch, and
reports the least and mean cosine between the two. Run from the repository root:

    .venv/bin/python -m benchmarks.int8_batching --data runs/wiki/data-wiki-100k --passages 32 \
        --output benchmarks/results/int8_batching.json
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np

from benchmarks.machine import machine_info

MODEL = "sentence-transformers/all-MiniLM-L6-v2"


def cosines(precision: str, texts: list[str], model: str) -> np.ndarray:
    """Each text's cosine between its vector encoded alone and encoded in one batch with the rest."""
    from densekit.encoding.runtimes import use_backend
    from densekit.models import DenseEncoder

    encoder = DenseEncoder.load(model).eval()
    use_backend(encoder, "onnx", precision, sides=("passage",))

    def vectors(batch: list[str]) -> np.ndarray:
        padded = encoder.pad(encoder.tokenize(batch, "passage"))
        return encoder.runtime(padded["input_ids"], padded["attention_mask"], "passage").numpy()

    together = vectors(texts)
    alone = np.concatenate([vectors([text]) for text in texts])
    norms = np.linalg.norm(together, axis=1) * np.linalg.norm(alone, axis=1)
    return (together * alone).sum(axis=1) / norms


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, required=True, help="a collection folder (its corpus is read)")
    parser.add_argument("--passages", type=int, default=32, help="the first N passages, one batch")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    if args.passages < 2:
        parser.error(f"--passages {args.passages}: give at least 2, to batch them")
    from densekit.data.dataset import Dataset

    corpus = Dataset.open(args.data).iter_corpus()
    texts = [document.full_text for document in itertools.islice(corpus, args.passages)]  # as encoded
    command = f"python -m benchmarks.int8_batching --data {args.data} --passages {args.passages}"
    results = {"command": command, "machine": machine_info(), "model": args.model, "passages": len(texts),
               "precisions": {}}  # fmt: skip
    for precision in ("int8", "float32"):
        found = cosines(precision, texts, args.model)
        results["precisions"][precision] = {"least_cosine": float(found.min()),
                                            "mean_cosine": float(found.mean())}  # fmt: skip
        print(f"{precision}: least cosine {found.min():.8f}, mean {found.mean():.8f}")
    args.output.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
