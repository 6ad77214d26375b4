"""Generation and weight transfer: the `RolloutEngine` protocol the loop calls (protocol.py) and its two
implementations, colocated (colocated.py) and server mode (server_rollout.py); the vLLM engine (vllm_engine.py; with
vllm_lora.py, its LoRA adapter slot, the only modules that import vLLM), the rollout server and its HTTP client
(server mode), and the weight sync from the trainer's
(TP, PP) shards into the engines' layout: its plan (sync_plan.py, the only module that knows both layouts;
weight_transport.py executes it and knows them only through it), the server-mode transport (weight_transport.py), the
colocated sync (colocated_sync.py), the trainer's half of a server sync (server_sync.py) and the verification
(sync_check.py: exact per-tensor digests, weight_digest.py, of what each engine rank holds against what the trainer
sent); LoRA's adapter-only sync (adapter_sync.py).

May import: engine.config, engine.validation, engine.log_filters, engine.sampling_settings, engine.models,
engine.policy, engine.lora_settings.
"""
