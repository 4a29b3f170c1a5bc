"""Workers that crash or hang, priorities and deadlines, with real processes."""

from __future__ import annotations

import pytest
from cached_client import CompileFailed, DeadlineExceeded
from conftest import DaemonProcess, fault, wait_for


@pytest.fixture
def short_timeout_daemon(tmp_path):
    d = DaemonProcess(tmp_path, workers=2, job_timeout=8)
    yield d
    d.stop()


def test_crashed_worker_fails_only_its_job_and_is_replaced(short_timeout_daemon,
                                                           mm_fp4_requests):
    d = short_timeout_daemon
    client = d.client(timeout=120)
    before = set(d.worker_pids())
    with pytest.raises(CompileFailed, match="killed by SIGKILL"):
        client.get(fault("crash", tag="c1"))
    assert client.get(mm_fp4_requests[3]).origin == "compiled"
    wait_for(lambda: d.stats()["workers_ready"] == 2)
    stats = d.stats()
    assert stats["worker_restarts"] == 1 and stats["workers_alive"] == 2
    assert set(d.worker_pids()) != before
    assert "SIGKILL" in stats["last_failures"][-1]["message"]


def test_hung_worker_is_killed_at_the_job_timeout_and_others_finish(short_timeout_daemon,
                                                                    mm_fp4_requests):
    d = short_timeout_daemon
    client = d.client(timeout=120)
    hung_client = d.client(timeout=120)
    import threading

    errors: list[Exception] = []

    def hang() -> None:
        try:
            hung_client.get(fault("sleep", tag="h1", seconds=600))
        except Exception as exc:  # noqa: BLE001 -- asserted below
            errors.append(exc)

    t = threading.Thread(target=hang)
    t.start()
    assert client.get(mm_fp4_requests[4]).origin == "compiled"
    t.join(60)
    assert len(errors) == 1 and isinstance(errors[0], CompileFailed)
    assert "job timeout" in errors[0].message
    wait_for(lambda: d.stats()["workers_ready"] == 2)
    assert d.stats()["worker_restarts"] == 1


def test_waiting_client_goes_ahead_of_prewarm_work_and_deadline_holds(tmp_path):
    d = DaemonProcess(tmp_path, workers=1)
    try:
        client = d.client(timeout=60)
        client.prefetch([fault("sleep", tag="blocker", seconds=3)])
        wait_for(lambda: d.stats()["running"] == 1)
        client.prefetch([fault("fail", tag=f"prewarm{i}") for i in range(5)])
        with pytest.raises(DeadlineExceeded, match="not ready within"):
            client.get(fault("fail", tag="urgent"), timeout=0.5)
        with pytest.raises(CompileFailed, match="urgent"):
            client.get(fault("fail", tag="urgent"))
        wait_for(lambda: d.stats()["in_flight"] == 0)
        tags = [f["params"]["tag"] for f in d.stats()["last_failures"]]
        assert tags.index("urgent") < min(tags.index(f"prewarm{i}") for i in range(5))
        assert tags[0] == "blocker"
    finally:
        d.stop()
