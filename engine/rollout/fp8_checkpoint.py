"""The checkpoint an FP8 engine starts from (`rollout.vllm_weight_dtype: fp8`): a block-FP8 copy of the policy's.

vLLM's `fp8` method reads FP8-serialized checkpoints only (vllm 0.32 dropped online FP8 quantization from it), so
the engine cannot start from the policy's bf16 / fp32 checkpoint with FP8 layers. `write_fp8_engine_checkpoint`
writes a copy whose FP8 weights (engine/rollout/fp8_sync.py `is_fp8_weight`) are quantized with the sync's own
quantizer (the same bytes the first sync would send) and whose config.json carries `quantization_config: {quant_method:
fp8, activation_scheme: dynamic, weight_block_size: [128, 128]}`; every other file is linked. Every sync overwrites the
weights after that.

The copy is as large as the model's FP8 weights, so it is written once per machine (`acquire_fp8_engine_checkpoint`):
every engine process of the machine (colocated ranks, a server and its other nodes' workers on the same host) that
starts from the same checkpoint shares one copy, in a directory named after the checkpoint's path, sizes and
modification times. The first process to arrive writes it, the others wait for it to be complete; each registers as
a user, and the last user to release it (`FP8EngineCopy.release`: the engine's close, a failed start, the
interpreter's exit) deletes it. Users whose process has died are dropped on the next acquire or release, so a
killed run's copy is reused or deleted by the next one. A quantized checkpoint's dequantized copy (the engine's start
in the model's dtype, engine/rollout/quantized_source.py) is shared the same way.

Must not: import vLLM; write next to the user's checkpoint (the copy goes in the machine's temporary directory).

Test: tests/unit/test_fp8_sync.py (a tiny checkpoint: the copy's payload and scales are the reference quantizer's,
the rest bit-equal, the config names the block), tests/unit/test_fp8_copy.py (two processes on one machine get one
copy, which is gone after both release it; a failed write and a dead user leave nothing behind).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_file, save_file

from engine.config import ConfigError, RolloutConfig
from engine.policy.quantized_checkpoint import checkpoint_format
from engine.rollout.fp8_sync import FP8_BLOCK, fp8_engine_kwargs, fp8_machine_problems, quantize_bucket
from engine.rollout.quantized_source import fp8_source_problems, write_dequantized_engine_checkpoint

QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK)}
"""What vLLM's `Fp8Config.from_config` reads: FP8-serialized weights, activations quantized per token group at run
time, one scale per 128 x 128 weight block."""


def write_fp8_engine_checkpoint(model_dir: str | Path, out_dir: str | Path) -> Path:
    """A block-FP8 copy of the HF checkpoint in `model_dir` (safetensors files), in `out_dir`; returns its path.

    Raises:
        ValueError naming the directory when it has no safetensors files or is already quantized.
    """
    model_dir = Path(model_dir)
    files = sorted(model_dir.glob("*.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    if not files:
        raise ValueError(f"rollout.vllm_weight_dtype=fp8: {model_dir} has no *.safetensors files to quantize")
    if config.get("quantization_config"):
        raise ValueError(f"rollout.vllm_weight_dtype=fp8: {model_dir} is already quantized "
                         f"({config['quantization_config'].get('quant_method')!r}): a block-FP8 checkpoint is the FP8 engine's "
                         "start as it is (`fp8_engine_settings`), there is nothing to quantize")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    index = {}
    for path in files:
        tensors = quantize_bucket(list(load_file(path).items()))
        save_file({name: t.contiguous() for name, t in tensors}, out / path.name, metadata={"format": "pt"})
        index |= {name: path.name for name, _ in tensors}
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors" and path.name not in ("config.json", "model.safetensors.index.json"):
            os.symlink(path.resolve(), out / path.name)
    if (model_dir / "model.safetensors.index.json").is_file():
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=1))
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": QUANTIZATION_CONFIG}, indent=1))
    return out


def _copy_key(model_dir: Path) -> str:
    """The name of a checkpoint's shared copy: its resolved path and its files' names, sizes and modification
    times (a rewritten checkpoint gets a copy of its own)."""
    files = sorted(p for p in model_dir.iterdir() if p.suffix == ".safetensors" or p.name == "config.json")
    facts = [str(model_dir.resolve())] + [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:16]


def _alive(token: str) -> bool:
    """Whether the process of a user / writer token (`<pid>-<random>`) is still running on this machine."""
    try:
        os.kill(int(token.split("-")[0]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


class _Locked:
    """An exclusive flock on the copies' root directory, held briefly while users register or leave."""

    def __init__(self, root: Path):
        self.fd = os.open(root, os.O_RDONLY)

    def __enter__(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _prune(directory: Path) -> list[str]:
    """Drop the users whose process died; the living users' tokens."""
    users = directory / "users"
    alive = []
    for user in users.iterdir() if users.is_dir() else []:
        if _alive(user.name):
            alive.append(user.name)
        else:
            user.unlink(missing_ok=True)
    return alive


@dataclass
class FP8EngineCopy:
    """One process's use of a machine's shared block-FP8 copy (`acquire_fp8_engine_checkpoint`)."""

    path: Path
    """The copy's checkpoint directory (the engine's `model`)."""
    directory: Path
    """Its shared directory (the copy, the users, the writer's marker)."""
    token: str
    wrote: bool
    """Whether this process wrote the copy (one process per machine does)."""
    released: bool = field(default=False)

    def release(self) -> None:
        """Leave the copy; the last user deletes it (idempotent; also run at the interpreter's exit)."""
        if self.released:
            return
        self.released = True
        if not self.directory.parent.is_dir():
            return
        with _Locked(self.directory.parent):
            (self.directory / "users" / self.token).unlink(missing_ok=True)
            if not _prune(self.directory):
                shutil.rmtree(self.directory, ignore_errors=True)


@contextlib.contextmanager
def released_on_error(copy: FP8EngineCopy | None, always: bool = False):
    """Release `copy` (None: nothing) when the block raises, or after it in any case with `always`."""
    try:
        yield
    except BaseException:
        if copy is not None:
            copy.release()
        raise
    if always and copy is not None:
        copy.release()


def copy_directory(model_dir: str | Path, kind: str = "fp8", root: str | Path | None = None) -> Path:
    """The shared directory of a checkpoint's engine copy of `kind` on this machine."""
    root = Path(root) if root is not None else Path(tempfile.gettempdir())
    return root / f"grpo-{kind}-engine-{_copy_key(Path(model_dir))}"


def acquire_fp8_engine_checkpoint(model_dir: str | Path, root: str | Path | None = None, timeout_s: float = 3600.0,
                                  *, kind: str = "fp8", write=write_fp8_engine_checkpoint) -> FP8EngineCopy:
    """This machine's block-FP8 copy of `model_dir` (`write_fp8_engine_checkpoint`), written by the first process
    to ask for it, under `root` (default: the machine's temporary directory); release it when the engine closes.
    Another `kind` of copy (engine/rollout/quantized_source.py: a quantized checkpoint dequantized) is shared alike,
    written by `write(model_dir, out_dir)`.

    Raises:
        ValueError from the write (in every waiting process too, naming the checkpoint); TimeoutError when the
        copy is not complete within `timeout_s`; RuntimeError when the writing process died before completing it.
    """
    model_dir = Path(model_dir)
    root = Path(root) if root is not None else Path(tempfile.gettempdir())
    directory = copy_directory(model_dir, kind, root)
    token = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with _Locked(root):
        (directory / "users").mkdir(parents=True, exist_ok=True)
        _prune(directory)
        (directory / "users" / token).touch()
        writer = directory / "writer"
        wrote = not (directory / "model").is_dir() and (not writer.is_file() or not _alive(writer.read_text())
                                                        or (directory / "failed").is_file())
        if wrote:
            writer.write_text(token)
            (directory / "failed").unlink(missing_ok=True)
    copy = FP8EngineCopy(directory / "model", directory, token, wrote)
    atexit.register(copy.release)
    try:
        if wrote:
            _write_shared(model_dir, directory, token, write)
        else:
            _wait_for(directory, model_dir, timeout_s)
    except BaseException:
        copy.release()
        raise
    return copy


def _write_shared(model_dir: Path, directory: Path, token: str, write) -> None:
    """Write the copy beside its final place and move it there when complete; a failure is left for the waiters."""
    partial = directory / f"partial-{token}"
    try:
        write(model_dir, partial)
        os.rename(partial, directory / "model")
    except BaseException as error:
        shutil.rmtree(partial, ignore_errors=True)
        (directory / "failed").write_text(f"{type(error).__name__}: {error}")
        raise


def _wait_for(directory: Path, model_dir: Path, timeout_s: float) -> None:
    """Wait until the writer completed the copy (or failed, or died)."""
    deadline = time.monotonic() + timeout_s
    while not (directory / "model").is_dir():
        if (directory / "failed").is_file():
            raise ValueError(f"writing the engine's copy of {model_dir} failed in another "
                             f"process of this machine: {(directory / 'failed').read_text()}")
        writer = (directory / "writer").read_text() if (directory / "writer").is_file() else ""
        if writer and not _alive(writer):
            raise RuntimeError(f"the process writing the engine's copy of {model_dir} "
                               f"into {directory} died before completing it; start again")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the engine's copy of {model_dir} in {directory} was not "
                               f"complete within {timeout_s:g} s")
        time.sleep(0.2)


def fp8_engine_settings(model_dir: str | Path, rollout: RolloutConfig, on_gpu: bool,
                        dtype: str = "bfloat16") -> tuple[str | Path, dict, FP8EngineCopy | None]:
    """(the checkpoint the engine starts from, vLLM keywords, the shared copy to release when the engine closes) of
    `rollout.vllm_weight_dtype`, `rollout.vllm_kv_cache_dtype` and the checkpoint's own quantization
    (engine/rollout/quantized_source.py): for fp8 weights the block-FP8 copy (`acquire_fp8_engine_checkpoint`) of an
    unquantized checkpoint, a block-FP8 checkpoint as it is, and `quantization="fp8"`; for model-dtype weights a
    quantized checkpoint's dequantized copy in `dtype` (the engine's); `kv_cache_dtype`.

    Raises:
        ConfigError naming each setting this machine's vLLM cannot run, and why (`fp8_machine_problems`), and a
        quantized checkpoint the FP8 engine cannot start from (naming the tensors or the format), before anything is
        written or loaded.
    """
    fp8 = rollout.vllm_weight_dtype == "fp8"
    problems = fp8_machine_problems(rollout.vllm_weight_dtype, rollout.vllm_kv_cache_dtype, on_gpu)
    fmt = checkpoint_format(model_dir) if not problems else None
    if fp8 and fmt is not None and fmt.method == "mxfp4":
        problems.append(f"rollout.vllm_weight_dtype=fp8 with the MXFP4 checkpoint {model_dir}: vLLM's block-FP8 "
                        "layers do not hold MXFP4 experts; set rollout.vllm_weight_dtype=model (the engine then "
                        "starts from a dequantized copy)")
    elif fp8 and fmt is not None:
        problems += fp8_source_problems(model_dir, fmt)
    if problems:
        raise ConfigError("; ".join(problems))
    copy = None
    if fp8 and fmt is None:
        copy = acquire_fp8_engine_checkpoint(model_dir)
    elif not fp8 and fmt is not None:
        copy = acquire_fp8_engine_checkpoint(model_dir, kind=f"dequantized-{dtype}",
                                             write=functools.partial(write_dequantized_engine_checkpoint, dtype=dtype))
    return (copy.path if copy else model_dir), fp8_engine_kwargs(rollout.vllm_weight_dtype,
                                                                 rollout.vllm_kv_cache_dtype), copy
