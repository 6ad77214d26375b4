"""The rollout server's command line and token checks, without starting vLLM: `grpo-engine vllm-serve` takes TRL
1.16's `trl vllm-serve` flags (underscores or dashes, TRL's server defaults) with no config file, the run's YAML
config as before, or both; flags it cannot honour are refused with what to do instead; a missing or short
$GRPO_ENGINE_TOKEN is named on the side that lacks it. (The HTTP side, 401s and `/health`'s `authorized`, is tested
against a real server in tests/integration/test_rollout_server.py.)"""

import pytest

from engine.config import load_config
from engine.models.model_dir import resolve_model_dir
from engine.rollout.client import RolloutServerError, read_token
from engine.rollout.server import main, parse_serve_args, resolve_dtype

MODEL = "builtin:tiny-qwen2-arith"


def test_trl_flags_without_a_config_build_the_server_config_from_defaults_with_trls_server_defaults():
    s = parse_serve_args(["--model", MODEL, "--tensor-parallel-size", "2", "--max_model_len=4096",
                          "--enable_prefix_caching", "rollout.weight_sync_bucket_mb=64", "--enforce-eager", "false"])
    defaults = load_config()
    assert (s.host, s.port) == ("0.0.0.0", 8000)  # TRL's server address, the client's vllm_server_host/port
    assert s.cfg.model.name_or_path == MODEL and s.cfg.rollout.vllm_mode == "server"
    assert s.cfg.rollout.vllm_tensor_parallel_size == 2 and s.cfg.rollout.vllm_max_model_length == 4096
    assert s.cfg.rollout.vllm_gpu_memory_utilization == 0.9  # TRL's vllm-serve default, not colocate's 0.3
    assert s.cfg.rollout.weight_sync_bucket_mb == 64  # dotted overrides still work
    assert s.cfg.train == defaults.train and s.cfg.generation == defaults.generation
    assert s.dtype == "auto" and s.engine_options == {"enable_prefix_caching": True}  # a bare switch is true
    assert (s.num_nodes, s.node_rank, s.log_requests) == (1, 0, True)
    quiet = parse_serve_args(["--model", MODEL, "--log_level", "warning", "--trust_remote_code", "--kv-cache-dtype",
                              "fp8", "--host", "127.0.0.1", "--port", "8123", "--dtype", "bf16"])
    assert (quiet.host, quiet.port, quiet.dtype, quiet.log_requests) == ("127.0.0.1", 8123, "bf16", False)
    assert quiet.cfg.model.trust_remote_code
    assert quiet.engine_options == {"trust_remote_code": True, "kv_cache_dtype": "fp8"}


def test_a_config_keeps_its_values_and_flags_given_next_to_it_override_them():
    yaml_form = parse_serve_args(["configs/tiny_cpu.yaml", "rollout.vllm_mode=server", "--port=8765",
                                  "--num-nodes", "2", "--node-rank=1"])
    tiny = load_config("configs/tiny_cpu.yaml")
    assert yaml_form.cfg.rollout.vllm_gpu_memory_utilization == tiny.rollout.vllm_gpu_memory_utilization
    assert yaml_form.cfg.model == tiny.model and yaml_form.dtype is None  # model.dtype, not TRL's "auto"
    assert (yaml_form.host, yaml_form.port, yaml_form.num_nodes, yaml_form.node_rank) == ("0.0.0.0", 8765, 2, 1)
    both = parse_serve_args(["configs/tiny_cpu.yaml", "--tensor_parallel_size", "2", "--gpu_memory_utilization",
                             "0.5", "--rollout.vllm_max_model_length=64"])
    assert both.cfg.rollout.vllm_tensor_parallel_size == 2 and both.cfg.rollout.vllm_gpu_memory_utilization == 0.5
    assert both.cfg.rollout.vllm_max_model_length == 64 and both.cfg.train == tiny.train


def test_a_server_spanning_nodes_is_replica_rank_over_k_and_gives_vllm_its_node():
    """rollout.vllm_nodes_per_server=K: inference node R is node R % K of replica R // K (node 0 serves; the others
    run workers only, engine/rollout/server_nodes.py), and its vLLM engine gets nnodes / node_rank / master_*."""
    from engine.rollout.server_nodes import NodePlace

    argv = ["configs/tiny_cpu.yaml", "rollout.vllm_nodes_per_server=2", "--tensor_parallel_size=4", "--num-nodes=4",
            "--master-addr=10.0.0.7", "--master-port=29600"]
    places = [parse_serve_args([*argv, f"--node-rank={rank}"]) for rank in range(4)]
    assert [s.place for s in places] == [NodePlace(0, 2, 0, 2), NodePlace(0, 2, 1, 2), NodePlace(1, 2, 0, 2),
                                         NodePlace(1, 2, 1, 2)]
    assert places[3].place.engine_options(places[3].master_addr, places[3].master_port) == {
        "nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.7", "master_port": 29600}
    one = parse_serve_args(["configs/tiny_cpu.yaml", "--num-nodes=3", "--node-rank=2"]).place
    assert one == NodePlace(2, 3) and one.engine_options("127.0.0.1", 29501) == {}  # one node per server: as before


@pytest.mark.parametrize("argv,message", [
    (["--model", MODEL, "--data_parallel_size", "2"], r"--data_parallel_size=2 is not supported: run one server per "
                                                      r"data-parallel replica .* rollout.vllm_server_base_urls"),
    (["--model", MODEL, "--revision", "v1"], r"--revision=v1 is not supported: download that revision"),
    (["--model", MODEL, "--distributed-executor-backend", "ray"], r"ray is not supported: .* rollout.vllm_nodes_per_server=K .* one server per node"),
    (["--model", MODEL, "--speculative_config", "{}"], r"--speculative_config is not supported"),
    (["--model", MODEL, "--max-num-seqs", "64"], r"unknown flag\(s\) --max-num-seqs: `trl vllm-serve` passes unknown "
                                                 r"flags on to `vllm serve`"),
    (["--model", MODEL, "--dtype", "int8"], r"--dtype=int8: expected auto, bfloat16, float16, float32"),
    (["--model", MODEL, "--log_level", "loud"], r"--log_level='loud': expected one of critical"),
    (["--model", MODEL, "--vllm_model_impl", "sglang"], r"rollout.vllm_model_impl"),
    (["--model", MODEL, "--node-rank", "1"], r"--node-rank=1 must be in \[0, --num-nodes=1\)"),
    (["--model", MODEL, "rollout.vllm_nodes_per_server=2", "--tensor-parallel-size", "2", "--num-nodes", "3"],
     r"--num-nodes=3 inference nodes do not split into rollout servers of rollout.vllm_nodes_per_server=2 nodes"),
    (["--model", MODEL, "rollout.vllm_nodes_per_server=2", "--tensor-parallel-size", "3", "--num-nodes", "2"],
     r"vllm_nodes_per_server=2 must divide rollout.vllm_tensor_parallel_size=3"),
    ([], r"give the run's config .* or the model, as with TRL"),
])
def test_flags_that_cannot_be_honoured_are_refused_with_what_to_do(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_serve_args(argv)


def test_dtype_auto_is_the_checkpoints_and_a_local_directory_is_served_as_given(tmp_path):
    cfg = parse_serve_args(["--model", MODEL]).cfg
    model_dir = resolve_model_dir(cfg.model.name_or_path, cfg.train.output_dir, download=True)
    assert (model_dir / "config.json").is_file()
    assert resolve_dtype("auto", model_dir, "bfloat16") == "float32"  # the shipped tiny model is float32
    assert resolve_dtype("half", model_dir, "float32") == "float16"
    assert resolve_dtype(None, model_dir, "float32") == "float32"  # no --dtype: the config's model.dtype
    served = parse_serve_args(["--model", str(model_dir)]).cfg.model.name_or_path
    assert resolve_model_dir(served, tmp_path, download=True) == model_dir


@pytest.mark.parametrize("value,state", [(None, "unset"), ("short", r"too short \(5 characters, 16\+ needed\)")])
@pytest.mark.parametrize("side,other", [("trainer", "rollout server"), ("rollout server", "trainer")])
def test_a_missing_token_is_named_on_the_side_that_lacks_it_with_how_to_set_it(monkeypatch, value, state, side, other):
    if value is None:
        monkeypatch.delenv("GRPO_ENGINE_TOKEN", raising=False)
    else:
        monkeypatch.setenv("GRPO_ENGINE_TOKEN", value)
    with pytest.raises(RolloutServerError, match=rf"\$GRPO_ENGINE_TOKEN is {state} in the {side}'s environment: .* "
                                                 rf"the {other} needs the same value; generate one once, e.g. "
                                                 r"`export GRPO_ENGINE_TOKEN=\$\(python -c"):
        read_token(side)


def test_server_and_trainer_refuse_to_start_without_a_token(monkeypatch, capsys):
    from engine.cli import main as cli_main
    from engine.config import GenerationConfig, RolloutConfig
    from engine.rollout.client import connect_rollout_server

    monkeypatch.delenv("GRPO_ENGINE_TOKEN", raising=False)
    assert cli_main(["vllm-serve", "--model", MODEL, "--port", "1"]) == 2  # refused before binding or loading
    err = capsys.readouterr().err
    assert "rollout_server: refusing to start: $GRPO_ENGINE_TOKEN is unset in the rollout server's environment" in err
    assert main(["--model", MODEL, "--data_parallel_size", "4"]) == 2  # a refused flag: the same exit, its message
    assert "--data_parallel_size=4 is not supported" in capsys.readouterr().err
    with pytest.raises(RolloutServerError, match=r"unset in the trainer's environment"):
        connect_rollout_server(RolloutConfig(vllm_mode="server"), GenerationConfig(), rank=0)


@pytest.mark.parametrize("family", ["qwen2", "nemotron_h"])
def test_the_health_checks_model_facts_survive_json_and_a_changed_fact_is_named(tmp_path, family):
    """`/health`'s model facts arrive as JSON (tuples, e.g. ModelDims.layer_kinds, as lists): the same model is no
    mismatch either way (the trainer checks /health's JSON, the server /weights/init's: the tuple-vs-list comparison
    refused every server once Nemotron-H's tuple fields were added), and a changed shape fact is named."""
    import json
    from dataclasses import asdict

    from transformers import AutoConfig

    from engine.models.tiny_model import build_tiny_model
    from engine.policy.hf_map import ModelDims
    from engine.rollout.server import model_mismatch

    hf_config = AutoConfig.from_pretrained(build_tiny_model(tmp_path / family, family, seed=0))
    trainer = asdict(ModelDims.from_hf(hf_config, hf_config.vocab_size)) | {"ffn_hidden_size": 64}
    served = json.loads(json.dumps(trainer)) | {"name": "m", "model_type": family}
    assert model_mismatch(served, trainer) == ""  # the trainer's check of /health
    assert model_mismatch(trainer | {"name": "m"}, json.loads(json.dumps(trainer))) == ""  # the server's of /weights/init
    served["hidden_size"] += 1
    assert model_mismatch(served, trainer).startswith(f"hidden_size: server {trainer['hidden_size'] + 1}")
