"""What depends on the device the work runs on: training steps (GradCache's replayed dropout, mixed
precision, fp16's loss scaling, resuming), encoding and exact search, each against the CPU.

Marked `cuda`: run with `--device cuda` on a GPU machine (the GPU suite, benchmarks/gpu_suite.py, runs
them first); `--device cpu` runs them on the CPU, which checks the tests themselves (the GPU-only ones
skip); without --device they are skipped, so CI never needs a GPU.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch

import densekit
from densekit.encoding.embed import embed_texts
from densekit.index.exact_search import _top_k_of_blocks, exact_top_k
from densekit.models import DenseEncoder
from densekit.training.contrastive import contrastive_loss
from densekit.training.fine_tuning import run_training
from densekit.training.grad_cache import split_inputs
from densekit.training.trainer import Trainer

from .conftest import CORPUS
from .test_training import (
    final_weights,
    gradients,
    killed_at_step_five,
    make_config,
    make_task,
    max_difference,
)

pytestmark = pytest.mark.cuda
CACHE = {"enabled": True, "chunk_size": 3}


def needs_gpu(device: torch.device) -> None:
    if device.type != "cuda":
        pytest.skip("a GPU's behaviour: run with --device cuda")


def on_cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.cpu() for name, tensor in tensors.items()}


def test_grad_cache_replays_dropout_on_the_device(collection, tiny_model: Path, run_device: torch.device):
    """GradCache's second pass draws the first pass's dropout masks from the device's generator."""
    config = make_config(collection, tiny_model, optim={"batch_size": 8}, grad_cache=CACHE)
    task = make_task(config)
    task.encoder.to(run_device)
    batch = task.batch(0, 0)
    assert task.encoder.training

    torch.manual_seed(0)  # the reference: the same chunks in the same order, each with its graph
    queries = torch.cat([task._encode("query")(c)[0] for c in split_inputs(batch.queries, 3)])
    passages = torch.cat([task._encode("passage")(c)[0] for c in split_inputs(batch.passages, 3)])
    false_negatives = None if batch.false_negatives is None else batch.false_negatives.to(run_device)
    reference_loss = contrastive_loss(queries, passages, 3, task.temperature, True, false_negatives)
    reference_loss.backward()
    reference = gradients(task.encoder)
    task.encoder.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    cached = task.forward_backward(batch)
    assert abs(float(cached["loss"]) - float(reference_loss)) < 1e-10
    assert max_difference(gradients(task.encoder), reference) < 1e-5
    assert max(float(g.abs().max()) for g in reference.values()) > 1e-3


@pytest.mark.parametrize("cache", [{"enabled": False}, CACHE], ids=["plain", "grad-cache"])
def test_the_device_gives_the_cpus_loss_and_gradients(
    collection, still_model: Path, run_device: torch.device, cache: dict
):
    config = make_config(collection, still_model, optim={"batch_size": 8}, grad_cache=cache)
    cpu, device = make_task(config), make_task(config)
    device.encoder.to(run_device)
    cpu_loss = cpu.forward_backward(cpu.batch(1, 0))["loss"]
    device_loss = device.forward_backward(device.batch(1, 0))["loss"]
    assert abs(float(cpu_loss) - float(device_loss)) < 1e-10
    assert max_difference(gradients(cpu.encoder), on_cpu(gradients(device.encoder))) < 1e-9


def test_bf16_on_the_device_trains_close_to_float32(collection, still_model: Path, run_device: torch.device):
    full = make_task(make_config(collection, still_model, optim={"batch_size": 4}), dtype=torch.float32)
    half = make_task(make_config(collection, still_model, optim={"batch_size": 4, "precision": "bf16"}),
                     dtype=torch.float32)  # fmt: skip
    full.encoder.to(run_device)
    half.encoder.to(run_device)
    full_loss = float(full.forward_backward(full.batch(0, 0))["loss"])
    half_loss = float(half.forward_backward(half.batch(0, 0))["loss"])
    assert half_loss != full_loss and abs(half_loss - full_loss) < 0.02 * abs(full_loss)
    a, b = gradients(full.encoder), gradients(half.encoder)
    flat_a, flat_b = torch.cat([a[k].flatten() for k in a]), torch.cat([b[k].flatten() for k in a])
    assert float(torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0)) > 0.99


@pytest.mark.parametrize("precision", ["float32", "fp16"])
def test_a_killed_run_resumes_to_the_weights_of_a_straight_one(
    collection, tiny_model: Path, tmp_path: Path, monkeypatch, run_device: torch.device, precision: str
):
    """The device's random state (dropout) and fp16's loss scale come back from the checkpoint. The GPU's
    attention backward adds in no fixed order, so there the weights agree to rounding, not bit for bit."""
    if precision == "fp16":
        needs_gpu(run_device)
    config = make_config(collection, tiny_model, device=str(run_device), optim={"precision": precision})
    run_training(config, tmp_path / "straight", show_progress=False)
    killed_at_step_five(monkeypatch, config, tmp_path / "resumed")
    assert run_training(config, tmp_path / "resumed", resume=True, show_progress=False)["step"] == 6

    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert max_difference(straight, resumed) <= (1e-5 if run_device.type == "cuda" else 0.0)
    start = safetensors.torch.load_file(str(tiny_model / "model.safetensors"))
    assert any(not torch.equal(start[k], straight[k]) for k in straight if k in start)  # it trained
    losses = [json.loads(line)["loss"] for line in (tmp_path / "resumed" / "train_log.jsonl").open()]
    assert len(losses) == 6 and all(np.isfinite(losses))


def test_a_training_step_waits_for_the_gpu_nowhere_in_densekit(
    collection, tiny_model: Path, tmp_path: Path, run_device: torch.device
):
    """No read of a GPU tensor and no blocking copy in densekit's code during a step (GradCache or not):
    the host queues the next batch while the GPU computes. transformers' own waits are not densekit's."""
    needs_gpu(run_device)
    package = Path(densekit.__file__).parent
    for cache in ({"enabled": False}, CACHE):
        config = make_config(collection, tiny_model, device="cuda", grad_cache=cache)
        task = make_task(config, dtype=torch.float32)
        task.encoder.to(run_device)
        trainer = Trainer(task, config.optim, config.checkpoint, tmp_path, "", show_progress=False)
        assert all(group["fused"] for group in trainer.optimizer.param_groups)
        trainer._one_step()  # the first step allocates (pinned buffers, the optimizer's state)
        trainer.state["step"] += 1
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                trainer._one_step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        ours = [f"{w.filename}:{w.lineno}" for w in caught if Path(w.filename).is_relative_to(package)]
        assert ours == [], f"grad_cache {cache['enabled']}: a step waits for the GPU at {ours}"


def test_encoding_on_the_device_gives_the_cpus_vectors(tiny_model: Path, run_device: torch.device):
    texts = [f"{doc['title']} {doc['text']}" * (1 + i % 3) for i, doc in enumerate(CORPUS)]
    encoder = DenseEncoder.load(tiny_model, pooling="mean", normalize=True)
    cpu = embed_texts(encoder, texts, "passage", batch_size=3)
    encoder.to(run_device)
    on_device = embed_texts(encoder, texts, "passage", batch_size=3)
    bf16 = embed_texts(encoder, texts, "passage", batch_size=3, precision="bf16")
    assert np.abs(cpu - on_device).max() < 1e-5
    assert (bf16 * on_device).sum(axis=1).min() > 0.99  # unit vectors: their cosine


def test_exact_search_of_device_tensors_finds_the_cpus_results(run_device: torch.device):
    """The GPU suite searches on the GPU with exact search's own blocks of rows, on device tensors."""
    generator = np.random.default_rng(0)
    vectors = generator.standard_normal((3000, 16), dtype=np.float32)
    queries = generator.standard_normal((50, 16), dtype=np.float32)
    scores, rows = exact_top_k(vectors, queries, 10)
    table, asked = torch.from_numpy(vectors).to(run_device), torch.from_numpy(queries).to(run_device)
    device_scores, device_rows = _top_k_of_blocks(table, asked, 10, 1024)
    assert np.array_equal(device_rows.cpu().numpy(), rows)
    assert np.allclose(device_scores.cpu().numpy(), scores, atol=1e-5)
