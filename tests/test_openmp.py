"""A passing thread computes and leaves no OpenMP team behind, so the main thread of `tandem serve` stays out of them."""

import subprocess
import sys
import textwrap
import threading

import pytest

from tandem.kernels.openmp import in_passing_thread


def test_a_passing_thread_returns_its_value_from_another_thread_that_has_ended():
    ident, thread = in_passing_thread(lambda: (threading.get_ident(), threading.current_thread()))
    assert ident != threading.get_ident() and not thread.is_alive()


def test_a_passing_thread_raises_its_error_here():
    def fails(value):
        raise ValueError(f"bad value {value}")

    with pytest.raises(ValueError, match="bad value 3"):
        in_passing_thread(fails, 3)


def test_a_parallel_region_in_a_passing_thread_leaves_no_openmp_worker_behind():
    """What the module is for, counted in the process's threads: a parallel matmul on the main thread keeps a worker
    of its team alive; the same in a passing thread does not."""
    script = textwrap.dedent("""
        import os, time, torch
        from tandem.kernels.openmp import in_passing_thread
        torch.set_num_threads(2)
        threads = lambda: len(os.listdir("/proc/self/task"))
        matmul = lambda: torch.randn(512, 512) @ torch.randn(512, 512)
        before = threads()
        in_passing_thread(matmul)
        deadline = time.monotonic() + 5
        while threads() > before and time.monotonic() < deadline:  # the team's workers leave with their thread
            time.sleep(0.05)
        passing = threads()
        matmul()
        print(before, passing, threads())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    before, passing, main = map(int, done.stdout.split())
    assert passing == before, f"the passing thread left {passing - before} thread(s) behind"
    assert main > before, "a parallel region on the main thread keeps its team (else this test shows nothing)"
