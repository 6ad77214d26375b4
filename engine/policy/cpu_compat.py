"""Run Megatron-core unchanged on a machine without CUDA (development machines and CI).

Owns: `install_cpu_compat()`, which is idempotent and does nothing when CUDA is available. Megatron-core asks for
`torch.cuda.current_device()`, creates tensors with `device="cuda"`, moves them with `.cuda()` and forks the CUDA
RNG tracker even with `use_cpu_initialization=True` (docs/contributing/cpu-stack.md); what it patches, and why each: there
(`_CudaToCpu`, `_recompute_in_mode`, `_CpuStream`, `_host_split_sizes`).

Must not: change anything when CUDA exists; be imported for its side effects (call `install_cpu_compat`).
Only `engine/policy/parallel.py` calls it.

Test: the distributed tier (tests/distributed) runs Megatron through it.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_installed = False
_mode: TorchFunctionMode | None = None


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU: any `device=` naming CUDA (a string, an int, a torch.device) becomes
    the CPU, `Tensor.cuda()` a no-op and `Tensor.to(<cuda>)` `.to("cpu")`, and `Tensor.type()` (no arguments) names
    CPU tensors as the device's (`torch.cuda.FloatTensor`), which Megatron's distributed optimizer checks."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and args[0].device.type == "cpu":
            # Megatron's distributed optimizer accepts only 'torch.cuda.*Tensor' type names.
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _CpuStream:
    """Stands for a CUDA stream on the CPU, where work runs in order: waits and events are no-ops."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None) -> "_CpuStream":
        return self  # an "event" whose synchronize() returns at once

    def __eq__(self, other) -> bool:
        return isinstance(other, _CpuStream)

    __hash__ = object.__hash__


_CPU_STREAM = _CpuStream()


def _host_split_sizes() -> None:
    """The all-to-all dispatcher hands its split sizes to `all_to_all_single` as the numpy arrays that
    `maybe_move_tensor_to_cpu(as_numpy=True)` makes of CUDA tensors; a CPU tensor is returned unchanged, and
    `all_to_all_single` refuses a tensor of split sizes. Here every tensor asked for as numpy becomes numpy."""
    from megatron.core.transformer.moe import token_dispatcher

    original = token_dispatcher.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
        if torch.is_tensor(tensor) and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    # NOTE: its side stream is made once per process, from whatever torch.cuda.Stream is at the first MoE layer;
    # vLLM's CPU worker, once imported, puts its own placeholder there for good (record_event() returns None), so a
    # MoE model built after a vLLM engine in one process would fail in its first dispatch. Ours, made now.
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _CPU_STREAM


def _recompute_in_mode(mcore_random) -> None:
    """Megatron's full / selective recompute re-runs the forward in `CheckpointFunction.backward`, where torch has
    no TorchFunctionMode active (measured: the mode stack is empty inside any autograd Function's backward): enter
    the CUDA-to-CPU mode there."""
    backward = mcore_random.CheckpointFunction.backward

    def backward_in_mode(ctx, *grads):
        if torch.overrides._get_current_function_mode_stack():
            return backward(ctx, *grads)
        with _mode:
            return backward(ctx, *grads)

    mcore_random.CheckpointFunction.backward = staticmethod(backward_in_mode)


def install_cpu_compat() -> bool:
    """Install the compatibility layer once, if and only if CUDA is absent. Returns True when it is active.

    It enters the `_CudaToCpu` mode; points `torch.cuda.current_device`, `synchronize`, `set_device`, the RNG state
    get/set and `manual_seed` at the CPU (the CPU generator plays the role of the device generator, so Megatron's RNG
    tracker forks and restores it exactly as it would the CUDA one); routes Megatron's `_get_cuda_rng_state` /
    `_set_cuda_rng_state` to the CPU generator; runs Megatron's activation recompute inside the mode too
    (`_recompute_in_mode`: torch calls autograd backward functions with no TorchFunctionMode active, so the
    recomputed forward would otherwise create `device="cuda"` tensors, the causal mask, and fail); stands a no-op
    stream in for `torch.cuda.Stream` / `current_stream` / `stream()` (`_CpuStream`: MoE's all-to-all dispatcher
    moves its split sizes to the host on a side stream; on the CPU all work is in order), and gives that dispatcher
    its split sizes as numpy on the CPU too (`_host_split_sizes`).
    """
    global _installed, _mode
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    import megatron.core.tensor_parallel.random as mcore_random

    cuda = torch.cuda
    cuda.current_device = lambda: torch.device("cpu")
    cuda.synchronize = lambda device=None: None
    cuda.set_device = lambda device: None
    cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    # NOTE: not torch.manual_seed, which itself calls torch.cuda.manual_seed_all.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = cuda.manual_seed
    # MoE's all-to-all token dispatcher copies its split sizes to the host on a side stream (torch.cuda.Stream,
    # current_stream, stream(), record_event().synchronize()): on the CPU everything runs in order on one "stream".
    cuda.Stream = _CpuStream
    cuda.current_stream = lambda device=None: _CPU_STREAM
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    _host_split_sizes()
    mcore_random._get_cuda_rng_state = lambda device=-1, clone=False, graph_safe=False: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state)
    _mode = _CudaToCpu()
    _mode.__enter__()
    _recompute_in_mode(mcore_random)
    _installed = True
    return True
