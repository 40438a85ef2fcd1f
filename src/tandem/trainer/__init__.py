"""The training side: the loop, batching, weight sync, checkpoints.

A training process shares the machine's cores with its generation server and rollout worker. OpenMP threads
that spin while they wait steal those cores: the demo's steps took 1.4x as long through the Python API (20x in
the worst case measured), while passive waiting costs nothing measurable. The OpenMP runtime reads
OMP_WAIT_POLICY once, when torch loads it, so this package sets it before any of its modules imports torch,
unless the user chose a policy. When torch was loaded earlier, it is too late: `train()` then warns.
"""

import os
import sys

OPENMP_POLICY_TOO_LATE = "torch" in sys.modules and "OMP_WAIT_POLICY" not in os.environ
"""torch (and its OpenMP runtime) was loaded before this package could ask for passive waiting."""
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
