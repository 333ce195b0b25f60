"""The trainer: GradCache against the full batch, two processes against one, resumed against straight."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from densekit.configuration import validate_config
from densekit.encoding.embed import embed_texts
from densekit.models import DenseEncoder
from densekit.training import distributed
from densekit.training.config import TrainConfig
from densekit.training.contrastive import ContrastiveTask, contrastive_loss
from densekit.training.examples import read_examples
from densekit.training.grad_cache import split_inputs
from densekit.training.run import run_training
from densekit.training.trainer import Trainer

from .conftest import tiny_bert
from .training_fixtures import write_training_collection


@pytest.fixture(scope="module")
def collection(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return write_training_collection(tmp_path_factory.mktemp("train") / "data")


@pytest.fixture(scope="module")
def still_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT without dropout, for comparisons that must not depend on random masks."""
    path = tiny_bert(tmp_path_factory.mktemp("still") / "model")
    config = json.loads((path / "config.json").read_text())
    config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    (path / "config.json").write_text(json.dumps(config))
    return path


def make_config(collection: tuple[Path, Path], model_path: Path, **sections) -> TrainConfig:
    root, train = collection
    tree = {
        "model": {"path": str(model_path), "pooling": "mean"},
        "data": {"path": str(root), "train": str(train), "group_size": 3},
        "optim": {"batch_size": 4, "learning_rate": 1e-3, "max_steps": 6, "warmup_ratio": 0.2},
        "checkpoint": {"every": 3, "keep": 5},
        "log_every": 1,
        "device": "cpu",
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            tree.setdefault(section, {}).update(values)
        else:
            tree[section] = values
    return validate_config(tree, TrainConfig, "<test>")


def make_task(config: TrainConfig, dtype=torch.float64) -> ContrastiveTask:
    encoder = DenseEncoder.load(config.model.path, pooling=config.model.pooling).to(dtype)
    texts = {}
    from densekit.data import Dataset

    for doc in Dataset.open(config.data.path).iter_corpus():
        texts[doc.id] = doc.full_text
    return ContrastiveTask(encoder, read_examples(Path(config.data.train)), texts, config)


def gradients(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_grad_cache_equals_the_full_batch_with_dropout_replayed(collection, tiny_model: Path):
    config = make_config(
        collection, tiny_model, optim={"batch_size": 8}, grad_cache={"enabled": True, "chunk_size": 3}
    )
    task = make_task(config)
    batch = task.batch(0, 0)
    assert task.encoder.training  # dropout is on

    torch.manual_seed(0)  # reference: the same chunks in the same order, each with its graph
    queries = torch.cat([task._encode("query")(c)[0] for c in split_inputs(batch.queries, 3)])
    passages = torch.cat([task._encode("passage")(c)[0] for c in split_inputs(batch.passages, 3)])
    reference_loss = contrastive_loss(queries, passages, 3, config.loss.temperature, True)
    reference_loss.backward()
    reference_loss = reference_loss.detach()
    reference = gradients(task.encoder)
    task.encoder.zero_grad(set_to_none=True)

    torch.manual_seed(0)
    cached = task.forward_backward(batch)
    assert abs(cached["loss"] - reference_loss.item()) < 1e-10
    assert max_difference(gradients(task.encoder), reference) < 1e-5
    assert max(float(g.abs().max()) for g in reference.values()) > 1e-3  # a real gradient, not zeros


def test_grad_cache_equals_one_pass_over_the_whole_batch(collection, still_model: Path):
    """Without dropout, chunked caching matches the plain full-batch step, temperature included."""
    plain = make_task(
        make_config(collection, still_model, optim={"batch_size": 8}, loss={"temperature": 0.02})
    )
    cached = make_task(
        make_config(collection, still_model, optim={"batch_size": 8}, loss={"temperature": 0.02},
                    grad_cache={"enabled": True, "chunk_size": 2})
    )  # fmt: skip
    plain_loss = plain.forward_backward(plain.batch(1, 0))["loss"]
    cached_loss = cached.forward_backward(cached.batch(1, 0))["loss"]
    assert abs(plain_loss - cached_loss) < 1e-10
    assert max_difference(gradients(plain.encoder), gradients(cached.encoder)) < 1e-10


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _one_step_worker(rank: int, world: int, port: int, config_json: str, output: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        config = TrainConfig.model_validate_json(config_json)
        task = make_task(config)
        result = task.forward_backward(task.batch(0, 0))
        distributed.average_gradients(list(task.encoder.parameters()))
        if rank == 0:
            safetensors.torch.save_file(gradients(task.encoder), output)
            Path(output + ".json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_two_processes_give_the_loss_and_gradients_of_one(collection, still_model: Path, tmp_path: Path):
    config = make_config(collection, still_model, optim={"batch_size": 8})
    single = make_task(config)
    single_loss = single.forward_backward(single.batch(0, 0))["loss"]
    mp.spawn(
        _one_step_worker,
        args=(2, _free_port(), config.model_dump_json(), str(tmp_path / "g")),
        nprocs=2,
        join=True,
    )
    two = safetensors.torch.load_file(str(tmp_path / "g"))
    assert abs(json.loads((tmp_path / "g.json").read_text())["loss"] - single_loss) < 1e-10
    assert max_difference(two, gradients(single.encoder)) < 1e-10


def final_weights(output: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(output / "model" / "model.safetensors"))


def test_killed_run_resumes_to_the_same_weights(collection, tiny_model: Path, tmp_path: Path, monkeypatch):
    config = make_config(collection, tiny_model)
    run_training(config, tmp_path / "straight", show_progress=False)

    real_step = Trainer._one_step

    def killed_at_step_five(self):
        if self.state["step"] == 4:
            raise KeyboardInterrupt("killed")
        return real_step(self)

    monkeypatch.setattr(Trainer, "_one_step", killed_at_step_five)
    with pytest.raises(KeyboardInterrupt):
        run_training(config, tmp_path / "resumed", show_progress=False)
    monkeypatch.setattr(Trainer, "_one_step", real_step)
    state = run_training(config, tmp_path / "resumed", resume=True, show_progress=False)
    assert state["step"] == 6

    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "resumed")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    start = safetensors.torch.load_file(str(tiny_model / "model.safetensors"))
    assert any(not torch.equal(start[k], straight[k]) for k in straight if k in start)  # it did train
    steps = [
        r["step"]
        for r in map(json.loads, (tmp_path / "resumed" / "train_log.jsonl").read_text().splitlines())
    ]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_outputs_load_everywhere_and_feedback_is_written(collection, tiny_model: Path, tmp_path: Path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    config = make_config(
        collection, tiny_model, model={"normalize": True}, eval={"split": "test", "every": 3}
    )
    state = run_training(config, tmp_path / "run", show_progress=False)
    output = tmp_path / "run"
    texts = ["question about cats", "bread flour and an oven"]
    ours = embed_texts(DenseEncoder.load(output / "model"), texts, "passage")
    theirs = SentenceTransformer(str(output / "model"), device="cpu").encode(texts, convert_to_numpy=True)
    assert np.allclose(ours, theirs, atol=1e-5)
    AutoModel.from_pretrained(output / "model")
    records = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
    assert {"loss", "lr", "grad_norm", "examples_per_s"} <= set(records[0])
    assert [r["step"] for r in records if "eval/nDCG@10" in r] == [3, 6]
    assert state["best_step"] in (3, 6) and (output / "best" / "densekit.json").is_file()
    assert (output / "training_curves.png").stat().st_size > 10_000
    assert [p.name for p in sorted((output / "checkpoints").iterdir())] == ["step-00000003", "step-00000006"]
    assert (output / "checkpoints" / "step-00000003" / "config.yaml").read_text() == (
        output / "config.yaml"
    ).read_text()


def test_torchrun_two_processes_train_like_one(collection, still_model: Path, tmp_path: Path):
    """`torchrun --nproc_per_node 2 -m densekit train` (gloo) ends with the weights of one process."""
    config = make_config(collection, still_model, optim={"batch_size": 8, "max_steps": 3})
    config_file = tmp_path / "config.yaml"
    from densekit.configuration import dump_config

    config_file.write_text(dump_config(config))
    run_training(config, tmp_path / "one", show_progress=False)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
        "--master_port", str(_free_port()),
        "-m", "densekit", "train", str(config_file), "--out", str(tmp_path / "two"), "--no-progress",
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-5
