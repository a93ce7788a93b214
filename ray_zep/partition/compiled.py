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

The kernels compile once per machine, on the first call of any (half a minute for all of
them), and numba keeps them on disk beside their modules (or in the user's cache
directory where that is read-only); later processes load them in half a second, and a
process that never plans does not import numba. numba's cache checks a kernel's own file
alone, not those of the kernels it calls, so before they compile the kernel files are
hashed together and a cache beside them made from other sources is dropped
(`forget_stale_kernels`; an install writes every file anew, which numba's own check sees).
A kernel reads no constants of modules other than the kernel files (they come in as
arguments), and none calls itself (a cached recursive kernel does not load again).
`NUMBA_DISABLE_JIT=1` runs every kernel as Python, with the same answers, slowly.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy

KERNELS = Path(__file__).parent
"""Where the kernel files (`*_kernel.py`) live, and numba's cache of them (`__pycache__`)."""
STAMP = "kernels.sha256"
"""The file beside the cache naming the kernel sources it was made from."""


class Kernel:
    """A function compiled with numba (no Python objects inside, cached on disk) on the
    first call of any kernel: until then numba is not imported (a process that plans
    nothing, a training worker or a command, does not pay for it). Its Python self stays
    as `py_func`."""

    made: ClassVar[list[Kernel]] = []
    """Every kernel defined so far, compiled or not."""

    def __init__(self, py_func: Callable, inline: bool = False) -> None:
        functools.update_wrapper(self, py_func)
        self.py_func = py_func
        self.inline = inline
        self.dispatcher: Any = None
        Kernel.made.append(self)

    def __call__(self, *args: Any) -> Any:
        if self.dispatcher is None:
            compile_all()
        return self.dispatcher(*args)


def compiled(kernel: Callable) -> Kernel:
    """`kernel` as a `Kernel`."""
    return Kernel(kernel)


def compiled_inline(kernel: Callable) -> Kernel:
    """`kernel` as a `Kernel` that the kernels calling it compile into their own code
    (numba's `inline='always'`): a small function called in a loop the compiler may then
    vectorise."""
    return Kernel(kernel, inline=True)


def compile_all() -> None:
    """Makes every kernel defined so far a numba dispatcher, and puts it in place of the
    `Kernel` wherever a kernel module names it (its own, and those that imported it), so
    that a kernel compiling finds the kernels it calls as dispatchers. Drops a stale cache
    first (`forget_stale_kernels`)."""
    from numba import njit

    forget_stale_kernels()
    dispatchers = {}
    for kernel in Kernel.made:
        if kernel.dispatcher is None:
            inline = "always" if kernel.inline else "never"
            kernel.dispatcher = njit(cache=True, inline=inline)(kernel.py_func)
        dispatchers[id(kernel)] = kernel.dispatcher
    for module in {kernel.py_func.__module__ for kernel in Kernel.made}:
        names = vars(sys.modules[module])
        for name, value in list(names.items()):
            if isinstance(value, Kernel):
                names[name] = dispatchers[id(value)]


def forget_stale_kernels(folder: Path = KERNELS) -> bool:
    """Drops numba's cached kernels beside `folder`'s kernel files where they were made
    from other sources than these (a kernel loaded from its cache carries the kernels it
    calls as they were) or under another numpy (`sum_kernel.NUMPY_BUFFER` follows its
    version). Returns whether it dropped any; a cache it cannot write is left to numba
    (an install's files are all new)."""
    sources = [*sorted(folder.glob("*_kernel.py")), Path(__file__)]
    made_of = b"".join(path.read_bytes() for path in sources) + numpy.__version__.encode()
    digest = hashlib.sha256(made_of).hexdigest()
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
