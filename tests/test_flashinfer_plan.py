"""The FlashInfer backend's host-side plan inputs, checked on the CPU (the kernels
themselves are tested against the torch reference in test_gpu.py)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from sgl.kernels.flashinfer_attention import _host_lens, prefers_tensor_cores


@given(st.lists(st.integers(1, 40_000), min_size=1, max_size=300))
def test_host_lens_are_the_indptr_steps_and_iterate_to_their_maximum(lens: list[int]) -> None:
    """FlashInfer's tensor-core plan reads `max(seq_lens.cpu()).item()` and hands the
    tensor to its planner: after `.cpu()` the lengths must still be the rows' lengths,
    and Python's max() over them their maximum."""
    indptr = torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32)
    host = _host_lens(indptr).cpu()
    assert host.dtype == torch.int32
    assert torch.Tensor.tolist(host) == lens
    assert max(host).item() == max(lens)


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lens], dtype=torch.int64).cumsum(0).to(torch.int32)


def test_the_decode_kernel_pick_follows_the_measured_batches() -> None:
    """The kernel pick, at the batches benchmarks/decode_balance.py timed: W1's uniform
    rows keep the decode kernel, W2's mixed ones and W3's shared prefix (cascade off)
    take the tensor-core kernel, and so does a small shared prefix only once it is half
    the row."""
    from benchmarks.decode_balance import w2_contexts

    assert not prefers_tensor_cores(_indptr([768] * 256), 0)
    assert not prefers_tensor_cores(_indptr([768] * 256), 100)
    assert prefers_tensor_cores(_indptr([768] * 256), 384)
    assert prefers_tensor_cores(_indptr([2100] * 256), 2000)
    for t in (0, 200, 400, 600, 800, 950):
        assert prefers_tensor_cores(_indptr(w2_contexts(t)), 0)
    assert not prefers_tensor_cores(_indptr([100] * 200 + [125] * 56), 0)
    assert prefers_tensor_cores(_indptr([100] * 255 + [1000]), 0)
