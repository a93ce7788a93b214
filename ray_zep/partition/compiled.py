"""The planner's sequential loops, compiled.

Some of a level's steps deal sequences one after another, each decision reading the
ones before it (`ring_groups`: which group a ring joins; `level_fill`: which ranks take
a small ring), so they do not vectorise over sequences; written as array calls over a
few hundred slots or nodes, each sequence costs a dozen numpy calls, and at 4,096 GPUs
a level deals thousands. Compiled with numba they run as plain loops over the same
arrays, the same arithmetic in the same order, so the answers are those of the array
code they replace, bit for bit (each kernel's test plays the compiled kernel against
itself run as Python).

Each kernel compiles once per machine, on its first call (a few seconds), and numba
keeps it on disk beside its module (or in the user's cache directory where that is
read-only); later processes load it in a fraction of a second. numba's cache checks a
kernel's own file alone, so a kernel calls kernels of its own file only and reads no
other module's constants (they come in as arguments), and none calls itself (a cached
recursive kernel does not load again). `NUMBA_DISABLE_JIT=1` runs every kernel as Python,
with the same answers, slowly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from numba import njit

Kernel = TypeVar("Kernel", bound=Callable)


def compiled(kernel: Kernel) -> Kernel:
    """`kernel` compiled (numba, no Python objects inside, cached on disk); its Python
    self stays as `kernel.py_func`."""
    return njit(cache=True)(kernel)
