"""The trainer: GradCache against the full batch, two processes against one, resumed against straight."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed as dist

from densekit.configuration import dump_config, validate_config
from densekit.data import DataError
from densekit.data.examples import TrainingExample, read_examples, write_examples
from densekit.encoding.embed import embed_texts
from densekit.io.outputs import OutputError
from densekit.models import DenseEncoder
from densekit.training import distributed
from densekit.training.ance.versions import NegativeVersions
from densekit.training.checkpoint import checkpoints, load_checkpoint, prune_checkpoints, save_checkpoint
from densekit.training.config import TrainConfig
from densekit.training.contrastive import ContrastiveTask, contrastive_loss
from densekit.training.fine_tuning import run_training
from densekit.training.grad_cache import split_inputs
from densekit.training.sampling import global_batch_rows
from densekit.training.trainer import Trainer

from .processes import run_in_processes
from .training_fixtures import write_training_collection


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
    overrides = config.model.model_dump(include={"pooling", "normalize"})
    encoder = DenseEncoder.load(config.model.path, **overrides).to(dtype)
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
    temperature = task.temperature
    reference_loss = contrastive_loss(queries, passages, 3, temperature, True, batch.false_negatives)
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


def _one_step_worker(
    rank: int, world: int, port: int, config_json: str, output: str, prepare: Callable | None = None
) -> None:
    """One step on process `rank` of `world`; `prepare(encoder)` (a module-level function, as spawn
    pickles it) changes the encoder first. Process 0 saves the averaged gradients and the loss."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        config = TrainConfig.model_validate_json(config_json)
        task = make_task(config)
        if prepare is not None:
            prepare(task.encoder)
        result = task.forward_backward(task.batch(0, 0))
        distributed.average_gradients(list(task.encoder.parameters()))
        if rank == 0:
            safetensors.torch.save_file(gradients(task.encoder), output)
            Path(output + ".json").write_text(json.dumps({k: float(v) for k, v in result.items()}))
    finally:
        dist.destroy_process_group()


def test_two_processes_give_the_loss_and_gradients_of_one(collection, still_model: Path, tmp_path: Path):
    config = make_config(collection, still_model, optim={"batch_size": 8})
    single = make_task(config)
    assert single.batch(0, 0).false_negatives.any()  # the gathered batch's false negatives are masked
    single_loss = single.forward_backward(single.batch(0, 0))["loss"]
    run_in_processes(_one_step_worker, (2, _free_port(), config.model_dump_json(), str(tmp_path / "g")))
    two = safetensors.torch.load_file(str(tmp_path / "g"))
    assert abs(json.loads((tmp_path / "g.json").read_text())["loss"] - single_loss) < 1e-10
    assert max_difference(two, gradients(single.encoder)) < 1e-10


def final_weights(output: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(str(output / "model" / "model.safetensors"))


def killed_at_step_five(monkeypatch, config, output: Path, run=run_training) -> None:
    """Train into `output` with `run` until an interruption as step 5 begins (after the step-3
    checkpoint)."""
    real_step = Trainer._one_step

    def interrupted(self):
        if self.state["step"] == 4:
            raise KeyboardInterrupt("killed")
        return real_step(self)

    with monkeypatch.context() as patch:
        patch.setattr(Trainer, "_one_step", interrupted)
        with pytest.raises(KeyboardInterrupt):
            run(config, output, show_progress=False)


def test_killed_run_resumes_to_the_same_weights(collection, tiny_model: Path, tmp_path: Path, monkeypatch):
    config = make_config(collection, tiny_model)
    run_training(config, tmp_path / "straight", show_progress=False)

    killed_at_step_five(monkeypatch, config, tmp_path / "resumed")
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


def checkpoint_names(output: Path) -> list[str]:
    return sorted(p.name for p in (output / "checkpoints").iterdir() if not p.name.startswith("."))


def test_an_existing_run_is_refused_without_resume_and_overwrite_clears_only_its_own_files(
    collection, tiny_model: Path, tmp_path: Path
):
    config = make_config(collection, tiny_model, checkpoint={"every": 1, "keep": 2})
    output = tmp_path / "run"
    run_training(config, output, show_progress=False)
    assert checkpoint_names(output) == ["step-00000005", "step-00000006"]
    (output / "my-notes.txt").write_text("mine")
    example = TrainingExample(query_id="q0", query="old", positives=["t0d0"], negatives=["t1d1"])
    NegativeVersions(output).publish(3, [example], {"checkpoint_step": 6})  # an older ANCE run's negatives
    trained = final_weights(output)

    with pytest.raises(OutputError, match=r"already holds this training run \(its newest checkpoint is "
                                          r"step-00000006\); pass --resume"):  # fmt: skip
        run_training(config, output, show_progress=False)
    shorter = make_config(collection, tiny_model, checkpoint={"every": 1, "keep": 2}, optim={"max_steps": 3})
    with pytest.raises(OutputError, match=r"differs in: config\.optim\.max_steps\); pass --overwrite"):
        run_training(shorter, output, show_progress=False)
    with pytest.raises(OutputError, match=r"differs in: config\.optim\.max_steps"):
        run_training(shorter, output, resume=True, show_progress=False)
    after = final_weights(output)
    assert all(torch.equal(trained[k], after[k]) for k in trained)  # nothing was touched

    run_training(shorter, output, show_progress=False, overwrite=True)
    assert checkpoint_names(output) == ["step-00000002", "step-00000003"]  # no stale step-5 or step-6
    assert not (output / "ance").exists() and (output / "my-notes.txt").read_text() == "mine"
    assert [json.loads(r)["step"] for r in (output / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_resume_refuses_changes_that_change_the_run_and_takes_the_others(
    tiny_model: Path, tmp_path: Path, monkeypatch, caplog
):
    collection = write_training_collection(tmp_path / "data")
    config = make_config(collection, tiny_model)
    output = tmp_path / "run"
    killed_at_step_five(monkeypatch, config, output)
    saved = (output / "config.yaml").read_text()

    faster = make_config(collection, tiny_model, optim={"learning_rate": 5e-3})
    with pytest.raises(OutputError, match=r"differs in: config\.optim\.learning_rate\)"):
        run_training(faster, output, resume=True, show_progress=False)
    assert (output / "config.yaml").read_text() == saved  # the refused config is not recorded

    train_file = collection[1]
    original = train_file.read_text()
    train_file.write_text(original.replace('"t1d1"', '"t2d1"', 1))
    with pytest.raises(OutputError, match=r"differs in: inputs\.data\.train\)"):
        run_training(config, output, resume=True, show_progress=False)
    train_file.write_text(original)

    elsewhere = make_config(collection, tiny_model, log_every=2, checkpoint={"keep": 3})
    assert run_training(elsewhere, output, resume=True, show_progress=False)["step"] == 6

    with caplog.at_level(logging.WARNING, logger="densekit"):
        run_training(config, tmp_path / "empty", resume=True, show_progress=False)
    assert "holds no training run to resume; starting a new one" in caplog.text


def test_curves_are_redrawn_at_a_checkpoint_only_a_while_after_the_last_drawing_and_always_at_the_end(
    collection, tiny_model: Path, tmp_path: Path, monkeypatch
):
    from densekit.training import trainer

    config = make_config(collection, tiny_model)
    killed_at_step_five(monkeypatch, config, tmp_path / "soon")  # checkpoint 3 came seconds after the start
    assert (tmp_path / "soon" / "checkpoints" / "step-00000003").is_dir()
    assert not (tmp_path / "soon" / "training_curves.png").exists()
    run_training(config, tmp_path / "soon", resume=True, show_progress=False)
    assert (tmp_path / "soon" / "training_curves.png").stat().st_size > 10_000  # at the end
    monkeypatch.setattr(trainer, "PLOT_INTERVAL_S", 0.0)
    killed_at_step_five(monkeypatch, config, tmp_path / "late")
    assert (tmp_path / "late" / "training_curves.png").stat().st_size > 10_000  # drawn at checkpoint 3


def test_a_run_made_before_an_option_existed_resumes_while_the_option_keeps_its_default(
    tiny_model: Path, tmp_path: Path, monkeypatch
):
    collection = write_training_collection(tmp_path / "data")
    config = make_config(collection, tiny_model)
    output = tmp_path / "run"
    killed_at_step_five(monkeypatch, config, output)
    manifest_path = output / "densekit-artefact.json"
    manifest = json.loads(manifest_path.read_text())
    del manifest["identity"]["config"]["data"]["passage_embeddings"]  # as an older densekit wrote it
    del manifest["identity"]["config"]["loss"]["teacher_temperature"]
    assert "matryoshka" not in manifest["identity"]["config"]["loss"]  # recorded only when set
    manifest["identity"]["config"]["loss"]["matryoshka"] = None  # as densekit wrote it for a while
    manifest_path.write_text(json.dumps(manifest))

    warmer = make_config(collection, tiny_model, loss={"teacher_temperature": 2.0})
    with pytest.raises(OutputError, match=r"differs in: config\.loss\.teacher_temperature\)"):
        run_training(warmer, output, resume=True, show_progress=False)
    assert run_training(config, output, resume=True, show_progress=False)["step"] == 6


KILLED_IN_A_CHECKPOINT = """
import os, signal, sys
from pathlib import Path
import safetensors.torch
from densekit.configuration import load_config
from densekit.training import checkpoint
from densekit.training.config import TrainConfig
from densekit.training.fine_tuning import run_training
from densekit.training.sampling import global_batch_rows

real_save = safetensors.torch.save_file
def save_file(tensors, path, *args, **kwargs):
    real_save(tensors, path, *args, **kwargs)
    if "step-00000006" in path:  # kill -9 halfway through writing the second checkpoint
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.safetensors.torch.save_file = save_file
run_training(load_config(Path(sys.argv[1]), TrainConfig), Path(sys.argv[2]), show_progress=False)
"""


def test_kill_9_during_a_checkpoint_write_resumes_from_the_previous_one(
    collection, tiny_model: Path, tmp_path: Path
):
    config = make_config(collection, tiny_model)
    run_training(config, tmp_path / "straight", show_progress=False)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(dump_config(config))
    output = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_IN_A_CHECKPOINT, str(config_file), str(output)], capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert checkpoint_names(output) == ["step-00000003"]
    assert list((output / "checkpoints").glob(".step-00000006.tmp-*"))  # the half-written one

    assert run_training(config, output, resume=True, show_progress=False)["step"] == 6
    assert not [p for p in (output / "checkpoints").iterdir() if p.name.startswith(".")]
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(output)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_the_fp16_loss_scale_is_saved_and_restored(tiny_model: Path, tmp_path: Path):
    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(module.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.tensor(1.0))
    scaler.update(512.0)
    state = {"step": 7, "elapsed_s": 1.0, "best": None, "best_step": None}
    save_checkpoint(tmp_path / "step-7", module, optimizer, scheduler, state, "", lambda path: None,
                    torch.device("cpu"), scaler)  # fmt: skip
    restored = torch.amp.GradScaler("cpu")
    load_checkpoint(tmp_path / "step-7", module, optimizer, scheduler, torch.device("cpu"), restored)
    assert restored.state_dict() == scaler.state_dict() and restored.get_scale() == 512.0
    save_checkpoint(tmp_path / "step-8", module, optimizer, scheduler, {**state, "step": 8}, "",
                    lambda path: None, torch.device("cpu"))  # fmt: skip
    with pytest.raises(ValueError, match="holds no fp16 loss scaler"):
        load_checkpoint(tmp_path / "step-8", module, optimizer, scheduler, torch.device("cpu"), restored)


def test_a_damaged_checkpoint_is_refused_by_resume(collection, tiny_model: Path, tmp_path: Path):
    config = make_config(collection, tiny_model)
    output = tmp_path / "run"
    run_training(config, output, show_progress=False)
    weights = output / "checkpoints" / "step-00000006" / "state.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"state.safetensors: error: its checksum differs"):
        run_training(config, output, resume=True, show_progress=False)


def overlapping_task(tmp_path: Path, model: Path, mask: bool = True) -> ContrastiveTask:
    """Three queries in one batch: A's two positives are B's positive and B's negative."""
    from .conftest import write_beir

    ids = ("a1", "a2", "c1", "n1", "n2")
    corpus = [{"_id": d, "title": "", "text": f"text of {d} about {d}"} for d in ids]
    queries = [{"_id": q, "text": f"question {q}"} for q in ("A", "B", "C")]
    root = write_beir(tmp_path / "overlap", corpus, queries, {"train": [("A", "a1", 1)]})
    examples = [
        TrainingExample(query_id="A", query="question A", positives=["a1", "a2"], negatives=["n1"]),
        TrainingExample(query_id="B", query="question B", positives=["a2"], negatives=["a1"]),
        TrainingExample(query_id="C", query="question C", positives=["c1"], negatives=["n2"]),
    ]
    write_examples(root / "train.jsonl", examples)
    config = make_config((root, root / "train.jsonl"), model, data={"group_size": 2},
                         optim={"batch_size": 3}, loss={"mask_false_negatives": mask})  # fmt: skip
    return make_task(config)


def test_known_positives_are_left_out_of_a_querys_negatives(tmp_path: Path, still_model: Path):
    task = overlapping_task(tmp_path, still_model)
    rows = global_batch_rows(3, 3, 0, 0, task.config.seed)
    layout = [task.sampler.group(int(r), 0).documents for r in rows]  # each query's [positive, negative]
    passages = [doc for group in layout for doc in group]
    query = {task.examples[int(r)].query_id: i for i, r in enumerate(rows)}
    mask = task.batch(0, 0).false_negatives
    a, b, c = query["A"], query["B"], query["C"]
    assert [passages[j] for j in range(6) if mask[a, j]] == passages[2 * b : 2 * b + 2]  # B's a2 and a1
    a_target = layout[a][0]
    assert [passages[j] for j in range(6) if mask[b, j]] == (["a2"] if a_target == "a2" else [])
    assert not mask[c].any()

    batch = task.batch(0, 0)
    queries = task._encode("query")(batch.queries)[0]
    passage_vectors = task._encode("passage")(batch.passages)[0]
    scores = (queries @ passage_vectors.T / task.temperature).detach()
    by_hand = torch.stack([
        torch.logsumexp(scores[i][~mask[i]], 0) - scores[i, 2 * i] for i in range(3)
    ]).mean()  # fmt: skip
    with torch.no_grad():
        masked = contrastive_loss(queries, passage_vectors, 2, task.temperature, True, mask)
        unmasked = contrastive_loss(queries, passage_vectors, 2, task.temperature, True)
    assert abs(float(masked) - float(by_hand)) < 1e-10 and float(masked) < float(unmasked)


def test_without_known_positives_in_the_batch_masking_changes_nothing(collection, still_model: Path):
    masked = make_task(make_config(collection, still_model, optim={"batch_size": 4}))
    plain = make_task(make_config(collection, still_model, optim={"batch_size": 4},
                                  loss={"mask_false_negatives": False}))  # fmt: skip
    clean = next((e, s) for e in range(3) for s in range(3) if masked.false_negatives(e, s) is None)
    assert plain.batch(*clean).false_negatives is None
    loss = masked.forward_backward(masked.batch(*clean))["loss"]
    assert loss == plain.forward_backward(plain.batch(*clean))["loss"]
    assert max_difference(gradients(masked.encoder), gradients(plain.encoder)) == 0


def test_an_alias_of_a_measure_trains_and_a_typo_fails_before_any_step(
    collection, tiny_model: Path, tmp_path: Path
):
    config = make_config(collection, tiny_model, eval={"split": "test", "every": 3, "metric": "MRR@10"})
    assert config.eval.metric == "RR@10"
    state = run_training(config, tmp_path / "run", show_progress=False)
    assert state["best"] is not None and state["best_step"] in (3, 6)
    with pytest.raises(DataError, match=r"eval\.metric: .*unknown measure 'nDGC@10'"):
        make_config(collection, tiny_model, eval={"split": "test", "metric": "nDGC@10"})


def test_the_default_temperature_follows_normalisation_and_a_mismatch_is_warned_of(
    collection, still_model: Path, caplog
):
    assert make_task(make_config(collection, still_model)).temperature == 1.0  # raw inner products
    assert make_task(make_config(collection, still_model, model={"normalize": True})).temperature == 0.05
    with caplog.at_level(logging.WARNING, logger="densekit"):
        task = make_task(make_config(collection, still_model, loss={"temperature": 0.05}))
    assert task.temperature == 0.05 and "with unnormalised embeddings" in caplog.text


def test_gradient_accumulation_steps_with_the_mean_of_its_micro_batches_gradients(
    collection, still_model: Path, tmp_path: Path
):
    """With in-batch negatives, two micro-batches of 4 are not one batch of 8 (GradCache is that);
    accumulation must give the mean of the micro-batches' gradients, from consecutive batches."""
    optim = {"batch_size": 4, "grad_accumulation": 2, "max_grad_norm": None}
    config = make_config(collection, still_model, optim=optim)
    task = make_task(config)
    trainer = Trainer(task, config.optim, config.checkpoint, tmp_path, "", show_progress=False)
    stepped = {}

    def record_instead_of_stepping(*args, **kwargs):
        stepped.update(gradients(task.encoder))

    trainer.optimizer.step = record_instead_of_stepping
    trainer.state["step"] = 1  # the second optimizer step reads micro-batches 2 and 3: epoch 0's last
    figures = trainer._one_step()  # (12 examples make 3 of 4) and epoch 1's first

    reference = make_task(config)
    losses = [reference.forward_backward(reference.batch(*at), 0.5)["loss"] for at in ((0, 2), (1, 0))]
    assert abs(figures["loss"] - sum(losses) / 2) < 1e-10
    assert max_difference(stepped, gradients(reference.encoder)) < 1e-10
    assert trainer.steps_per_epoch == 1  # 3 micro-batches an epoch make 1 whole step


def test_bf16_mixed_precision_trains_close_to_float32(collection, still_model: Path):
    full = make_task(make_config(collection, still_model, optim={"batch_size": 4}), dtype=torch.float32)
    half = make_task(make_config(collection, still_model, optim={"batch_size": 4, "precision": "bf16"}),
                     dtype=torch.float32)  # fmt: skip
    full_loss = full.forward_backward(full.batch(0, 0))["loss"]
    half_loss = half.forward_backward(half.batch(0, 0))["loss"]
    assert half_loss != full_loss and abs(half_loss - full_loss) < 0.02 * abs(full_loss)
    a, b = gradients(full.encoder), gradients(half.encoder)
    flat_a = torch.cat([a[k].flatten() for k in a])
    flat_b = torch.cat([b[k].flatten() for k in a])
    assert float(torch.nn.functional.cosine_similarity(flat_a, flat_b, dim=0)) > 0.99


def test_pruning_keeps_the_newest_checkpoints_and_nothing_else_is_touched(tmp_path: Path):
    root = tmp_path / "checkpoints"
    for step in (3, 12, 9, 100):
        (root / f"step-{step:08d}").mkdir(parents=True)
    (root / "notes").mkdir()
    prune_checkpoints(root, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["notes", "step-00000012", "step-00000100"]
    assert [p.name for p in checkpoints(root)] == ["step-00000012", "step-00000100"]  # by number, not name


def test_a_steps_figures_are_read_at_the_log_line_and_logged_as_before(
    collection, still_model: Path, tmp_path: Path
):
    """Each step's loss and gradient norm stay unread tensors (on a GPU, reading one waits for the step)
    until the log line, whose means equal those of their values, as when each step read them."""
    config = make_config(collection, still_model, log_every=3)
    task = make_task(config)
    trainer = Trainer(task, config.optim, config.checkpoint, tmp_path, "", 3, show_progress=False)
    stepped, real_step = [], trainer._one_step

    def recording():
        stepped.append(real_step())
        return stepped[-1]

    trainer._one_step = recording
    trainer.train()
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.float64 for f in stepped for v in f.values())
    records = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 6]
    for record, window in zip(records, (stepped[:3], stepped[3:]), strict=True):
        for key in ("loss", "grad_norm"):
            assert record[key] == sum(float(figures[key]) for figures in window) / 3
