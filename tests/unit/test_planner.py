"""The memory planner against hand-computed cases and the published numbers its docstring cites: Megatron Core's
distributed-optimizer table and `theoretical_memory_usage.py`, Korthikanti et al. 2022 Table 2, a vLLM start-up
log, the hub's parameter counts; and its refusals of layouts that do not divide or fit."""

from pathlib import Path

import pytest

from engine.cli import main
from engine.config import ConfigError, build_config, load_config
from engine.planning.memory import GIB, activation_term
from engine.planning.planner import build_plan, format_plan
from engine.planning.shapes import (
    KNOWN_MODELS,
    ModelDims,
    PlanError,
    load_model_dims,
    megatron_padded_vocab,
    resolve_cluster_shape,
)

CONFIGS = Path(__file__).parents[2] / "configs"
QWEN_72B = CONFIGS / "qwen2.5-72b_tp8_pp4_split_4x1.yaml"
LLAMA_70B = CONFIGS / "llama3.1-70b_tp8_pp4_split_4x1.yaml"
LLAMA_70B_LORA = CONFIGS / "llama3.1-70b_lora_tp8_split_1x1.yaml"
GPU_CONFIGS = [QWEN_72B, LLAMA_70B, CONFIGS / "qwen2.5-7b_tp2_dp4_1node.yaml", CONFIGS / "qwen2.5-0.5b_tp1_1gpu.yaml",
               LLAMA_70B_LORA]
TWO_URLS = "rollout.vllm_server_base_urls=[http://gpu005:8000,http://gpu006:8000]"


def _plan(path, overrides=(), **shape):
    cfg = load_config(path, list(overrides))
    return build_plan(cfg, resolve_cluster_shape(cfg, **shape))


def _terms(budget):
    return {t.label: t.nbytes for t in budget.terms}


# --- the shipped configs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [QWEN_72B, LLAMA_70B], ids=["qwen2.5-72b", "llama3.1-70b"])
def test_split_70b_configs_fit_under_80_gib_on_training_and_inference_nodes(path):
    plan = _plan(path)
    assert plan.shape.train_nodes == 4 and plan.shape.infer_nodes == 1
    assert not plan.problems
    for budget in plan.budgets:
        assert budget.total_bytes < 80 * GIB, budget.title


@pytest.mark.parametrize("path", GPU_CONFIGS, ids=[p.stem for p in GPU_CONFIGS])
def test_config_header_quotes_the_planner_totals(path):
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    for budget in _plan(path).budgets:
        assert f"{budget.total_bytes / GIB:.2f} GiB" in header, (budget.title, f"{budget.total_bytes / GIB:.2f}")


def test_72b_training_gpu_terms_equal_the_hand_computed_arithmetic():
    plan = _plan(QWEN_72B)
    terms = _terms(plan.budget("training GPU"))
    # Qwen2.5-72B layer: q, o 8192*8192 each + k, v 8192*1024 each + QKV bias 8192 + 2*1024 + SwiGLU 3*8192*29568,
    # split over TP 8, plus 2 RMSNorm weights of 8192 per layer on every rank. Last stage: 20 layers, the output
    # layer (152064 padded to 152576 at TP8: 149 * 1024) and the final norm.
    split = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 8192 + 2048 + 3 * 8192 * 29568
    params = 20 * (split / 8 + 2 * 8192) + 152576 * 8192 / 8 + 8192
    assert terms["weights"] == pytest.approx(params * 2)
    assert terms["main grads"] == pytest.approx(params * 4)
    assert terms["optimizer"] == pytest.approx(params * 12)  # DP = 1: the distributed optimizer shards nothing
    s, b, h, t = 512 + 8192, 2, 8192, 8
    sbh = s * b * h
    one_layer = sbh * (10 + 4 + 4 * 8 / 64 + 6 * 29568 / 8192) / t
    assert terms["activations"] == pytest.approx(20 * 1 * 2 * sbh / t + one_layer)  # last stage: 1 micro-batch
    n = 2 * 8192
    onepass_dw = 152576 // 8 * h * 4  # dapo takes the one-pass LM head: its float32 dW shard until the backward
    assert terms["loss workspace"] == pytest.approx(1024 * 2**20 + 2 * sbh + n * h * (2 + 4) + n * 16 * 4 + onepass_dw)
    assert terms["weight-sync send"] / GIB == pytest.approx(0.58, abs=0.005)  # tests/unit/test_sync_buffers.py
    assert plan.budget("training GPU").total_bytes / GIB == pytest.approx(47.27 + onepass_dw / GIB, abs=0.005)


def test_70b_lora_counts_frozen_base_and_adapter_state_on_one_training_node():
    """LoRA (configs/llama3.1-70b_lora_tp8_split_1x1.yaml): the base's bf16 weights, the adapters' fp32 weights (PEFT's
    default, lora.lora_adapter_dtype), fp32 gradients and Adam state for the adapters only (no master copy: an fp32
    adapter is its own; bf16 adapters have one); 1 training node, where the full fine-tune does not fit."""
    plan = _plan(LLAMA_70B_LORA)
    assert plan.shape.train_nodes == 1 and plan.shape.infer_nodes == 1 and not plan.problems
    terms = _terms(plan.budget("training GPU"))
    # r = 32 on every linear of a Llama-3.1-70B layer, TP 8 (column: A r*in + B out*r/8, row: A r*in/8 + B out*r)
    h, kv, f, r, t = 8192, 1024, 28672, 32, 8
    per_layer = ((r * h + h * r / t) + 2 * (r * h + kv * r / t) + (r * h / t + h * r) + 2 * (r * h + f * r / t)
                 + (r * f / t + h * r))
    assert per_layer == 2_252_800
    adapters = 80 * per_layer
    base = 80 * ((2 * h * h + 2 * h * kv + 3 * h * f) / t + 2 * h) + 2 * 129024 * h / t
    assert terms["weights"] == pytest.approx(base * 2)
    assert terms["adapter weights"] == pytest.approx(adapters * 4)
    assert terms["main grads"] == pytest.approx(adapters * 4)
    assert terms["optimizer"] == pytest.approx(adapters * 8)
    assert plan.budget("training GPU").total_bytes / GIB == pytest.approx(29.36, abs=0.005)  # + 2 x 0.25 send slots, one-pass dW 0.49
    in_bf16 = _terms(_plan(LLAMA_70B_LORA, ["lora.lora_adapter_dtype=model"]).budget("training GPU"))
    assert (in_bf16["adapter weights"], in_bf16["optimizer"]) == pytest.approx((adapters * 2, adapters * 12))
    # adapter-only sync: vLLM's LoRA slot (max_lora_rank 32 = r, vLLM TP 8 = the trainer's TP: the same shares)
    inference = _terms(plan.budget("inference GPU"))
    assert inference["LoRA slot"] == pytest.approx(adapters * 2)
    assert plan.budget("inference GPU").total_bytes / GIB == pytest.approx(63.26, abs=0.005)
    merged = _terms(_plan(LLAMA_70B_LORA, ["lora.lora_weight_sync=merged"]).budget("inference GPU"))
    assert "LoRA slot" not in merged and sum(inference.values()) - sum(merged.values()) == pytest.approx(adapters * 2)
    full = _plan(LLAMA_70B_LORA, ["lora.use_peft=false", "lora.lora_r=16", "lora.lora_alpha=32",
                                  "lora.lora_dropout=0.05", "lora.lora_target_modules=null",
                                  "lora.lora_weight_sync=merged"])
    assert full.budget("training GPU").total_bytes > 79.1 * GIB, "the full fine-tune must not fit on one node"
    # modules_to_save (merged sync): each V/t x h trained in full: the original copy (2 B), fp32 grad (4 B), fp32 master
    # and Adam (12 B, dp 1); the embedding on the first stage, the LM head on the last (one stage here)
    saved = ["lora.lora_weight_sync=merged", "lora.lora_modules_to_save=[lm_head]"]
    head = _terms(_plan(LLAMA_70B_LORA, saved).budget("training GPU"))
    assert head["modules_to_save"] == pytest.approx(129024 * h / t * (2 + 4 + 12))
    both = _terms(_plan(LLAMA_70B_LORA, saved[:1] + ["lora.lora_modules_to_save=[embed_tokens,lm_head]"])
                  .budget("training GPU"))
    assert both["modules_to_save"] == pytest.approx(2 * head["modules_to_save"])
    assert "modules_to_save" not in _terms(_plan(LLAMA_70B_LORA, saved[:1]).budget("training GPU"))


def test_lora_on_an_moe_model_plans_attention_adapters_and_refuses_expert_ones_as_the_run_does():
    moe = CONFIGS / "qwen3-30b-a3b_tp2_ep8_split_2x1.yaml"
    attention = _plan(moe, ["lora.use_peft=true", "lora.lora_target_modules=[q_proj,k_proj,v_proj,o_proj]"])
    assert _terms(attention.budget("training GPU"))["adapter weights"] > 0
    with pytest.raises(PlanError, match=r"includes \['gate_proj', 'up_proj', 'down_proj'\], but .* routes its MLP "
                                        r"through 128 experts"):
        _plan(moe, ["lora.use_peft=true", "lora.lora_target_modules=[all-linear]"])


def test_lora_kl_reference_is_the_base_with_adapters_off_so_the_plan_holds_no_reference_copy():
    """beta > 0 with LoRA: the reference is the policy's frozen base with its adapters disabled (engine/policy/
    reference.py base_of), no second copy; the full fine-tune's reference holds a whole copy of the weights."""
    lora = _terms(_plan(LLAMA_70B_LORA, ["grpo.beta=0.04"]).budget("training GPU"))
    without = _terms(_plan(LLAMA_70B_LORA).budget("training GPU"))
    assert lora["reference"] == 0 and sum(lora.values()) == pytest.approx(sum(without.values()))
    full = _plan(LLAMA_70B_LORA, ["grpo.beta=0.04", "lora.use_peft=false", "lora.lora_r=16", "lora.lora_alpha=32",
                                  "lora.lora_dropout=0.05", "lora.lora_target_modules=null",
                                  "lora.lora_weight_sync=merged"])
    assert _terms(full.budget("training GPU"))["reference"] == pytest.approx(lora["weights"])


def test_72b_inference_gpu_holds_the_whole_generation_round_in_kv_cache():
    terms = _terms(_plan(QWEN_72B).budget("inference GPU"))
    # 2 (K, V) x 80 layers x 1 KV head per GPU (8 / TP 8) x head_dim 128 x 2 B = 40 KiB per token;
    # 128 completions (2 x 1 x 64) of 512 + 8192 tokens.
    assert terms["KV cache"] == 128 * 8704 * 2 * 80 * 1 * 128 * 2 == 42.5 * GIB
    vllm_params = 80 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 10240 + 3 * 8192 * 29568) / 8 + 80 * 2 * 8192
    vllm_params += 2 * 152064 * 8192 / 8 + 8192
    assert terms["weights"] == pytest.approx(vllm_params * 2)


def test_plan_prints_every_term_as_arithmetic():
    text = format_plan(_plan(QWEN_72B))
    assert "= 2.35e9 params x 2 B = 4.38 GiB" in text
    assert "2.35e9 x 12 B (fp32 master + Adam m, v) / dp 1 (distributed optimizer) = 26.27 GiB" in text
    assert "40 KiB/token x 128 sequences (ceil(8 prompts / 1 server(s)) = 8 prompts x 16 generations) x 8704" in text
    assert "total            63.43 GiB of vLLM's share 0.9 x 79.1 GiB = 71.19 GiB: fits" in text


# --- published numbers ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,params",
    [
        # Total parameters in each checkpoint's safetensors metadata on the Hugging Face hub.
        ("Qwen/Qwen2.5-0.5B-Instruct", 494_032_768),
        ("Qwen/Qwen2.5-7B-Instruct", 7_615_616_512),
        ("Qwen/Qwen2.5-72B-Instruct", 72_706_203_648),
        ("meta-llama/Llama-3.1-70B-Instruct", 70_553_706_496),
        ("meta-llama/Meta-Llama-3-8B", 8_030_261_248),
    ],
)
def test_parameter_count_matches_the_hub(name, params):
    assert load_model_dims(name).total_params() == params


@pytest.mark.parametrize(
    "dtype,distributed,dp,bytes_per_param",
    [  # Megatron Core user guide, "Distributed Optimizer": bf16 params + fp32 grads 18 | 6 + 12/d; fp32 16 | 8 + 8/d
        ("bfloat16", False, 4, 18.0),
        ("bfloat16", True, 4, 6 + 12 / 4),
        ("float32", False, 4, 16.0),
        ("float32", True, 4, 8 + 8 / 4),
    ],
)
def test_bytes_per_parameter_follow_megatrons_distributed_optimizer_table(dtype, distributed, dp, bytes_per_param):
    cfg = build_config({
        "model": {"name_or_path": "Qwen/Qwen2.5-7B-Instruct", "dtype": dtype},
        "parallel": {"tp_size": 2, "dp_size": dp},
        "optimizer": {"use_distributed_optimizer": distributed},
        "data": {"max_prompt_length": 512},
    })
    terms = _terms(build_plan(cfg, resolve_cluster_shape(cfg)).budget("training GPU"))
    params = terms["weights"] / (2 if dtype == "bfloat16" else 4)
    assert (terms["weights"] + terms["main grads"] + terms["optimizer"]) / params == pytest.approx(bytes_per_param)


@pytest.mark.parametrize("dtype,distributed,bytes_per_param", [("bfloat16", True, 6 + 8 / 4), ("bfloat16", False, 14.0),
                                                               ("float32", True, 8 + 4 / 4)])
def test_bf16_adam_moments_count_two_bytes_each(dtype, distributed, bytes_per_param):
    """optimizer.optimizer_state_dtype=bfloat16: Adam's m, v at 2 B each (4 B, not 8) next to the fp32 master (bf16
    model) and fp32 main grads; sharded over DP by the distributed optimizer as before."""
    cfg = build_config({
        "model": {"name_or_path": "Qwen/Qwen2.5-7B-Instruct", "dtype": dtype},
        "parallel": {"tp_size": 2, "dp_size": 4},
        "optimizer": {"use_distributed_optimizer": distributed, "optimizer_state_dtype": "bfloat16"},
        "data": {"max_prompt_length": 512},
    })
    plan = build_plan(cfg, resolve_cluster_shape(cfg))
    terms = _terms(plan.budget("training GPU"))
    params = terms["weights"] / (2 if dtype == "bfloat16" else 4)
    assert (terms["weights"] + terms["main grads"] + terms["optimizer"]) / params == pytest.approx(bytes_per_param)
    assert "Adam m, v (bf16)" in format_plan(plan)


@pytest.mark.parametrize("tp,pp,dp", [(8, 4, 1), (8, 1, 4)])
def test_weights_and_optimizer_match_megatron_theoretical_memory_usage(tp, pp, dp):
    # megatron/training/theoretical_memory_usage.py::compute_weight_and_optimizer_memory, transcribed for
    # Llama-3.1-70B (SwiGLU, GQA 64/8, RMSNorm, untied): the most loaded shard times 6 + 12/dp bytes.
    h, ffn, layers, vocab = 8192, 28672, 80, megatron_padded_vocab(128256, 128, tp)
    layer = 2 * h * (ffn * 3 / 2 + 1) + 2 * h * h * (1 + 8 / 64)
    block = layer * layers + h
    embedding = h * vocab
    most_loaded = (block / pp + embedding) / tp + (embedding / tp if pp == 1 else 0)
    megatron = most_loaded * (6 + 12 / dp)
    cfg = build_config({
        "model": {"name_or_path": "meta-llama/Llama-3.1-70B-Instruct"},
        "parallel": {"tp_size": tp, "pp_size": pp, "dp_size": dp, "sequence_parallel": True},
        "optimizer": {"use_distributed_optimizer": True},
        "data": {"max_prompt_length": 512},
    })
    terms = _terms(build_plan(cfg, resolve_cluster_shape(cfg, infer_nodes=0)).budget("training GPU"))
    ours = terms["weights"] + terms["main grads"] + terms["optimizer"]
    # Megatron divides the norm weights by TP; they are replicated (2h per layer on every rank): < 0.02% apart.
    assert ours == pytest.approx(megatron, rel=2e-4)
    assert ours >= megatron


# A GPT-3-style shape for Korthikanti et al. Table 2: g = a, and SwiGLU with f = 8h/3 has the 16*s*b*h MLP
# activations of the paper's 4h GeLU MLP (6 f/h = 16).
GPT = ModelDims(hidden_size=3072, num_layers=8, num_heads=24, num_kv_heads=24, intermediate_size=8192,
                vocab_size=50304, tie_word_embeddings=False, qkv_bias=False)


def _activation_cfg(tp, sp, recompute, impl="local", pp=1, vpp=None, b=2, s=2048, attention="eager"):
    return build_config({
        "model": {"transformer_impl": impl, "attention_implementation": attention},
        "parallel": {"tp_size": tp, "pp_size": pp, "sequence_parallel": sp, "virtual_pipeline_size": vpp},
        "train": {"per_device_train_batch_size": b, "gradient_checkpointing": recompute},
        "generation": {"max_completion_length": s // 2},
        "data": {"max_prompt_length": s // 2},
    })


@pytest.mark.parametrize(
    "tp,sp,impl,attention,per_layer",  # Table 2 rows, in units of s*b*h (5*a*s/h = 5*24*2048/3072 = 80)
    [
        (1, False, "local", "eager", 34 + 80),                 # no parallelism
        (4, False, "local", "eager", 10 + 24 / 4 + 80 / 4),    # tensor parallel
        (4, True, "local", "eager", (34 + 80) / 4),            # tensor + sequence parallel
        (4, True, "transformer_engine", "eager", 34 / 4),      # + selective recompute (fused attention: no scores)
        (4, True, "local", "sdpa", 34 / 4),                    # the local spec's SDPA keeps no scores either
        (4, True, "local", "auto", 34 / 4),                    # nor does auto (SDPA for the plain attention)
    ],
)
def test_activations_per_layer_match_korthikanti_table_2(tp, sp, impl, attention, per_layer):
    s, b, h = 2048, 2, 3072
    cfg = _activation_cfg(tp, sp, recompute=False, impl=impl, attention=attention)
    term = activation_term(cfg, GPT, stage=0, num_microbatches=1)
    assert term.nbytes == pytest.approx(8 * per_layer * s * b * h)


def test_full_recompute_keeps_layer_inputs_plus_one_layer():
    s, b, h = 2048, 2, 3072
    term = activation_term(_activation_cfg(4, True, recompute=True, impl="transformer_engine"), GPT, 0, 1)
    assert term.nbytes == pytest.approx(8 * 2 * s * b * h / 4 + 34 * s * b * h / 4)  # paper §4: 2sbhL (/t under SP)


@pytest.mark.parametrize("stage,microbatches,vpp,in_flight", [(0, 64, None, 4), (3, 64, None, 1), (0, 2, None, 2),
                                                              (0, 64, 2, 4 * (1 + 3 / 8))])
def test_pipeline_stage_holds_its_1f1b_micro_batches_in_flight(stage, microbatches, vpp, in_flight):
    s, b, h = 2048, 2, 3072
    cfg = _activation_cfg(1, False, recompute=True, impl="transformer_engine", pp=4, vpp=vpp)
    term = activation_term(cfg, GPT, stage, microbatches)
    stored = 2 * 2 * s * b * h * in_flight  # 8 layers / pp 4 = 2 layers per stage, 2*s*b*h each
    assert term.nbytes == pytest.approx(stored + 34 * s * b * h)


def test_kv_cache_and_weights_match_a_vllm_startup_log():
    # vLLM issue #12330, Meta-Llama-3-8B on an A100-40GB: "total_gpu_memory (39.50GiB) x gpu_memory_utilization
    # (0.90) = 35.55GiB; model weights take 14.96GiB; non_torch_memory takes 0.10GiB; PyTorch activation peak memory
    # takes 9.37GiB; the rest of the memory reserved for KV Cache is 11.12GiB" and "Maximum concurrency for 8192
    # tokens per request: 11.12x".
    cfg = build_config({
        "model": {"name_or_path": "meta-llama/Meta-Llama-3-8B"},
        "rollout": {"vllm_mode": "server", "vllm_gpu_memory_utilization": 0.9},
        "generation": {"max_completion_length": 4096},
        "data": {"max_prompt_length": 4096},
    })
    shape = resolve_cluster_shape(cfg, gpus_per_node=1, gpu_memory_gib=39.5, reserve_gib=0.10 + 9.37)
    budget = build_plan(cfg, shape).budget("inference GPU")
    terms = _terms(budget)
    assert terms["weights"] / GIB == pytest.approx(14.96, abs=0.01)  # vLLM also counts a 2 MiB RoPE cache
    room = budget.limit_bytes - terms["weights"] - terms["reserve"]
    assert room / GIB == pytest.approx(11.12, abs=0.01)
    per_token = terms["KV cache"] / (cfg.train.per_device_train_batch_size * 8192)
    assert per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB
    assert room / (8192 * per_token) == pytest.approx(11.12, abs=0.01)


def test_known_table_matches_the_builtin_tiny_models_and_megatrons_vocab_padding(tmp_path):
    from engine.models.tiny_model import tiny_model_config
    from engine.policy.model import padded_vocab_size

    for family in ("qwen2", "llama"):
        tiny_model_config(family).to_json_file(tmp_path / "config.json")
        assert load_model_dims(str(tmp_path)) == KNOWN_MODELS[f"builtin:tiny-{family}"]
    for vocab, tp in [(151936, 1), (151936, 8), (152064, 8), (128256, 8), (400, 2)]:
        assert megatron_padded_vocab(vocab, 128, tp) == padded_vocab_size(vocab, 128, tp)


# --- refusals -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides,shape,message",
    [
        (["parallel.tp_size=16", "parallel.pp_size=2"], {},
         r"parallel.tp_size=16 must divide the GPUs per node \(8 % 16 = 8\)"),
        (["parallel.pp_size=3", "parallel.dp_size=null"], {"train_nodes": 3},
         r"num_hidden_layers=80 is not divisible by pp_size\*virtual_pipeline_size = 3\*1 = 3 \(80 % 3 = 2\)"),
        (["rollout.vllm_tensor_parallel_size=3"], {},
         r"vllm_tensor_parallel_size=3 must divide num_attention_heads=64"),
        (["rollout.vllm_tensor_parallel_size=16"], {},
         r"vllm_tensor_parallel_size=16 > rollout.vllm_nodes_per_server x GPUs per node = 1 x 8 = 8"),
        ([], {"infer_nodes": 0}, r"vllm_mode='server' needs inference nodes"),
        ([], {"infer_nodes": 2},
         r"2 inference nodes run 2 rollout servers \(one per inference node\) but the trainer is given one .* set "
         r"rollout.vllm_server_base_urls to one URL"),
        ([TWO_URLS], {"infer_nodes": 3},
         r"rollout.vllm_server_base_urls lists 2 server\(s\) but 3 inference node\(s\) \(--infer-nodes\) run 3"),
        ([TWO_URLS], {"infer_nodes": 1}, r"lists 2 server\(s\) but 1 inference node\(s\) \(--infer-nodes\) run 1"),
        (["rollout.vllm_tensor_parallel_size=16", TWO_URLS], {},
         r"vllm_tensor_parallel_size=16 > .* = 8: a rollout server's vLLM TP spans its nodes' GPUs only \(raise "
         r"rollout.vllm_nodes_per_server"),
        # rollout.vllm_nodes_per_server: servers over several nodes (engine/rollout/server_nodes.py)
        (["rollout.vllm_tensor_parallel_size=16", "rollout.vllm_nodes_per_server=2"], {"infer_nodes": 3},
         r"3 inference nodes \(--infer-nodes\) do not split into rollout servers of rollout.vllm_nodes_per_server=2 "
         r"nodes \(3 % 2 = 1\)"),
        (["rollout.vllm_tensor_parallel_size=16", "rollout.vllm_nodes_per_server=2", TWO_URLS], {"infer_nodes": 2},
         r"lists 2 server\(s\) but 2 inference node\(s\) \(--infer-nodes\) run 1: one rollout server runs per 2 "
         r"inference nodes \(rollout.vllm_nodes_per_server\), give one URL each \(node 0's\)"),
        (["rollout.vllm_mode=colocate", "rollout.max_staleness=0"], {"infer_nodes": 1},
         r"'colocate' runs vLLM on the training GPUs: got 1"),
        (["model.name_or_path=acme/unknown-70b"], {}, r"does not know this model's dimensions and does not download"),
        (["data.max_prompt_length=null"], {}, r"the planner needs a bound on the sequence length"),
    ],
)
def test_planner_refuses_a_layout_that_does_not_divide(overrides, shape, message):
    with pytest.raises(PlanError, match=message):
        _plan(QWEN_72B, overrides, **shape)


# --- rollout server replicas (server mode, one per inference node) ---------------------------------------------------


def test_two_inference_nodes_run_two_replicas_each_holding_half_the_round():
    one = _plan(QWEN_72B)
    two = _plan(QWEN_72B, [TWO_URLS])  # the inference node count defaults to the number of URLs
    assert two.shape.infer_nodes == 2 and not two.problems
    text = format_plan(two)
    assert ("rollout: 2 rollout server replica(s), one per inference node, each one vLLM engine at TP 8 on 8 of 8 "
            "GPUs; 8 prompts per round split among them: at most ceil(8 / 2) = 4 per server") in text
    assert "inference GPU (vLLM TP 8, 2 rollout server(s), one per inference node, 64 sequences per engine)" in text
    # 8 prompts x 16 completions split by prompt: 4 x 16 = 64 sequences per server, half of one server's KV cache.
    inference_one, inference_two = _terms(one.budget("inference GPU")), _terms(two.budget("inference GPU"))
    assert inference_two["KV cache"] == 64 * 8704 * 2 * 80 * 1 * 128 * 2 == inference_one["KV cache"] / 2
    assert inference_two["weights"] == inference_one["weights"]  # every replica holds the whole model at TP 8
    assert _terms(two.budget("training GPU")) == _terms(one.budget("training GPU"))


def test_replicas_that_do_not_divide_the_prompts_size_the_busiest_server():
    urls = "rollout.vllm_server_base_urls=[http://a:1,http://b:1,http://c:1]"
    plan = _plan(QWEN_72B, [urls], infer_nodes=3)
    kv = _terms(plan.budget("inference GPU"))["KV cache"]
    assert kv == 3 * 16 * 8704 * 40 * 1024  # ceil(8 / 3) = 3 prompts x 16 generations on the busiest server
    assert "ceil(8 prompts / 3 server(s)) = 3 prompts x 16 generations" in format_plan(plan)


def test_a_vllm_tp_smaller_than_the_node_is_planned_and_its_idle_gpus_reported():
    plan = _plan(QWEN_72B, [TWO_URLS, "rollout.vllm_tensor_parallel_size=4"])
    budget = plan.budget("inference GPU")
    assert "each inference node uses vLLM TP 4 of its 8 GPUs: 4 idle per node" in " ".join(budget.notes)
    assert "at TP 4 on 4 of 8 GPUs" in format_plan(plan)
    assert not any("idle" in note for note in _plan(QWEN_72B, [TWO_URLS]).budget("inference GPU").notes)


def test_a_server_over_two_nodes_holds_the_model_at_their_tp_and_the_trainer_gets_one_url_per_server():
    """rollout.vllm_nodes_per_server=2: 4 inference nodes are 2 servers at vLLM TP 16 (weights per GPU halved against
    TP 8, KV heads 8 replicated in 2 copies: 8 per GPU -> 1), each holding half a round."""
    two_nodes = ["rollout.vllm_nodes_per_server=2", "rollout.vllm_tensor_parallel_size=16", TWO_URLS]
    plan = _plan(QWEN_72B, two_nodes)  # the inference node count defaults to 2 nodes per URL
    assert plan.shape.infer_nodes == 4 and not plan.problems
    text = format_plan(plan)
    assert ("rollout: 2 rollout server replica(s), one per 2 inference nodes (rollout.vllm_nodes_per_server: vLLM's "
            "TP across them), each one vLLM engine at TP 16 on 16 of 16 GPUs") in text
    assert "inference GPU (vLLM TP 16, 2 rollout server(s), one per 2 inference nodes, 64 sequences per engine)" in text
    assert _terms(plan.budget("inference GPU"))["weights"] < _terms(_plan(QWEN_72B, [TWO_URLS]).budget(
        "inference GPU"))["weights"] / 2 + 2 * GIB  # per GPU: about half at twice the TP (+ replicated KV heads)
    idle = _plan(QWEN_72B, ["rollout.vllm_nodes_per_server=2", "rollout.vllm_tensor_parallel_size=8", TWO_URLS])
    assert "each rollout server uses vLLM TP 8 of its 2 x 8 GPUs: 8 idle per server" in " ".join(
        idle.budget("inference GPU").notes)


def test_plan_command_accepts_two_inference_nodes_in_server_mode(capsys):
    assert main(["plan", str(QWEN_72B), TWO_URLS, "--infer-nodes=2"]) == 0
    out = capsys.readouterr().out
    assert "cluster: 4 training node(s) + 2 inference node(s)" in out
    assert "rollout: 2 rollout server replica(s)" in out


def test_planner_refuses_a_node_count_that_does_not_match_the_layout():
    with pytest.raises(ConfigError, match=r"tp_size\*pp_size\*dp_size = 8\*4\*1 = 32 != world size 24"):
        _plan(QWEN_72B, train_nodes=3)


def test_planner_reports_every_divisibility_problem_at_once():
    with pytest.raises(PlanError) as info:
        _plan(QWEN_72B, ["parallel.tp_size=16", "parallel.pp_size=3", "parallel.dp_size=null"], train_nodes=6)
    assert "8 % 16 = 8" in str(info.value) and "80 % 3 = 2" in str(info.value)


def test_generation_round_too_large_for_the_kv_cache_does_not_fit(capsys):
    assert main(["plan", str(QWEN_72B), "train.per_device_train_batch_size=4"]) == 1
    err = capsys.readouterr().err
    # 256 x 8704 tokens x 40 KiB = 85 GiB of KV cache next to 16.93 GiB of weights in vLLM's 71.19 GiB
    assert "total 105.93 GiB > vLLM's share 0.9 x 79.1 GiB = 71.19 GiB" in err
    assert "the KV room holds 151.37 sequences at full length" in err


def test_training_state_too_large_for_the_gpu_does_not_fit():
    # TP8 x DP4 without pipelining: every GPU holds 80 layers / 8 + both vocab tables, 9.09e9 x (6 + 12/4) B =
    # 76 GiB before activations. (16 micro-batches keep the generation round at 2 x 4 x 16 = 128 completions.)
    plan = _plan(QWEN_72B, ["parallel.pp_size=1", "parallel.dp_size=4", "train.gradient_accumulation_steps=16"])
    [problem] = plan.problems
    assert problem.startswith("training GPU") and "> 79.1 GiB per GPU; raise parallel.pp_size" in problem


def test_colocated_vllm_with_sleep_mode_adds_only_what_the_activations_do_not_already_take():
    path = CONFIGS / "qwen2.5-7b_tp2_dp4_1node.yaml"
    asleep = _terms(_plan(path).budget("training GPU"))
    awake = _terms(_plan(path, ["rollout.vllm_enable_sleep_mode=false"]).budget("training GPU"))
    share = 0.4 * 79.1 * GIB
    assert asleep["vLLM (colocated)"] == pytest.approx(share - asleep["activations"] - asleep["loss workspace"])
    assert awake["vLLM (colocated)"] == pytest.approx(share)


# --- the commands ---------------------------------------------------------------------------------------------------


def test_plan_command_prints_both_node_kinds_and_exits_zero(capsys):
    assert main(["plan", str(LLAMA_70B)]) == 0
    out = capsys.readouterr().out
    assert "training GPU, last pipeline stage (the larger of 4 stages), per GPU:" in out
    assert (
        "inference GPU (vLLM TP 8, 1 rollout server(s), one per inference node, 128 sequences per engine), per GPU:"
        in out
    )


def test_train_dry_run_refuses_a_launcher_world_size_that_disagrees_with_the_shape(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert main(["train", str(QWEN_72B), "--dry-run"]) == 1
    assert "world size 16 (from the launcher) != training nodes x GPUs per node = 4 x 8 = 32" in capsys.readouterr().err


def test_train_dry_run_prints_this_nodes_ranks_and_exits_zero(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "4")
    monkeypatch.setenv("SLURM_PROCID", "2")
    assert main(["train", str(QWEN_72B), "--dry-run", "--gpus-per-node=8"]) == 0
    out = capsys.readouterr().out
    assert "node rank 2 of 4: global ranks 16-23, pipeline stage(s) 2, data-parallel rank(s) 0" in out
    assert "dry run: layout valid and fits on 32 training GPUs; not training" in out


# --- activation recompute, as it runs -----------------------------------------------------------------------------


ALL_CONFIGS = sorted(CONFIGS.glob("*.yaml"))
OTHER_GPUS = {"deepseek-v3-671b_tp8_ep128_split_16x4": {"gpu_memory_gib": 139.8}}
"""Shipped configs for another GPU than the planner's default H100 80GB (their headers say which, and the
--gpu-memory-gib they are planned with)."""


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=[p.stem for p in ALL_CONFIGS])
def test_every_shipped_config_fits_with_the_recompute_that_runs(path):
    """The plan budgets `resolve_recompute`'s result, the function that configures Megatron (engine/policy/model.py),
    prints it, and fits; a config that sets the recompute explicitly does not fit without it."""
    shape = OTHER_GPUS.get(path.stem, {})
    plan = _plan(path, **shape)
    assert not plan.problems, plan.problems
    cfg = load_config(path)
    assert any(line.startswith("activation recompute: ") for line in plan.header)
    if cfg.train.recompute_num_layers is not None:
        off = _plan(path, ["train.gradient_checkpointing=false", "train.recompute_method=null",
                           "train.recompute_num_layers=null"], **shape)
        assert off.problems, f"{path.name} sets recompute explicitly but fits without it"


def _recompute_cfg(**train):
    return build_config({
        "model": {"transformer_impl": "local", "attention_implementation": "eager"},
        "parallel": {"tp_size": 4, "sequence_parallel": True},
        "train": {"per_device_train_batch_size": 2, **train},
        "generation": {"max_completion_length": 1024},
        "data": {"max_prompt_length": 1024},
    })


@pytest.mark.parametrize("train,expected", [  # in s*b*h / t (SP); GPT: 8 layers, 5*a*s/h = 80, split 24 + 80
    ({"recompute_num_layers": 2}, 8 / 2 * 2 + 2 * (34 + 80)),                           # 4 units + one unit of 2
    ({"recompute_method": "block", "recompute_num_layers": 3}, 3 * 2 + 5 * (34 + 80) + (34 + 80)),
    ({"recompute_granularity": "selective"}, 8 * 34 + 80),  # the paper's selective row + one layer's scores again
    ({"recompute_granularity": "selective", "recompute_modules": ["mlp"]}, 8 * (34 + 80 - 16) + 16),  # 6*f/h = 24 - 8
    ({"gradient_checkpointing": False}, 8 * (34 + 80)),
])
def test_activation_term_follows_the_recompute_settings(train, expected):
    s, b, h = 2048, 2, 3072
    term = activation_term(_recompute_cfg(**train), GPT, stage=0, num_microbatches=1)
    assert term.nbytes == pytest.approx(expected * s * b * h / 4)


def test_planner_refuses_nemotron_h_naming_the_family(tmp_path):
    """A Nemotron-H config.json (no num_hidden_layers key: a KeyError before) is refused with the reason."""
    from engine.models.tiny_model import tiny_model_config

    tiny_model_config("nemotron_h").to_json_file(tmp_path / "config.json")
    with pytest.raises(PlanError, match="model_type nemotron_h .* is not sized by the planner yet"):
        load_model_dims(str(tmp_path))


def test_moe_lora_counts_the_local_experts_adapters():
    """Expert adapters (lora.lora_target_parameters) on Qwen3-30B-A3B at EP8: each rank holds 128 / 8 experts' A and
    B for gate_up_proj (r*(h + 2f)) and down_proj (r*(f + h)) on every layer, besides the attention adapters."""
    config = CONFIGS / "qwen3-30b-a3b_tp2_ep8_split_2x1.yaml"
    lora = ["lora.use_peft=true", "lora.lora_r=8", "lora.lora_dropout=0.0", "lora.lora_target_modules=[q_proj]"]
    attention = _terms(_plan(config, lora).budget("training GPU"))["adapter weights"]
    experts = _plan(config, lora + ["lora.lora_target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"])
    h, f, r = 2048, 768, 8
    assert _terms(experts.budget("training GPU"))["adapter weights"] - attention == pytest.approx(
        48 * 16 * (r * (h + 2 * f) + r * (f + h)) * 4)


def test_fp8_rollout_counts_one_byte_per_linear_weight_plus_block_scales_and_an_fp8_kv_cache():
    """Qwen2.5-7B at vLLM TP 2: the decoder's linear weights (28 layers x (q, o 3584^2; k, v 3584 x 512; gate, up,
    down 3584 x 18944) / 2 per rank) at 1 B + a float32 scale per 128 x 128 block instead of 2 B; embeddings, LM
    head and norms stay bf16; an FP8 KV cache holds 1 B per element instead of 2."""
    path = CONFIGS / "qwen2.5-7b_tp2_dp4_1node.yaml"
    base = _terms(_plan(path).budget("inference GPU"))
    fp8 = _terms(_plan(path, ["rollout.vllm_weight_dtype=fp8"]).budget("inference GPU"))
    both = _terms(_plan(path, ["rollout.vllm_weight_dtype=fp8", "rollout.vllm_kv_cache_dtype=fp8"]).budget("inference GPU"))
    linear = 28 * (2 * 3584 * 3584 + 2 * 3584 * 512 + 3 * 3584 * 18944) / 2
    # the planner's split count carries the QKV bias (4608 per layer) with the linears: 64 KiB of 4 GiB, hence rel 1e-4
    assert fp8["weights"] == pytest.approx(base["weights"] - linear * 2 + linear * (1 + 4 / 128**2), rel=1e-4)
    assert fp8["KV cache"] == base["KV cache"] and both["KV cache"] == base["KV cache"] / 2
    assert both["weights"] == fp8["weights"]
