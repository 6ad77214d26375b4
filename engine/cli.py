"""The `grpo-engine` command (also `python -m engine`): train, plan, check, demo, tiny-model.

Owns: argument parsing and dispatch only; each subcommand calls into the module that owns the work.
Subcommands whose issue has not landed say so and exit with status 2; they never pretend to run.

    grpo-engine demo                                   # the README's first command (via `make demo`)
    grpo-engine check configs/tiny_cpu.yaml grpo.beta=0.04 --world-size 2
    grpo-engine plan configs/qwen2.5-72b_tp8_pp4_split_4x1.yaml
    grpo-engine train configs/tiny_cpu.yaml [section.key=value ...]
    grpo-engine tiny-model /tmp/tiny --family llama
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from engine.config import ConfigError, config_to_dict, load_config, write_resolved_config
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
    cfg, d = _load(args)
    par = cfg.parallel
    print(f"layout: tp_size*pp_size*dp_size = {par.tp_size}*{par.pp_size}*{d.dp_size} = {d.world_size} ranks")
    print(
        f"batch: {d.micro_batch_size} completions/micro-batch x {d.num_microbatches} micro-batches x {d.dp_size} DP "
        f"= {d.global_batch_size} completions per optimizer step"
    )
    print(
        f"generation: {d.num_prompts_per_generation} prompts x {cfg.grpo.num_generations} = "
        f"{d.generation_batch_size} completions per round, serving {d.optimizer_steps_per_generation} optimizer step(s)"
    )
    print("per-GPU memory and the node split: not yet available (the planner lands with the cluster-launch issue)")
    return 0


def cmd_train(args) -> int:
    cfg, derived = _load(args)
    path = write_resolved_config(cfg, cfg.train.output_dir)
    print(f"config valid ({derived}); resolved config written to {path}")
    print("train: not yet available: the GRPO loop lands with the trainer issue", file=sys.stderr)
    return 2


def cmd_tiny_model(args) -> int:
    from engine.tiny_model import build_tiny_model

    path = build_tiny_model(args.output_dir, args.family, seed=args.seed, tie_word_embeddings=args.tie)
    print(f"tiny {args.family} model written to {path}")
    return 0


def cmd_demo(args) -> int:
    from engine.demo import run_demo

    return run_demo(DEMO_CONFIG, args.overrides)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo-engine", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func, help_text in [
        ("train", cmd_train, "run GRPO training from a config"),
        ("plan", cmd_plan, "print the layout, batch geometry and (later) per-GPU memory of a config"),
        ("check", cmd_check, "validate a config and print it fully resolved"),
    ]:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help="YAML file in configs/")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. grpo.beta=0.04")
        p.add_argument("--world-size", type=int, default=None, help="default: $WORLD_SIZE, else the config's layout")
        p.set_defaults(func=func)
    p = sub.add_parser("demo", help="run the embedded tiny demo on CPU")
    p.add_argument("overrides", nargs="*", help="dotted overrides of configs/tiny_cpu.yaml")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("tiny-model", help="build the tiny random-weight model and tokenizer in HF format")
    p.add_argument("output_dir")
    p.add_argument("--family", default="qwen2", choices=["qwen2", "llama"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie", action="store_true", help="tie input and output embeddings")
    p.set_defaults(func=cmd_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
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
