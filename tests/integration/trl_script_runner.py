"""Run a TRL-style script as `python script.py` would (`__main__`, argv), then report what the script left behind:
the `GRPOTrainer` it built (`trainer.state.log_history`, `global_step`, `output_dir`, `args.to_dict()`), its other
JSON-able module globals, and `trainer.save_model(<save_dir>)` written afterwards.

Used by tests/integration/test_trl_guides.py so that the guide scripts in examples/ stay exactly as a user runs
them (no test hooks inside). Usage:

    python tests/integration/trl_script_runner.py SCRIPT RESULT_JSON SAVE_DIR [script args...]
"""

from __future__ import annotations

import json
import runpy
import sys


def _jsonable(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _owner(hook):
    """A function itself; an instance's class."""
    return hook if hasattr(hook, "__qualname__") else type(hook)


def main() -> None:
    script, result_path, save_dir, *script_args = sys.argv[1:]
    sys.argv = [script, *script_args]
    namespace = runpy.run_path(script, run_name="__main__")

    from engine import GRPOTrainer

    trainers = [value for value in namespace.values() if isinstance(value, GRPOTrainer)]
    if len(trainers) != 1:
        raise SystemExit(f"{script} left {len(trainers)} GRPOTrainer objects in its globals; expected 1")
    trainer = trainers[0]
    trainer.save_model(save_dir)
    hooks = {name: f"{_owner(value).__module__}:{_owner(value).__qualname__}"
             for name, value in trainer.args.in_memory_callables.items()}
    result = {
        "log_history": trainer.state.log_history,
        "global_step": trainer.state.global_step,
        "output_dir": str(trainer.output_dir),
        "model_path": str(trainer.model_path),
        "hooks": hooks,
        "globals": {name: value for name, value in namespace.items()
                    if not name.startswith("_") and isinstance(value, (list, dict, int, float, str))
                    and not isinstance(value, bool) and _jsonable(value)},
    }
    filter_func = trainer.args.in_memory_callables.get("group_filter_func")
    if filter_func is not None:
        result["group_filter_state"] = {k: v for k, v in vars(filter_func).items() if _jsonable(v)} \
            if hasattr(filter_func, "__dict__") else {}
    with open(result_path, "w") as out:
        json.dump(result, out)


if __name__ == "__main__":
    main()
