"""Parallel state: the one module that touches Megatron's global `parallel_state` (docs/contributing/house-rules.md).

Owns: starting torch.distributed (nccl on GPU, gloo on CPU; a plain `python` run becomes a world of one), calling
Megatron's `initialize_model_parallel` from the `parallel` config section, seeding Megatron's RNG tracker, and handing
everyone else a frozen `ParallelState` with sizes, ranks and a `ProcessGroupCollection`. On a machine without CUDA it
installs the CPU compatibility layer first (engine/policy/cpu_compat.py).

Owns too: every process group made for a layout. Megatron's `destroy_model_parallel()` drops its references but
destroys only its gloo data-parallel groups; the others stay alive in torch.distributed (gloo threads, NCCL
communicators and their memory) until the whole world is destroyed. So the groups `initialize_model_parallel` makes,
and those the engine makes for a layout (`new_layout_group`), are recorded and destroyed by `destroy_parallel`, also
when the process group is kept for the next layout: N builds and teardowns on the same processes hold what one holds.

Owns too: the store the ranks meet through (`_rendezvous_store`). A process that trains, evaluates or trains again
starts the process group again on the same MASTER_PORT, and torch names what each start publishes (every rank's
address) the same way each time. So the store is made once per world and kept after the process group is torn down,
and each start gets a prefix of its own on it: a start never reads an earlier start's addresses (torchrun's agent
store outlives every start; under it a second start read stale ones), and ranks that leave a run at different times
never meet a store that is about to close. `close_rendezvous()` drops it.

Must not: be read from anywhere else for groups (components receive `ParallelState` or its groups as arguments).

Test: tests/distributed/test_parallel_state.py (ranks and groups per layout, a world that does not fit); every
layout test under tests/distributed runs on it.
"""

from __future__ import annotations

import atexit
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.config import ConfigError, ParallelConfig
from engine.policy.cpu_compat import install_cpu_compat
from engine.validation import resolve_dp_size


@dataclass(frozen=True)
class ParallelState:
    """Sizes, ranks and process groups of this process. Pass it (or its groups) to whoever needs them."""

    world_size: int
    rank: int
    tp_size: int
    pp_size: int
    dp_size: int
    vpp_size: int | None
    tp_rank: int
    pp_rank: int
    dp_rank: int
    sequence_parallel: bool
    groups: object
    """megatron.core.process_groups_config.ProcessGroupCollection (tp, pp, dp, mp, embd, pos_embd, cp, ...)."""
    device: torch.device
    ep_size: int = 1
    """Expert-parallel size (MoE): experts are split over the `groups.ep` group."""
    ep_rank: int = 0
    etp_size: int = 1
    """Tensor-parallel size inside each expert (`groups.expt_tp`)."""
    etp_rank: int = 0
    edp_rank: int = 0
    """Rank in the expert-data-parallel group (the ranks holding copies of the same expert shards)."""

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1


_layout_groups: list = []
"""The process groups made for the current layout (Megatron's and the engine's), destroyed by `destroy_parallel`."""


def _live_groups() -> set:
    """Every process group torch.distributed holds now (NOTE: torch has no public listing; `_world.pg_map` is it)."""
    return set(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else set()


def new_layout_group(ranks: list[int]):
    """`dist.new_group(ranks)` (collective: every rank calls it), destroyed with the layout by `destroy_parallel`."""
    group = dist.new_group(ranks)
    _layout_groups.append(group)
    return group


def _destroy_layout_groups() -> None:
    """Destroy the groups made for the layout that are still alive (Megatron destroyed some of them itself)."""
    live = _live_groups()
    while _layout_groups:
        group = _layout_groups.pop()
        if group in live and group is not dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


def _drop_leftover_megatron_groups(mpu) -> None:
    """Clear the groups `destroy_model_parallel()` leaves in Megatron's globals.

    NOTE: upstream bug, megatron-core 0.16.1: `_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP` and its `_GLOO` twin are
    not reset, so a gloo group (two worker threads and a socket loop) outlived every teardown, even once destroyed.
    Every global still holding a group is cleared, so a later version's leftover is caught too; so is the MoE
    aux-loss tracker, whose entries keep the groups of the last step (tests/distributed/test_parallel_state.py counts
    the threads)."""
    import sys

    for name, value in list(vars(mpu).items()):
        if name.startswith("_") and isinstance(value, dist.ProcessGroup):
            setattr(mpu, name, None)
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    if moe_utils is not None:
        moe_utils.get_moe_layer_wise_logging_tracker().clear()


def _clear_rotary_caches() -> None:
    """Empty the caches of Megatron's rotary embeddings, so the models they belong to can go.

    NOTE: upstream, megatron-core 0.16.1: `RotaryEmbedding.forward` (and its subclasses', e.g. YaRN's) is an
    `lru_cache`d method: the cache keeps up to 32 modules alive after their model is gone, with their rope tables
    and the context-parallel group they reference (whose gloo threads then outlive the teardown)."""
    import sys

    module = sys.modules.get("megatron.core.models.common.embeddings.rotary_pos_embedding")
    if module is None:
        return
    pending = [module.RotaryEmbedding]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        forward = vars(cls).get("forward")
        if hasattr(forward, "cache_clear"):
            forward.cache_clear()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_rendezvous: dict = {}
"""This process's rendezvous store, kept across starts of the process group: "world" (address, port, size, rank),
"store", "starts" (how many starts it has served)."""


def _rendezvous_store(timeout: timedelta) -> dist.Store:
    """The store for the next start of the process group: this world's store, made at the first start and kept, under
    a prefix of its own for this start. Every rank starts the process group the same number of times, so the prefixes
    agree. Rank 0 hosts the store, or, under torchrun, every rank is a client of the agent's
    (`TORCHELASTIC_USE_AGENT_STORE`; a restarted attempt has its own prefix, as torch gives it).

    NOTE: upstream, torch 2.13: `destroy_process_group()` resets the group count, so each start publishes its ranks'
    addresses under the names the last start used; with `init_process_group`'s env:// store a start in the same
    process read the last start's (torchrun's agent store keeps them) or met a store about to close (rank 0's)."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise RuntimeError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {' and '.join(missing)} not set: the ranks have "
                           "nowhere to meet; launch with torchrun or srun (launch/), which set them")
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    world = (addr, port, int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]))
    if _rendezvous.get("world") != world:
        close_rendezvous()
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        # multi_tenant, as torch's env:// store: a process group the user starts later on this port shares the server
        store = dist.TCPStore(addr, port, world[2], is_master=world[3] == 0 and not agent, timeout=timeout,
                              multi_tenant=True)
        _rendezvous.update(world=world, store=store, starts=0)
    store = _rendezvous["store"]
    store.set_timeout(timeout)
    _rendezvous["starts"] += 1
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"grpo-engine/attempt{attempt}/start{_rendezvous['starts']}", store)


def close_rendezvous() -> None:
    """Drop the kept rendezvous store (on rank 0 this closes its server and frees MASTER_PORT). Call it once no rank
    will start the process group again on this world's MASTER_PORT; a later start makes a new one."""
    _rendezvous.clear()


@atexit.register
def _close_at_exit() -> None:
    """At interpreter exit, while Python still runs: destroy a process group still started on the kept store (one the
    TRL accelerator surface left open), then drop the store. Left to the interpreter's teardown, the store's server
    and the group's threads were destroyed in no set order, and a rank aborted at exit ("terminate called without an
    active exception", exit code -6) in about one exit in three."""
    if not _rendezvous:
        return
    if dist.is_initialized():
        dist.destroy_process_group()
    close_rendezvous()


def start_process_group(backend: str, timeout_min: int = 30) -> None:
    """Join the world torchrun/srun describe in the environment through this world's rendezvous store, or make a
    world of one for a plain `python` run. Nothing to do when a process group is up."""
    if dist.is_initialized():
        return
    timeout = timedelta(minutes=timeout_min)
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if int(os.environ["WORLD_SIZE"]) == 1:  # nobody to meet: a store of its own, closed with the process group
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    dist.init_process_group(backend=backend, timeout=timeout, store=_rendezvous_store(timeout),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def init_parallel(cfg: ParallelConfig, *, seed: int, timeout_min: int = 30) -> ParallelState:
    """Start torch.distributed and Megatron's model-parallel groups for the layout in `cfg`.

    Args:
        cfg: the `parallel` config section.
        seed: base seed; Megatron derives the TP-rank and data-parallel RNG streams from it.
        timeout_min: collective timeout in minutes.
    Returns:
        the ParallelState of this process.
    Raises:
        ConfigError when the world size does not match tp_size * pp_size * dp_size.
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    has_cuda = torch.cuda.is_available()
    backend = cfg.distributed_backend if cfg.distributed_backend != "auto" else ("nccl" if has_cuda else "gloo")
    if backend == "nccl" and not has_cuda:
        raise ConfigError("parallel.distributed_backend='nccl' needs CUDA; use 'gloo' or 'auto' on this machine")
    if has_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        install_cpu_compat()
    start_process_group(backend, timeout_min)
    world_size = dist.get_world_size()
    dp_size = resolve_dp_size(cfg, world_size)
    vpp = cfg.virtual_pipeline_size if (cfg.virtual_pipeline_size or 1) > 1 else None
    before = _live_groups()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp_size,
        pipeline_model_parallel_size=cfg.pp_size,
        virtual_pipeline_model_parallel_size=vpp,
        expert_model_parallel_size=cfg.ep_size,
        expert_tensor_parallel_size=cfg.expert_tp_size,
        distributed_timeout_minutes=timeout_min,
    )
    _layout_groups.extend(_live_groups() - before)
    model_parallel_cuda_manual_seed(seed)
    return ParallelState(
        world_size=world_size,
        rank=dist.get_rank(),
        tp_size=cfg.tp_size,
        pp_size=cfg.pp_size,
        dp_size=dp_size,
        vpp_size=vpp,
        tp_rank=mpu.get_tensor_model_parallel_rank(),
        pp_rank=mpu.get_pipeline_model_parallel_rank(),
        dp_rank=mpu.get_data_parallel_rank(),
        sequence_parallel=cfg.sequence_parallel,
        groups=ProcessGroupCollection.use_mpu_process_groups(),
        device=torch.device("cuda", torch.cuda.current_device()) if has_cuda else torch.device("cpu"),
        ep_size=cfg.ep_size,
        ep_rank=mpu.get_expert_model_parallel_rank(),
        etp_size=cfg.expert_tp_size,
        etp_rank=mpu.get_expert_tensor_parallel_rank(),
        edp_rank=mpu.get_expert_data_parallel_rank(),
    )


def destroy_parallel(keep_process_group: bool = False) -> None:
    """Tear down the layout's groups (Megatron's and the engine's) and the process group (safe to call when nothing
    was started).

    keep_process_group: tear down the layout's groups only, so `init_parallel` can set up another layout on the same
    processes (tests that check several layouts in one launch; a process that rebuilds its layout)."""
    from megatron.core import parallel_state as mpu

    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
        _drop_leftover_megatron_groups(mpu)
        _clear_rotary_caches()
    _destroy_layout_groups()
    if dist.is_initialized() and not keep_process_group:
        dist.destroy_process_group()
