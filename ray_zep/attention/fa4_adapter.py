"""The module torch's FA4 implementation is pointed at: flash-attn-4's kernels with the
return values torch's glue reads.

torch (2.11-2.13, `torch.nn.attention._fa4`) unpacks `out, lse` from flash-attn-4's
`_flash_attn_fwd`; flash-attn-4 4.0.0b36 returns five values (out, lse and three it leaves
None unless asked). This module passes every argument through and returns the first two, so
either release of either package works; the backward passes through unchanged. The kernels'
own module is untouched (its functions look themselves up by name for their compile caches).
"""

from __future__ import annotations

import importlib
from typing import Any

KERNELS = "flash_attn.cute.interface"
"""flash-attn-4's module (the one torch registers by default)."""


def _kernels() -> Any:
    return importlib.import_module(KERNELS)


def _flash_attn_fwd(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """flash-attn-4's forward: (out, lse) whatever else its release returns."""
    result = _kernels()._flash_attn_fwd(*args, **kwargs)
    return result[0], result[1]


def _flash_attn_bwd(*args: Any, **kwargs: Any) -> Any:
    """flash-attn-4's backward: (dq, dk, dv)."""
    return _kernels()._flash_attn_bwd(*args, **kwargs)
