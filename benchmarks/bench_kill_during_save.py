"""Kill-during-save campaign: real SIGKILLs timed into checkpoint saves of the GRPO loop, then
resume from `latest`; counts what survives. A program, not a test: CPU-heavy (about 25 trainer starts per dtype).

    python -m benchmarks.bench_kill_during_save                   # bf16 and fp32, 20 kill points each
    python -m benchmarks.bench_kill_during_save --dtypes bfloat16 --points 6 --steps 10   # a quick look

Per dtype:
1. run A, uninterrupted: the tiny config (as tests/integration/test_resume.py: colocated vLLM, beta > 0, lr 3e-3
   decaying linearly) saving every step (`checkpoint.save_steps=1`, `save_total_limit=2`, so rotation runs too);
   its save times (the `checkpoint: saved ... in X s` lines) size the kill delays. (lr 3e-3 here: a 26-step bf16
   run at 1e-2 failed the weight-sync check at step 4, p90 0.224 > 0.2.)
2. a chain of runs B_0, B_1, ...: each resumes from `latest` (B_0 starts fresh) and is killed during its second
   save (the first, which also plans the checkpoint layout and is slower, completes: every kill has an earlier
   checkpoint to resume from):
   the monitor sees `checkpoint-<k>.tmp` appear (the save's start on rank 0), waits the point's delay and SIGKILLs
   - `group` points: the trainer's whole process group (the trainer, vLLM's engine core, Megatron's forked writer
     processes: a node losing power), delays spread evenly over [0, 1.1 x the median of run A's saves after its
     first];
   - `writers` points: only Megatron's checkpoint writer processes (the trainer's forked children that appear
     during the save), `writer_delay` after they are first seen; the trainer must then fail, not hang (given 120 s).
   The next run of the chain is the resume of the previous kill. After the last point, one run resumes to the end.
3. counted, per kill: whether the next run resumed from `latest` without error (the latest checkpoint loadable),
   whether the metrics it then logged equal run A's for the same steps (every field but wall-clock ones, exactly),
   processes of the killed run still alive 5 s later (by an environment marker: SIGKILL runs no cleanup), and
   /dev/shm entries it held just before the kill that no live process holds 5 s after (leaked); at the end, the
   checkpoints left on disk (read_progress). A `writers` point whose writer had already finished (the save then
   completes) is a miss: the run is killed right after that save instead, and the miss is counted.

Rows (benchmarks/results/kill_during_save.csv, bench `kill_during_save`, variant = dtype, x = kill points):
`loadable_latest`, `resumed_equal`, `leaked_processes`, `leaked_shm`, `hung_trainers`, `writer_kills_missed`,
`final_equal` (counts) and
`save_time` (s, p20/p50/p80 of run A's saves). Each point's detail goes to
benchmarks/results/kill_during_save_points.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, make_row

REPO = Path(__file__).resolve().parents[1]
MARKER = "GRPO_KILL_CAMPAIGN"
WALL_CLOCK = re.compile(r"^time/|_s$|seconds|elapsed|step_time")
SAVED = re.compile(r"checkpoint: saved .*checkpoint-(\d+) \(step \d+\) in ([0-9.]+) s")


def digit_fraction(completions, **kwargs):
    """A reward with signal even for a random model: the share of digits in the completion."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def _command(run_dir: Path, dtype: str, steps: int, resume: bool) -> list[str]:
    return [sys.executable, "-m", "engine", "train", "configs/tiny_cpu.yaml", f"train.output_dir={run_dir}",
            f"train.max_steps={steps}", "generation.max_completion_length=12", "grpo.beta=0.05",
            "reward.reward_funcs=[benchmarks.bench_kill_during_save:digit_fraction]", "optimizer.learning_rate=3e-3",
            "optimizer.lr_scheduler_type=linear", "data.dataset_test_split=null", "checkpoint.save_hf_at_end=false",
            f"model.dtype={dtype}", "checkpoint.save_steps=1", "checkpoint.save_total_limit=2",
            # NOTE: every sync is verified exactly (digests), in bf16 too: no tolerance to raise
            *(["checkpoint.resume_from_checkpoint=latest"] if resume else [])]


def _env(tag: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    return env | {"GRPO_ENGINE_VERBOSE": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", MARKER: tag}


def _marked_pids(tag: str) -> list[int]:
    """Live (not zombie) processes whose environment carries this run's marker."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if f"{MARKER}={tag}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                if "\nState:\tZ" not in (proc / "status").read_text():
                    found.append(int(proc.name))
        except OSError:
            continue
    return found


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _identity(path: Path) -> tuple | None:
    """(inode, change time) of a directory: a save that removed and recreated it has another."""
    try:
        st = path.stat()
        return st.st_ino, st.st_ctime_ns
    except OSError:
        return None


def _rows(run_dir: Path) -> dict[int, dict]:
    from engine.train.metric_sinks import read_metrics

    return {r["step"]: {k: v for k, v in r.items() if not WALL_CLOCK.search(k)}
            for r in read_metrics(run_dir / "metrics.jsonl")}


def _uninterrupted(work: Path, dtype: str, steps: int) -> tuple[dict[int, dict], list[float]]:
    run_dir, log = work / f"A-{dtype}", work / f"A-{dtype}.log"
    with open(log, "w") as out:
        status = subprocess.run(_command(run_dir, dtype, steps, False), cwd=REPO, env=_env("A"), stdout=out,
                                stderr=subprocess.STDOUT, timeout=1800).returncode
    text = log.read_text()
    if status != 0:
        raise SystemExit(f"run A ({dtype}) failed ({status}):\n{text[-3000:]}")
    return _rows(run_dir), [float(s) for _, s in SAVED.findall(text)]


def _run_to_kill(command, env, log: Path, run_dir: Path, point: dict, min_step: int = 0) -> dict:
    """Start one run of the chain, kill it during its first save of a step >= `min_step` as `point` says; what
    happened."""
    stale = {p.name: _identity(p) for p in run_dir.glob("checkpoint-*.tmp")}  # an earlier kill's: replaced on save
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    outcome = {"point": point["index"], "mode": point["mode"], "delay_s": point["delay_s"]}
    deadline = time.monotonic() + 900
    tmp = None
    while proc.poll() is None and time.monotonic() < deadline and tmp is None:
        fresh = [p for p in run_dir.glob("checkpoint-*.tmp")
                 if stale.get(p.name, "new") != _identity(p) and int(p.name[11:-4]) >= min_step]
        tmp = fresh[0] if fresh else None
        time.sleep(0.002)
    if tmp is None:
        _killpg(proc)
        proc.wait()
        return outcome | {"error": f"no save started (exit {proc.returncode})"}
    outcome["step"] = int(tmp.name[11:-4])
    trainer_cmd = _cmdline(proc.pid)
    if point["mode"] == "group":
        time.sleep(point["delay_s"])
        outcome["writers_alive"] = len([c for c in _children(proc.pid) if _cmdline(c) == trainer_cmd])
        outcome["renamed"] = (run_dir / f"checkpoint-{outcome['step']}").exists()
        shm_held = _held(_marked_pids(env[MARKER]))
        _killpg(proc)
        proc.wait()
    else:  # only Megatron's writer processes: forked children of the trainer (same command line)
        # forked (not spawned: a spawned child has the parent's command line only until its exec, within ~1 ms)
        writers, first_seen, seen_by = [], {}, time.monotonic() + 60
        while not writers and proc.poll() is None and time.monotonic() < seen_by:
            now = time.monotonic()
            forked = [c for c in _children(proc.pid) if _cmdline(c) == trainer_cmd]
            first_seen = {c: first_seen.get(c, now) for c in forked}
            writers = [c for c, t in first_seen.items() if now - t >= 0.003]
            time.sleep(0.0005)
        time.sleep(point["delay_s"])
        shm_held = _held(_marked_pids(env[MARKER]))
        killed = []
        for pid in writers:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        outcome["writers_killed"] = len(killed)
        # the trainer must now fail (not hang); a writer that had already finished (a kill that missed: the save
        # completes and is renamed) ends the run here instead
        give_up, final = time.monotonic() + 120, run_dir / f"checkpoint-{outcome['step']}"
        while killed and proc.poll() is None and time.monotonic() < give_up and not final.exists():
            time.sleep(0.01)  # no writer seen at all: the run is killed at once (it ran to its end at 47b611c)
        outcome["missed"] = not killed or final.exists()
        outcome["hung"] = proc.poll() is None and not outcome["missed"]
        _killpg(proc)
        outcome["trainer_exit"] = proc.wait()
        outcome["renamed"] = final.exists()
    time.sleep(5.0)  # SIGKILL runs no cleanup: what is still alive now stays
    outcome["leaked_pids"] = _marked_pids(env[MARKER])
    for pid in outcome["leaked_pids"]:
        os.kill(pid, signal.SIGKILL)
    # what this run's processes held just before the kill and nobody holds now (other programs on the machine
    # make and leave entries too: only this run's count)
    outcome["leaked_shm"] = _orphans(shm_held)
    from engine.train.checkpoint import find_latest_checkpoint, read_progress

    latest = find_latest_checkpoint(run_dir)
    outcome["latest_after_kill"] = None if latest is None else read_progress(latest).step
    return outcome


def _held(pids: list[int] | None = None) -> set[str]:
    """The /dev/shm entries the given processes (None = every live one) hold open or mapped."""
    held = set()
    procs = [Path(f"/proc/{pid}") for pid in pids] if pids is not None else list(Path("/proc").iterdir())
    for proc in procs:
        if not proc.name.isdigit():
            continue
        try:
            held |= {line.split("/dev/shm/", 1)[1].strip() for line in (proc / "maps").read_text().splitlines()
                     if "/dev/shm/" in line}
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    held.add(target[len("/dev/shm/"):])
        except OSError:
            continue
    return held


def _orphans(names: set[str]) -> list[str]:
    """Of `names`, the /dev/shm entries that exist and no live process holds (nobody will unlink them)."""
    held = _held()
    return sorted(n for n in names if n not in held and (Path("/dev/shm") / n).exists())


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already
        pass


def _resumed_from(log: Path) -> int | None:
    match = re.search(r"resumed from .*checkpoint-(\d+): step (\d+)", log.read_text())
    return int(match.group(2)) if match else None


def _campaign(work: Path, dtype: str, steps: int, num_points: int, num_writer_points: int) -> dict:
    reference, save_times = _uninterrupted(work, dtype, steps)
    span_s = 1.1 * statistics.median(save_times[1:])  # a process's first save also plans the layout: not timed
    num_group = num_points - num_writer_points
    points = [{"index": i, "mode": "group", "delay_s": round((i + 0.5) / num_group * span_s, 4)}
              for i in range(num_group)]
    writer_delays = [0.0, 0.002, 0.0, 0.005, 0.001]  # short-lived: seen 30 ms + 0 ms, a bf16 writer had finished
    writers = [{"mode": "writers", "delay_s": writer_delays[j % len(writer_delays)]} for j in range(num_writer_points)]
    every = max(1, num_points // max(1, num_writer_points))
    for j, point in enumerate(writers):  # interleaved: writer points 3, 7, 11, ... of 20
        points.insert(min(len(points), (j + 1) * every - 1), point)
    points = [point | {"index": i} for i, point in enumerate(points)]
    run_dir = work / f"B-{dtype}"
    records, previous = [], None
    for n, point in enumerate(points + [None]):
        tag = f"{dtype}-{n}-{uuid.uuid4().hex[:8]}"
        log = work / f"B-{dtype}-{n}.log"
        command = _command(run_dir, dtype, steps, resume=n > 0)
        if point is None:  # the last run resumes and finishes
            with open(log, "w") as out:
                status = subprocess.run(command, cwd=REPO, env=_env(tag), stdout=out, stderr=subprocess.STDOUT,
                                        timeout=1800).returncode
            outcome = {"point": "final", "exit": status}
        else:
            # every run is killed in its second save (the first saves whole: an earlier checkpoint always exists)
            first = 0 if previous is None else previous.get("latest_after_kill") or 0
            outcome = _run_to_kill(command, _env(tag), log, run_dir, point, min_step=first + 2)
        resumed = _resumed_from(log)
        outcome["resumed_step"] = resumed
        rows = _rows(run_dir)
        mine = {s: r for s, r in rows.items() if resumed is None or s > resumed}
        if point is not None and "step" in outcome:
            mine = {s: r for s, r in mine.items() if s <= outcome["step"]}
        outcome["steps_logged"] = sorted(mine)
        outcome["equal"] = bool(mine) and all(reference.get(s) == r for s, r in mine.items())
        if previous is not None:  # this run's start is the previous kill's resume: from the latest checkpoint
            # NOTE: a failed load never logs "resumed from"; this run may fail later on purpose (a writer point)
            previous["next_resumed_ok"] = resumed == previous.get("latest_after_kill")
            previous["next_metrics_equal"] = outcome["equal"]
            previous["next_resumed_step"] = resumed
        records.append(outcome)
        previous = outcome if point is not None else None
        print(json.dumps(outcome), flush=True)
    final = records[-1]
    final["all_rows_equal"] = _rows(run_dir) == reference
    from engine.train.checkpoint import list_checkpoints, read_progress

    final["checkpoints_left"] = [read_progress(p).step for _, p in list_checkpoints(run_dir)]
    return {"records": records, "save_times": save_times, "steps": steps, "span_s": span_s}


def _summary_rows(env, dtype: str, result: dict, num_points: int) -> list:
    kills = [r for r in result["records"] if r["point"] != "final"]
    missed = sum(bool(r.get("missed")) for r in kills)
    final = result["records"][-1]
    counts = {
        "loadable_latest": sum(bool(r.get("next_resumed_ok")) for r in kills),
        "resumed_equal": sum(bool(r.get("next_metrics_equal")) for r in kills),
        "leaked_processes": sum(len(r.get("leaked_pids", [])) for r in kills),
        "leaked_shm": sum(len(r.get("leaked_shm", [])) for r in kills),
        "hung_trainers": sum(bool(r.get("hung")) for r in kills),
        "writer_kills_missed": missed,
        "final_equal": int(final.get("exit") == 0 and final.get("all_rows_equal", False)),
    }
    config = {"model": "builtin:tiny-qwen2-arith", "dtype": dtype, "save_steps": 1, "save_total_limit": 2,
              "max_steps": result["steps"], "vllm": "colocated", "kill": "SIGKILL",
              "delay_span_s": round(result["span_s"], 3)}
    rows = [make_row(env, bench="kill_during_save", variant=dtype, mode="sigkill", metric=name, unit="count",
                     x_name="kill_points", x_value=num_points, p20=value, p50=value, p80=value, n_iters=num_points,
                     config=config) for name, value in counts.items()]
    times = sorted(result["save_times"])
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))]  # noqa: E731
    rows.append(make_row(env, bench="kill_during_save", variant=dtype, mode="uninterrupted", metric="save_time",
                         unit="s", x_name="kill_points", x_value=num_points, p20=q(0.2), p50=q(0.5), p80=q(0.8),
                         n_iters=len(times), config=config))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--points", type=int, default=20, help="kill points per dtype")
    parser.add_argument("--writer-points", type=int, default=5, help="of which: only Megatron's writer processes")
    parser.add_argument("--steps", type=int, default=None, help="max_steps (default: 2 * points + 6)")
    parser.add_argument("--work-dir", default=None, help="run directories and logs (default: a fresh /tmp dir)")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR,
                        help="where kill_during_save.csv and kill_during_save_points.jsonl are appended to")
    args = parser.parse_args(argv)
    work = Path(args.work_dir or f"/tmp/kill_during_save-{uuid.uuid4().hex[:8]}")
    work.mkdir(parents=True, exist_ok=True)
    steps = args.steps or 2 * args.points + 6
    env = capture_env("cpu")
    for dtype in args.dtypes.split(","):
        start = time.monotonic()
        result = _campaign(work, dtype, steps, args.points, args.writer_points)
        rows = _summary_rows(env, dtype, result, args.points)
        append_rows(args.results_dir / "kill_during_save.csv", rows, overwrite=args.overwrite)
        with open(args.results_dir / "kill_during_save_points.jsonl", "a") as f:
            for record in result["records"]:
                f.write(json.dumps({"dtype": dtype, "git_sha": env.git_sha} | record) + "\n")
        print(f"{dtype}: " + ", ".join(f"{r.metric}={r.p50:g}" for r in rows) +
              f" ({time.monotonic() - start:.0f} s; logs in {work})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
