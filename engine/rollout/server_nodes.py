"""A rollout server spanning several inference nodes: which replica and node a server process is, and the node
processes that hold only vLLM workers.

With `rollout.vllm_nodes_per_server` = K > 1 one rollout server's vLLM engine runs TP over K nodes (vLLM's
multiprocessing executor with `nnodes`, `node_rank`, `master_addr`, `master_port`, as `vllm serve --nnodes K
--node-rank R [--headless]`). The job's M inference nodes (`--num-nodes M --node-rank R`, as for one node per
server) are M / K replicas: replica R // K, node R % K of it. Node 0 of a replica is the server (HTTP, the engine's
scheduler and its first GPUs' workers, at `--master-addr`); nodes 1..K-1 run `run_worker_node`: their workers only,
driven by node 0's engine (generation and weight syncs alike), until node 0's server stops answering /health.

Owns: `NodePlace` (replica / node arithmetic and the vLLM keywords of a node), `run_worker_node`.
Must not: import vLLM (engine/rollout/vllm_engine.py `serve_node_workers` does), bind a port on worker nodes.

Test: tests/unit/test_rollout_server_args.py (the arithmetic and its refusals), tests/integration/test_rollout_server.py
(its TP-2 server is one replica over two node processes on loopback: syncs, digests, log-probs, a GRPO loop).
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

VLLM_MASTER_PORT = 29501
"""`--master-port` default: vLLM's own (ParallelConfig.master_port), the torch.distributed store on node 0."""
HEAD_MISSES = 3
"""A worker node stops after node 0's /health failed this many times in a row (once it has answered)."""


@dataclass(frozen=True)
class NodePlace:
    """Where one server process stands: replica `replica` of `num_replicas`, node `node` of its `nodes`."""

    replica: int
    num_replicas: int
    node: int = 0
    nodes: int = 1

    @classmethod
    def of(cls, num_nodes: int, node_rank: int, nodes_per_server: int) -> NodePlace:
        """From the job's inference nodes (`--num-nodes`, `--node-rank`) and `rollout.vllm_nodes_per_server`.

        Raises:
            ValueError: the nodes do not split into whole replicas, or the rank is outside them.
        """
        if not 0 <= node_rank < num_nodes:
            raise ValueError(f"--node-rank={node_rank} must be in [0, --num-nodes={num_nodes})")
        if num_nodes % nodes_per_server:
            raise ValueError(
                f"--num-nodes={num_nodes} inference nodes do not split into rollout servers of "
                f"rollout.vllm_nodes_per_server={nodes_per_server} nodes ({num_nodes} % {nodes_per_server} = "
                f"{num_nodes % nodes_per_server}): start a multiple of {nodes_per_server} nodes")
        return cls(node_rank // nodes_per_server, num_nodes // nodes_per_server, node_rank % nodes_per_server,
                   nodes_per_server)

    def engine_options(self, master_addr: str, master_port: int) -> dict:
        """vLLM's multi-node keywords for this node ({} for a one-node server)."""
        if self.nodes == 1:
            return {}
        return {"nnodes": self.nodes, "node_rank": self.node, "master_addr": master_addr, "master_port": master_port}

    def describe(self) -> str:
        where = f"replica {self.replica} of {self.num_replicas}"
        return where if self.nodes == 1 else f"{where}, node {self.node} of its {self.nodes}"


def _head_answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return bool(json.loads(response.read()).get("status"))
    except (OSError, ValueError):
        return False


def head_watch(url: str, first_answer_s: float, stopping: threading.Event, poll_s: float = 2.0):
    """A `stop()` for `serve_node_workers`: true once `stopping` is set (SIGTERM), node 0's /health at `url` failed
    HEAD_MISSES times in a row after answering, or it never answered within `first_answer_s`."""
    state = {"seen": False, "misses": 0, "next": 0.0, "start": time.monotonic()}

    def stop() -> bool:
        now = time.monotonic()
        if stopping.is_set():
            return True
        if now < state["next"]:
            return False
        state["next"] = now + poll_s
        if _head_answers(url):
            state["seen"], state["misses"] = True, 0
            return False
        state["misses"] += 1
        if not state["seen"]:
            return now - state["start"] > first_answer_s
        return state["misses"] >= HEAD_MISSES

    return stop


def run_worker_node(settings, place: NodePlace, model_dir, dtype: str) -> int:
    """Node `place.node` > 0 of a multi-node rollout server: this node's vLLM workers until node 0 stops (exit 0)
    or a worker dies (exit 1: under SLURM, `srun --kill-on-bad-exit` then ends the server's other nodes too; node 0's
    engine itself does not watch other nodes' workers). `settings`: the server's ServeSettings (node 0's config)."""
    from engine.rollout.vllm_engine import serve_node_workers

    cfg = settings.cfg
    head = f"http://{settings.master_addr}:{settings.port}/health"
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    print(f"rollout_server: {place.describe()}: vLLM workers only (node 0 at {settings.master_addr}, port "
          f"{settings.master_port}); stops when {head} stops answering", file=sys.stderr, flush=True)
    ok = serve_node_workers(model_dir, cfg.rollout, cfg.generation, seed=cfg.train.seed, dtype=dtype,
                            stop=head_watch(head, cfg.rollout.vllm_server_timeout, stopping), **settings.engine_options,
                            **place.engine_options(settings.master_addr, settings.master_port))
    print(f"rollout_server: {place.describe()}: {'stopped' if ok else 'a vLLM worker died'}", file=sys.stderr,
          flush=True)
    return 0 if ok else 1
