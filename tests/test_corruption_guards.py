"""What keeps a bug from corrupting the engine silently: a KV slot or a request row
freed twice is refused at once (always, not only in strict mode) and never handed to
two owners; each model owns its rotary tables, so two engines in one process never
read each other's; OpenAI's `min_tokens` reaches the sampler as `min_new_tokens`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl.cache.kv_allocator import TokenToKVPoolAllocator
from sgl.cache.req_to_token_pool import ReqToTokenPool
from sgl.core.sampling_params import SamplingParams
from sgl.kernels import layers


def test_kv_double_free_is_refused_and_nothing_is_handed_out_twice() -> None:
    a = TokenToKVPoolAllocator(16)
    x = a.alloc(6)
    assert x is not None
    a.free(x[:3])
    for bad in (x[:1], torch.tensor([int(x[4]), int(x[4])]), torch.tensor([0]), torch.tensor([17])):
        with pytest.raises(RuntimeError, match="double free|bad slot"):
            a.free(bad)
    assert a.available_size() == 13  # the refused frees changed nothing
    a.free(x[3:])
    assert sorted(a.free_slots().tolist()) == list(range(1, 17))
    y = a.alloc(16)
    assert y is not None and sorted(y.tolist()) == list(range(1, 17))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5)), min_size=1, max_size=40))
def test_allocator_never_hands_a_held_slot_out(ops: list[tuple[bool, int]]) -> None:
    """Random allocs and frees (some of them frees of already free slots, which must
    raise): the held slots are always distinct, and free + held == size."""
    a = TokenToKVPoolAllocator(24)
    held: list[int] = []
    freed: list[int] = []
    for is_alloc, n in ops:
        if is_alloc:
            out = a.alloc(n)
            if out is not None:
                held += out.tolist()
        elif held:
            k = min(n, len(held))
            a.free(torch.tensor(held[:k]))
            freed, held = held[:k], held[k:]
        elif freed:
            with pytest.raises(RuntimeError):
                a.free(torch.tensor(freed[:1]))
        assert len(set(held)) == len(held)
        assert a.available_size() + len(held) == 24


def test_request_row_double_free_is_refused() -> None:
    pool = ReqToTokenPool(3, 8)
    r = pool.alloc()
    assert r is not None
    pool.free(r)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(r)
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2]  # r came back once, not twice
    assert pool.alloc() is None


def test_each_model_owns_its_rotary_tables() -> None:
    a = layers.rope_tables(16, 64, 10000.0, None, "cpu")
    b = layers.rope_tables(16, 64, 1e6, None, "cpu")
    assert not torch.equal(a.cos, b.cos)
    for t in (a, b):  # FlashInfer's view is of these very tables: cos halves, then sin halves
        assert torch.equal(t.cos_sin, torch.cat([t.cos[:, :8], t.sin[:, :8]], dim=-1))
    q, k = torch.randn(5, 2, 16), torch.randn(5, 1, 16)
    pos = torch.arange(5)
    qa, _ = layers.apply_rope(q, k, pos, a)
    qb, _ = layers.apply_rope(q, k, pos, b)
    assert not torch.allclose(qa, qb)
    assert not any(isinstance(v, dict) and not k.startswith("__") for k, v in vars(layers).items()), \
        "a module-level table cache is back"


def test_openai_min_tokens_maps_to_min_new_tokens() -> None:
    from sgl.server.openai_protocol import CompletionRequest, sampling_dict

    req = CompletionRequest(prompt="hi", min_tokens=3, max_tokens=8)
    sp = sampling_dict(req, req.max_tokens)
    assert sp["min_new_tokens"] == 3 and "min_tokens" not in sp
    assert SamplingParams.coerce(sp).min_new_tokens == 3
