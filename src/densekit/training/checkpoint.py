"""Training checkpoints: weights, optimizer, scheduler, random states and position, with no pickle.

A checkpoint is a folder `step-<n>` written atomically:

- `state.safetensors`: the trained module's tensors (heads and all, for resuming); when some of its
  parameters are frozen (a module on a frozen base), only the others, with a fingerprint of the frozen
  ones that resuming checks, so that a module run's checkpoint is module-sized;
- `optimizer.safetensors` + `trainer_state.json`: optimizer moments, hyper-parameters, scheduler,
  fp16's loss scaler, step, best evaluation;
- `rng.safetensors`: the CPU and GPU random states (dropout's), so a resumed run draws the same;
- `model/`: the usable model (`densekit`, transformers and sentence-transformers load it);
- `config.yaml`: the run's configuration;
- densekit's manifest, with a checksum of every file, checked before a run resumes from it.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

from densekit.errors import InputError
from densekit.io.artefact import artefact_dir, verify
from densekit.models.fingerprint import tensors_fingerprint

_STEP_FOLDER = re.compile(r"^step-(\d+)$")
KIND = "checkpoint"
FROZEN_FINGERPRINT = "densekit.frozen"  # state.safetensors metadata: the frozen tensors' fingerprint


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's state as flat tensors plus JSON-able rest."""
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for param_id, values in state["state"].items():
        for name, value in values.items():
            key = f"{param_id}.{name}"
            if torch.is_tensor(value):
                tensors[key] = value.detach().contiguous().cpu()
            else:
                scalars[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def restore_optimizer(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], rest: dict[str, Any]
) -> None:
    """Load what `optimizer_tensors` saved."""
    state: dict[int, dict[str, Any]] = {}
    for key, value in [*tensors.items(), *rest["scalars"].items()]:
        param_id, name = key.split(".", 1)
        state.setdefault(int(param_id), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": rest["param_groups"]})


def random_states(device: torch.device) -> dict[str, torch.Tensor]:
    """The random states dropout draws from."""
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_random_states(states: dict[str, torch.Tensor], device: torch.device) -> None:
    """Set what `random_states` saved."""
    torch.set_rng_state(states["cpu"])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"], device)


def save_checkpoint(
    folder: Path,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    trainer_state: dict[str, Any],
    config_yaml: str,
    export: Any,
    device: torch.device,
    scaler: torch.amp.GradScaler | None = None,
) -> None:
    """Write a checkpoint folder atomically; `export(path)` writes the usable model."""
    with artefact_dir(folder, KIND, {"step": trainer_state["step"]}) as tmp:
        save_state(module, tmp / "state.safetensors")
        tensors, rest = optimizer_tensors(optimizer)
        safetensors.torch.save_file(tensors, str(tmp / "optimizer.safetensors"))
        safetensors.torch.save_file(random_states(device), str(tmp / "rng.safetensors"))
        payload = {**trainer_state, "optimizer": rest, "scheduler": scheduler.state_dict()}
        if scaler is not None:
            payload["scaler"] = scaler.state_dict()
        (tmp / "trainer_state.json").write_text(json.dumps(payload, indent=2), encoding="utf-8")
        (tmp / "config.yaml").write_text(config_yaml, encoding="utf-8")
        export(tmp / "model")


def load_checkpoint(
    folder: Path,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    device: torch.device,
    scaler: torch.amp.GradScaler | None = None,
) -> dict[str, Any]:
    """Check a checkpoint's files and restore it into the given objects; returns the trainer state
    (step, best, ...)."""
    verify(folder)
    load_state(module, folder / "state.safetensors", device)
    payload = json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
    tensors = safetensors.torch.load_file(str(folder / "optimizer.safetensors"), device=str(device))
    restore_optimizer(optimizer, tensors, payload.pop("optimizer"))
    scheduler.load_state_dict(payload.pop("scheduler"))
    scaler_state = payload.pop("scaler", None)
    if scaler is not None:
        if scaler_state is None:
            raise InputError(f"{folder}: the checkpoint holds no fp16 loss scaler; it was not an fp16 run")
        scaler.load_state_dict(scaler_state)
    restore_random_states(safetensors.torch.load_file(str(folder / "rng.safetensors")), device)
    return payload


def _frozen(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state entries of `module` that are frozen parameters, by name in sorted order."""
    frozen = {id(p) for p in module.parameters() if not p.requires_grad}
    state = module.state_dict(keep_vars=True)
    return {key: state[key].detach() for key in sorted(state) if id(state[key]) in frozen}


def save_state(module: torch.nn.Module, path: Path) -> None:
    """Write `module`'s tensors for resuming: all of them, or, when some parameters are frozen, every
    other tensor once (tied ones under their first name) and the frozen ones' fingerprint."""
    frozen = _frozen(module)
    if not frozen:
        safetensors.torch.save_model(module, str(path))
        return
    kept: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, tensor in module.state_dict(keep_vars=True).items():
        if key not in frozen and id(tensor) not in seen:
            seen.add(id(tensor))
            kept[key] = tensor.detach().contiguous()
    metadata = {FROZEN_FINGERPRINT: tensors_fingerprint(frozen, "")}
    safetensors.torch.save_file(kept, str(path), metadata=metadata)


def load_state(module: torch.nn.Module, path: Path, device: torch.device) -> None:
    """Restore what `save_state` wrote into `module`; refused when the tensors do not fit it, or when
    its frozen parameters are not those the checkpoint was trained on."""
    with safetensors.safe_open(str(path), framework="pt") as saved:
        frozen_fingerprint = (saved.metadata() or {}).get(FROZEN_FINGERPRINT)
    if frozen_fingerprint is None:
        missing, unexpected = safetensors.torch.load_model(module, str(path), device=str(device))
    else:
        frozen = _frozen(module)
        if tensors_fingerprint(frozen, "") != frozen_fingerprint:
            raise InputError(
                f"{path.parent}: the checkpoint was trained on other frozen weights than this model's "
                "(its base changed since); resume needs the base it started from"
            )
        tensors = safetensors.torch.load_file(str(path), device=str(device))
        state = module.state_dict(keep_vars=True)
        loaded = {id(state[key]) for key in tensors if key in state}
        missing = [k for k, t in state.items() if k not in frozen and id(t) not in loaded]
        unexpected = [key for key in tensors if key not in state or key in frozen]
        if not (missing or unexpected):
            module.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise InputError(
            f"{path.parent}: checkpoint does not match the model (missing {missing}, unexpected {unexpected})"
        )


def checkpoints(root: Path) -> list[Path]:
    """Complete checkpoint folders under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_FOLDER.match(p.name)) and p.is_dir()]
    return [path for _, path in sorted(found)]


def prune_checkpoints(root: Path, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints."""
    for old in checkpoints(root)[:-keep]:
        shutil.rmtree(old)
