"""Exact, cheap masking: ``torch.where(mask, x, 0)`` as an integer AND of the value's bits.

``where`` with a bool condition is several times slower than arithmetic on CPU (the loss path
masks every per-token tensor a few times per micro-batch). ANDing the bits with an all-ones /
all-zeros word gives the same result bit for bit (masked positions become +0, NaN/inf there
included) at the cost of one integer op; :func:`masked_zero` is the differentiable form (its
backward masks the gradient the same way, as ``where``'s does). Works on any device.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

_INT_OF = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
           torch.float16: torch.int16, torch.int64: torch.int64, torch.int32: torch.int32}


def mask_bits(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """All-ones where ``mask`` (bool) is true, 0 elsewhere, in the integer type as wide as
    ``dtype`` (the second argument of :func:`zero_where_not`); same shape and device."""
    # negated as int8 (1 byte per element), then sign-extended: -1 -> all ones
    return (-mask.contiguous().view(torch.int8)).to(_INT_OF[dtype])


def not_mask_bits(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """:func:`mask_bits` of ``~mask`` (all-ones where ``mask`` is false), one op fewer."""
    return (mask.contiguous().view(torch.int8) - 1).to(_INT_OF[dtype])


def zero_where_not(x: Tensor, bits: Tensor) -> Tensor:
    """``torch.where(mask, x, 0)`` bit for bit, ``bits`` from :func:`mask_bits` (``x``'s dtype).
    Not differentiable: use :func:`masked_zero` for tensors that need a gradient. An expanded
    ``x`` (a broadcast gradient: stride 0 in some dimension) is masked through broadcasting,
    without materialising it first (the same bits)."""
    if bits.shape == x.shape and 0 in x.stride() and not x.is_contiguous():
        x = x[tuple(slice(0, 1) if st == 0 else slice(None) for st in x.stride())]
    x = x.contiguous()
    return (x.view(_INT_OF[x.dtype]) & bits).view(x.dtype)


class _MaskedZero(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, bits: Tensor) -> Tensor:  # noqa: D102
        ctx.save_for_backward(bits)
        return zero_where_not(x, bits)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: D102
        (bits,) = ctx.saved_tensors
        return zero_where_not(grad, bits), None


def masked_zero(x: Tensor, mask: Tensor) -> Tensor:
    """Differentiable ``torch.where(mask, x, 0)`` (``mask`` bool, broadcast-free: same shape as
    ``x``); value and gradient bit-identical to ``where``'s."""
    if x.dtype not in _INT_OF or mask.shape != x.shape:
        return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return _MaskedZero.apply(x, mask_bits(mask, x.dtype))


def same_bits(a: Tensor, b: Tensor) -> Tensor:
    """bool ``a == b`` compared as bit patterns (same shape and float dtype): equal to the float
    ``==`` except that a NaN equals a NaN of the same payload and ``+0 != -0``; an integer
    compare, about half the cost of the float one on CPU."""
    a, b = a.contiguous(), b.contiguous()
    return a.view(_INT_OF[a.dtype]) == b.view(_INT_OF[b.dtype])


def adjacent_view(xs: list[Tensor], dtype: torch.dtype, n: int) -> Tensor | None:
    """A read-only flat ``[n]`` view of the micro-batches' tensors when they already lie one
    after the other in one storage (contiguous row slices of one mini-batch tensor, the usual
    case): no copy is needed. None otherwise."""
    first = xs[0]
    if any(x.dtype != dtype or not x.is_contiguous() for x in xs):
        return None
    storage, size = first.untyped_storage(), first.element_size()
    start = first.storage_offset()
    pos = start
    for x in xs:
        if x.untyped_storage().data_ptr() != storage.data_ptr() or x.storage_offset() != pos:
            return None
        pos += x.numel()
    if pos * size > storage.nbytes():
        return None
    return first.detach().as_strided((n,), (1,))


def count_true(mask: Tensor) -> Tensor:
    """int64 0-dim number of true entries of a bool ``mask`` (no host sync). A contiguous mask
    whose bytes fill whole 8-byte words is counted eight bytes at a time: the bytes of a word
    are 0 or 1, so the top byte of ``word * 0x0101010101010101`` is their sum (no carry below
    it); about twice as fast as a byte sum on CPU. Other masks: ``count_nonzero``."""
    m = mask.contiguous()
    if m.numel() % 8 or m.storage_offset() % 8 or m.numel() < 4096:
        return torch.count_nonzero(m)
    words = m.view(-1).view(torch.int64)
    return ((words * 0x0101010101010101) >> 56).sum()
