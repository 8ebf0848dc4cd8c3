"""Checkpoints stored in FP8: config.json's `quantization_config` with `quant_method: "fp8"`,
as Qwen's FP8 releases (a scale per 128 x 128 block, `weight_scale_inv`, with
`weight_block_size`) and AutoFP8's (a scale per tensor or per row, `weight_scale`, maybe a
static `input_scale`) write them. Each scale multiplies its weight's FP8 values.

The loaders read such a checkpoint through `Fp8Checkpoint.dequantized`: every FP8 weight
leaves it as float32 values, its scales consumed, `input_scale` dropped (sgl scales
activations per token at run time). The model then quantizes the weights again, a scale per
output row (sgl.kernels.fp8_linear), where the device runs FP8 GEMMs, and keeps them in its
dtype elsewhere. A row of a block-scaled matrix is rounded twice that way: e4m3 is a
floating-point format, so the second rounding costs at most the same relative 1/16 again.

It reads names, shapes and values; it never opens files or decides where a tensor goes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_FP8_NAMES = {"F8_E4M3": "float8_e4m3fn"}  # a header's dtype -> torch's name
_SCALES = (".weight_scale_inv", ".weight_scale")


@dataclass(frozen=True, slots=True)
class Fp8Checkpoint:
    """How a checkpoint's FP8 weights are scaled: per block of `block` (rows, columns), or
    (None) per tensor or per row, whatever shape each scale has."""

    block: tuple[int, int] | None

    @classmethod
    def of(cls, config: Any) -> Fp8Checkpoint | None:
        """The config's FP8 scheme; None for an unquantized checkpoint. ValueError for a
        quantization sgl does not read, naming it."""
        qc = getattr(config, "quantization_config", None)
        if qc is None:
            return None
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        method = qc.get("quant_method")
        if method != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"the checkpoint is quantized with quant_method={method!r} (fmt={qc.get('fmt')!r}): "
                             "sgl reads unquantized checkpoints and FP8 e4m3 ones (quant_method 'fp8')")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise ValueError(f"quantization_config.weight_block_size={block!r}: expected [rows, columns]")
        return cls(None if block is None else (int(block[0]), int(block[1])))

    def header(self, items: Iterable[tuple[str, list[int], str]]) -> list[tuple[str, list[int], str]]:
        """A checkpoint's (name, shape, dtype) as `dequantized` will yield them: scales and
        input scales gone, FP8 weights float32. ValueError naming an FP8 weight without a
        scale or a scale without its weight: said before anything is read or copied."""
        out: list[tuple[str, list[int], str]] = []
        fp8: set[str] = set()
        scaled: set[str] = set()
        for name, shape, dtype in items:
            if name.endswith(_SCALES):
                scaled.add(_scaled_weight(name))
            elif not name.endswith(".input_scale"):
                is_fp8 = _FP8_NAMES.get(dtype, dtype) == "float8_e4m3fn"
                if is_fp8:
                    fp8.add(name)
                out.append((name, shape, "float32" if is_fp8 else dtype))
        if fp8 != scaled:
            left = sorted(fp8 - scaled) or sorted(scaled - fp8)
            what = "FP8 weights without a scale" if fp8 - scaled else "scales without their FP8 weight"
            raise ValueError(f"{what} in the checkpoint: {', '.join(left[:4])}")
        return out

    def dequantized(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors with every FP8 weight as float32 values (a weight and
        its scale may come in either order); ValueError naming a weight left without its
        scale, or a scale without its weight, at the end."""
        weights: dict[str, torch.Tensor] = {}
        scales: dict[str, torch.Tensor] = {}
        for name, t in tensors:
            if name.endswith(".input_scale"):
                continue
            if name.endswith(_SCALES):
                owner = _scaled_weight(name)
                if owner in weights:
                    yield owner, self._values(owner, weights.pop(owner), t)
                else:
                    scales[owner] = t
            elif t.dtype == torch.float8_e4m3fn:
                if name in scales:
                    yield name, self._values(name, t, scales.pop(name))
                else:
                    weights[name] = t
            else:
                yield name, t
        if weights or scales:
            left = sorted(weights) or sorted(scales)
            what = "FP8 weights without a scale" if weights else "scales without their FP8 weight"
            raise ValueError(f"{what} in the checkpoint: {', '.join(left[:4])}")

    def _values(self, name: str, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        s = scale.float()
        if self.block is not None and s.dim() == 2 and q.dim() == 2:
            (n, k), (bn, bk) = q.shape, self.block
            if tuple(s.shape) != (-(-n // bn), -(-k // bk)):
                raise ValueError(f"the scale of {name!r} has shape {tuple(s.shape)}; a {n} x {k} weight in blocks "
                                 f"of {bn} x {bk} needs {(-(-n // bn), -(-k // bk))}")
            s = s.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        elif s.numel() == 1:
            s = s.reshape(())
        elif s.numel() == q.shape[0]:
            s = s.reshape(-1, *([1] * (q.dim() - 1)))
        else:
            raise ValueError(f"the scale of {name!r} has shape {tuple(s.shape)}: expected one value, one per row "
                             "or one per block")
        return q.float() * s


def _scaled_weight(scale_name: str) -> str:
    """The weight a scale belongs to: `x.weight_scale_inv` and `x.weight_scale` scale `x.weight`."""
    return scale_name.rsplit(".", 1)[0] + ".weight"
