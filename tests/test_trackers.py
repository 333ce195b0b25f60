"""Experiment tracking: TensorBoard's event files and MLflow's store, read back, hold the training log."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from densekit.cli.main import main
from densekit.training.fine_tuning import run_training
from densekit.training.trackers import mlflow_name, scalars_of

from .test_training import killed_at_step_five, make_config


def log_records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


def log_series(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the JSONL log as (step, value) pairs, in the log's order."""
    series: dict[str, list[tuple[int, float]]] = {}
    for record in log_records(run):
        for key, value in scalars_of(record).items():
            series.setdefault(key, []).append((record["step"], value))
    return series


def tensorboard_series(run: Path) -> tuple[dict[str, list[tuple[int, float]]], str]:
    """The scalars TensorBoard reads from the run's event files, and the config text it shows."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    series = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    return series, text


def mlflow_runs(run: Path) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("densekit")
    return client, client.search_runs([experiment.experiment_id])


def test_tensorboard_and_mlflow_hold_the_scalars_and_config_of_the_training_log(
    collection, tiny_model: Path, tmp_path: Path, monkeypatch
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = make_config(
        collection, tiny_model, eval={"split": "test", "every": 3}, report_to=["tensorboard", "mlflow"]
    )
    run_training(config, tmp_path / "run", show_progress=False)
    run = tmp_path / "run"
    expected = log_series(run)
    assert {"loss", "lr", "grad_norm", "eval/nDCG@10"} <= set(expected)

    scalars, text = tensorboard_series(run)
    assert set(scalars) == set(expected)
    for key, pairs in expected.items():  # TensorBoard keeps 32-bit floats
        assert scalars[key] == [(step, float(np.float32(value))) for step, value in pairs], key
    config_yaml = (run / "config.yaml").read_text()
    assert yaml.safe_load("\n".join(line[4:] for line in text.splitlines())) == yaml.safe_load(config_yaml)

    client, runs = mlflow_runs(run)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED" and runs[0].info.run_name == "run"
    run_id = runs[0].info.run_id
    for key, pairs in expected.items():
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, mlflow_name(key))]
        assert history == pairs, key
    params = runs[0].data.params
    assert params["optim.learning_rate"] == "0.001" and params["report_to"] == '["tensorboard", "mlflow"]'
    assert params["eval.metric"] == "nDCG@10" and params["model.pooling"] == "mean"
    saved = Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path))).read_text()
    assert saved == config_yaml


def test_a_resumed_run_repeats_no_step_in_its_trackers(
    collection, tiny_model: Path, tmp_path: Path, monkeypatch
):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = make_config(collection, tiny_model, report_to=["tensorboard", "mlflow"])
    run = tmp_path / "run"
    killed_at_step_five(monkeypatch, config, run)  # steps 1-4 logged, the checkpoint at 3
    client, runs = mlflow_runs(run)
    assert [r.info.status for r in runs] == ["FAILED"]
    run_training(config, run, resume=True, show_progress=False)

    expected = log_series(run)
    assert [step for step, _ in expected["loss"]] == [1, 2, 3, 4, 5, 6]
    scalars, _ = tensorboard_series(run)
    assert {key: [step for step, _ in pairs] for key, pairs in scalars.items()} == {
        key: [step for step, _ in pairs] for key, pairs in expected.items()
    }
    assert scalars["loss"] == [(step, float(np.float32(value))) for step, value in expected["loss"]]
    client, runs = mlflow_runs(run)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    history = client.get_metric_history(runs[0].info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == expected["loss"]


CONFIG_YAML = "optim:\n  learning_rate: 0.001\nreport_to:\n- mlflow\n"


def log_record(step: int, resumed: bool = False) -> dict:
    """A training log record; a resumed run's differ from the killed one's (their throughput does)."""
    return {"step": step, "epoch": step / 6, "loss": 1.0 / step, "lr": 1e-3 * step,
            "examples_per_s": 100.0 + step + (0.5 if resumed else 0.0), "elapsed_s": 0.25 * step}  # fmt: skip


def killed_and_resumed(folder: Path, first: list[str], then: list[str]) -> None:
    """The training log of a run killed after step 4 (its checkpoint at step 3) and resumed to step 6."""
    from densekit.training.log import TrainingLog

    training_log = TrainingLog(folder, None, first, CONFIG_YAML)
    for step in (1, 2, 3, 4):
        training_log.write(log_record(step))
    training_log.close(failed=True)
    training_log = TrainingLog(folder, 3, then, CONFIG_YAML)
    for step in (4, 5, 6):
        training_log.write(log_record(step, resumed=True))
    training_log.close()


def test_on_resume_mlflow_replaces_its_run_and_a_tracker_named_only_then_gets_the_whole_log(
    tmp_path: Path, monkeypatch
):
    from mlflow.entities import ViewType

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    killed_and_resumed(tmp_path, ["mlflow"], ["mlflow", "tensorboard"])
    expected = log_series(tmp_path)
    assert [value for step, value in expected["examples_per_s"] if step == 4] == [104.5]

    client, runs = mlflow_runs(tmp_path)
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    for key, pairs in expected.items():
        assert [(m.step, m.value) for m in client.get_metric_history(runs[0].info.run_id, key)] == pairs
    experiment = client.get_experiment_by_name("densekit").experiment_id
    (earlier,) = client.search_runs([experiment], run_view_type=ViewType.DELETED_ONLY)
    assert earlier.info.status == "FAILED"  # the killed start's run, deleted
    scalars, _ = tensorboard_series(tmp_path)
    assert {key: [step for step, _ in pairs] for key, pairs in scalars.items()} == {
        key: [step for step, _ in pairs] for key, pairs in expected.items()
    }


def test_report_to_takes_only_known_trackers_and_none(collection, tiny_model: Path, tmp_path: Path):
    assert make_config(collection, tiny_model, report_to="none").report_to == []
    assert make_config(collection, tiny_model).report_to == []
    with pytest.raises(ValueError, match="report_to"):
        make_config(collection, tiny_model, report_to=["tensorbord"])


def test_the_command_line_option_sets_report_to_and_a_missing_extra_is_one_line(
    collection, tiny_model: Path, tmp_path: Path, monkeypatch, capsys
):
    import densekit.training.trackers as trackers

    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(make_config(collection, tiny_model).model_dump(mode="json")))
    monkeypatch.setattr(trackers, "PACKAGES", {**trackers.PACKAGES, "mlflow": ("no_such_mlflow", "mlflow")})
    command = ["densekit", "train", str(config), "--out", str(tmp_path / "run"),
               "--report-to", "tensorboard,mlflow"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", command)
    with pytest.raises(SystemExit) as stopped:
        main()
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert "report_to mlflow needs the no_such_mlflow package: pip install 'densekit[mlflow]'" in error
    assert len(error.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (`run-ID.wandb`): wandb has no reader of its own in Python, so this
    reads its format, LevelDB's log (32 KiB blocks of chunks, each with a 7-byte header: checksum,
    length, type), after the file's 7-byte header, and parses each record with wandb's protobuf."""
    from wandb.proto import wandb_internal_pb2

    raw, position, parts, records = path.read_bytes(), 7, [], []
    while position + 7 <= len(raw):
        left = 32768 - position % 32768
        kind = raw[position + 6] if left >= 7 else 0
        if kind == 0:  # the zeros that pad the end of a block
            position += left
            continue
        length = int.from_bytes(raw[position + 4 : position + 6], "little")
        parts.append(raw[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            records.append(record)
            parts = []
    return records


def test_wandb_offline_holds_the_training_log_once_after_a_resume(tmp_path: Path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is an optional extra, tested where it is installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    killed_and_resumed(tmp_path, ["wandb"], ["wandb"])
    wandb.teardown()  # its service writes the run file on a process of its own: wait until it is done

    offline = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1  # the killed start's run was replaced by the resumed one's
    records = wandb_records(offline[0])
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}  # fmt: skip
            history[items["_step"]] = {k: v for k, v in items.items() if not k.startswith("_")}
    assert history == {r["step"]: scalars_of(r) for r in log_records(tmp_path)}
    (started,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    logged = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
              for item in started.config.update}  # fmt: skip
    assert {k: v for k, v in logged.items() if k != "_wandb"} == yaml.safe_load(CONFIG_YAML)


@pytest.mark.parametrize("command", ["pretrain", "train-cross-encoder"])
def test_pretraining_and_cross_encoder_runs_report_the_same_log(
    command: str, collection, tiny_model: Path, tmp_path: Path
):
    from densekit.configuration import validate_config

    from . import test_cross_encoder_training, test_pretraining

    run = tmp_path / "run"
    if command == "pretrain":
        from densekit.pretraining.run import run_pretraining

        corpus = tmp_path / "texts.txt"
        corpus.write_text("\n".join(test_pretraining.TEXTS) + "\n")
        config = test_pretraining.make_config(corpus, tiny_model, "mlm", optim={"max_steps": 2},
                                              report_to=["tensorboard"])  # fmt: skip
        run_pretraining(config, run, show_progress=False)
    else:
        from densekit.training.config import CrossEncoderTrainConfig
        from densekit.training.fine_tuning import run_cross_encoder_training

        config = test_cross_encoder_training.make_config(collection, tiny_model, optim={"max_steps": 2})
        tree = {**config.model_dump(mode="json"), "report_to": "tensorboard"}
        run_cross_encoder_training(validate_config(tree, CrossEncoderTrainConfig, "<test>"), run,
                                   show_progress=False)  # fmt: skip
    scalars, _ = tensorboard_series(run)
    expected = log_series(run)
    assert expected["loss"] and set(scalars) == set(expected)
    assert scalars["loss"] == [(step, float(np.float32(value))) for step, value in expected["loss"]]


def test_a_recipes_training_step_takes_report_to_in_its_config(collection, tiny_model: Path, tmp_path: Path):
    from densekit.recipes.runner import load_recipe

    root, train = collection
    config = {"model": {"path": str(tiny_model)}, "data": {"path": str(root), "train": str(train)}}
    recipe = tmp_path / "recipe.yaml"
    step = {"type": "train", "output": "{out}/run", "config": {**config, "report_to": ["mlflow"]}}
    recipe.write_text(yaml.safe_dump({"steps": {"train": step}}))
    _, steps = load_recipe(recipe, tmp_path / "out", [])
    assert steps["train"].validated().report_to == ["mlflow"]
    _, steps = load_recipe(recipe, tmp_path / "out", ["steps.train.config.report_to=[tensorboard,wandb]"])
    assert steps["train"].validated().report_to == ["tensorboard", "wandb"]
    step["config"]["report_to"] = ["comet"]
    recipe.write_text(yaml.safe_dump({"steps": {"train": step}}))
    with pytest.raises(ValueError, match="report_to"):
        load_recipe(recipe, tmp_path / "out", [])
