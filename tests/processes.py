"""Processes for the tests that run one step in two processes and compare it with one.

torch.multiprocessing's `spawn` starts each process as a new interpreter that imports torch,
transformers and densekit again: about 10 s a process on the 2-core CI machine, paid twice by every
such test. Here the processes are forked from multiprocessing's fork server, which imports them once
per test worker (`PRELOAD`) and forks before any tensor is computed, so each process is as fresh as a
spawned one but starts at once. What runs in them is the code under test, unchanged.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing

PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers.models.bert.modeling_bert",
    "safetensors.torch",
    "densekit.training.trainer",
    "densekit.pretraining",
]
multiprocessing.set_forkserver_preload(PRELOAD)


def run_in_processes(worker: Callable[..., Any], args: tuple, count: int = 2) -> None:
    """Run `worker(rank, *args)` for each rank in `count` processes and wait for all of them; a
    process that fails raises here, with its traceback."""
    torch.multiprocessing.start_processes(
        worker, args=args, nprocs=count, join=True, start_method="forkserver"
    )
