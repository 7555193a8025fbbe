"""worker.JobImages: which job images the agent removes when (held to real Podman by
tests/acceptance/test_hello.py, where the kept image's ID-mapped copy is started again)."""

from __future__ import annotations

from campugrid.agent.worker import JobImages


class Store:
    """What JobImages asks of the sandbox: remove_image, which a busy store lock puts off."""

    def __init__(self, *names: str) -> None:
        self.names = set(names)
        self.busy = False
        self.asked: list[str] = []

    def remove_image(self, name: str) -> bool:
        self.asked.append(name)
        if self.busy:
            return False
        self.names.discard(name)
        return True


def test_a_tasks_image_stays_until_the_next_task_has_ended() -> None:
    store = Store("a", "b", "c")
    images = JobImages(store)  # type: ignore[arg-type]
    assert images.ended("a") == [] and store.names == {"a", "b", "c"}
    assert images.ended("b") == [] and store.names == {"b", "c"}
    assert images.ended("c") == [] and store.names == {"c"}
    assert images.drop() == [] and store.names == set()
    assert images.drop() == [] and store.asked == ["a", "b", "c"]  # nothing held: nothing asked


def test_a_removal_the_store_lock_put_off_is_tried_again_and_reported_once_done() -> None:
    store = Store("a", "b", "c")
    images = JobImages(store)  # type: ignore[arg-type]
    images.ended("a")
    store.busy = True
    assert images.ended("b") == [] and store.names == {"a", "b", "c"}
    assert images.drop() == [] and store.names == {"a", "b", "c"}  # still busy: both put off
    store.busy = False
    assert images.ended("c") == ["a", "b"] and store.names == {"c"}
