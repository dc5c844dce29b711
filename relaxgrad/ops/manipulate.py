"""Rules for shape manipulation (relax.op.manipulate)."""

from __future__ import annotations

from tvm import relax
from tvm.relax import Tuple
from tvm.relax.op import (
    arange,
    astype,
    broadcast_to,
    collapse_sum_to,
    concat,
    equal,
    flip,
    full_like,
    gather_elements,
    gather_nd,
    permute_dims,
    reshape,
    scatter_elements,
    scatter_nd,
    split,
    squeeze,
    strided_slice,
    sum,
    take,
    where,
    zeros_like,
)
from tvm.relax.op.grad import no_grad
from tvm.relax.op.nn import pad
from tvm.sym import Analyzer

from .. import _ty
from ..errors import GradientError
from ._utils import const, numel, static_dims
from .registry import register_gradient, register_no_grad


@register_gradient("relax.permute_dims")
def permute_dims_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = permute_dims(x, axes)``; backward: ``[permute_dims(g, inverse(axes))]``."""
    axes = orig_call.attrs.axes
    if not axes:
        return [permute_dims(output_grad)]
    inverse = [0] * len(axes)
    for i, a in enumerate(axes):
        inverse[int(a)] = i
    return [permute_dims(output_grad, inverse)]


@register_gradient("relax.concat")
def concat_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = concat((x1, ..., xn), axis)``; backward: ``[split(g, offsets, axis)]``.

    ``split`` cannot express every concat: of a single input (``split(g, [])`` is a tensor, not
    a 1-tuple) or with an empty input (its offsets repeat); those get one ``strided_slice`` of g
    per input instead."""
    axis = int(orig_call.attrs.axis)
    sizes = [_ty.shape_values(field)[axis] for field in _ty.tuple_fields(orig_call.args[0])]
    offsets = [sizes[0]]
    for size in sizes[1:]:
        offsets.append(offsets[-1] + size)
    analyzer = Analyzer()
    if len(sizes) > 1 and not any(analyzer.can_prove_equal(size, 0) for size in sizes):
        return [split(output_grad, offsets[:-1], axis)]
    begins = [0] + offsets[:-1]
    return [Tuple([strided_slice(output_grad, [axis], [b], [e]) for b, e in zip(begins, offsets)])]


@register_gradient("relax.split")
def split_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``(y1, ..., yn) = split(x, indices, axis)``; backward: ``[concat(g, axis)]``
    (one section: TVM types ``y`` as the tensor itself, whose gradient is ``g``)."""
    if not _ty.is_tuple(orig_var):
        return [output_grad]
    return [concat(output_grad, int(orig_call.attrs.axis))]


@register_gradient("relax.reshape")
def reshape_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = reshape(x, shape)``; backward: ``[reshape(g, x.shape), no_grad]``."""
    x, shape = orig_call.args
    return [reshape(output_grad, _ty.shape_of(x)), no_grad(shape)]


@register_gradient("relax.broadcast_to")
def broadcast_to_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = broadcast_to(x, shape)``; backward:
    ``[collapse_sum_to(g, x.shape), no_grad]``."""
    x, shape = orig_call.args
    return [collapse_sum_to(output_grad, _ty.shape_of(x)), no_grad(shape)]


@register_gradient("relax.expand_dims")
def expand_dims_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = expand_dims(x, axis)``; backward: ``[squeeze(g, axis)]``."""
    return [squeeze(output_grad, orig_call.attrs.axis)]


@register_gradient("relax.squeeze")
def squeeze_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = squeeze(x, axis)``; backward: ``[reshape(g, x.shape)]``."""
    return [reshape(output_grad, _ty.shape_of(orig_call.args[0]))]


@register_gradient("relax.flatten")
def flatten_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = flatten(x)``; backward: ``[reshape(g, x.shape)]``."""
    return [reshape(output_grad, _ty.shape_of(orig_call.args[0]))]


@register_gradient("relax.flip")
def flip_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = flip(x, axis)``; backward: ``[flip(g, axis)]``."""
    return [flip(output_grad, orig_call.attrs.axis)]


@register_gradient("relax.tile")
def tile_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = tile(x, repeats)``; backward: ``[sum of g over the copies]``: g reshaped to
    ``(r0, d0, r1, d1, ...)`` and summed over the ``r`` axes."""
    x = orig_call.args[0]
    dims = _ty.shape_values(x)
    repeats = [int(r) for r in orig_call.attrs.repeats]
    rank = max(len(dims), len(repeats))
    dims = [1] * (rank - len(dims)) + dims
    repeats = [1] * (rank - len(repeats)) + repeats
    interleaved = reshape(output_grad, [v for r, d in zip(repeats, dims) for v in (r, d)])
    return [reshape(sum(interleaved, list(range(0, 2 * rank, 2))), _ty.shape_of(x))]


@register_gradient("relax.repeat")
def repeat_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = repeat(x, r, axis)``; backward: ``[sum of g over the r copies]``: g reshaped
    to ``(..., d, r, ...)`` and summed over the ``r`` axis (x flattened when axis is None)."""
    x = orig_call.args[0]
    repeats = int(orig_call.attrs.repeats)
    if orig_call.attrs.axis is None:
        summed = sum(reshape(output_grad, [numel(x), repeats]), [1])
        return [reshape(summed, _ty.shape_of(x))]
    dims = _ty.shape_values(x)
    axis = int(orig_call.attrs.axis) % len(dims)
    split_copies = reshape(output_grad, dims[: axis + 1] + [repeats] + dims[axis + 1 :])
    return [sum(split_copies, [axis + 1])]


@register_gradient("relax.stack")
def stack_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = stack((x1, ..., xn), axis)``; backward:
    ``[(take(g, 0, axis), ..., take(g, n - 1, axis))]``."""
    fields = _ty.tuple_fields(orig_call.args[0])
    axis = int(orig_call.attrs.axis) % (_ty.ndim_of(fields[0]) + 1)
    return [Tuple([take(output_grad, relax.const(i, "int64"), axis) for i in range(len(fields))])]


register_no_grad(["relax.one_hot"])  # of integer indices; on/off values are prim values


@register_gradient("relax.gather_elements")
def gather_elements_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = gather_elements(x, indices, axis)``; backward:
    ``[scatter_elements(zeros_like(x), indices, g, axis, "add"), no_grad]``.

    ``indices`` may be smaller than x on the other axes, but TVM's scatter_elements kernels
    assume they agree there (they place the values in the wrong rows otherwise), so ``indices``
    and ``g`` are first padded to x's size on those axes: the padding adds zeros at index 0."""
    x, indices = orig_call.args
    ndim = _ty.ndim_of(x)
    axis = int(orig_call.attrs.axis) % ndim
    x_dims, index_dims = _ty.shape_values(x), _ty.shape_values(indices)
    analyzer = Analyzer()
    if any(
        a != axis and not analyzer.can_prove_equal(d, i)
        for a, (d, i) in enumerate(zip(x_dims, index_dims))
    ):
        x_dims = static_dims(x, "relax.gather_elements")
        index_dims = static_dims(indices, "relax.gather_elements")
        widths = [0] * (2 * ndim)
        for a in range(ndim):
            if a != axis:
                widths[2 * a + 1] = x_dims[a] - index_dims[a]
        indices, output_grad = pad(indices, widths), pad(output_grad, widths)
    scattered = scatter_elements(zeros_like(x), indices, output_grad, axis, "add")
    return [scattered, no_grad(orig_call.args[1])]


def _batch_coordinates(indices, batch_dims: int):
    """``indices`` of a ``gather_nd`` with ``batch_dims`` leading batch axes, as the indices of
    a ``gather_nd`` without: the batch coordinates prepended to each index tuple."""
    if batch_dims == 0:
        return indices
    dims, dtype = _ty.shape_values(indices), _ty.dtype_of(indices)
    coords = []
    for a in range(batch_dims):  # an arange along axis a (its size may be symbolic)
        shape = [d if i == a else 1 for i, d in enumerate(dims)]
        coords.append(broadcast_to(reshape(arange(0, dims[a], 1, dtype), shape), dims[:-1] + [1]))
    return concat(coords + [indices], -1)


@register_gradient("relax.gather_nd")
def gather_nd_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = gather_nd(x, indices, batch_dims)``; backward:
    ``[scatter_nd(zeros_like(x), indices, g, "add"), no_grad]`` (batch coordinates prepended to
    the indices when ``batch_dims > 0``)."""
    x, indices = orig_call.args
    full_indices = _batch_coordinates(indices, int(orig_call.attrs.batch_dims))
    return [scatter_nd(zeros_like(x), full_indices, output_grad, "add"), no_grad(indices)]


def _scatter_partials(op_name, scatter, gather, args, y, g, reduction: str):
    """``(d data, d updates)`` of ``y = scatter(data, indices, updates, reduction)``, where
    ``gather(t, indices)`` reads the positions the updates go to."""
    data, indices, updates = args
    if reduction == "add":
        return g, gather(g, indices)
    if reduction == "update":  # only the update that is written last (the "winner") counts
        ids = reshape(arange(numel(updates), dtype="int64"), _ty.shape_of(updates))
        written = scatter(
            full_like(data, relax.const(-1, "int64"), "int64"), indices, ids, "update"
        )
        won = equal(gather(written, indices), ids)
        kept = scatter(g, indices, zeros_like(updates), "update")
        return kept, where(won, gather(g, indices), const(0, updates))
    if reduction in ("max", "min"):  # g shared evenly by the values equal to the result
        dtype = _ty.dtype_of(data)
        data_hit = astype(equal(data, y), dtype)
        update_hit = astype(equal(updates, gather(y, indices)), dtype)
        share = g / scatter(data_hit, indices, update_hit, "add")
        return data_hit * share, update_hit * gather(share, indices)
    raise GradientError(
        f"Gradient: {op_name} has no gradient rule for reduction={reduction!r} (only for "
        "update, add, max and min)"
    )


def _check_scatter_indices(data, indices, axis: int) -> None:
    """TVM 0.27's scatter_elements kernel writes to the wrong positions when the indices are
    smaller than the data off the scatter axis (it walks the data with the indices' strides);
    no gradient can match that forward, so refuse it."""
    ndim = _ty.ndim_of(data)
    for a, (d, i) in enumerate(zip(_ty.shape_values(data), _ty.shape_values(indices))):
        if a != axis % ndim and not Analyzer().can_prove_equal(d, i):
            raise GradientError(
                f"Gradient: relax.scatter_elements with indices of shape "
                f"{list(_ty.shape_values(indices))} smaller than the data "
                f"{list(_ty.shape_values(data))} on axis {a} (not the scatter axis): TVM's kernel "
                "computes a wrong forward result there, so it has no gradient rule"
            )


@register_gradient("relax.scatter_elements")
def scatter_elements_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = scatter_elements(x, indices, u, axis, reduction)``; backward for "add":
    ``[g, no_grad, gather_elements(g, indices, axis)]``; "update", "max" and "min" mask both
    partials to the values that reach y (see :func:`_scatter_partials`)."""
    axis = orig_call.attrs.axis
    _check_scatter_indices(orig_call.args[0], orig_call.args[1], int(axis))
    dx, du = _scatter_partials(
        "relax.scatter_elements",
        lambda d, i, u, r: scatter_elements(d, i, u, axis, r),
        lambda t, i: gather_elements(t, i, axis),
        orig_call.args, orig_var, output_grad, str(orig_call.attrs.reduction),
    )  # fmt: skip
    return [dx, no_grad(orig_call.args[1]), du]


@register_gradient("relax.scatter_nd")
def scatter_nd_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = scatter_nd(x, indices, u, reduction)``; backward for "add":
    ``[g, no_grad, gather_nd(g, indices)]``; "update", "max" and "min" mask both partials to the
    values that reach y (see :func:`_scatter_partials`)."""
    dx, du = _scatter_partials(
        "relax.scatter_nd", scatter_nd, gather_nd, orig_call.args, orig_var, output_grad,
        str(orig_call.attrs.reduction),
    )  # fmt: skip
    return [dx, no_grad(orig_call.args[1]), du]
