"""The `grpo-engine` command (also `python -m engine`): train, plan, check, demo, tiny-model, vllm-serve.

Owns: argument parsing and dispatch only; each subcommand calls into the module that owns the work.

    grpo-engine demo                                   # the README's first command (via `make demo`)
    grpo-engine check configs/tiny_cpu.yaml grpo.beta=0.04 --world-size 2
    grpo-engine plan configs/qwen2.5-72b_tp8_pp4_split_4x1.yaml
    grpo-engine train configs/tiny_cpu.yaml [section.key=value ...]
    grpo-engine tiny-model /tmp/tiny --family llama
    grpo-engine vllm-serve --model Qwen/Qwen2.5-7B --tensor_parallel_size 2 --port 8000   # `trl vllm-serve`'s flags
    grpo-engine grpo --config recipe.yaml [--max_steps 10 ...]   # `trl grpo`: TRL's arguments and recipes

`vllm-serve` is the rollout server of server mode (engine/rollout/server.py, also `python -m engine.rollout.server`):
TRL's `vllm-serve` flags, or the run's config; its arguments go to that module's parser unchanged. `grpo` is TRL's
`trl grpo` (engine/api/trl_script.py): TRL's ScriptArguments, GRPOConfig and ModelConfig flags, `--config` recipes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from engine.config import ConfigError, config_to_dict, load_config
from engine.models.families import SUPPORTED_MODEL_TYPES
from engine.validation import validate

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "tiny_cpu.yaml"


def _world_size(arg: int | None, cfg) -> int:
    if arg is not None:
        return arg
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    par = cfg.parallel
    return par.tp_size * par.pp_size * (par.dp_size or 1)


def _load(args):
    cfg = load_config(args.config, args.overrides)
    return cfg, validate(cfg, _world_size(args.world_size, cfg))


def cmd_check(args) -> int:
    import yaml

    cfg, derived = _load(args)
    print(yaml.safe_dump(config_to_dict(cfg), sort_keys=False), end="")
    print(f"# derived: {derived}")
    return 0


def cmd_plan(args) -> int:
    from engine.planning.planner import build_plan, format_plan
    from engine.planning.shapes import SHAPE_OPTIONS, resolve_cluster_shape

    cfg = load_config(args.config, args.overrides)
    shape = resolve_cluster_shape(cfg, **{k: getattr(args, k) for k in SHAPE_OPTIONS})
    if args.world_size is not None and args.world_size != shape.train_gpus:
        raise ConfigError(
            f"--world-size {args.world_size} != training nodes x GPUs per node = {shape.train_nodes} x "
            f"{shape.gpus_per_node} = {shape.train_gpus}; the planner sizes the cluster shape (--train-nodes, ...)"
        )
    plan = build_plan(cfg, shape)
    derived = plan.derived
    print(format_plan(plan))
    print(
        f"generation: {derived.num_prompts_per_generation} prompts x {cfg.grpo.num_generations} = "
        f"{derived.generation_batch_size} completions per round, serving {derived.steps_per_generation * cfg.grpo.num_iterations}/"
        f"{cfg.train.gradient_accumulation_steps} optimizer step(s)"
    )
    if plan.problems:
        print("plan: layout does not fit:\n  - " + "\n  - ".join(plan.problems), file=sys.stderr)
        return 1
    return 0


def cmd_train(args) -> int:
    if not args.dry_run:
        from engine.train.loop import train
        from engine.train.run_summary import format_run_summary

        start = time.perf_counter()
        cfg = load_config(args.config, args.overrides)
        summary = train(cfg)
        if summary["rank"] == 0:
            if summary.get("stopped_by_signal"):
                print(f"stopped by SIGUSR1 after step {summary['steps']}; resume with "
                      "checkpoint.resume_from_checkpoint=latest")
            print(format_run_summary(cfg, summary, time.perf_counter() - start))
        return 0
    # --dry-run: validate against the launcher's world size and the cluster shape, plan, exit 0 only if it fits.
    from engine.planning.planner import build_plan, format_plan
    from engine.planning.shapes import SHAPE_OPTIONS, node_roles, resolve_cluster_shape

    cfg = load_config(args.config, args.overrides)
    shape = resolve_cluster_shape(cfg, **{k: getattr(args, k) for k in SHAPE_OPTIONS})
    env = os.environ
    # World size: --world-size, torchrun's $WORLD_SIZE, or one srun task per node x GPUs per node.
    world_size = args.world_size or (int(env["WORLD_SIZE"]) if "WORLD_SIZE" in env else None)
    if world_size is None and "SLURM_STEP_NUM_NODES" in env:
        world_size = int(env["SLURM_STEP_NUM_NODES"]) * int(env.get("SLURM_GPUS_ON_NODE") or shape.gpus_per_node)
    if world_size is not None and world_size != shape.train_gpus:
        raise ConfigError(
            f"world size {world_size} (from the launcher) != training nodes x GPUs per node = "
            f"{shape.train_nodes} x {shape.gpus_per_node} = {shape.train_gpus}"
        )
    plan = build_plan(cfg, shape)
    print(format_plan(plan))
    node_rank = next((int(env[k]) for k in ("GROUP_RANK", "NODE_RANK", "SLURM_PROCID") if k in env), 0)
    print(node_roles(cfg, shape, plan.derived, node_rank))
    if plan.problems:
        print("dry run: layout does not fit:\n  - " + "\n  - ".join(plan.problems), file=sys.stderr)
        return 1
    print(f"dry run: layout valid and fits on {shape.train_gpus} training GPUs; not training")
    return 0


def cmd_tiny_model(args) -> int:
    from engine.models.tiny_model import build_tiny_model

    path = build_tiny_model(args.output_dir, args.family, seed=args.seed, tie_word_embeddings=args.tie)
    print(f"tiny {args.family} model written to {path}")
    return 0


def cmd_demo(args) -> int:
    from engine.demo.run import run_demo

    return run_demo(DEMO_CONFIG, args.overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-engine", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, help_text in [
        ("train", cmd_train, "run GRPO training from a config"),
        ("plan", cmd_plan, "print the layout, batch geometry and per-GPU memory of a config on a cluster shape"),
        ("check", cmd_check, "validate a config and print it fully resolved"),
    ]:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help="YAML file in configs/")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.beta=0.04")
        p.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE, else the config's layout")
        p.set_defaults(func=func)
        if name in ("train", "plan"):  # the cluster shape the planner sizes (engine/planning/shapes.py)
            p.add_argument("--train-nodes", type=int, default=None, help="default: as many as tp*pp*dp needs")
            p.add_argument("--infer-nodes", type=int, default=None, help="default: 1 in vllm_mode server, else 0")
            p.add_argument("--gpus-per-node", type=int, default=None, help="default: 8, or the layout's GPUs if fewer")
            p.add_argument("--gpu-memory-gib", type=float, default=None, help="memory of one GPU (default 79.1: H100 80GB)")
            p.add_argument("--reserve-gib", type=float, default=None,
                           help="per GPU, what the formulas leave out: CUDA context, NCCL, vLLM runtime (default 4)")
        if name == "train":
            p.add_argument("--dry-run", action="store_true",
                           help="validate against the launcher's world size and the cluster shape, plan, exit")
    p = sub.add_parser("demo", help="run the embedded tiny demo on CPU")
    p.add_argument("overrides", nargs="*", help="dotted overrides of configs/tiny_cpu.yaml")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("tiny-model", help="build the tiny random-weight model and tokenizer in HF format")
    p.add_argument("output_dir")
    p.add_argument("--family", default=SUPPORTED_MODEL_TYPES[0], choices=SUPPORTED_MODEL_TYPES,
                   help="a model_type of the family registry (engine/models/families.py); default: its first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    p.set_defaults(func=cmd_tiny_model)
    sub.add_parser("vllm-serve", add_help=False, help="the rollout server of server mode, with trl vllm-serve's flags "
                   "(--model M --tensor_parallel_size N --host H --port P ...) or the run's config; see "
                   "`grpo-engine vllm-serve --help`")  # dispatched in `main` before this parser runs
    sub.add_parser("grpo", add_help=False, help="TRL's `trl grpo`: --config recipe.yaml and TRL's GRPOConfig / "
                   "ScriptArguments / ModelConfig flags; see `grpo-engine grpo --help`")  # dispatched in `main`
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["vllm-serve"]:  # its own parser (TRL's flags); see engine/rollout/server.py
        from engine.rollout.server import main as serve

        return serve(argv[1:], prog="grpo-engine vllm-serve")
    if argv[:1] == ["grpo"]:  # TRL's parser over its dataclasses; see engine/api/trl_script.py
        from engine.api.trl_script import main as grpo

        return grpo(argv[1:])
    # Overrides may be written `grpo.beta=0.1` or `--grpo.beta=0.1`; the second form is not an option.
    argv = [a[2:] if a.startswith("--") and "=" in a and "." in a.split("=", 1)[0] else a for a in argv]
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
