"""How many BLAS threads the CPU backend may use, set in the environment before numpy loads.

OpenBLAS and OpenMP start one spinning thread per core by default. On a machine whose cores are
also busy with the other daemons, the gateway or other programs, those threads spin against
each other: decode of SmolLM2 fell from 43 to 2-7 tok/s on a busy 2-core machine. Half the cores
this process may run on (at least 1, at most 8) keeps the matrix products parallel where cores
are plenty and out of the way where they are few; ``NTX_CPU_THREADS`` sets the number, and any
of the libraries' own variables already set wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
MAX_DEFAULT_THREADS = 8


def cpu_threads() -> int:
    """The BLAS thread count for the CPU backend (``NTX_CPU_THREADS``, or half the usable cores)."""
    given = os.environ.get("NTX_CPU_THREADS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, min(MAX_DEFAULT_THREADS, len(os.sched_getaffinity(0)) // 2))


def bound_blas_threads(env: MutableMapping[str, str]) -> None:
    """Set the BLAS libraries' thread counts in ``env`` (a child's environment, or os.environ
    before numpy is first imported), leaving any the user set."""
    n = str(cpu_threads())
    for var in BLAS_THREAD_VARS:
        env.setdefault(var, n)
