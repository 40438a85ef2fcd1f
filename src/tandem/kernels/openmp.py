"""Keep the main thread of a process whose compute runs on another thread out of OpenMP's parallel regions.

libgomp keeps a thread's team of workers for as long as the thread lives, and once the teams' threads outnumber the
cores it spins ~100 rounds instead of ~300k before a worker sleeps. `tandem serve` computes on its engine thread: with
the main thread's idle team beside it (left by loading the model), every parallel region of a decode step waited on a
worker's wake-up, and a step of the 76M model took 1.4x as long (29 -> 41 ms at 8 rows, bf16).
"""

import concurrent.futures


def in_passing_thread(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` on a thread that ends when it returns (taking its OpenMP team with it); its result or its
    exception, as if called here."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # leaving the block joins the pool's one thread
        return pool.submit(fn, *args, **kwargs).result()
