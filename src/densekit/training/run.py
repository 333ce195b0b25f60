"""What every run through the trainer does first: its device, its process group, its seed, its folder."""

from __future__ import annotations

from pathlib import Path

import torch

from densekit.configuration import dump_config
from densekit.device import resolve_device
from densekit.training import distributed
from densekit.training.config import RunConfig
from densekit.training.run_folder import prepare_run_folder
from densekit.training.trackers import check_installed


def training_device(setting: str) -> torch.device:
    """The device of this process: its own GPU under torchrun, else as `setting` says."""
    device = resolve_device(setting)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", distributed.local_rank())
        torch.cuda.set_device(device)
    return device


def start_run(
    config: RunConfig, output: Path, kind: str, resume: bool | None, overwrite: bool
) -> tuple[torch.device, str, bool]:
    """Pick the device, join the process group, seed, and check that the output folder may take this
    run (see `prepare_run_folder`), saving the config there. Call it once the inputs have been read
    and checked, so that a run refused for bad input leaves no folder behind.

    Returns the device, the config as YAML (checkpoints keep a copy) and whether the run continues.
    """
    check_installed(config.report_to)  # before anything is made, so a missing extra leaves no folder
    device = training_device(config.device)
    distributed.init_from_environment(device)
    torch.manual_seed(config.seed)
    config_yaml = dump_config(config)
    resumed = distributed.on_main(
        lambda: prepare_run_folder(Path(output), kind, config, config_yaml, resume, overwrite)
    )
    return device, config_yaml, resumed
