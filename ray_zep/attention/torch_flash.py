"""PyTorch's built-in flash attention (varlen, with the log-sum-exp) on CUDA.

The ops `aten._flash_attention_forward` / `aten._flash_attention_backward` are the
FlashAttention-2 kernels that ship inside torch (the ones `F.scaled_dot_product_attention`
and `torch.nn.attention.varlen` call). Given cumulative sequence lengths they take a packed
batch in one launch, return the LSE as (H, T_q) float32, take fewer K/V heads than query
heads (GQA) natively and sum dk/dv over each group in their backward. No dropout here, so
the RNG state the backward takes is never read.

On a Hopper GPU where FlashAttention-3 (`flash_attn_interface`) or FlashAttention-4
(`flash-attn-4`, also Blackwell) is installed, torch can route these same ops to it
(`torch.nn.attention.activate_flash_attention_impl`); `use_fastest_impl` does so, as
`RAY_ZEP_FLASH_IMPL` asks (default `auto`: FA3, else FA4, else torch's own FA2).

Only the pieces that call the ops live here; `ray_zep.attention.kernels` decides which
blocks they may take (their causal mask is the same as the reference's only on a square
block) and keeps the reference for the rest.

Shapes: q_THE (T_q, H, E), k_TKE / v_TKE (T_k, K, E) with H % K == 0, lse_HT float32.
"""

from __future__ import annotations

import functools
import importlib
import os
from typing import NamedTuple

import torch

from ray_zep.errors import ConfigError

DTYPES = (torch.float16, torch.bfloat16)


class Varlen(NamedTuple):
    """What a packed call takes besides its tensors, forward and backward alike."""

    cu_q: torch.Tensor
    """Cumulative query sequence lengths (any integer dtype and device)."""
    cu_k: torch.Tensor
    """Cumulative key sequence lengths."""
    max_q: int
    """The longest query sequence."""
    max_k: int
    """The longest key sequence."""
    causal: bool
    scale: float
    """The softmax scale."""

    def offsets(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cu_q and cu_k as the kernels take them: int32 on `device`."""
        return self.cu_q.to(device, torch.int32), self.cu_k.to(device, torch.int32)


@functools.cache
def _ops_present() -> bool:
    aten = torch.ops.aten
    try:
        present = hasattr(aten, "_flash_attention_forward") and hasattr(
            aten, "_flash_attention_backward"
        )
    except Exception:  # an op registry that raises on lookup
        return False
    check = getattr(torch.backends.cuda, "is_flash_attention_available", None)
    return present and (check is None or bool(check()))


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def available(device: torch.device) -> bool:
    """Whether torch's flash kernels can run on `device`: a CUDA build that has them and an
    Ampere or newer GPU (sm_80+; torch builds them for no older chip)."""
    if device.type != "cuda" or not torch.cuda.is_available() or not _ops_present():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (8, 0)


IMPL_ENV = "RAY_ZEP_FLASH_IMPL"
"""The environment variable that picks torch's flash implementation: `auto` (the default:
FA3, else FA4, where each can run, else FA2), `fa2`, `fa3` or `fa4` (that one or a
ConfigError saying why not). Process-wide, as torch's own switch is."""
IMPLS = ("auto", "fa2", "fa3", "fa4")


class FlashImpl(NamedTuple):
    """An implementation torch can route its flash ops to, and what it needs."""

    name: str
    """torch's name for it (`torch.nn.attention.list_flash_attention_impls`)."""
    module: str
    """The module whose kernels torch registers."""
    package: str
    """What to pip install for it."""
    majors: tuple[int, ...]
    """The compute capabilities (major) it runs on."""


SWITCHABLE = (
    FlashImpl("FA3", "flash_attn_interface", "FlashAttention-3 (flash_attn_interface)", (9,)),
    FlashImpl("FA4", "flash_attn.cute.interface", "flash-attn-4", (9, 10)),
)
"""In the order `auto` tries them."""
ADAPTER = "ray_zep.attention.fa4_adapter"
"""The module torch's FA4 glue is pointed at (see `ray_zep.attention.fa4_adapter`)."""


def requested_impl() -> str:
    """`RAY_ZEP_FLASH_IMPL`, lower-cased (`auto` when unset).

    Raises:
        ConfigError: a value other than auto | fa2 | fa3 | fa4.
    """
    wanted = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if wanted not in IMPLS:
        raise ConfigError(
            f"environment variable {IMPL_ENV}={os.environ[IMPL_ENV]!r}: expected "
            + " | ".join(IMPLS)
        )
    return wanted


@functools.cache
def use_fastest_impl(device: torch.device) -> str:
    """Route torch's flash ops to the implementation `RAY_ZEP_FLASH_IMPL` asks for (`auto`:
    FA3, else FA4, each where torch can switch to it, the GPU runs it and its package is
    installed); which implementation runs, with the reasons where it is FA2. Process-wide,
    once per device.

    Raises:
        ConfigError: an unknown value, or an implementation asked for by name that cannot run.
    """
    wanted = requested_impl()
    if wanted == "fa2":
        return f"FA2 ({IMPL_ENV}=fa2)"
    chosen = [i for i in SWITCHABLE if wanted in ("auto", i.name.lower())]
    reasons = []
    for impl in chosen:
        reason = _activate(impl, device)
        if reason is None:
            return impl.name
        reasons.append(reason)
    if wanted != "auto":
        raise ConfigError(f"environment variable {IMPL_ENV}={wanted}: {reasons[0]}")
    return f"FA2 ({'; '.join(reasons)})"


def _activate(impl: FlashImpl, device: torch.device) -> str | None:
    """Switch torch's flash ops to `impl`; None once done, else why it cannot run."""
    try:
        from torch.nn import attention
    except ImportError:  # pragma: no cover - every supported torch has the module
        return "torch has no torch.nn.attention"
    if not hasattr(attention, "activate_flash_attention_impl"):
        return f"torch {torch.__version__} cannot switch its flash implementation"
    if impl.name not in attention.list_flash_attention_impls():
        return f"torch {torch.__version__} lists no {impl.name} implementation"
    index = device.index if device.index is not None else torch.cuda.current_device()
    major, minor = _capability(index)
    if major not in impl.majors:
        runs_on = ", ".join(f"sm_{m}x" for m in impl.majors)
        return f"{impl.name} runs on {runs_on}; this GPU is sm_{major}{minor}"
    try:
        importlib.import_module(impl.module)
        attention.activate_flash_attention_impl(impl.name)
    except Exception as exc:  # ImportError of the package, or its kernels missing
        return f"{impl.name} not activated: {exc}; pip install {impl.package}"
    if impl.name == "FA4":
        _point_fa4_at_adapter()
    return None


def _point_fa4_at_adapter() -> None:
    """Have torch's FA4 glue call `fa4_adapter` (flash-attn-4's kernels with the two return
    values the glue unpacks) instead of the package's module. torch keeps the module's path
    in `torch.nn.attention._fa4._FA4_MODULE_PATH` and imports it on every call (2.11-2.13)."""
    from torch.nn.attention import _fa4

    if hasattr(_fa4, "_FA4_MODULE_PATH"):
        _fa4._FA4_MODULE_PATH = ADAPTER


def runs(q_THE: torch.Tensor, k_TKE: torch.Tensor) -> bool:
    """Whether this call's tensors suit the kernels: CUDA, fp16/bf16, a head dim that is a
    multiple of 8 up to 256 (over 192 the backward needs an A100/H100-sized shared memory),
    and whole groups of query heads per K/V head; routed to FA4 on Blackwell, up to 128."""
    dim, heads, kv_heads = q_THE.shape[-1], q_THE.shape[1], k_TKE.shape[1]
    if q_THE.dtype not in DTYPES or not available(q_THE.device):
        return False
    if dim % 8 or dim > 256 or heads % kv_heads:
        return False
    if dim <= 128:
        return True
    index = q_THE.device.index
    index = index if index is not None else torch.cuda.current_device()
    capability = _capability(index)
    if capability[0] == 10 and use_fastest_impl(q_THE.device) == "FA4":
        return False  # FA4 on sm_100 takes head dims up to 128 (and 256, excluded below)
    return dim <= 192 or capability in ((8, 0), (9, 0))


def forward(
    q_THE: torch.Tensor, k_TKE: torch.Tensor, v_TKE: torch.Tensor, call: Varlen
) -> tuple[torch.Tensor, torch.Tensor]:
    """out_THE (q's dtype) and lse_HT (float32) of a packed batch, no autograd."""
    out, lse = torch.ops.aten._flash_attention_forward(
        _rows_strided(q_THE),
        _rows_strided(k_TKE),
        _rows_strided(v_TKE),
        *call.offsets(q_THE.device),
        call.max_q,
        call.max_k,
        0.0,
        call.causal,
        False,
        scale=call.scale,
    )[:2]
    if lse.shape != (q_THE.shape[1], q_THE.shape[0]):
        raise RuntimeError(
            f"torch {torch.__version__}'s flash kernel returned an LSE of shape "
            f"{tuple(lse.shape)}, not (heads, tokens): use model.attention_kernel=torch"
        )
    return out, lse


def backward(
    dout_THE: torch.Tensor,
    q_THE: torch.Tensor,
    k_TKE: torch.Tensor,
    v_TKE: torch.Tensor,
    out_THE: torch.Tensor,
    lse_HT: torch.Tensor,
    call: Varlen,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (in q's dtype; dk and dv summed over each group of query heads) of a
    packed batch, given the output and LSE the probabilities are formed with.

    A row whose LSE is -inf (it saw no key) is given +inf, the kernels' own mark for such
    a row: its probabilities are exp(S - inf) = 0, so its gradients are zero, as the
    reference's."""
    dtype = q_THE.dtype
    lse = lse_HT.float()
    lse = torch.where(lse == float("-inf"), float("inf"), lse).contiguous()
    rng_state, unused = _unread_inputs(q_THE.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        _rows_strided(dout_THE.to(dtype)),
        _rows_strided(q_THE),
        _rows_strided(k_TKE),
        _rows_strided(v_TKE),
        _rows_strided(out_THE.to(dtype)),
        lse,
        *call.offsets(q_THE.device),
        call.max_q,
        call.max_k,
        0.0,
        call.causal,
        rng_state,
        unused,
        scale=call.scale,
    )
    return dq, dk, dv


@functools.cache
def _unread_inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The RNG state and offset the backward takes and, with no dropout, never reads: made
    once per device rather than allocated and filled on every call."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


def _rows_strided(t: torch.Tensor) -> torch.Tensor:
    """`t` as the kernels take it: any row and head strides, the head dim contiguous (K and
    V as views into a packed K/V tensor pass uncopied)."""
    return t if t.stride(-1) == 1 else t.contiguous()


class FlashVarlen(torch.autograd.Function):
    """`forward` with autograd: the gradient of out through `backward` (the LSE is not
    differentiable, as with flash-attn's own function)."""

    @staticmethod
    def forward(ctx, q_THE, k_TKE, v_TKE, call: Varlen):
        q_THE, k_TKE, v_TKE = (_rows_strided(t) for t in (q_THE, k_TKE, v_TKE))
        out, lse = forward(q_THE, k_TKE, v_TKE, call)
        ctx.save_for_backward(q_THE, k_TKE, v_TKE, out, lse)
        ctx.call = call
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        dq, dk, dv = backward(dout, *ctx.saved_tensors, ctx.call)
        return dq, dk, dv, None
