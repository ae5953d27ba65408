"""trainer.grad_buckets: what arrives while a send is in flight leaves in the next one, every item once, errors reach the step."""
from __future__ import annotations

import threading

import pytest

from cossd.trainer.grad_buckets import GradBuckets


class GatedSend:
    """A send that records its batch and, for the first one, holds until released."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.started = threading.Event()
        self.release = threading.Event()
        self.fail_on = fail_on

    def __call__(self, batch: list[int]) -> int:
        self.batches.append(batch)
        if len(self.batches) == 1:
            self.started.set()
            assert self.release.wait(10)
        if self.fail_on is not None and self.fail_on in batch:
            raise OSError(f"device lost while sending {self.fail_on}")
        return len(batch)


def test_items_made_during_a_send_leave_together_in_the_next() -> None:
    send = GatedSend()
    buckets = GradBuckets(send)
    buckets.put(0)
    assert send.started.wait(10)
    for item in range(1, 6):  # backward goes on while the first send is in flight
        buckets.put(item)
    send.release.set()
    buckets.wait()
    assert send.batches == [[0], [1, 2, 3, 4, 5]]
    buckets.put(6)  # the next step's first gradient goes at once again
    buckets.wait()
    assert send.batches[-1] == [6]
    buckets.close()


def test_every_item_is_sent_exactly_once_from_many_threads() -> None:
    sent: list[int] = []
    buckets = GradBuckets(lambda batch: sent.extend(batch))
    threads = [threading.Thread(target=lambda k=k: [buckets.put(k * 1000 + i) for i in range(200)]) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    buckets.wait()
    assert sorted(sent) == sorted(k * 1000 + i for k in range(4) for i in range(200))
    buckets.close()


def test_a_failed_send_raises_in_wait_and_the_next_step_can_send() -> None:
    send = GatedSend(fail_on=3)
    buckets = GradBuckets(send)
    buckets.put(0)
    assert send.started.wait(10)
    buckets.put(3)
    send.release.set()
    with pytest.raises(OSError, match="device lost while sending 3"):
        buckets.wait()
    buckets.put(7)
    buckets.wait()
    assert send.batches[-1] == [7]
    buckets.close()


def test_cancel_drops_what_is_queued_and_sending_resumes() -> None:
    send = GatedSend()
    buckets = GradBuckets(send)
    buckets.put(0)
    assert send.started.wait(10)
    buckets.put(1)  # queued behind the send in flight: an aborted step drops it
    threading.Timer(0.2, send.release.set).start()
    buckets.cancel()  # waits for the send in flight
    assert send.batches == [[0]]
    buckets.put(2)
    buckets.wait()
    assert send.batches == [[0], [2]]
    buckets.close()
