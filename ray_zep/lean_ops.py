"""RMSNorm and SwiGLU that keep only their inputs for backward.

Written as plain tensor operations, autograd keeps every intermediate the backward
formulas read. An RMSNorm `x * rsqrt(mean(x^2) + eps) * w` keeps its input, the
inverse RMS and the normalised input: 2D + 1 fp32 values per token, while its backward
needs only the input and the inverse RMS (the normalised input is one multiply away). SwiGLU
`silu(a) * b` keeps a, b and silu(a): 3F values per token, while its backward needs
only a and b. Per transformer block that is one fp32 D-vector per norm and one
F-vector in the compute dtype for SwiGLU: on the 13B preset (D = 5,120, F = 13,824, bf16,
flash-attn) 68.6 KB of the 284.8 KB a token's block kept (24%), which is what decides
how many blocks a rank holding many tokens must checkpoint (`ray_zep.parallel.memory`).

These autograd Functions keep only those and work out the rest again in backward
(element-wise passes over D or F per token, counted in
`ray_zep.costmodel.pointwise_elements_per_token`), as Megatron-LM's SwiGLU function
keeps its input alone and the fused RMSNorm of Apex and Transformer Engine its input and
inverse RMS. Their backward works in place where it can, so that it holds no more
F-wide buffers than the plain operations' backward did (on the CPU model the peak
stays the loss's backward). Forward values are those of the plain operations, bit for
bit. SwiGLU's gradients are too (they call the same
`silu_backward`); RMSNorm's follow its closed form
dx = r (g w - n mean(g w n)), dw = sum over tokens of g n (n = x r, r the inverse RMS),
in fp32, equal to autograd's to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _RmsNorm(torch.autograd.Function):
    """`rms_norm`: keeps x (its own dtype), the inverse RMS and the weight."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
        x = x_TD.float()
        inverse_T1 = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x_TD, inverse_T1, weight_D)
        return (x * inverse_T1).type_as(x_TD) * weight_D

    @staticmethod
    def backward(ctx, grad_TD: torch.Tensor):
        x_TD, inverse, weight_D = ctx.saved_tensors
        normed = x_TD.float() * inverse
        grad_weight = None
        if ctx.needs_input_grad[1]:
            dims = tuple(range(grad_TD.dim() - 1))
            grad_weight = (grad_TD * normed.type_as(x_TD)).sum(dim=dims).to(weight_D.dtype)
        grad_x = None
        if ctx.needs_input_grad[0]:  # in place: two D-wide fp32 buffers at once
            g = (grad_TD * weight_D).float()
            dot = (g * normed).mean(-1, keepdim=True)
            grad_x = g.sub_(normed.mul_(dot)).mul_(inverse).to(x_TD.dtype)
        return grad_x, grad_weight, None


class _SwiGlu(torch.autograd.Function):
    """`swiglu`: keeps a and b."""

    @staticmethod
    def forward(ctx, a_TF: torch.Tensor, b_TF: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a_TF, b_TF)
        return F.silu(a_TF) * b_TF

    @staticmethod
    def backward(ctx, grad_TF: torch.Tensor):
        a_TF, b_TF = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[1]:  # silu(a), then its product, in one F-wide buffer
            grad_b = F.silu(a_TF).mul_(grad_TF)
        if ctx.needs_input_grad[0]:  # silu's gradient written over its input's
            grad_a = grad_TF * b_TF
            torch.ops.aten.silu_backward.grad_input(grad_a, a_TF, grad_input=grad_a)
        return grad_a, grad_b


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / RMS(x) * weight` (the ratio in fp32, cast back to x's dtype), keeping only x,
    the inverse RMS and the weight for backward (module docstring)."""
    return _RmsNorm.apply(x_TD, weight_D, eps)


def swiglu(a_TF: torch.Tensor, b_TF: torch.Tensor) -> torch.Tensor:
    """`silu(a) * b`, keeping only a and b for backward (module docstring)."""
    return _SwiGlu.apply(a_TF, b_TF)
