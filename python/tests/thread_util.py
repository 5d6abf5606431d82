"""A second participant on a thread for the Python tests: started before the
test body, joined with a deadline after it, and what it raised raised in the
test (a failed assertion on the thread fails the test)."""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator


@contextlib.contextmanager
def in_background(fn: Callable[[], None], timeout_s: float = 60.0) -> Iterator[None]:
    """Runs fn() on a thread while the with-body runs. After the body the
    thread is joined (it must end within timeout_s); an exception of the body
    wins over the thread's, else the thread's is raised."""
    errors = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # raised in the test below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    try:
        yield
    finally:
        t.join(timeout=timeout_s)
        assert not t.is_alive(), "the background thread did not finish"
    if errors:
        raise errors[0]
