"""The FlashInfer backend's host-side plan inputs, checked on the CPU (the kernels
themselves are tested against the torch reference in test_gpu.py)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from sgl.kernels.flashinfer_attention import _host_lens


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
