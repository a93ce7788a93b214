"""The planner's sequential loops, compiled.

Some of a level's steps deal sequences one after another, each decision reading the
ones before it (`ring_groups`: which group a ring joins; `usp_guests`: which host a guest
joins; `level_fill`: which rank or small ring takes a whole sequence), so they do not
vectorise over sequences; written as array calls over a few hundred slots or nodes, each
sequence costs a dozen numpy calls, and at 4,096 GPUs a level deals thousands. Compiled
with numba (the `*_kernel.py` files) they run as plain loops over the same arrays, the
same arithmetic in the same order, so the answers are those of the array code they
replaced, bit for bit (their tests play each kernel against scans of every rank, against
the model's array formulas, and against itself run as Python).

Each kernel compiles once per machine, on its first call (a few seconds), and numba
keeps it on disk beside its module (or in the user's cache directory where that is
read-only); later processes load it in a fraction of a second. numba's cache checks a
kernel's own file alone, not those of the kernels it calls, so the kernel files are
hashed together on import and a kernel cache beside them made from other sources is
dropped (`forget_stale_kernels`; an install writes every file anew, which numba's own
check sees). A kernel reads no constants of modules other than the kernel files (they
come in as arguments), and none calls itself (a cached recursive kernel does not load
again). `NUMBA_DISABLE_JIT=1` runs every kernel as Python, with the same answers, slowly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from numba import njit

Kernel = TypeVar("Kernel", bound=Callable)

KERNELS = Path(__file__).parent
"""Where the kernel files (`*_kernel.py`) live, and numba's cache of them (`__pycache__`)."""
STAMP = "kernels.sha256"
"""The file beside the cache naming the kernel sources it was made from."""


def compiled(kernel: Kernel) -> Kernel:
    """`kernel` compiled (numba, no Python objects inside, cached on disk); its Python
    self stays as `kernel.py_func`."""
    return njit(cache=True)(kernel)


def forget_stale_kernels(folder: Path = KERNELS) -> bool:
    """Drops numba's cached kernels beside `folder`'s kernel files where they were made
    from other sources than these (a kernel loaded from its cache carries the kernels it
    calls as they were). Returns whether it dropped any; a cache it cannot write is left
    to numba (an install's files are all new)."""
    sources = [*sorted(folder.glob("*_kernel.py")), Path(__file__)]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in sources)).hexdigest()
    cache = folder / "__pycache__"
    stamp = cache / STAMP
    try:
        if stamp.read_text() == digest:
            return False
    except OSError:
        pass
    try:
        cache.mkdir(exist_ok=True)
        stale = [*cache.glob("*_kernel.*.nbi"), *cache.glob("*_kernel.*.nbc")]
        for path in stale:
            path.unlink(missing_ok=True)
        stamp.write_text(digest)
    except OSError:
        return False
    return bool(stale)


forget_stale_kernels()
