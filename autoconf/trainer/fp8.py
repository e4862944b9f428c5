"""FP8 linear layers for the reference trainer: every GEMM of ``y = x W^T + b`` via ``torch._scaled_mm``.

Imported by ``autoconf.trainer.layers`` and the profiler (it imports torch). Current ("dynamic") scaling, as torchao's
Float8Linear does: each operand is scaled just before its GEMM from its own absolute maximum,
``scale = amax / fmax`` (fmax = 448 for E4M3, 57344 for E5M2), quantised as ``(t / scale)``
saturated to +-fmax, and the GEMM multiplies the scales back in (``scale_a``, ``scale_b``).

Recipes (``RECIPES``):

- **tensorwise**: one scale per tensor (X, W and dY each).
- **rowwise**: one scale per row along the contracted axis of each GEMM, so each GEMM re-quantises
  its operands along its own axis, as torchao's rowwise recipe does:
  forward  Y  = X  @ W^T : X per row (over K),      W per output row (over K);
  backward dX = dY @ W   : dY per row (over N),     W per input column (over N);
           dW = dY^T @ X : dY per column (over M),  X per column (over M).

Formats: "hybrid", as Transformer Engine and torchao's defaults: X and W in E4M3 (more mantissa),
the output gradient dY in E5M2 (more range). GEMM outputs come out in the operands' high-precision
dtype (the model's dtype: ``out_dtype`` of ``_scaled_mm``); a bias is added in that dtype and its
gradient is the high-precision sum of dY. Backward saves the high-precision X and W (not the FP8
copies: torchao's layout, which ``frameworks.reference`` describes with ``fp8_saves_inputs=False``)
and quantises them again.

Device constraints. The CPU kernel of ``_scaled_mm`` (torch 2.13) accepts both FP8 formats on
either side, any operand layout and any M, K, N, with fp32 scales: 0-d / (1,) / (1, 1) for
tensorwise, contiguous (M, 1) and (1, N) for rowwise. The CUDA kernels also need K and N to be
multiples of 16 and A row-major, B column-major; the operands below are always laid out that way,
and on CUDA indivisible dimensions are refused with a one-line ValueError rather than padded.
"""

from __future__ import annotations

import torch

RECIPES = ("tensorwise", "rowwise")
"""The FP8 scaling recipes implemented here (the reference framework's ``fp8_recipes``)."""
FWD_DTYPE = torch.float8_e4m3fn
GRAD_DTYPE = torch.float8_e5m2
EPS = 1e-12
"""Floor of an amax, so that an all-zero tensor gets a finite scale (torchao's EPS)."""
CUDA_ALIGN = 16


def check_recipe(recipe: str) -> str:
    """``recipe`` itself if it is one of ``RECIPES``, else a one-line ValueError naming the valid ones."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r} is not implemented by the reference trainer; "
                         f"valid: {', '.join(RECIPES)}")
    return recipe


def quantize(t: torch.Tensor, dtype, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(t / scale saturated to ``dtype``, scale) for a 2-D ``t``; ``dim`` None: one fp32 scale for
    the tensor (0-d), else one per slice along ``dim`` (amax over ``dim``, kept as size 1)."""
    t32 = t.float()
    amax = t32.abs().amax() if dim is None else t32.abs().amax(dim=dim, keepdim=True)
    fmax = torch.finfo(dtype).max
    scale = amax.clamp(min=EPS) / fmax
    return (t32 / scale).clamp(-fmax, fmax).to(dtype), scale.contiguous()


def scaled_mm(a: torch.Tensor, a_dtype, b: torch.Tensor, b_dtype, rowwise: bool, out_dtype) -> torch.Tensor:
    """a [M, K] @ b [K, N] (high precision in, ``out_dtype`` out) with both operands quantised:
    tensorwise one scale each; rowwise a per row (M, 1) and b per column (1, N), i.e. both along K."""
    if a.device.type == "cuda" and (a.shape[1] % CUDA_ALIGN or b.shape[1] % CUDA_ALIGN):
        raise ValueError(f"fp8 GEMM [{a.shape[0]}x{a.shape[1]}] @ [{b.shape[0]}x{b.shape[1]}]: CUDA's "
                         f"_scaled_mm needs K and N multiples of {CUDA_ALIGN}")
    qa, sa = quantize(a, a_dtype, -1 if rowwise else None)
    qb, sb = quantize(b, b_dtype, 0 if rowwise else None)
    # A row-major, B column-major (what cuBLASLt wants; the CPU kernel takes any layout)
    qb = qb.t().contiguous().t()
    return torch._scaled_mm(qa.contiguous(), qb, scale_a=sa, scale_b=sb, out_dtype=out_dtype)


def forward(x2: torch.Tensor, weight: torch.Tensor, recipe: str) -> torch.Tensor:
    """x2 [M, K] @ weight[N, K]^T in FP8, in x2's dtype."""
    return scaled_mm(x2, FWD_DTYPE, weight.t(), FWD_DTYPE, recipe == "rowwise", x2.dtype)


def backward(g2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, recipe: str):
    """(dX [M, K], dW [N, K]) of ``forward`` from dY = g2 [M, N], both GEMMs in FP8 (dY in E5M2)."""
    rw = recipe == "rowwise"
    grad_x = scaled_mm(g2, GRAD_DTYPE, weight, FWD_DTYPE, rw, x2.dtype)
    grad_w = scaled_mm(g2.t(), GRAD_DTYPE, x2, FWD_DTYPE, rw, weight.dtype)
    return grad_x, grad_w


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T (+ b) with its three GEMMs in FP8; x [..., K] (any leading dims), W [N, K]."""

    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.has_bias = recipe, bias is not None
        y = forward(x.reshape(-1, x.shape[-1]), weight, recipe)
        if bias is not None:
            y = y + bias
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x, grad_w = backward(g2, x.reshape(-1, x.shape[-1]), weight, ctx.recipe)
        grad_b = g2.sum(0) if ctx.has_bias else None
        return grad_x.view_as(x), grad_w, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           recipe: str = "tensorwise") -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the forward GEMM and both backward GEMMs in FP8."""
    return _Fp8Linear.apply(x, weight, bias, check_recipe(recipe))
