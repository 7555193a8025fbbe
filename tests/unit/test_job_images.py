"""worker.JobImages: which job images the agent removes when (held to real Podman by
tests/acceptance/test_hello.py, where no job image is left once its task has ended)."""

from __future__ import annotations

from campugrid.agent.worker import JobImages


class Store:
    """What JobImages asks of the sandbox: remove_image, which a busy store lock puts off."""

    def __init__(self, *names: str) -> None:
        self.names = set(names)
        self.busy = False
        self.down = False  # Podman's service cannot be reached
        self.asked: list[str] = []

    def remove_image(self, name: str) -> bool:
        self.asked.append(name)
        if self.down:
            raise ConnectionError("podman.sock: connection refused")
        if self.busy:
            return False
        self.names.discard(name)
        return True


def test_a_tasks_image_goes_as_its_task_ends() -> None:
    store = Store("a", "b")
    images = JobImages(store)  # type: ignore[arg-type]
    assert images.ended("a") == [] and store.names == {"b"}
    assert images.ended("b") == [] and store.names == set()
    assert images.retry() == [] and images.ended("") == []
    assert store.asked == ["a", "b"]  # nothing put off: nothing asked again


def test_a_removal_the_store_lock_put_off_is_tried_again_and_reported_once_done() -> None:
    store = Store("a", "b", "c")
    images = JobImages(store)  # type: ignore[arg-type]
    store.busy = True
    assert images.ended("a") == [] and images.ended("b") == [] and store.names == {"a", "b", "c"}
    assert images.retry() == [] and store.names == {"a", "b", "c"}  # still busy: both put off
    store.busy = False
    assert images.ended("c") == ["a", "b"] and store.names == set()
    assert images.retry() == [] and store.asked.count("a") == 4  # gone: not asked again


def test_a_store_that_cannot_be_asked_leaves_the_image_for_later_and_the_agent_goes_on() -> None:
    store = Store("a", "b")
    images = JobImages(store)  # type: ignore[arg-type]
    store.down = True
    assert images.ended("a") == [] and images.retry() == []  # no exception: put off
    assert store.names == {"a", "b"}
    store.down = False
    assert images.retry() == ["a"] and store.names == {"b"}
