"""Training checkpoints: Megatron's distributed checkpoint format, written atomically, resumed exactly.

Owns: `save_checkpoint` / `load_checkpoint` of everything a run needs to continue as if it had never stopped,
`find_latest_checkpoint`, `resolve_resume_checkpoint` (`checkpoint.resume_from_checkpoint`: a path or `latest`;
`agree_on_resume_checkpoint` for all ranks), `rotate_checkpoints` (keep the newest `save_total_limit`), `is_save_step`,
`read_progress`, `describe_model`, and `StopSignal` (SIGUSR1: save at the next round boundary, then exit).

The format and how a save stays atomic: `save_checkpoint`; what cannot be loaded, and a Megatron 0.16
workaround: `load_checkpoint`.

Must not: read Megatron's global parallel state (ps carries the layout), know the GRPO loop, touch vLLM.

Test: tests/unit/test_checkpoint.py (naming, latest, rotation, errors), tests/distributed/test_checkpoint_resharding.py
(save at one TP x PP, load at another), tests/integration/test_resume.py (SIGKILL and resume, kill while saving).
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from engine.policy.lora import is_lora_param, is_lora_trained
from engine.policy.parallel import ParallelState
from engine.train.checkpoint_writers import WriterWatch

CHECKPOINT_PREFIX = "checkpoint-"
TMP_SUFFIX = ".tmp"
DELETING_SUFFIX = ".deleting"
STATE_FILE = "trainer_state.json"
DIST_CKPT_METADATA = "metadata.json"
REFERENCE_PREFIX = "reference."
"""Key prefix of the TR-DPO reference's tensors in a checkpoint (`grpo.sync_ref_model`)."""
FORMAT = "grpo-engine/megatron-dist-ckpt/1"
CRASH_HOOK_ENV = "GRPO_CHECKPOINT_CRASH_BEFORE_RENAME"
_NAME = re.compile(rf"^{re.escape(CHECKPOINT_PREFIX)}(\d+)$")
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
MODEL_IDENTITY_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt, or belongs to another model."""


@dataclass(frozen=True)
class Progress:
    """Where a run stands: optimizer steps taken and generation rounds of prompts consumed (the data position)."""

    step: int = 0
    rounds_done: int = 0
    num_tokens: int = 0
    """TRL's cumulative `num_tokens` metric, so the resumed run's curve continues."""
    loop_state: dict = field(default_factory=dict)
    """Other loop state that carries over between rounds (JSON values), e.g. the adaptive entropy controller's."""


def _log(msg: str) -> None:
    print(f"checkpoint: {msg}", file=sys.stderr, flush=True)


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """`<run_dir>/checkpoint-<step>`."""
    return Path(run_dir) / f"{CHECKPOINT_PREFIX}{step}"


def describe_model(hf_config, padded_vocab_size: int) -> dict:
    """The model's identity: what must match between a checkpoint and the run that loads it."""
    identity = {k: getattr(hf_config, k, None) for k in MODEL_IDENTITY_KEYS}
    return identity | {"padded_vocab_size": int(padded_vocab_size)}


# ---------------------------------------------------------------------------------------------------------------
# finding checkpoints


def is_complete(path: Path) -> bool:
    """True when `path` holds a finished checkpoint (the trainer state, written last, and Megatron's metadata)."""
    return (path / STATE_FILE).is_file() and (path / DIST_CKPT_METADATA).is_file()


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `run_dir` as (step, path), oldest first. Partial temporaries (`*.tmp`, a crash while
    saving) and incomplete directories are skipped with a log line."""
    run_dir = Path(run_dir)
    found = []
    for path in sorted(run_dir.glob(f"{CHECKPOINT_PREFIX}*")) if run_dir.is_dir() else []:
        match = _NAME.match(path.name)
        if match is None:
            if path.name.endswith(TMP_SUFFIX):
                _log(f"ignoring {path}: a partial checkpoint (a save that did not finish)")
            continue
        if not is_complete(path):
            _log(f"ignoring {path}: incomplete (no {STATE_FILE} or {DIST_CKPT_METADATA})")
            continue
        found.append((int(match.group(1)), path))
    return sorted(found)


def find_latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step in `run_dir`, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def resolve_resume_checkpoint(resume_from: str | None, run_dir: str | Path) -> Path | None:
    """The checkpoint `checkpoint.resume_from_checkpoint` names: None -> None; `latest` -> the newest complete one in
    the run directory, or None (logged: a job preempted before its first save starts afresh); a path -> that path.

    Raises:
        CheckpointError when a named path does not exist or is not a complete checkpoint.
    """
    if resume_from is None:
        earlier = list_checkpoints(run_dir)
        if earlier:  # NOTE: `latest` and the keep-last-K rotation go by step number, as HF Trainer's do
            _log(f"{run_dir} holds checkpoints of an earlier run ({', '.join(p.name for _, p in earlier)}) and this run "
                 "starts from step 0: a later `latest` or save_total_limit rotation counts them with this run's; "
                 "resume with checkpoint.resume_from_checkpoint=latest or use a fresh train.output_dir")
        return None
    if resume_from == "latest":
        path = find_latest_checkpoint(run_dir)
        if path is None:
            _log(f"resume_from_checkpoint=latest: no complete checkpoint in {run_dir}; starting from step 0")
        return path
    path = Path(resume_from)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint.resume_from_checkpoint={resume_from!r}: no such directory")
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint: {STATE_FILE} or {DIST_CKPT_METADATA} is missing "
                              "(a save that did not finish?)")
    return path


def agree_on_resume_checkpoint(resume_from: str | None, run_dir: str | Path, ps: ParallelState) -> Path | None:
    """`resolve_resume_checkpoint` on rank 0, the answer (or its error) sent to every rank, so that all ranks load
    the same checkpoint and fail together (collective)."""
    answer: list = [None]
    if ps.rank == 0:
        try:
            path = resolve_resume_checkpoint(resume_from, run_dir)
            answer = [None if path is None else str(path)]
        except CheckpointError as exc:
            answer = [exc]
    dist.broadcast_object_list(answer, src=0)
    if isinstance(answer[0], CheckpointError):
        raise answer[0]
    return None if answer[0] is None else Path(answer[0])


class StopSignal:
    """SIGUSR1 (SLURM's `--signal=USR1@<s>` before the time limit, forwarded by torchrun) asks the run to save at
    the next round boundary and exit. The handler only sets a flag; `agreed` makes every rank see the request of
    any rank (collective, once per round)."""

    def __init__(self):
        self.requested = False
        """This rank received SIGUSR1."""
        self.stopping = False
        """Every rank agreed to stop (set by `agreed`)."""
        self._previous = None

    def install(self) -> StopSignal:
        """Handle SIGUSR1 from now on (no-op outside the main thread, where Python cannot install handlers)."""
        import threading

        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGUSR1, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True
        print("checkpoint: SIGUSR1 received: saving at the end of this round, then exiting", file=sys.stderr, flush=True)

    def agreed(self, ps: ParallelState) -> bool:
        """True on every rank when any rank has been signalled (collective)."""
        flag = torch.tensor([int(self.requested)], device=ps.device)  # NCCL reduces device tensors only
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stopping = bool(flag.item())
        return self.stopping

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGUSR1, self._previous)
            self._previous = None


def read_state(path: str | Path) -> dict:
    """The `trainer_state.json` of a checkpoint. Raises CheckpointError when missing or unreadable."""
    file = Path(path) / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: cannot read the trainer state ({exc})") from exc
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{file}: format {state.get('format')!r}, this engine reads {FORMAT!r}")
    return state


def read_progress(path: str | Path) -> Progress:
    """Step and data position stored in a checkpoint (no model needed)."""
    return Progress(**read_state(path)["progress"])


def is_save_step(save_steps: int, step: int, steps_in_round: int) -> bool:
    """True when the round that ended at optimizer step `step` (having taken `steps_in_round` steps) crossed a
    multiple of `save_steps`: checkpoints fall on round boundaries. 0 = never on schedule (only at the end)."""
    return save_steps > 0 and step // save_steps > (step - steps_in_round) // save_steps


def rotate_checkpoints(run_dir: str | Path, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints (None or 0 = keep all). Returns the deleted paths.

    Each is renamed to `checkpoint-<step>.deleting` before it is removed: a kill during the removal leaves that
    name (ignored, and removed by the next save's `remove_leftovers`), never a half-deleted `checkpoint-<step>`
    (found by benchmarks/bench_kill_during_save.py: such a directory stayed on disk, ignored, for good)."""
    if not keep:
        return []
    doomed = [path for _, path in list_checkpoints(run_dir)[:-keep]]
    for path in doomed:
        trash = path.with_name(path.name + DELETING_SUFFIX)
        os.replace(path, trash)
        shutil.rmtree(trash)
        _log(f"deleted {path} (save_total_limit={keep})")
    return doomed


def remove_leftovers(run_dir: str | Path, step: int) -> list[Path]:
    """Remove what killed saves and rotations left in `run_dir`: `checkpoint-<k>.tmp` for k < `step` (a save that
    never finished; `step` has just been saved, so none of those is being written) and `*.deleting` directories.
    Called by rank 0 after checkpoint-<step> is in place. Returns the removed paths."""
    removed = []
    for path in sorted(Path(run_dir).glob(f"{CHECKPOINT_PREFIX}*")):
        number = path.name[len(CHECKPOINT_PREFIX):-len(TMP_SUFFIX)] if path.name.endswith(TMP_SUFFIX) else ""
        if path.name.endswith(DELETING_SUFFIX) or number.isdigit() and int(number) < step:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        _log(f"removed what earlier killed saves left: {', '.join(p.name for p in removed)}")
    return removed


# ---------------------------------------------------------------------------------------------------------------
# state


def _sharded_state_dict(policy_optimizer, is_loading: bool, reference: list | None = None) -> dict:
    """{'model' | 'model<i>': the chunks' sharded state, 'optimizer': the optimizer's}, Megatron-LM's key layout;
    with `reference` chunks also {'reference<i>': their sharded state, every key under `reference.`}."""
    from engine.policy.step import unwrap

    chunks = [unwrap(m) for m in policy_optimizer.model]
    if len(chunks) == 1:
        model = {"model": _model_state(chunks[0])}
    else:
        model = {f"model{i}": _model_state(chunk) for i, chunk in enumerate(chunks)}
    merged = {k: v for part in model.values() for k, v in part.items()}
    optimizer = policy_optimizer.optimizer.sharded_state_dict(merged, is_loading=is_loading,
                                                              metadata=_OPTIMIZER_METADATA)
    frozen = {f"reference{i}": chunk.sharded_state_dict(prefix=REFERENCE_PREFIX)
              for i, chunk in enumerate(reference or [])}
    return model | {"optimizer": optimizer} | frozen


def _has_adapters(chunk) -> bool:
    return any(is_lora_param(name) for name, _ in chunk.named_parameters())


def _model_state(chunk) -> dict:
    """A chunk's sharded state; with LoRA only the adapters' and modules_to_save's (the frozen base is the Hugging Face
    checkpoint the run loads before resuming: engine/train/run.py `build_run`)."""
    state = chunk.sharded_state_dict()
    return {k: v for k, v in state.items() if is_lora_trained(k, chunk)} if _has_adapters(chunk) else state


def _capture_rng() -> dict:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _layout(ps: ParallelState) -> dict:
    return {"world_size": ps.world_size, "tp_size": ps.tp_size, "pp_size": ps.pp_size, "dp_size": ps.dp_size,
            "vpp_size": ps.vpp_size}


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for path in [root, *sorted(p for p in root.rglob("*") if p.is_dir())]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_json(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------------------------
# save / load


def save_checkpoint(run_dir: str | Path, progress: Progress, policy_optimizer, ps: ParallelState, *, model: dict,
                    run_config: dict | None = None, save_total_limit: int | None = None,
                    reference: list | None = None) -> Path:
    """Write `<run_dir>/checkpoint-<step>` atomically (collective: every rank calls it), then rotate.

    Args:
        run_dir: the run directory (`train.output_dir`), on a file system every rank sees.
        progress: step and rounds consumed after the round just finished.
        policy_optimizer: engine.policy.optimizer.PolicyOptimizer (DDP-wrapped chunks, Megatron optimizer, LR
            scheduler).
        ps: this process's parallel state.
        model: `describe_model(...)`, checked when the checkpoint is loaded.
        run_config: the resolved config as plain data (stored for the record).
        save_total_limit: keep the newest K checkpoints after this one is in place (None = all).
        reference: the TR-DPO reference's chunks (`grpo.sync_ref_model`: mixed towards the policy, no longer the
            Hugging Face weights), saved under `reference.`; None = not saved.
    Returns:
        the checkpoint directory.

    A checkpoint is the directory `<output_dir>/checkpoint-<step>` (HF Trainer's naming) holding
    - the model chunks' and the Megatron optimizer's `sharded_state_dict()` saved with
      `megatron.core.dist_checkpointing` (torch_dist backend: every tensor is stored with its global shape and this
      rank's offsets, so the checkpoint loads at another TP x PP x DP layout; the distributed optimizer's state in its
      `fully_reshardable` form); with LoRA adapters only theirs (and their optimizer state): the frozen base is the
      Hugging Face checkpoint the run loads first;
    - `rng/rank-<r>.pt`: every rank's python, numpy, torch (and CUDA) generator states and Megatron's model-parallel
      RNG tracker states (restored only at the same layout: at another layout the ranks' streams do not correspond);
    - `trainer_state.json`, written last: format, step, rounds of prompts consumed (the data position), the LR
      scheduler's state, the layout it was written at, the model's identity and the resolved run config;
    - with TR-DPO (`grpo.sync_ref_model`) the reference's chunks too, keys under `reference.` (`has_reference` in the
      state): after a sync the reference is no longer the Hugging Face checkpoint, and a resumed run continues with it.

    Atomicity: every rank writes into `checkpoint-<step>.tmp` next to the final directory; after a barrier (every rank
    finished) rank 0 fsyncs the files and renames the directory into place. A crash while saving leaves at most a
    `*.tmp` directory, which `latest` ignores (with a log line) and the next save of that step replaces; the previous
    checkpoints are untouched until the new one is in place (rotation runs after the rename).
    A Megatron writer process killed during the save fails the save with a CheckpointError
    (engine/train/checkpoint_writers.py) instead of hanging it.
    Test hook: `GRPO_CHECKPOINT_CRASH_BEFORE_RENAME=<step>` SIGKILLs rank 0 after checkpoint-<step> is fully
    written but before the rename (tests/integration/test_resume.py; a real kill cannot be timed into that window).
    """
    from megatron.core import dist_checkpointing

    start = time.perf_counter()
    final = checkpoint_dir(run_dir, progress.step)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    if ps.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a previous attempt at this step that died
        tmp.mkdir(parents=True)
    dist.barrier()
    _use_in_process_results_queue()  # no spawned results process
    with WriterWatch(tmp, CheckpointError, _log):  # a killed writer process fails the save instead of hanging it
        dist_checkpointing.save(_sharded_state_dict(policy_optimizer, is_loading=False, reference=reference), str(tmp))
    (tmp / "rng").mkdir(exist_ok=True)
    with open(tmp / "rng" / f"rank-{ps.rank:05d}.pt", "wb") as f:
        torch.save(_capture_rng(), f)
        f.flush()
        os.fsync(f.fileno())
    dist.barrier()  # every rank has written its part
    if ps.rank == 0:
        state = {"format": FORMAT, "progress": asdict(progress), "scheduler": policy_optimizer.scheduler.state_dict(),
                 "optimizer_kind": _optimizer_kind(policy_optimizer.optimizer), "has_reference": reference is not None,
                 "layout": _layout(ps), "model": model, "config": run_config, "saved_at": time.time()}
        _write_json(tmp / STATE_FILE, state)
        _fsync_tree(tmp)
        if os.environ.get(CRASH_HOOK_ENV) == str(progress.step):
            os.kill(os.getpid(), signal.SIGKILL)
        _install(tmp, final)
        remove_leftovers(run_dir, progress.step)
        rotate_checkpoints(run_dir, save_total_limit)
        _log(f"saved {final} (step {progress.step}) in {time.perf_counter() - start:.1f} s")
    dist.barrier()
    return final


def _install(tmp: Path, final: Path) -> None:
    """Rename the finished temporary into place (replacing an older save of the same step) and fsync the parent."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    shutil.rmtree(old, ignore_errors=True)


def check_compatible(state: dict, path: Path, model: dict) -> None:
    """Raise CheckpointError naming every model field that differs between the checkpoint and this run."""
    saved = state.get("model") or {}
    diffs = [f"{k}: checkpoint {saved.get(k)!r}, this run {v!r}" for k, v in model.items() if saved.get(k) != v]
    if diffs:
        raise CheckpointError(f"{path} was written for another model:\n  " + "\n  ".join(diffs))


def load_checkpoint(path: str | Path, policy_optimizer, ps: ParallelState, *, model: dict,
                    reference: list | None = None) -> Progress:
    """Restore model chunks, optimizer, LR scheduler, (at the same layout) every rank's RNG and, when the checkpoint
    holds one and `reference` chunks are given, the TR-DPO reference from `path` (collective: every rank calls it).
    Returns the stored step and data position.

    Raises:
        CheckpointError when the checkpoint is incomplete, written for another model, or cannot be read.

    Limits: the padded vocabulary (make_vocab_size_divisible_by * tp_size) must be the same at save and load (true for
    the shipped configs at TP 1 and 2; Qwen2.5's 151936 pads differently at TP 8): a mismatch fails with the
    tensor named. Megatron 0.16's distributed optimizer cannot load its own `fully_reshardable` state when the inner
    optimizer is torch's Adam (CPU: no Apex / Transformer Engine) because it expects a per-parameter `step` tensor in
    the loaded state, and it gives every parameter one shared step tensor; `_load_optimizer_state` loads the step
    through the regular path, the tensors without it, and gives each parameter its own step.
    """
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException as TorchCheckpointException

    path = Path(path)
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint ({STATE_FILE} or {DIST_CKPT_METADATA} missing)")
    state = read_state(path)
    check_compatible(state, path, model)
    from engine.policy.step import unwrap

    saved_kind, kind = state.get("optimizer_kind"), _optimizer_kind(policy_optimizer.optimizer)
    if saved_kind != (kind if "(" in str(saved_kind) else re.sub(r"\(\w+\)", "", kind)):  # older saves: no inner name
        raise CheckpointError(f"{path} holds a {saved_kind} state, this run builds a {kind} "
                              "(optimizer.optim and optimizer.use_distributed_optimizer must be the same as when it "
                              "was saved)")
    _init_empty_optimizer_state(policy_optimizer.optimizer)
    reference = reference if state.get("has_reference") else None
    try:
        loaded = dist_checkpointing.load(_sharded_state_dict(policy_optimizer, is_loading=True, reference=reference),
                                         str(path))
        chunks = [unwrap(m) for m in policy_optimizer.model]
        for i, chunk in enumerate(chunks):
            adapters_only = _has_adapters(chunk)  # LoRA: the base stays as loaded from the HF checkpoint
            result = chunk.load_state_dict(loaded["model" if len(chunks) == 1 else f"model{i}"],
                                           strict=not adapters_only)
            missing = [k for k in result.missing_keys if is_lora_trained(k, chunk)] if adapters_only else []
            if missing or (adapters_only and result.unexpected_keys):
                raise CheckpointError(f"{path}: adapters missing {missing[:3]}, unexpected "
                                      f"{result.unexpected_keys[:3]} (lora.* settings differ from the saved run's?)")
        for i, chunk in enumerate(reference or []):
            prefixed = loaded[f"reference{i}"]
            chunk.load_state_dict({k.removeprefix(REFERENCE_PREFIX): v for k, v in prefixed.items()}, strict=True)
        _load_optimizer_state(policy_optimizer.optimizer, loaded["optimizer"])
    except CheckpointError:
        raise
    except (Exception, TorchCheckpointException) as exc:  # noqa: BLE001 - many kinds (torch's is a BaseException)
        torn = _describe_torn_files(path)
        cause = torn or f"{type(exc).__name__}: {exc}"
        raise CheckpointError(f"{path}: cannot load the model / optimizer state: {cause}; resume from an earlier "
                              "checkpoint (checkpoint.resume_from_checkpoint=<its directory>)") from exc
    policy_optimizer.scheduler.load_state_dict(state["scheduler"])
    _restore_rank_rng(path, state, ps)
    progress = Progress(**state["progress"])
    if ps.rank == 0:
        _log(f"resumed from {path}: step {progress.step}, {progress.rounds_done} rounds of prompts consumed")
    return progress


def _restore_rank_rng(path: Path, state: dict, ps: ParallelState) -> None:
    if state["layout"] != _layout(ps):
        if ps.rank == 0:
            _log(f"layout {_layout(ps)} differs from the checkpoint's {state['layout']}: RNG states not restored "
                 "(the model, optimizer, scheduler and data position are)")
        return
    file = path / "rng" / f"rank-{ps.rank:05d}.pt"
    try:
        _restore_rng(torch.load(file, weights_only=False))
    except (OSError, RuntimeError, KeyError, EOFError) as exc:
        raise CheckpointError(f"{file}: cannot restore this rank's RNG state ({exc})") from exc


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _optimizer_kind(optimizer) -> str:
    """E.g. `DistributedOptimizer(Adam)`: Megatron's wrapper and the torch optimizer inside."""
    return "+".join(f"{type(opt).__name__}({type(getattr(opt, 'optimizer', opt)).__name__})"
                    for opt in _inner_optimizers(optimizer))


def _describe_torn_files(path: Path) -> str | None:
    """Which data files of a torch_dist checkpoint are missing or shorter than its index says (a torn copy), or
    None when every file is whole (the failure is something else)."""
    try:
        from torch.distributed.checkpoint import FileSystemReader

        storage = FileSystemReader(str(path)).read_metadata().storage_data
    except Exception as exc:  # noqa: BLE001 - the index itself is unreadable
        return f"its index {path / '.metadata'} is unreadable ({type(exc).__name__}: {str(exc)[:200]})"
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size < size:
            problems.append(f"{name} has {file.stat().st_size} bytes, its index needs {size} (torn)")
    return f"damaged files: {'; '.join(problems)}" if problems else None


def _init_empty_optimizer_state(optimizer) -> None:
    """Give a distributed optimizer that has not stepped yet its torch Adam state (zeros, step 0) before loading:
    Megatron 0.16 reads the per-parameter `step` while building the state to load into and finds none."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from engine.policy.state_dtype_adam import StateDtypeAdamW

    adams = (torch.optim.Adam, torch.optim.AdamW, StateDtypeAdamW)
    for opt in _inner_optimizers(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(opt, DistributedOptimizer) or not isinstance(inner, adams):
            continue
        if opt.init_state_fn is not None:
            opt.init_state_fn(inner, opt.config)
        for group in inner.param_groups:
            for p in group["params"]:
                inner.state[p].setdefault("step", torch.tensor(0.0))


def _load_optimizer_state(optimizer, state: dict) -> None:
    """`optimizer.load_state_dict`, working around Megatron 0.16's distributed optimizer with torch Adam (see the
    module docstring): the per-parameter `step` tensors are set aside while the parameter state is copied in."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", None)
    if inner is not None:
        parts = [state] if len(inner) == 1 else [v for _, v in sorted(state.items())]
        for sub, sub_state in zip(inner, parts, strict=True):
            _load_optimizer_state(sub, sub_state)
        return
    if not isinstance(optimizer, DistributedOptimizer) or "param_state" not in state:
        optimizer.load_state_dict(state)
        return
    state = dict(state)
    param_state, kind = state.pop("param_state"), state.pop("param_state_sharding_type")
    if kind != "fully_reshardable":
        raise CheckpointError(f"distributed optimizer state of type {kind!r}; this engine writes 'fully_reshardable'")
    optimizer.load_state_dict(state)  # param groups, step, grad scaler
    steps = {p: s.pop("step") for p, s in optimizer.optimizer.state.items() if "step" in s}
    try:
        optimizer.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for p, step in steps.items():
            # NOTE: Megatron hands every parameter the *same* step tensor; torch Adam increments each parameter's
            # step in place, so a shared tensor would advance once per parameter and break the bias correction.
            optimizer.optimizer.state[p]["step"] = step.clone()


def _use_in_process_results_queue() -> None:
    """Let Megatron's torch_dist writer hand its results back through a plain in-process queue.

    NOTE: megatron-core 0.16.1 (`filesystem_async._get_write_results_queue`) creates that queue once per process in
    a *spawned* multiprocessing `Manager`: a fresh Python process that imports torch to unpickle the results (about
    6 s at the first save of every run on a 2-core machine) and lives until the process exits. Only an asynchronous
    save, whose writer runs in another process, needs that. The engine saves synchronously: the function that puts
    the results runs in the trainer's own thread (its forked children report through their own queue), so a
    thread-safe `queue.Queue` is all it needs. Set before the first save; a queue already set is left alone.
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
