"""The doorbell the trainer rings when it frees room: the worker's event loop hears it at once, across processes,
and ringing never blocks the trainer, whoever listens."""

import asyncio
import multiprocessing as mp
import threading
from contextlib import contextmanager

from tandem.contract.channels import Doorbell, ServedVersions, versions_at


def wait_for_a_wake_up(bell: Doorbell, listening, heard) -> None:
    """A worker's side: wait on the event loop until the bell wakes it (a ring, or its pipe closing), then say so."""

    async def main():
        rang = asyncio.Event()
        bell.listen(rang)
        listening.set()
        await asyncio.wait_for(rang.wait(), 30)
        bell.stop_listening()
        heard.set()

    asyncio.run(main())


@contextmanager
def listening_worker():
    """A spawned process listening to a new bell: yields the bell and the event it sets once woken."""
    context = mp.get_context("spawn")
    bell, listening, heard = Doorbell(context), context.Event(), context.Event()
    worker = context.Process(target=wait_for_a_wake_up, args=(bell, listening, heard), daemon=True)
    worker.start()
    try:
        assert listening.wait(60), "the worker process did not start listening"
        yield bell, heard
    finally:
        worker.join(10)
        worker.kill()


def test_a_ring_in_the_trainer_wakes_the_worker_process():
    with listening_worker() as (bell, heard):
        assert not heard.wait(0.2), "the worker woke without a ring"
        bell.ring()
        assert heard.wait(10), "the ring did not reach the worker's event loop"


def test_the_worker_hears_when_the_trainer_side_closes():
    with listening_worker() as (bell, heard):
        bell.close()  # as when the trainer's process is gone: the worker holds no write end of its own
        assert heard.wait(10), "the worker's event loop did not hear the pipe close"


def test_ringing_never_blocks_when_nobody_listens():
    bell = Doorbell(mp.get_context("spawn"))

    def ring_a_lot():
        for _ in range(100_000):  # past any pipe buffer (64 KiB on Linux): a full pipe already holds a ring
            bell.ring()

    ringer = threading.Thread(target=ring_a_lot, daemon=True)
    ringer.start()
    ringer.join(60)
    assert not ringer.is_alive(), "a ring blocked on the full pipe"
    bell.close()
    bell.ring()  # a closed bell (a stopped worker's) is silent


def test_rings_before_listening_are_heard_and_drained():
    bell = Doorbell(mp.get_context("spawn"))
    bell.ring()
    bell.ring()

    async def main():
        rang = asyncio.Event()
        bell.listen(rang)
        await asyncio.wait_for(rang.wait(), 5)
        rang.clear()
        await asyncio.sleep(0.05)  # both rings were read at once: nothing sets it again
        bell.stop_listening()
        return rang.is_set()

    assert asyncio.run(main()) is False


def test_a_streamed_token_is_labelled_with_the_version_served_when_it_arrived():
    """The trainer marks when each version began to be served; a token arriving later is that version's, one arriving
    earlier the version before, and none is older than the version its request was sent under."""
    served = ServedVersions(mp.get_context("spawn"))
    served.mark(5, since=10.0)
    served.mark(6, since=20.0)
    timeline = served.timeline()
    assert timeline == [(10.0, 5), (20.0, 6)]
    assert versions_at(timeline, [9.0, 10.0, 19.9, 20.0, 30.0], floor=4) == [4, 5, 5, 6, 6]
    assert versions_at(timeline, [9.0, 25.0], floor=6) == [6, 6], "a request sent under 6 samples nothing older"
    assert versions_at([], [1.0, 2.0], floor=3) == [3, 3], "no sync yet: the request's own version"


def test_the_versions_served_are_remembered_in_a_ring_the_newest_overwriting_the_oldest():
    served = ServedVersions(mp.get_context("spawn"))
    for version in range(ServedVersions.SLOTS + 3):
        served.mark(version, since=float(version))
    timeline = served.timeline()
    assert (
        len(timeline) == ServedVersions.SLOTS
        and timeline[0] == (3.0, 3)
        and timeline[-1][1] == ServedVersions.SLOTS + 2
    )
