"""What tests share, and how a new test gets it (start-up, not behaviour, is where the suite's time goes).

Owns the helpers several test files use; the expensive real components are started once and shared:

- A gloo world: `tests.distributed.launcher.run_distributed(fn, world_size, *args)`. One world per size is kept
  for the session and runs body after body, each from a fresh process group with the environment restored; a body
  that builds in-process vLLM engines (colocated mode) keeps its world too (vLLM's groups are released after it).
  So a real-stack test should run its trainer / engine inside `run_distributed` (even at world size 1) rather than
  in a subprocess of its own: the rank is already started and has torch, Megatron and vLLM imported. `fn` must be
  importable at module level; it must close the engines it builds (a world holding one is replaced).
- A rollout server pair: the fixture `replica_servers` (tests/helpers/replica_servers.py): two TP1 servers of the
  shipped tiny model, replica 0 and 1 of 2, restarted if a test killed one. A trainer joins them with a fresh
  transfer group and syncs before its first round, so any weights a previous test left do not matter.
  One-off servers (other flags, another model): `tests.integration.test_rollout_server.Server`.
- A command run as its user runs it (`python script.py`, `python -m engine ...`): `tests.helpers.warm_python.run` /
  `.Popen` in place of `subprocess.run` / `.Popen` (the same arguments). The process is forked from an interpreter
  that has already imported torch, transformers and Megatron (about 12 s of a core saved per process); it sees
  what a fresh interpreter would. GRPO_TESTS_FRESH_PYTHON=1 runs every such command fresh instead.
- Several behaviours per start: prefer one real-stack run whose results several asserts (or several tests, through
  a module-scoped fixture that returns the run's artefacts) read, over one run per assert.
- Where the time goes: `pytest ... --timings-file F` then `python -m tests.timings F` (tests/timings.py).

Must not: mock a component that runs for real here, or hide one test's state from the next beyond what the
launcher and the fixtures above document. Tested by tests/distributed/test_launcher.py (world reuse, vLLM
included) and the tests that use each helper.
"""
