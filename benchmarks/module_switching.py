"""Switching modules on one loaded base: densekit's choice of a module per call against peft's
`set_adapter`, same run.

One all-MiniLM-L6-v2 base carries several LoRA modules. densekit takes the module as an argument of each
call and looks its tower up (`encoder.chosen(name)`, what `module=` costs; the result keeps its earlier
key, `densekit_activate_s`); peft's own way is one PeftModel holding the same adapters and
`set_adapter(name)`. Both are timed over many switches, beside the time to encode one batch of
passages (batch size 32, 256 tokens) with a module, which a switch should cost well under 1% of.
Run from the repository root:

    .venv/bin/python -m benchmarks.module_switching --data ../shared/data/scifact
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import peft
import torch

from benchmarks import WORK
from benchmarks.machine import machine_info
from densekit.data import Dataset
from densekit.encoding.embed import embed_texts
from densekit.models import DenseEncoder, resolve_model_path
from densekit.models.modules.kinds.lora import LoraSpec


def seconds_per_call(work, calls: int) -> float:
    """Median over 5 rounds of the mean seconds of `calls` calls of `work`."""
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for i in range(calls):
            work(i)
        rounds.append((time.perf_counter() - start) / calls)
    return statistics.median(rounds)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", type=Path, default=Path("../shared/data/scifact"))
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--modules", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--switches", type=int, default=2000)
    parser.add_argument("--note", default="", help="conditions of the run worth recording")
    parser.add_argument("--output", type=Path, default=WORK / "module_switching.json")
    args = parser.parse_args()

    path = resolve_model_path(args.model)
    texts = [
        doc.full_text
        for _, doc in zip(range(args.batch_size), Dataset.open(args.data).iter_corpus(), strict=False)
    ]
    encoder = DenseEncoder.load(path, passage_max_length=256).eval()
    names = [f"m{i}" for i in range(args.modules)]
    for name in names:
        encoder.new_module(LoraSpec(name=name))
    with torch.no_grad():
        for module in encoder.attached.values():
            for parameter in module.query_tower.own_parameters().values():
                parameter.normal_(std=0.01)

    peer = peft.get_peft_model(
        DenseEncoder.load(path).query_backbone, peft.LoraConfig(r=16), adapter_name=names[0]
    )
    for name in names[1:]:
        peer.add_adapter(name, peft.LoraConfig(r=16))

    ours = seconds_per_call(lambda i: encoder.chosen(names[i % len(names)]), args.switches)
    theirs = seconds_per_call(lambda i: peer.set_adapter(names[i % len(names)]), args.switches)
    embed_texts(encoder, texts, "passage", args.batch_size, module=names[0])  # warm-up
    batch = seconds_per_call(
        lambda i: embed_texts(encoder, texts, "passage", args.batch_size, module=names[0]), 1
    )
    result = {
        "command": "python -m benchmarks.module_switching "
        + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("output", "note")
        ),
        "modules_on_one_base": args.modules,
        "densekit_activate_s": ours,
        "peft_set_adapter_s": theirs,
        "speed_ratio_densekit_over_peft": theirs / ours,
        "encode_one_batch_s": batch,
        "switch_share_of_one_batch": ours / batch,
        "note": args.note,
        "machine": machine_info(),
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))


if __name__ == "__main__":
    main()
