"""The doorbell the trainer rings when it frees room: the worker's event loop hears it at once, across processes,
and ringing never blocks the trainer, whoever listens."""

import asyncio
import multiprocessing as mp
import threading
from contextlib import contextmanager

from tandem.contract.channels import Doorbell


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
