"""What the GPU suite (`benchmarks/gpu_suite.py`) works on: models of all-MiniLM-L6-v2's and BERT-base's
shapes with seeded random weights, and the data a lent GPU machine cannot reach.

The device machine has no network and carries at most 64 MiB, so all-MiniLM-L6-v2's weights (87 MiB)
cannot travel: its config and tokenizer files do, and the weights are drawn there from a fixed seed,
the same bits on any machine (uniform draws of torch's CPU generator, scaled exactly; the checksum of
every tensor is recorded so that a run can show it started where the CPU reference did). Timings do not
depend on the weights. Prepare the carried inputs, once, here, from the repository root:

    .venv/bin/python -m benchmarks.gpu_inputs --shared ../shared/data --out .dkdata/gpu_suite

(`benchmarks/gpu_prepare.sh` runs it after the shared wheels script).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

# The files of the bundled all-MiniLM-L6-v2 that a random model of its shape needs (no weights).
TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                   "special_tokens_map.json")  # fmt: skip
MINILM_FILES = "minilm"
TRAIN_FILE = "scifact_train.jsonl"
WIKI_SAMPLE = "wiki1m_sample.jsonl.gz"
WIKI_PASSAGES = 1_004_001  # passages in wiki1m (../shared/data/README.md)
INPUTS_FILE = "inputs.json"
INIT_STD = 0.02  # BERT's initializer_range


@dataclass(frozen=True)
class Shape:
    """A BERT encoder's size."""

    name: str
    hidden: int
    layers: int
    heads: int
    intermediate: int

    def flops_per_token(self, length: int) -> float:
        """Forward-pass multiply-adds times two per token of a sequence of `length` tokens: the four
        attention projections and the two feed-forward products (24 h^2 a layer) and the attention's
        two products over the sequence (4 s h a layer); embeddings and pooling are negligible."""
        return self.layers * (8 * self.hidden**2 + 4 * self.hidden * self.intermediate
                              + 4 * length * self.hidden)  # fmt: skip


MINILM = Shape("all-MiniLM-L6-v2", 384, 6, 12, 1536)
BERT_BASE = Shape("bert-base", 768, 12, 12, 3072)
# The smoke run's stand-ins: the same code on shapes a loaded 2-core CPU runs in seconds.
TINY_MINILM = Shape("tiny (for all-MiniLM-L6-v2)", 32, 2, 2, 64)
TINY_BERT_BASE = Shape("tiny (for bert-base)", 64, 2, 2, 128)


def seeded_weights(model, seed: int) -> str:
    """Overwrite every parameter of `model` from `seed` (sorted by name: LayerNorm weights 1, biases 0,
    the rest uniform with BERT's standard deviation, 0.02) and return the sha256 of the result.

    Uniform draws are 24-bit integers scaled by powers of two and one float32 product, exact on any CPU,
    where torch's normal draws take vectorised transcendental paths that differ between CPUs."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    bound = INIT_STD * math.sqrt(3.0)
    with torch.no_grad():
        for name, parameter in sorted(model.named_parameters()):
            if name.endswith("bias"):
                values = torch.zeros(parameter.shape)
            elif "LayerNorm" in name:
                values = torch.ones(parameter.shape)
            else:
                values = (torch.rand(parameter.shape, generator=generator) * 2 - 1) * bound
            parameter.copy_(values)
    return weights_checksum(model)


def weights_checksum(model) -> str:
    """sha256 over every parameter's name and float32 bytes, in name order."""
    digest = hashlib.sha256()
    for name, parameter in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(parameter.detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def build_model(files: Path, shape: Shape, folder: Path, seed: int, max_length: int,
                dropout: bool = True) -> str:  # fmt: skip
    """Save a sentence-transformers folder at `folder`: a BERT of `shape` with `seeded_weights`, the
    tokenizer in `files`, mean pooling and normalisation (all-MiniLM-L6-v2's head); returns the weights'
    checksum. Without `dropout`, its rates are 0 (a run that two machines must repeat alike)."""
    from transformers import BertConfig, BertModel

    config = BertConfig.from_pretrained(files)
    config.update({"hidden_size": shape.hidden, "num_hidden_layers": shape.layers,
                   "num_attention_heads": shape.heads, "intermediate_size": shape.intermediate})  # fmt: skip
    if not dropout:
        config.update({"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0})
    model = BertModel(config)
    checksum = seeded_weights(model, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES[1:]:
        shutil.copy(files / name, folder / name)
    modules = [("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize")]
    (folder / "modules.json").write_text(json.dumps([
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (kind, path) in enumerate(modules)
    ]))  # fmt: skip
    (folder / "1_Pooling").mkdir(exist_ok=True)
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": shape.hidden, "pooling_mode_mean_tokens": True})
    )
    (folder / "2_Normalize").mkdir(exist_ok=True)
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_length}))
    return checksum


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def read_jsonl_gz(path: Path) -> list[dict]:
    """Every JSON object of a gzip-compressed JSONL file."""
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def prepare(shared: Path, out: Path, wiki_corpus: Path | None = None, wiki_sample: int = 4096,
            wiki_first: bool = False, model_files: Path | None = None) -> dict:  # fmt: skip
    """Write into `out` what the suite reads besides SciFact itself: the tokenizer files of
    all-MiniLM-L6-v2 (from `model_files`, default the bundled copy), SciFact's training queries with one
    BM25 negative each (mined by densekit), and `wiki_sample` passages of wiki1m's corpus (evenly spaced
    over it, or its first ones with `wiki_first`, which reads only those); returns what it wrote."""
    from densekit.data import Dataset
    from densekit.mining.filters import MiningSettings
    from densekit.mining.mine import mine
    from densekit.models import resolve_model_path

    out.mkdir(parents=True, exist_ok=True)
    source = Path(model_files or resolve_model_path("sentence-transformers/all-MiniLM-L6-v2"))
    (out / MINILM_FILES).mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, out / MINILM_FILES / name)
    train = out / TRAIN_FILE
    settings = MiningSettings(first_rank=1, last_rank=30, count=1)
    mine(Dataset.open(shared / "scifact"), "train", train, "bm25", settings, show_progress=False,
         overwrite=True)  # fmt: skip
    wiki_corpus = wiki_corpus or shared / "wiki1m" / "corpus.jsonl.gz"
    stride = 1 if wiki_first else max(1, WIKI_PASSAGES // wiki_sample)
    with gzip.open(wiki_corpus, "rt", encoding="utf-8") as handle:
        lines = itertools.islice(handle, 0, None, stride)
        sample = [line for line in itertools.islice(lines, wiki_sample)]
    with gzip.open(out / WIKI_SAMPLE, "wt", encoding="utf-8") as handle:
        handle.writelines(sample)
    inputs = {
        "train_file": TRAIN_FILE,
        "train_sha256": file_sha256(train),
        "wiki_sample": WIKI_SAMPLE,
        "wiki_passages": len(sample),
        "wiki_stride": stride,
        "model_files": MINILM_FILES,
        "shapes": {shape.name: asdict(shape) for shape in (MINILM, BERT_BASE)},
    }
    (out / INPUTS_FILE).write_text(json.dumps(inputs, indent=2) + "\n")
    return inputs


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shared", type=Path, default=Path("../shared/data"))
    parser.add_argument("--out", type=Path, default=Path(".dkdata/gpu_suite"))
    parser.add_argument("--wiki-sample", type=int, default=4096, help="wiki1m passages carried")
    args = parser.parse_args()
    print(json.dumps(prepare(args.shared, args.out, wiki_sample=args.wiki_sample), indent=2))


if __name__ == "__main__":
    main()
