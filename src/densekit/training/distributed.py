"""torch.distributed helpers: the process group from torchrun's environment, gathers and reductions.

densekit starts no processes itself: `torchrun --nproc_per_node N densekit train ...` does, and sets
the environment read here. Without it, everything runs as a single process.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def init_from_environment(device: torch.device) -> None:
    """Join the process group torchrun describes (gloo on CPUs, nccl on GPUs); no-op when alone."""
    if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=30))


def world_size() -> int:
    """Processes taking part (1 when not distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's index (0 when not distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def local_rank() -> int:
    """This process's index on its machine, from torchrun's LOCAL_RANK."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    """True on the process that writes files and logs."""
    return rank() == 0


def gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """Every process's `tensor` concatenated in rank order; gradients flow into this process's part.

    all_gather returns detached copies, so this process's own slice is replaced by the local tensor:
    its gradient then holds the contributions of the whole gathered batch (the Tevatron way).
    """
    if world_size() == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    dist.all_gather(parts, tensor.detach().contiguous())
    parts[rank()] = tensor
    return torch.cat(parts)


def gathered_loss_weight() -> int:
    """What a loss over the batch gathered from every process is multiplied by before its backward
    pass, and divided by when reported: each process's gradient holds only its own part's share of
    that loss, and `average_gradients` takes their mean, so the mean equals one process's gradient of
    the whole loss only when each process back-propagates world-size times it."""
    return world_size()


def average_gradients(parameters: list[torch.nn.Parameter]) -> None:
    """Average `.grad` over processes, in one flat buffer per dtype.

    The trainer does this itself rather than wrapping the model in DistributedDataParallel: gradient
    caching runs several backward passes per step, and some backbone parameters (BERT's pooler) get
    no gradient; one explicit reduction after the last backward is exact for both.
    """
    count = world_size()
    if count == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for parameter in parameters:
        # Which parameters get no gradient depends on the model, not the data, so it is the same on
        # every process; leaving them out keeps the optimizer from decaying them, as in one process.
        if parameter.grad is not None:
            by_dtype.setdefault(parameter.grad.dtype, []).append(parameter.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= count
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def all_reduce_mean(value: float | torch.Tensor) -> float | torch.Tensor:
    """The mean of a number over processes; of a 0-dim tensor, a tensor on its device, not read."""
    if world_size() == 1:
        return value
    if isinstance(value, torch.Tensor):
        summed = value.detach().double().clone()
        dist.all_reduce(summed)
        return summed / world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return float(tensor.item()) / world_size()


def on_main(work: Callable[[], T]) -> T:
    """Run `work` on the main process only and give its result, or raise its error, on every process."""
    if world_size() == 1:
        return work()
    box: list[Any] = [None]
    if is_main():
        try:
            box[0] = ("ok", work())
        except Exception as err:  # sent to the other processes, then raised everywhere
            box[0] = ("error", err)
    dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise value
    return value


def barrier() -> None:
    """Wait for every process."""
    if world_size() > 1:
        dist.barrier()
