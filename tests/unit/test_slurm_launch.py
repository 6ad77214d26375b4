"""The SLURM launchers under a fake SLURM: bash runs the real scripts; stand-in `srun`, `scontrol`, `sbatch` and
`torchrun` (first on PATH) append their argv and the environment they saw to a JSONL log.

The stand-in srun runs its command once per node of `--nodelist` with srun's per-task variables (SLURM_PROCID,
SLURMD_NODENAME, SLURM_STEP_NUM_NODES, ...) and writes `--output` per node like srun's `%N`; with
FAKE_SRUN_BLOCK=1 it instead waits for a signal and records it. So the tests see which node got which command,
what rank and ports each task computed, and, in dry-run mode, the real `grpo-engine train --dry-run` validating
the layout on every training node.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPLIT_SCRIPT = ROOT / "launch" / "grpo_72b.slurm"
ONE_NODE_SCRIPT = ROOT / "launch" / "grpo_1node.slurm"
JOB_ID = 4217
NODES = [f"gpu{i:03d}" for i in range(1, 6)]
BASE_PORT = 20000 + (JOB_ID % 1000) * 10

_RECORD = f"""#!{sys.executable} -S
import json, os, sys

def record(tool, **extra):
    keys = [k for k in os.environ if k.startswith(("SLURM", "TORCH", "NCCL", "CUDA_DEVICE"))
            or k in ("WORLD_SIZE", "GRPO_ENGINE_TOKEN")]
    entry = {{"tool": tool, "argv": sys.argv[1:], "env": {{k: os.environ[k] for k in keys}}, **extra}}
    with open(os.environ["FAKE_SLURM_LOG"], "a") as log:
        log.write(json.dumps(entry) + "\\n")
"""

FAKE_SRUN = _RECORD + """
import signal, subprocess, time

args = sys.argv[1:]
options = {}
while args and args[0].startswith("-"):
    key, _, value = args.pop(0).partition("=")
    options[key] = value
if os.environ.get("FAKE_SRUN_BLOCK") == "1":
    def stop(signum, frame):
        record("srun", event="signal", signal=signal.Signals(signum).name)
        sys.exit(0 if signum == signal.SIGUSR1 else 143)

    signal.signal(signal.SIGUSR1, stop)  # before "start" is recorded: the tests signal once they read it
    signal.signal(signal.SIGTERM, stop)
    record("srun", event="start", pid=os.getpid())
    time.sleep(30)
    sys.exit(124)
record("srun", event="run")
nodes = options["--nodelist"].split(",") if "--nodelist" in options else [os.environ["SLURMD_NODENAME"]]
status = 0
for rank, node in enumerate(nodes):
    env = dict(os.environ, SLURM_PROCID=str(rank), SLURM_NODEID=str(rank), SLURMD_NODENAME=node,
               SLURM_STEP_NUM_NODES=str(len(nodes)), SLURM_STEP_NODELIST=",".join(nodes))
    output = options.get("--output")
    sink = open(output.replace("%N", node), "a") if output else None
    done = subprocess.run(args, env=env, stdout=sink, stderr=subprocess.STDOUT if sink else None)
    status = max(status, done.returncode)
sys.exit(status)
"""

FAKE_SCONTROL = _RECORD + """
record("scontrol")
if sys.argv[1:3] == ["show", "hostnames"]:
    # Slurm's compressed form, one range: gpu[001-005] -> gpu001 ... gpu005
    prefix, _, ranges = sys.argv[3].partition("[")
    first, _, last = ranges.rstrip("]").partition("-")
    for i in range(int(first), int(last or first) + 1):
        print(f"{prefix}{i:0{len(first)}d}")
"""

FAKE_SBATCH = _RECORD + """
# Reads the script's #SBATCH header for the node count, then runs it as Slurm would: under bash, in the
# submission directory, with the job's variables.
record("sbatch")
script, *script_args = sys.argv[1:]
nodes = 1
for line in open(script):
    if line.startswith("#SBATCH --nodes="):
        nodes = int(line.split("=", 1)[1])
env = dict(os.environ, SLURM_JOB_ID=os.environ["FAKE_JOB_ID"], SLURM_JOB_NAME="grpo", SLURM_NNODES=str(nodes),
           SLURM_JOB_NODELIST=f"gpu[001-{nodes:03d}]", SLURM_SUBMIT_DIR=os.getcwd(), SLURMD_NODENAME="gpu001")
os.execvpe("bash", ["bash", script, *script_args], env)
"""

FAKE_TORCHRUN = _RECORD + """
import time

record("torchrun")


def last_server_started():
    # The fake srun starts the servers one after another: the last has --node-rank = --num-nodes - 1.
    for line in open(os.environ["FAKE_SLURM_LOG"]):
        argv = json.loads(line)["argv"]
        if "engine.rollout.server" in argv:
            opts = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
            if int(opts["node-rank"]) == int(opts["num-nodes"]) - 1:
                return True
    return False


# Like the real trainer (rollout.vllm_server_timeout), wait for every rollout server before finishing.
deadline = time.monotonic() + 20
while "rollout.vllm_mode=server" in sys.argv and time.monotonic() < deadline:
    if last_server_started():
        break
    time.sleep(0.02)
"""

FAKE_PYTHON = _RECORD + """
# Stands in for `python` in non-dry runs: records the planner and vLLM-server invocations.
record("python")
"""


def _make_slurm(tmp_path: Path):
    """A runner of launchers under the fake SLURM: (command, *args, background=False, **env) -> (result, records)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in [("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("sbatch", FAKE_SBATCH),
                       ("torchrun", FAKE_TORCHRUN), ("fake-python", FAKE_PYTHON)]:
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "slurm.jsonl"

    def run(command, *args, background=False, stderr=subprocess.PIPE, **env_overrides):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "WORLD_SIZE", "TORCHELASTIC"))}
        env.update(
            PATH=f"{bin_dir}:{env['PATH']}", FAKE_SLURM_LOG=str(log), FAKE_JOB_ID=str(JOB_ID),
            SLURM_JOB_ID=str(JOB_ID), SLURM_JOB_NAME="grpo", SLURM_JOB_NODELIST="gpu[001-005]", SLURM_NNODES="5",
            SLURM_SUBMIT_DIR=str(ROOT), SLURMD_NODENAME="gpu001", SLURM_CPUS_ON_NODE="96",
            LOG_DIR=str(tmp_path / "logs"),
            PYTHON=str(bin_dir / "fake-python"),
        )
        env.update(env_overrides)
        argv = [*command, *map(str, args)]
        if background:
            return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True)
        result = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        return result, read_records(log)

    run.log = log
    run.logs = tmp_path / "logs"
    return run


@pytest.fixture
def slurm(tmp_path):
    return _make_slurm(tmp_path)


@pytest.fixture(scope="module")
def split_run(tmp_path_factory):
    """One ordinary run of the split script (4 + 1 nodes, a user override), shared by the tests that only read it."""
    slurm = _make_slurm(tmp_path_factory.mktemp("split"))
    result, records = slurm(["bash", SPLIT_SCRIPT], "grpo.beta=0.04")
    assert result.returncode == 0, result.stderr
    return records, slurm.logs


SIX_NODES = [f"gpu{i:03d}" for i in range(1, 7)]


@pytest.fixture(scope="module")
def two_replica_run(tmp_path_factory):
    """The split script on 6 nodes (`sbatch --nodes=6`): 4 training + 2 inference nodes, one rollout server each."""
    slurm = _make_slurm(tmp_path_factory.mktemp("split6"))
    result, records = slurm(["bash", SPLIT_SCRIPT], SLURM_JOB_NODELIST="gpu[001-006]", SLURM_NNODES="6")
    assert result.returncode == 0, result.stderr
    return records, slurm.logs


def read_records(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def _tool(records, tool):
    return [r for r in records if r["tool"] == tool]


def _option(argv, name):
    """The value of `--name=value` in an argv, or None."""
    return next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")), None)


def _overrides(argv):
    return dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("-"))


def _servers(records):
    """The rollout-server launches (one per inference task), in launch order."""
    return [r for r in _tool(records, "python") if "engine.rollout.server" in r["argv"]]


def _base_urls(argv):
    """The trainer's rollout.vllm_server_base_urls as the engine parses it (the override is a YAML flow list)."""
    from engine.config import load_config

    command = argv[argv.index("-m") + 1:] if "-m" in argv else argv
    config, overrides = command[2], [a for a in command[3:] if "=" in a and not a.startswith("-")]
    return load_config(ROOT / config, overrides).rollout.vllm_server_base_urls


def _srun_steps(records):
    """The srun invocations, keyed 'train' / 'infer' by the program they launch."""
    steps = {}
    for r in _tool(records, "srun"):
        argv = r["argv"]
        steps["infer" if "engine.rollout.server" in " ".join(argv) else "train"] = r
    return steps


def test_split_script_sends_training_to_the_first_nodes_and_vllm_to_the_rest(split_run):
    records, _ = split_run
    steps = _srun_steps(records)
    assert _option(steps["train"]["argv"], "nodelist") == ",".join(NODES[:4])
    assert [_option(steps["train"]["argv"], k) for k in ("ntasks", "ntasks-per-node")] == ["4", "1"]
    assert _option(steps["train"]["argv"], "cpus-per-task") == "96"  # the whole node to torchrun's 8 ranks
    assert _option(steps["infer"]["argv"], "nodelist") == NODES[4]
    servers = _servers(records)
    assert [(r["env"]["SLURMD_NODENAME"], _option(r["argv"], "node-rank")) for r in servers] == [(NODES[4], "0")]
    assert _option(servers[0]["argv"], "num-nodes") == "1"
    assert _option(servers[0]["argv"], "host") == NODES[4]  # binds its own node, the name in the trainer's URL


def test_split_script_gives_each_training_node_its_torchrun_rank_and_one_rendezvous(split_run):
    records, _ = split_run
    runs = _tool(records, "torchrun")
    assert [(r["env"]["SLURMD_NODENAME"], _option(r["argv"], "node-rank")) for r in runs] == [
        (node, str(rank)) for rank, node in enumerate(NODES[:4])
    ]
    for r in runs:
        assert _option(r["argv"], "nnodes") == "4" and _option(r["argv"], "nproc-per-node") == "8"
        assert _option(r["argv"], "master-addr") == NODES[0]  # the host of node rank 0
        assert _option(r["argv"], "master-port") == str(20000 + (JOB_ID % 1000) * 10)
        command = r["argv"][r["argv"].index("-m") + 1:]
        assert command[:3] == ["engine", "train", "configs/qwen2.5-72b_tp8_pp4_split_4x1.yaml"]


def test_trainer_and_vllm_server_agree_on_host_and_ports(split_run):
    records, _ = split_run
    trainer_argv = _tool(records, "torchrun")[0]["argv"]
    trainer, [server] = _overrides(trainer_argv), _servers(records)
    assert _base_urls(trainer_argv) == [f"http://{NODES[4]}:{BASE_PORT + 1}"]
    assert (_option(server["argv"], "host"), _option(server["argv"], "port")) == (NODES[4], str(BASE_PORT + 1))
    assert trainer["rollout.vllm_group_port"] == str(BASE_PORT + 2)
    assert trainer["grpo.beta"] == "0.04"  # the user's override reaches both sides
    assert "rollout.vllm_server_host" not in trainer and "rollout.vllm_server_port" not in trainer  # the URLs replace
    assert _overrides(server["argv"]) == trainer  # same config, same overrides: the URL list validates on both sides


def test_split_script_starts_one_rollout_server_per_inference_node_and_gives_the_trainer_every_url(two_replica_run):
    records, logs = two_replica_run
    steps = _srun_steps(records)
    assert _option(steps["infer"]["argv"], "nodelist") == ",".join(SIX_NODES[4:])
    assert _option(steps["infer"]["argv"], "ntasks") == "2"
    servers = _servers(records)
    assert [
        (r["env"]["SLURMD_NODENAME"], _option(r["argv"], "host"), _option(r["argv"], "node-rank"),
         _option(r["argv"], "num-nodes"), _option(r["argv"], "port")) for r in servers
    ] == [(node, node, str(rank), "2", str(BASE_PORT + 1)) for rank, node in enumerate(SIX_NODES[4:])]
    trainers = _tool(records, "torchrun")
    assert len(trainers) == 4 and {_option(r["argv"], "nnodes") for r in trainers} == {"4"}
    # URL i is replica i (--node-rank=i): server i's weight-transfer group is vllm_group_port + i on the trainer side.
    assert _base_urls(trainers[0]["argv"]) == [f"http://{node}:{BASE_PORT + 1}" for node in SIX_NODES[4:]]
    assert {_overrides(r["argv"])["rollout.vllm_server_base_urls"] for r in trainers + servers} == {
        f"[http://gpu005:{BASE_PORT + 1},http://gpu006:{BASE_PORT + 1}]"
    }
    plan = next(r for r in _tool(records, "python") if r["argv"][:3] == ["-m", "engine", "plan"])
    assert _option(plan["argv"], "infer-nodes") == "2"
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        [f"train-{n}.log" for n in SIX_NODES[:4]] + [f"infer-{n}.log" for n in SIX_NODES[4:]]
    )


def test_split_script_runs_one_server_over_the_inference_nodes_its_config_names(slurm):
    """configs/deepseek-v3-671b...: rollout.vllm_nodes_per_server=4 read from the config, 16 + 4 nodes: one server,
    every inference task given node 0's host and vLLM's master port (the port after the one group port), one URL."""
    nodes = [f"gpu{i:03d}" for i in range(1, 21)]
    config = "configs/deepseek-v3-671b_tp8_ep128_split_16x4.yaml"
    result, records = slurm(["bash", SPLIT_SCRIPT], SLURM_JOB_NODELIST="gpu[001-020]", SLURM_NNODES="20",
                            CONFIG=config, TRAIN_NODES="16", GPU_MEMORY_GIB="139.8")
    assert result.returncode == 0, result.stderr
    servers = _servers(records)
    assert [(r["env"]["SLURMD_NODENAME"], _option(r["argv"], "node-rank"), _option(r["argv"], "num-nodes"),
             _option(r["argv"], "master-addr"), _option(r["argv"], "master-port")) for r in servers] == [
        (node, str(rank), "4", "gpu017", str(BASE_PORT + 3)) for rank, node in enumerate(nodes[16:])]
    trainer = _tool(records, "torchrun")[0]["argv"]
    assert _base_urls(trainer) == [f"http://gpu017:{BASE_PORT + 1}"] and _overrides(trainer)["rollout.vllm_group_port"] \
        == str(BASE_PORT + 2)
    plan = next(r for r in _tool(records, "python") if r["argv"][:3] == ["-m", "engine", "plan"])
    assert (_option(plan["argv"], "infer-nodes"), _option(plan["argv"], "gpu-memory-gib")) == ("4", "139.8")
    assert "1 rollout server(s) of 4 node(s)" in result.stderr


def test_split_script_gives_two_servers_over_two_nodes_each_their_node_0(slurm):
    """An override rollout.vllm_nodes_per_server=2 on 4 + 4 nodes: servers on gpu005-006 and gpu007-008."""
    result, records = slurm(["bash", SPLIT_SCRIPT], "rollout.vllm_nodes_per_server=2",
                            "rollout.vllm_tensor_parallel_size=16", SLURM_JOB_NODELIST="gpu[001-008]", SLURM_NNODES="8")
    assert result.returncode == 0, result.stderr
    assert [(_option(r["argv"], "node-rank"), _option(r["argv"], "master-addr")) for r in _servers(records)] == [
        ("0", "gpu005"), ("1", "gpu005"), ("2", "gpu007"), ("3", "gpu007")]
    assert _base_urls(_tool(records, "torchrun")[0]["argv"]) == [f"http://gpu005:{BASE_PORT + 1}",
                                                                 f"http://gpu007:{BASE_PORT + 1}"]
    sruns = len(_tool(records, "srun"))
    three, records = slurm(["bash", SPLIT_SCRIPT], "rollout.vllm_nodes_per_server=2",
                           SLURM_JOB_NODELIST="gpu[001-007]", SLURM_NNODES="7")
    assert three.returncode == 1 and len(_tool(records, "srun")) == sruns  # refused before any srun
    assert ("3 inference node(s) do not split into rollout servers of rollout.vllm_nodes_per_server=2 nodes: submit "
            "with --nodes=8") in three.stderr


def test_split_script_plans_two_replicas_with_the_real_planner(slurm):
    result, records = slurm(["bash", SPLIT_SCRIPT], DRY_RUN="1", PYTHON=sys.executable,
                            SLURM_JOB_NODELIST="gpu[001-006]", SLURM_NNODES="6")
    assert result.returncode == 0, result.stderr
    assert list(_srun_steps(records)) == ["train"]
    assert "rollout: 2 rollout server replica(s), one per inference node" in result.stdout
    assert result.stdout.count("dry run: layout valid and fits on 32 training GPUs") == 4


def test_split_script_refuses_more_inference_nodes_than_its_port_block_holds(slurm):
    result, records = slurm(["bash", SPLIT_SCRIPT], SLURM_JOB_NODELIST="gpu[001-013]", SLURM_NNODES="13")
    assert result.returncode == 1
    assert f"9 rollout servers need group ports {BASE_PORT + 2}-{BASE_PORT + 10}" in result.stderr
    assert "pin VLLM_GROUP_PORT" in result.stderr
    assert not _tool(records, "srun")


def test_split_script_writes_one_log_per_node(split_run):
    _, logs = split_run
    assert sorted(p.name for p in logs.iterdir()) == sorted(
        [f"train-{n}.log" for n in NODES[:4]] + [f"infer-{NODES[4]}.log"]
    )


def test_split_script_exports_what_nccl_megatron_and_torchrun_need(split_run):
    records, _ = split_run
    env = _tool(records, "torchrun")[0]["env"]
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "SIGUSR1" in env["TORCHELASTIC_SIGNALS_TO_HANDLE"].split(",")
    assert int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < 600  # finishes inside the --signal lead time


def test_split_script_gives_trainer_and_servers_one_fresh_secret_token_per_job(slurm, split_run):
    records, logs = split_run
    [server] = _servers(records)
    token = server["env"]["GRPO_ENGINE_TOKEN"]
    assert len(token) == 64 and int(token, 16) >= 0  # 32 random bytes, hex
    assert {r["env"]["GRPO_ENGINE_TOKEN"] for r in _tool(records, "torchrun")} == {token}  # every training node
    assert all(token not in p.read_text() for p in logs.iterdir()), "the token reached a log"
    result, again = slurm(["bash", SPLIT_SCRIPT], GRPO_ENGINE_TOKEN="stale-token-from-the-shell")
    assert result.returncode == 0, result.stderr
    assert token not in result.stdout + result.stderr
    launched = _tool(again, "torchrun") + [r for r in _tool(again, "python") if "engine.rollout.server" in r["argv"]]
    fresh = {r["env"]["GRPO_ENGINE_TOKEN"] for r in launched}
    assert len(fresh) == 1 and fresh.isdisjoint({token, "stale-token-from-the-shell"})  # new job, new token


def test_split_script_plans_before_starting_any_node(split_run):
    records, _ = split_run
    first = records[[r["tool"] for r in records].index("python")]
    assert first["argv"][:3] == ["-m", "engine", "plan"]
    assert records.index(first) < min(records.index(r) for r in _tool(records, "srun"))
    assert [_option(first["argv"], k) for k in ("train-nodes", "infer-nodes", "gpus-per-node")] == ["4", "1", "8"]


def test_dry_run_validates_the_layout_on_every_training_node_and_skips_vllm(slurm):
    result, records = slurm(["bash", SPLIT_SCRIPT], DRY_RUN="1", PYTHON=sys.executable)
    assert result.returncode == 0, result.stderr
    assert list(_srun_steps(records)) == ["train"]
    out = result.stdout
    assert out.count("dry run: layout valid and fits on 32 training GPUs") == 4
    for rank in range(4):
        first = rank * 8
        assert f"node rank {rank} of 4: global ranks {first}-{first + 7}, pipeline stage(s) {rank}," in out
    assert "training layout: tp*pp*dp = 8*4*1 = 32 GPUs = 4 node(s) x 8" in out


def test_split_script_refuses_a_node_split_that_does_not_divide_before_any_srun(slurm):
    result, records = slurm(["bash", SPLIT_SCRIPT], TRAIN_NODES="3", PYTHON=sys.executable)
    assert result.returncode != 0
    assert "tp_size*pp_size*dp_size = 8*4*1 = 32 != world size 24" in result.stderr
    assert not _tool(records, "srun")


def test_split_script_refuses_an_allocation_without_an_inference_node(slurm):
    result, records = slurm(["bash", SPLIT_SCRIPT], SLURM_JOB_NODELIST="gpu[001-004]", SLURM_NNODES="4")
    assert result.returncode == 1
    assert "TRAIN_NODES=4 leaves 0 for vLLM; submit with --nodes=5" in result.stderr
    assert not _tool(records, "srun")


def test_first_run_does_not_resume(split_run):
    records, _ = split_run
    assert "checkpoint.resume_from_checkpoint=latest" not in _tool(records, "torchrun")[0]["argv"]


def test_usr1_before_the_time_limit_reaches_the_trainer_then_the_job_requeues(slurm):
    header = SPLIT_SCRIPT.read_text()
    assert "#SBATCH --signal=B:USR1@600" in header and "#SBATCH --requeue" in header
    proc = slurm(["bash", SPLIT_SCRIPT], background=True, FAKE_SRUN_BLOCK="1")
    try:
        deadline = time.monotonic() + 20
        while sum(r.get("event") == "start" for r in read_records(slurm.log)) < 2:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)  # what `--signal=B:USR1@600` does 10 minutes before the limit
        proc.wait(timeout=20)
    finally:
        proc.kill()
    records = read_records(slurm.log)
    signals = {
        "infer" if "engine.rollout.server" in " ".join(r["argv"]) else "train": r["signal"]
        for r in records if r.get("event") == "signal"
    }
    assert signals == {"train": "SIGUSR1", "infer": "SIGTERM"}  # trainer checkpoints; servers stop after it
    assert [r["argv"] for r in _tool(records, "scontrol") if r["argv"][0] == "requeue"] == [["requeue", str(JOB_ID)]]
    assert proc.returncode == 0


def _usr1_pending(pid: int) -> bool:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return any(int(status[key], 16) >> (signal.SIGUSR1 - 1) & 1 for key in ("SigPnd", "ShdPnd"))


def _ended(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _drain(fd: int, into: list) -> None:
    while chunk := os.read(fd, 1 << 16):
        into.append(chunk)
    os.close(fd)


@pytest.mark.parametrize("script", [SPLIT_SCRIPT, ONE_NODE_SCRIPT], ids=["split", "one_node"])
def test_usr1_arriving_as_the_trainer_step_ends_keeps_the_steps_status(slurm, script):
    # The trainer step ends while the batch shell is still in its USR1 trap (its log line held up by a full pipe here,
    # by a slow log disk on a cluster). bash's `wait` has already returned 138 for the signal; the job must still exit
    # with the step's own status (0) and requeue.
    env = dict(SLURM_JOB_NODELIST="gpu[001-001]", SLURM_NNODES="1") if script == ONE_NODE_SCRIPT else {}
    steps = 1 if script == ONE_NODE_SCRIPT else 2
    read_end, write_end = os.pipe()
    proc = slurm(["bash", script], background=True, stderr=write_end, FAKE_SRUN_BLOCK="1", **env)
    stderr: list[bytes] = []
    try:
        deadline = time.monotonic() + 20
        while len(starts := [r for r in read_records(slurm.log) if r.get("event") == "start"]) < steps:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        [trainer] = [r["pid"] for r in starts if "engine.rollout.server" not in " ".join(r["argv"])]
        # Fill the pipe through a description of our own (the shell's stays blocking), so the trap's `say` blocks.
        filler = os.open(f"/proc/self/fd/{write_end}", os.O_WRONLY | os.O_NONBLOCK)
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(filler, b"." * 4096)
        os.close(filler)
        os.close(write_end)
        proc.send_signal(signal.SIGUSR1)
        while _usr1_pending(proc.pid):  # the shell has taken the signal: its `wait` returned, the trap runs
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(trainer, signal.SIGUSR1)  # the trainer checkpoints and its step ends, inside the shell's trap
        while not _ended(trainer):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        reader = threading.Thread(target=_drain, args=(read_end, stderr), daemon=True)
        reader.start()
        proc.wait(timeout=20)
        reader.join(timeout=20)  # the shell's whole stderr, for the message below
    finally:
        proc.kill()
    records = read_records(slurm.log)
    assert [r["argv"] for r in _tool(records, "scontrol") if r["argv"][0] == "requeue"] == [["requeue", str(JOB_ID)]]
    assert proc.returncode == 0, b"".join(stderr).lstrip(b".").decode()


def test_requeued_sbatch_job_uses_its_header_node_count_and_resumes_from_the_latest_checkpoint(slurm):
    # `sbatch launch/grpo_72b.slurm` as users type it; the stand-in reads `#SBATCH --nodes=5` for the allocation.
    result, records = slurm(["sbatch", SPLIT_SCRIPT], SLURM_RESTART_COUNT="2")
    assert result.returncode == 0, result.stderr
    steps = _srun_steps(records)
    assert _option(steps["train"]["argv"], "nodelist") == ",".join(NODES[:4])
    assert _option(steps["infer"]["argv"], "nodelist") == NODES[4]
    for argv in [_tool(records, "torchrun")[0]["argv"], steps["infer"]["argv"]]:
        assert "checkpoint.resume_from_checkpoint=latest" in argv


def test_one_node_script_runs_colocated_torchrun_and_no_server(slurm):
    result, records = slurm(["bash", ONE_NODE_SCRIPT], SLURM_JOB_NODELIST="gpu[001-001]", SLURM_NNODES="1")
    assert result.returncode == 0, result.stderr
    [run] = _tool(records, "torchrun")
    assert "--standalone" in run["argv"] and _option(run["argv"], "nproc-per-node") == "8"
    assert _overrides(run["argv"])["rollout.vllm_mode"] == "colocate"
    assert not [r for r in _tool(records, "python") if "engine.rollout.server" in r["argv"]]
    assert sorted(p.name for p in slurm.logs.iterdir()) == ["train-gpu001.log"]


def test_one_node_dry_run_validates_the_7b_layout(slurm):
    result, _ = slurm(["bash", ONE_NODE_SCRIPT], SLURM_JOB_NODELIST="gpu[001-001]", SLURM_NNODES="1",
                      DRY_RUN="1", PYTHON=sys.executable)
    assert result.returncode == 0, result.stderr
    assert "training layout: tp*pp*dp = 2*1*4 = 8 GPUs" in result.stdout
    assert "dry run: layout valid and fits on 8 training GPUs" in result.stdout


def test_local_cpu_dry_run_validates_the_tiny_config_at_two_ranks(slurm):
    result, _ = slurm([str(ROOT / "launch" / "local_cpu.sh")], "parallel.tp_size=2", DRY_RUN="1", NPROC="2",
                      PYTHON=sys.executable)
    assert result.returncode == 0, result.stderr
    assert "training layout: tp*pp*dp = 2*1*1 = 2 GPUs" in result.stdout
