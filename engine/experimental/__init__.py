"""TRL's `trl.experimental` names, at the path a TRL user would guess (`trl.experimental.gfpo` ->
`engine.experimental.gfpo`). Only re-exports: the implementations live in engine/api/trl_trainer.py and
engine/api/trl_config.py (GFPO's maths in engine/grpo/group_filter.py).

Test: `pytest tests/unit/test_trl_api.py -k gfpo`.

May import: engine.api.
"""
