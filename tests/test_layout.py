"""kernel_pytorch.ops.layout: outputs in their input's dim order, and copies into another tensor's strides."""

from __future__ import annotations

import pytest
import torch

from kernel_pytorch.ops.layout import empty_in_order_of, in_strides_of


def _transposed_projection():
    return torch.randn(2, 5, 3, 8).transpose(1, 2)  # (B, L, H, D) memory viewed as (B, H, L, D)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 3, 5, 8),
    _transposed_projection,
    lambda: torch.randn(2, 5, 3 * 8 * 3)[..., :24].view(2, 5, 3, 8).transpose(1, 2),  # sliced out of a fused qkv
    lambda: torch.randn(8, 5, 3, 2).permute(3, 2, 1, 0),
], ids=["contiguous", "transposed", "qkv-slice", "reversed"])
def test_empty_in_order_of_keeps_the_dim_order_dense(make):
    x = make()
    out = empty_in_order_of(x, dtype=torch.bfloat16)
    eager = x * 2.0  # eager elementwise ops lay their result out in x's dim order
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert out.stride() == eager.stride()


def test_in_strides_of_copies_only_when_the_strides_differ():
    like = _transposed_projection()
    same = torch.empty_like(like).copy_(like)
    assert in_strides_of(same, like) is same
    other = torch.randn(like.shape)
    moved = in_strides_of(other, like)
    assert moved.stride() == like.stride() and torch.equal(moved, other)
