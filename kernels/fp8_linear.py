"""FP8 (e4m3) linear layers, `quantization="fp8"`: each weight quantized once, per output
channel, as it is loaded; each activation per token at every call; the product by
`torch._scaled_mm` with both scales (row-wise scaling, accumulated in float32). Half a
bf16 weight's bytes, so a memory-bound decode step reads half as much, and FP8 tensor
cores for the rest.

Why by hand: torch has the GEMM on CPUs and on GPUs of compute capability 8.9+ (the
same op in both places, so the CPU tests check what a GPU runs); what remains is the
per-token scaling. In torch ops that is seven launches a projection (four a layer, 36
layers at 8B: a thousand tiny kernels a decode step), so on a GPU one Triton kernel
does it, bit for bit as the torch ops do. Per channel and per token (not per tensor)
because one outlier row then costs only its own precision.

`weight_only_linear` is the other product for decode-sized batches (up to WEIGHT_ONLY_MAX_M
tokens): the activations stay in 16 bits and one Triton kernel reads each FP8 weight tile,
widens it in registers and multiplies, scaling each output channel at the end. A decode
step is the weights' read, and this reads them once at half a bf16 weight's bytes, with no
activation quantization and no row-scaled GEMM, whose kernels are slowest at a few rows
(benchmarks/fp8_gemm.py, the 2026-12-05 entry of benchmarks/RESULTS.md: slower than bf16
below 64 tokens at 8B). By hand because torch has no weight-only FP8 product. The model
keeps `fp8_linear` until `python -m benchmarks.fp8_gemm` shows this one faster on a GPU.

It decides nothing about which layers are quantized (the model does) and holds no state."""

from __future__ import annotations

import functools
from typing import Any

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
# A scale is the row's largest magnitude times this: torch on a GPU divides by a Python
# number as such a product, so torch and the kernel agree to the bit only in this form.
INV_FP8_MAX = 1.0 / FP8_MAX
# A row of zeros gets this scale: its values quantize to 0 and dequantize to 0.
_TINY = 1e-12
# torch._scaled_mm on a GPU needs both dimensions of the weight in multiples of 16.
ALIGN = 16


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any float dtype) -> (q [M, K] FP8, scale [M, 1] float32), x ~ q * scale,
    each row scaled so its largest magnitude maps to FP8's largest value: one Triton
    launch on a GPU that has it, `quantize_rows_torch` elsewhere (the same bits)."""
    if x.is_cuda and x.stride(-1) == 1 and _triton_runs(x.device):
        return _quantize_rows_triton(x)
    return quantize_rows_torch(x)


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` in torch ops: the definition the Triton kernel follows."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=_TINY) * INV_FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


@functools.cache
def _triton_runs(device: torch.device) -> bool:
    from sgl.kernels.triton_decode import handles

    return handles(device, FP8)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, k, stride_x, stride_q, fp8_max, inv_fp8_max, tiny,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(0, k, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + cols, mask=cols < k, other=0.0).to(tl.float32)))
        scale = tl.maximum(tl.max(amax, 0), tiny) * inv_fp8_max
        tl.store(s_ptr + row, scale)
        for k0 in range(0, k, BLOCK):
            cols = k0 + tl.arange(0, BLOCK)
            live = cols < k
            x = tl.load(x_row + cols, mask=live, other=0.0).to(tl.float32)
            # An IEEE division (div_rn), as torch's by a tensor: the same quotients to round.
            q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -fp8_max), fp8_max)
            tl.store(q_ptr + row * stride_q + cols, q.to(tl.float8e4nv), mask=live)

    return quantize_rows_kernel


def _quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        block = min(4096, 1 << max(k - 1, 1).bit_length())
        _kernel()[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX, INV_FP8_MAX, _TINY, BLOCK=block,
                        num_warps=8 if block >= 2048 else 4)
    return q, scale


WEIGHT_ONLY_MAX_M = 64  # rows of one program's tile: the decode batches it is for


@functools.cache
def _weight_only_kernels() -> tuple[Any, Any]:
    import triton
    import triton.language as tl

    @triton.jit
    def weight_only_kernel(x_ptr, w_ptr, s_ptr, y_ptr, m, n, k, k_chunk, stride_x, stride_w, stride_y,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           PARTIAL: tl.constexpr):
        # One program: every row of x against BLOCK_N output channels over one K chunk (all of
        # K, or split k ways: then it stores its unscaled float32 partial, y_ptr[split]).
        cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        split = tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        row_live, col_live = rows < m, cols < n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        k_end = tl.minimum(k, (split + 1) * k_chunk)
        for k0 in range(split * k_chunk, k_end, BLOCK_K):
            k_live = k0 + ks < k_end
            x = tl.load(x_ptr + rows[:, None] * stride_x + (k0 + ks)[None, :],
                        mask=row_live[:, None] & k_live[None, :], other=0.0)
            w = tl.load(w_ptr + cols[None, :] * stride_w + (k0 + ks)[:, None],
                        mask=col_live[None, :] & k_live[:, None], other=0.0)
            acc = tl.dot(x, w.to(x.dtype), acc)  # the weight widened in registers: [BLOCK_K, BLOCK_N]
        out = rows[:, None] * stride_y + cols[None, :]
        if PARTIAL:
            tl.store(y_ptr + split.to(tl.int64) * m * stride_y + out, acc,
                     mask=row_live[:, None] & col_live[None, :])
        else:
            scale = tl.load(s_ptr + cols, mask=col_live, other=0.0)
            tl.store(y_ptr + out, (acc * scale[None, :]).to(y_ptr.dtype.element_ty),
                     mask=row_live[:, None] & col_live[None, :])

    @triton.jit
    def reduce_kernel(part_ptr, s_ptr, y_ptr, mn, n, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
        # The k partials of each output summed in order, scaled by its channel, cast.
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = i < mn
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for sp in tl.static_range(SPLITS):
            acc += tl.load(part_ptr + sp * mn + i, mask=live, other=0.0)
        scale = tl.load(s_ptr + i % n, mask=live, other=0.0)
        tl.store(y_ptr + i, (acc * scale).to(y_ptr.dtype.element_ty), mask=live)

    return weight_only_kernel, reduce_kernel


def weight_only_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                       block_n: int = 32, block_k: int = 256, num_warps: int = 4,
                       num_stages: int = 4, split_k: int = 1) -> torch.Tensor:
    """x [M, K] (16-bit; M <= WEIGHT_ONLY_MAX_M) @ (weight [N, K] * weight_scale [N, 1]).T in
    x's dtype, through the Triton kernel (on a GPU that converts FP8, or Triton's
    interpreter; there any weight dtype). Each product is accumulated in float32 from the
    weight's exact values widened to x's dtype. `split_k` > 1 cuts K into that many chunks
    run as programs of their own (more programs in flight for the few output blocks of a
    long K), their float32 partials summed by a second kernel."""
    m, k = x.shape
    n = weight.shape[0]
    if m > WEIGHT_ONLY_MAX_M:
        raise ValueError(f"weight_only_linear takes at most {WEIGHT_ONLY_MAX_M} rows, got {m}")
    if split_k < 1:
        raise ValueError(f"split_k must be at least 1, got {split_k}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    x = x if x.stride(-1) == 1 else x.contiguous()
    block_m = max(16, 1 << (m - 1).bit_length())  # tl.dot needs 16 rows at least
    # Chunks of whole blocks; a split left with no K (a short K cut many ways) stores zeros.
    per_split = -(-k // split_k)
    chunk = -(-per_split // block_k) * block_k
    main, reduce = _weight_only_kernels()
    scale = weight_scale.view(-1)
    out = y if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    main[((n + block_n - 1) // block_n, split_k)](
        x, weight, scale, out, m, n, k, chunk, x.stride(0), weight.stride(0), n, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, PARTIAL=split_k > 1, num_warps=num_warps, num_stages=num_stages)
    if split_k > 1:
        reduce[(-(-(m * n) // 1024),)](out, scale, y, m * n, n, SPLITS=split_k, BLOCK=1024)
    return y


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               out_dtype: torch.dtype) -> torch.Tensor:
    """x [..., K] @ (weight [N, K] FP8 * weight_scale [N, 1]).T in `out_dtype`, x quantized
    per row first. On a GPU the product comes out in bf16 (row-wise scaling gives no
    other type there) and is cast to `out_dtype` if that differs."""
    n = weight.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[0] == 0:
        return x.new_empty((*lead, n), dtype=out_dtype)
    q, s = quantize_rows(x2)
    mm_dtype = torch.bfloat16 if x.is_cuda else out_dtype
    y = torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=weight_scale.view(1, n), out_dtype=mm_dtype)
    return (y if mm_dtype == out_dtype else y.to(out_dtype)).view(*lead, n)


def fp8_supported(device: torch.device) -> str | None:
    """None where FP8 weights run on `device`, else why not (a sentence for an error)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    if torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return (f"quantization='fp8' needs FP8 tensor cores (compute capability 8.9+, e.g. L4, H100, H200); "
                f"{name} has {major}.{minor}: leave quantization unset")
    if (error := _row_scaled_gemm_error(device)) is not None:
        return (f"quantization='fp8' needs torch._scaled_mm with a scale per row, which torch {torch.__version__} "
                f"does not run on {name} ({error}): leave quantization unset")
    return None


@functools.cache
def _row_scaled_gemm_error(device: torch.device) -> str | None:
    """Why one tiny row-scaled FP8 GEMM fails on `device`, or None. Which GPUs torch runs it
    on depends on its build (its kernel for 8.9 came later than 9.0's; some newer GPUs'
    libraries refuse it), so the device is asked rather than a table kept."""
    a = torch.zeros(ALIGN, ALIGN, device=device).to(FP8)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(ALIGN, 1, device=device),
                         scale_b=torch.ones(1, ALIGN, device=device), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        return str(e).splitlines()[0]
    return None
