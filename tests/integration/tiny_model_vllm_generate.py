"""Helper for tests/integration/test_tiny_model_vllm.py: generate with vLLM (CPU) from a saved tiny model; the
prompts, the sampled tokens and their logprobs.

The test calls `generate_in_process` in a kept rank of tests/distributed/launcher.py (world size 1), so vLLM's
global state stays out of the pytest process and the rank's start-up and imports are shared with the other
in-process-engine tests; the engine core runs in that process, as the colocated engine runs it. By hand, as a
program that writes a JSON file (with vLLM's default executor the engine core is a spawned process that re-imports
`__main__`, which needs the `if __name__ == "__main__":` guard, docs/contributing/cpu-stack.md):

    VLLM_CPU_KVCACHE_SPACE=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python tests/integration/tiny_model_vllm_generate.py MODEL_DIR OUT.json
"""

import argparse
import json
import os
import time


def generate(model_dir: str, num_prompts: int, max_tokens: int, seed: int) -> dict:
    """Load `model_dir` in vLLM and sample `max_tokens` tokens for `num_prompts` chat prompts.

    Args:
        model_dir: a saved Hugging Face model directory (the tiny model).
        num_prompts: how many prompts to generate for.
        max_tokens: tokens sampled per prompt (eos ignored, so every completion has this length).
        seed: sampling seed.

    Returns:
        {"startup_s", "generate_s", "samples": [{"prompt", "prompt_token_ids", "token_ids", "logprobs"}]},
        logprobs being the sampled tokens' log-probabilities (raw model logprobs, float).
    """
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {3 * i + 2} + {7 * i}?"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for i in range(num_prompts)
    ]
    start = time.perf_counter()
    llm = LLM(
        model=model_dir,
        dtype="float32",
        gpu_memory_utilization=0.15,
        max_model_len=256,
        enforce_eager=True,
        seed=seed,
    )
    startup_s = time.perf_counter() - start
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, logprobs=0, ignore_eos=True, seed=seed)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    generate_s = time.perf_counter() - start
    samples = []
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = [step[token].logprob for step, token in zip(completion.logprobs, token_ids)]
        samples.append({
            "prompt": prompt,
            "prompt_token_ids": list(output.prompt_token_ids),
            "token_ids": token_ids,
            "logprobs": logprobs,
        })
    llm.llm_engine.engine_core.shutdown()
    return {"startup_s": startup_s, "generate_s": generate_s, "samples": samples}


def generate_in_process(model_dir: str, num_prompts: int, max_tokens: int, seed: int) -> dict:
    """`generate` with the engine core in this process and 1 GiB of KV cache (the environment is the caller's to
    restore: the launcher does)."""
    os.environ.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    return generate(model_dir, num_prompts, max_tokens, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_json")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    result = generate(args.model_dir, args.num_prompts, args.max_tokens, args.seed)
    with open(args.out_json, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
