"""`trainer.accelerator`: the part of accelerate's `Accelerator` that TRL's scripts and callbacks use, over this
engine's processes.

Owns: `AcceleratorSurface` (GRPOTrainer's `accelerator` and `end()`) and `Accelerator` (process index and count,
main-process checks, `print`, `wait_for_everyone`,
`main_process_first`, `device`, `gather` / `gather_for_metrics` of tensors and nested lists / dicts of them,
`reduce`, `unwrap_model`, `end_training`). The processes are the ones torchrun or srun started (the engine's process
group while it is up; the launcher's RANK / WORLD_SIZE otherwise), a world of one for a plain `python` run.
Collectives between runs (the engine tears its group down at the end of `train()`) open the process group on the
launcher's rendezvous, with the backends the engine would choose, and leave it open for the engine's next run.

Must not: import accelerate (not a dependency), or open a process group in a world of one.

Test: tests/unit/test_trl_accelerator.py.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator


class Accelerator:
    """accelerate's `Accelerator` as TRL scripts read it, over the engine's processes (module docstring)."""

    @property
    def process_index(self) -> int:
        """This process's global rank."""
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))

    @property
    def num_processes(self) -> int:
        """How many processes run the script (1 without a launcher)."""
        import torch.distributed as dist

        return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))

    @property
    def local_process_index(self) -> int:
        """This process's rank on its node."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        return self.process_index == self.num_processes - 1

    @property
    def device(self) -> Any:
        """This process's accelerator (cuda:LOCAL_RANK), or the CPU."""
        import torch

        return torch.device("cuda", self.local_process_index) if torch.cuda.is_available() else torch.device("cpu")

    @property
    def distributed_type(self) -> str:
        """'MULTI_GPU' / 'MULTI_CPU' with more than one process, 'NO' otherwise (accelerate's names)."""
        import torch

        if self.num_processes == 1:
            return "NO"
        return "MULTI_GPU" if torch.cuda.is_available() else "MULTI_CPU"

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the main process of each node only, as accelerate."""
        if self.is_local_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """A barrier across the processes (nothing to wait for in a world of one)."""
        if self.num_processes > 1:
            with _group() as dist:
                dist.barrier()

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Run the block on the main process, then on the others (e.g. to build a dataset cache once)."""
        if not self.is_main_process:
            self.wait_for_everyone()
        yield
        if self.is_main_process:
            self.wait_for_everyone()

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """As `main_process_first`, per node."""
        if not self.is_local_main_process:
            self.wait_for_everyone()
        yield
        if self.is_local_main_process:
            self.wait_for_everyone()

    def gather(self, data: Any) -> Any:
        """Tensors from every process, concatenated along dim 0 in rank order (a scalar becomes a vector of one per
        process, as accelerate); lists, tuples and dicts of tensors are gathered leaf by leaf. Every process must
        pass tensors of the same shape."""
        return _map_tensors(data, self._gather_tensor)

    def gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        """`gather` for tensors; other objects (and `use_gather_object=True`) are gathered as a list, one entry per
        process, flattened when each process gave a list (accelerate's `gather_object`)."""
        if not use_gather_object and _has_tensor(data):
            return self.gather(data)
        if self.num_processes == 1:
            return data
        with _group() as dist:
            gathered: list[Any] = [None] * self.num_processes
            dist.all_gather_object(gathered, data)
        if all(isinstance(item, list) for item in gathered):
            return [value for item in gathered for value in item]
        return gathered

    def reduce(self, data: Any, reduction: str = "sum") -> Any:
        """Tensors summed (or averaged: reduction='mean') across the processes."""
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduce: reduction must be 'sum' or 'mean', got {reduction!r}")

        def one(tensor: Any) -> Any:
            total = self._gather_tensor(tensor.unsqueeze(0)).sum(dim=0)
            return total / self.num_processes if reduction == "mean" else total

        return _map_tensors(data, one)

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True) -> Any:
        """The model itself: `trainer.model` is never wrapped here."""
        return model

    def end_training(self) -> None:
        """Nothing to finish: the engine closes its trackers and process group at the end of `train()`."""

    def _gather_tensor(self, tensor: Any) -> Any:
        tensor = tensor.unsqueeze(0) if tensor.dim() == 0 else tensor
        if self.num_processes == 1:
            return tensor
        with _group() as dist:
            local = tensor.detach().cpu() if dist.get_backend() == "gloo" else tensor.detach()
            parts = [local.new_empty(local.shape) for _ in range(self.num_processes)]
            dist.all_gather(parts, local.contiguous())
        import torch

        return torch.cat(parts, dim=0).to(tensor.device)


class AcceleratorSurface:
    """The trainer's `accelerator` and HF Trainer's `end()` (mixed into GRPOTrainer)."""

    @property
    def accelerator(self) -> Accelerator:
        """accelerate's `Accelerator` as TRL scripts and callbacks use it; one assigned to `trainer.accelerator` (HF
        Trainer's is a plain attribute: TRL's own tests assign a stand-in) is returned instead."""
        assigned = self.__dict__.get("_assigned_accelerator")
        return Accelerator() if assigned is None else assigned

    @accelerator.setter
    def accelerator(self, value: Any) -> None:
        self.__dict__["_assigned_accelerator"] = value

    def end(self) -> None:
        """HF Trainer's `end()` (TRL's grpo script calls it last): nothing is left to close, the engine closed its
        trackers and process group at the end of `train()`."""


@contextlib.contextmanager
def _group() -> Iterator[Any]:
    """torch.distributed with a process group: the engine's while it is up; otherwise one opened here on the
    launcher's rendezvous (MASTER_ADDR / MASTER_PORT, through the engine's rendezvous store) and left open, with
    gloo for CPU tensors and NCCL for CUDA ones, so the engine's next `train()` joins it rather than opening another.
    Opening and closing a group per call would cost a rendezvous each time."""
    import torch
    import torch.distributed as dist

    from engine.policy.parallel import start_process_group

    if not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            raise RuntimeError(f"accelerator: WORLD_SIZE={os.environ.get('WORLD_SIZE')} but no MASTER_ADDR / "
                               "MASTER_PORT to meet the other processes; launch the script with torchrun or srun")
        start_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    yield dist


def _has_tensor(data: Any) -> bool:
    import torch

    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, dict):
        return any(_has_tensor(v) for v in data.values())
    if isinstance(data, (list, tuple)):
        return any(_has_tensor(v) for v in data)
    return False


def _map_tensors(data: Any, func: Any) -> Any:
    """`func` applied to every tensor of a nested list / tuple / dict; anything else is refused."""
    import torch

    if isinstance(data, torch.Tensor):
        return func(data)
    if isinstance(data, dict):
        return type(data)({k: _map_tensors(v, func) for k, v in data.items()})
    if isinstance(data, (list, tuple)):
        return type(data)(_map_tensors(v, func) for v in data)
    raise TypeError(f"accelerator.gather takes tensors (or lists / dicts of them), got {type(data).__name__}; "
                    "use gather_for_metrics(obj, use_gather_object=True) for other objects")
