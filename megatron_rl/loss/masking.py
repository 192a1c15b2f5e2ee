"""Exact, cheap masking: ``torch.where(mask, x, 0)`` as an integer AND of the value's bits.

``where`` with a bool condition is several times slower than arithmetic on CPU (the loss path
masks every per-token tensor a few times per micro-batch). ANDing the bits with an all-ones /
all-zeros word gives the same result bit for bit (masked positions become +0, NaN/inf there
included) at the cost of one integer op; :func:`masked_zero` is the differentiable form (its
backward masks the gradient the same way, as ``where``'s does). Works on any device.
"""

from __future__ import annotations

import numpy as np
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
    ai, bi = a.view(_INT_OF[a.dtype]), b.view(_INT_OF[b.dtype])
    arr, other = host_array(ai), host_array(bi)
    if arr is None or other is None:
        return ai == bi
    out = torch.empty(a.shape, dtype=torch.bool, device=a.device)
    np.equal(arr, other, out=host_array(out))  # numpy's compare: faster on CPU, the same result
    return out


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


def host_array(x: Tensor) -> np.ndarray | None:
    """numpy view of a CPU tensor (shared memory); None for other devices and for dtypes numpy
    has no type for (bfloat16)."""
    if x.device.type != "cpu" or x.dtype == torch.bfloat16:
        return None
    if x.requires_grad:
        x = x.detach()
    return x.numpy()  # device-spy: ok (CPU tensors only: no device to sync with)


def count_true(mask: Tensor) -> Tensor:
    """int64 0-dim number of true entries of a bool ``mask``, on ``mask``'s device (no host
    sync on an accelerator; on CPU numpy's ``count_nonzero``, several times faster than
    torch's)."""
    arr = host_array(mask)
    if arr is not None:
        return torch.tensor(int(np.count_nonzero(arr)), dtype=torch.int64, device=mask.device)
    return torch.count_nonzero(mask)


def counts_f64(*masks: Tensor) -> Tensor:
    """fp64 ``[len(masks)]``: the number of true entries of each bool mask (see
    :func:`count_true`), on the masks' device."""
    arrs = [host_array(m) for m in masks]
    if all(a is not None for a in arrs):
        return torch.tensor([float(np.count_nonzero(a)) for a in arrs], dtype=torch.float64,
                            device=masks[0].device)
    return torch.stack([torch.count_nonzero(m) for m in masks]).to(torch.float64)


_COMPARE = {"gt": (torch.gt, np.greater), "lt": (torch.lt, np.less)}


def compare(op: str, a: Tensor, b: Tensor | float, out: Tensor | None = None) -> Tensor:
    """bool ``a > b`` (``op="gt"``) or ``a < b`` (``"lt"``) with torch's semantics (a scalar
    ``b`` in ``a``'s dtype; NaN compares false), into ``out`` if given. On CPU numpy's
    comparison (the same IEEE result, several times faster than torch's bool-output
    kernels), elsewhere torch's."""
    torch_op, np_op = _COMPARE[op]
    arr = host_array(a)
    if arr is None or (isinstance(b, Tensor) and (b.device.type != "cpu" or b.shape != a.shape)):
        return torch_op(a, b, out=out) if out is not None else torch_op(a, b)
    if out is None:
        out = torch.empty(a.shape, dtype=torch.bool, device=a.device)
    other = host_array(b) if isinstance(b, Tensor) else np.asarray(b, dtype=arr.dtype)
    np_op(arr, other, out=host_array(out))
    return out


def mul_mask_(x: Tensor, mask: Tensor) -> Tensor:
    """``x *= mask`` in place for an integer ``x`` and a bool ``mask`` of its shape (0 where
    the mask is false). On CPU numpy multiplies by the bool bytes directly; torch first copies
    the mask into ``x``'s dtype."""
    xa, ma = host_array(x), host_array(mask)
    if xa is None or ma is None or not x.is_contiguous():
        return x.mul_(mask)
    np.multiply(xa, ma, out=xa)
    return x
