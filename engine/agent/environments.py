"""TRL's `environment_factory`: environment instances pooled and reused, reset per rollout, their methods as tools.

Owns: `EnvironmentPool` (the factory, or a dict of named factories chosen per row by an `environment` column; the
instances, constructed once and reset often; each instance's tools and schemas), `environment_tools` (an instance's
public methods other than `reset` / `get_reward`, bound) and `environment_reward` (the reward function TRL appends
when the environment has `get_reward`: named after the class, sync or async, called once per rollout with the
`environments` the reward functions receive).

Checked at construction (one instance of each factory is built then and kept in the pool): a `reset` method, and a
schema for every tool method (type hints and an `Args:` docstring, engine/agent/toolbox.py). Environment state is
not checkpointed: a resumed run builds fresh instances and resets them for each rollout, as every rollout does.

Must not: generate or tokenize (engine/agent/agentic_rollout.py renders the observation into the prompt).

Test: tests/unit/test_agent_tools.py (pool, tools, reward), tests/integration/test_agentic.py (a run).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable

from engine.agent.toolbox import tool_schema

RESERVED = ("reset", "get_reward")
"""Environment methods that are never tools."""


def environment_tools(instance) -> dict[str, Callable]:
    """The instance's public methods other than `reset` / `get_reward`, bound, by name."""
    out = {}
    for name in dir(type(instance)):
        if name.startswith("_") or name in RESERVED:
            continue
        member = getattr(instance, name)
        if inspect.ismethod(member):
            out[name] = member
    return out


class EnvironmentPool:
    """Instances of each factory, reused across rounds: a round takes as many as it has rollouts of that kind.

    An instance taken is leased to its round until `release` (after the round's rewards are computed,
    engine/train/sampling.py): with rounds generated ahead (`rollout.max_staleness` k > 0) up to k + 1 rounds hold
    environments at once, and a round must never reset an instance whose `get_reward` is still to be read."""

    def __init__(self, environment_factory: Callable | dict[str, Callable]):
        self.factories = dict(environment_factory) if isinstance(environment_factory, dict) else {None: environment_factory}
        self.instances: dict[str | None, list] = {}
        self.schemas: dict[str | None, list[dict]] = {}
        for name, factory in self.factories.items():
            shown = f"environment_factory[{name!r}]" if name is not None else "environment_factory"
            if not callable(factory):
                raise TypeError(f"{shown} must be a zero-argument callable (a class), got {type(factory).__name__}")
            instance = factory()
            if not callable(getattr(instance, "reset", None)):
                raise TypeError(f"{shown}: {type(instance).__name__} has no reset() method (TRL's contract: "
                                "reset(**row) -> observation or None, called before every rollout)")
            try:
                self.schemas[name] = [tool_schema(m) for m in environment_tools(instance).values()]
            except ValueError as e:
                raise ValueError(f"{shown}: {type(instance).__name__}: {e}") from e
            self.instances[name] = [instance]
        self._leased: set[int] = set()  # ids of the instances taken and not yet released
        self._lock = threading.Lock()  # rounds generated ahead take from rank 0's background thread

    @property
    def is_multi(self) -> bool:
        return None not in self.factories

    def take(self, names: list[str | None]) -> list:
        """One instance per rollout (`names`: each rollout's factory), leased until `release`: the pool's free ones
        first (the same instances round after round), more built when a round needs more of a kind than are free."""
        out = []
        with self._lock:
            for name in names:
                if name not in self.factories:
                    raise KeyError(f"environment {name!r} (the row's `environment` column) is not one of the "
                                   f"environment_factory keys {sorted(map(str, self.factories))}")
                pool = self.instances[name]
                instance = next((e for e in pool if id(e) not in self._leased), None)
                if instance is None:
                    instance = self.factories[name]()
                    pool.append(instance)
                self._leased.add(id(instance))
                out.append(instance)
        return out

    def release(self, instances: list) -> None:
        """The round's instances are free again (its rewards were computed)."""
        with self._lock:
            self._leased.difference_update(id(e) for e in instances)

    def release_all(self) -> None:
        """Every instance is free again (a failed run: its rounds will never be scored)."""
        with self._lock:
            self._leased.clear()

    def num_leased(self) -> int:
        """Instances taken by rounds and not yet released."""
        with self._lock:
            return len(self._leased)

    def num_instances(self) -> int:
        return sum(len(v) for v in self.instances.values())

    def reward_functions(self) -> list[Callable]:
        """One reward function per factory whose instances have `get_reward` (TRL appends them, weight 1)."""
        return [environment_reward(type(pool[0])) for pool in self.instances.values()
                if callable(getattr(pool[0], "get_reward", None))]


def environment_reward(cls: type) -> Callable:
    """TRL's environment reward: `get_reward()` of each rollout's environment of class `cls` (None for rollouts of
    other environments: a NaN, ignored); coroutine results are awaited."""

    def reward(environments: list, **_) -> list[float | None]:
        out = []
        for env in environments:
            value = env.get_reward() if isinstance(env, cls) else None
            out.append(asyncio.run(value) if inspect.iscoroutine(value) else value)
        return out

    reward.__name__ = cls.__name__
    return reward
