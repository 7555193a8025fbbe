"""The store lock (sandbox/store_lock.py): writers share it, a removal has it alone or leaves."""

from __future__ import annotations

import threading
import time

import pytest

from campugrid.sandbox import store_lock


@pytest.fixture(autouse=True)
def _data_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))


def test_writers_share_it_and_a_removal_is_left_while_any_writes(tmp_path):
    assert store_lock.path() == tmp_path / "campugrid" / "store.lock"
    with store_lock.writing(), store_lock.writing():  # two agents' builds at once
        t0 = time.monotonic()
        with store_lock.removing(wait_s=0.3) as held:
            assert held is False
        assert time.monotonic() - t0 >= 0.3
    with store_lock.removing(wait_s=0) as held:
        assert held is True


def test_a_removal_waits_for_a_writer_that_ends_within_its_wait():
    writing = threading.Event()
    done = threading.Event()

    def build() -> None:
        with store_lock.writing():
            writing.set()
            time.sleep(0.3)
        done.set()

    threading.Thread(target=build).start()
    assert writing.wait(5)
    with store_lock.removing(wait_s=5) as held:
        assert held is True and done.is_set()


def test_a_writer_waits_for_a_removal_in_progress():
    order: list[str] = []
    with store_lock.removing(wait_s=0) as held:
        assert held

        def build() -> None:
            with store_lock.writing():
                order.append("wrote")

        t = threading.Thread(target=build)
        t.start()
        time.sleep(0.2)
        order.append("removed")
    t.join(5)
    assert order == ["removed", "wrote"]
