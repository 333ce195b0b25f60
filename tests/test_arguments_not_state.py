"""Arguments instead of shared state (issue 65, item 3): the module to encode with is passed down, the
inference runtime is part of an artefact's identity without the caller's help, and one module decides
the CPU padding policy."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import densekit.encoding.embed as embed_module
from densekit import inference
from densekit.encoding import onnx_backend
from densekit.encoding.embed import embed_texts
from densekit.encoding.onnx_backend import OnnxEncoder
from densekit.models import DenseEncoder, packed, padding
from densekit.models.modules.kinds.lora import LoraSpec

SOURCE = Path(__file__).resolve().parents[1] / "src" / "densekit"
TEXTS = [
    "question about cats and kittens",
    "bread flour and an oven, and the long story of how a loaf rises in a warm kitchen",
    "a text about trains",
    "moon",
]


@pytest.fixture
def encoder(tiny_model: Path) -> DenseEncoder:
    """The tiny base with two trained-looking LoRA modules, a and b, and no module of its own."""
    encoder = DenseEncoder.load(tiny_model, pooling="mean", normalize=True).eval()
    for seed, name in enumerate("ab", start=1):
        module = encoder.new_module(LoraSpec(name=name, rank=4, alpha=8, dropout=0.0))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for tower in module.towers().values():
                for parameter in tower.own_parameters().values():
                    parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    return encoder


def test_two_modules_encoded_at_once_from_threads_each_give_their_vectors_alone(encoder: DenseEncoder):
    alone = {name: embed_texts(encoder, TEXTS, "query", 2, module=name) for name in ("a", "b", None)}
    assert np.abs(alone["a"] - alone["b"]).max() > 1e-3 and np.abs(alone["a"] - alone[None]).max() > 1e-3
    each_from_threads_at_once(lambda name: embed_texts(encoder, TEXTS, "query", 2, module=name), alone, 4)


def each_from_threads_at_once(encode, alone: dict, copies: int) -> None:
    """`encode(name)` for each name of `alone`, `copies` threads each, all started at once and three
    times each: every call gives what the name gave alone."""
    names = list(alone) * copies
    start = threading.Barrier(len(names))
    results: dict[int, np.ndarray] = {}

    def run(number: int, name: str | None) -> None:
        start.wait()
        for _ in range(3):
            results[number] = encode(name)
            if not np.array_equal(results[number], alone[name]):
                return

    threads = [threading.Thread(target=run, args=(n, name)) for n, name in enumerate(names)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for number, name in enumerate(names):
        np.testing.assert_array_equal(results[number], alone[name], err_msg=f"module {name}")


def test_encoding_with_a_module_leaves_what_a_later_default_encode_returns(encoder: DenseEncoder):
    before = embed_texts(encoder, TEXTS, "passage")
    with_a = embed_texts(encoder, TEXTS, "passage", module="a")
    assert np.abs(with_a - before).max() > 1e-3
    assert encoder.own is None
    np.testing.assert_array_equal(embed_texts(encoder, TEXTS, "passage"), before)
    with pytest.raises(KeyError, match="holds: a, b"):
        embed_texts(encoder, TEXTS, "passage", module="c")


def test_no_module_switch_is_left_to_call():
    assert not hasattr(DenseEncoder, "activate") and "active" not in DenseEncoder.__init__.__code__.co_names
    callers = [path for path in SOURCE.rglob("*.py") if ".activate(" in path.read_text(encoding="utf-8")]
    assert callers == []


def test_an_artefacts_identity_holds_the_runtime_and_precision_without_the_callers_help(
    encoder: DenseEncoder, beir_dir: Path
):
    from densekit.data import Dataset
    from densekit.encoding.corpus import embedding_identity

    assert not hasattr(onnx_backend, "with_inference") and not hasattr(onnx_backend, "inference_record")
    record = {"model": {"weights": "w"}, "k": 5}
    assert encoder.artefact_identity(record) is record  # PyTorch at float32: as records always were
    torch_bf16 = {"backend": "torch", "precision": "bf16"}
    assert encoder.artefact_identity(record, "bf16") == {**record, "inference": torch_bf16}
    dataset = Dataset.open(beir_dir)
    plain = embedding_identity(encoder, dataset, 1, None)
    assert list(plain) == ["model", "corpus", "shards", "maxp"]  # the keys written before, in their order
    encoder.runtime = OnnxEncoder({}, "int8", None)  # what use_backend("onnx") sets, less its sessions
    try:
        exported = embedding_identity(encoder, dataset, 1, None)
        assert encoder.artefact_identity(record, "bf16")["inference"] == {
            "backend": "onnx",
            "precision": "int8",
        }
    finally:
        encoder.runtime = None
    assert exported == {**plain, "inference": {"backend": "onnx", "precision": "int8"}}
    assert embedding_identity(encoder, dataset, 1, None, "fp16")["inference"]["precision"] == "fp16"


def test_the_packing_decision_comes_from_one_function(encoder: DenseEncoder, monkeypatch):
    assert not hasattr(packed, "worth_packing") and not hasattr(packed, "PACK_ABOVE_PADDING")
    assert not hasattr(inference, "CPU_PASS_TOKENS")
    inputs = encoder.pad(encoder.tokenize(TEXTS, "query"))
    assert not inputs["attention_mask"].all()
    whole_passes: list[int] = []  # transformers' forward pass over the padded batch, each time it runs
    hook = encoder.backbone("query").register_forward_hook(lambda *_: whole_passes.append(1))
    try:
        for worth, whole in ((True, 0), (False, 1)):
            monkeypatch.setattr(padding, "worth_packing", lambda mask, worth=worth: worth)
            whole_passes.clear()
            with torch.inference_mode():
                encoder(inputs["input_ids"], inputs["attention_mask"], side="query")
            assert len(whole_passes) == whole, worth
    finally:
        hook.remove()

    asked: list[bool] = []
    monkeypatch.setattr(
        padding, "pass_cost", lambda device, computes_padding=True: asked.append(computes_padding) or 7
    )
    costs: list[int | None] = []
    real = embed_module.infer_in_batches
    monkeypatch.setattr(
        embed_module, "infer_in_batches", lambda *args: (costs.append(args[-1]), real(*args))[1]
    )
    embed_texts(encoder, TEXTS, "query", module="a")  # a module's towers compute their padding
    embed_texts(encoder, TEXTS, "query")  # the base alone, a BERT on a CPU: packed
    assert asked == [True, False] and costs == [7, 7]
