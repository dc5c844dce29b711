"""Rules for relax.op.image.

``resize2d`` is linear in the image and separable: ``y = R_h x R_w^T`` per batch and channel,
with static interpolation matrices ``R`` (one-hot rows for nearest neighbor). They are built here
by replaying TVM's kernel (``topi.image.resize``) in float32, as it computes, so the gradient
``dx = R_h^T g R_w`` matches the compiled forward, coordinate mode and rounding included.
"""

from __future__ import annotations

import numpy as np
from tvm import relax
from tvm.relax.op import astype, matmul
from tvm.relax.op.grad import no_grad

from .. import _ty
from ..errors import GradientError
from ._utils import relayout, static_dims
from .registry import register_gradient

_F32 = np.float32


def _source_coordinate(x: int, n_in: int, n_out: int, mode: str, start, end) -> np.float32:
    """The input coordinate output ``x`` samples (``topi.image.resize.get_inx``), in float32."""
    scale = _F32(n_in) / _F32(n_out)
    if mode == "half_pixel" or (mode == "pytorch_half_pixel" and n_out > 1):
        return (_F32(x) + _F32(0.5)) * scale - _F32(0.5)
    if mode == "pytorch_half_pixel":
        return _F32(0.0)
    if mode == "align_corners":
        return _F32(n_in - 1) / _F32(n_out - 1) * _F32(x)
    if mode == "asymmetric":
        return scale * _F32(x)
    if mode == "tf_half_pixel_for_nn":
        return (_F32(x) + _F32(0.5)) * scale
    if mode == "tf_crop_and_resize":
        if n_out > 1:
            step = _F32(end - start) * _F32(n_in - 1) / _F32(n_out - 1)
            return _F32(start) * _F32(n_in - 1) + _F32(x) * step
        return _F32(0.5) * _F32(start + end) * _F32(n_in - 1)
    raise GradientError(
        f"Gradient: relax.image.resize2d has no gradient rule for "
        f"coordinate_transformation_mode={mode!r}"
    )


def _nearest_index(coord: np.float32, rounding: str) -> int:
    """``topi.image.resize.get_closest_index`` (``round``: half to even, as TVM's llvm code)."""
    if rounding == "round":
        return int(np.round(coord))
    if rounding == "round_prefer_floor":
        return int(np.ceil(coord - _F32(0.5)))
    if rounding == "round_prefer_ceil":
        return int(np.floor(coord + _F32(0.5)))
    if rounding == "floor":
        return int(np.floor(coord + _F32(1e-5)))
    if rounding == "ceil":
        return int(np.ceil(coord - _F32(1e-5)))
    raise GradientError(
        f"Gradient: relax.image.resize2d has no gradient rule for rounding_method={rounding!r}"
    )


def _cubic_weights(t: np.float32, alpha: float, first: int, n_in: int, exclude: bool):
    """The 4 cubic spline weights of the inputs ``first .. first + 3`` at fraction ``t``."""
    a, t2, t3 = _F32(alpha), t * t, t * t * t
    weights = [
        a * (t3 - 2 * t2 + t),
        (a + 2) * t3 - (3 + a) * t2 + 1,
        -(a + 2) * t3 + (3 + 2 * a) * t2 - a * t,
        -a * t3 + a * t2,
    ]
    if exclude:  # TVM's test: first + i < 0 or first + i + 1 > n_in
        weights = [_F32(0) if first + i < 0 or first + i + 1 > n_in else w
                   for i, w in enumerate(weights)]  # fmt: skip
        total = _F32(sum(weights))
        weights = [w / total for w in weights]
    return weights


def resize_matrix(n_in: int, n_out: int, attrs, roi: tuple[float, float]) -> np.ndarray:
    """``R`` (n_out x n_in) of one axis of ``resize2d``: ``y = R x`` along that axis."""
    method, mode = str(attrs.method), str(attrs.coordinate_transformation_mode)
    rounding = str(attrs.rounding_method) or ("round" if mode == "align_corners" else "floor")
    # TVM replaces the float coordinate by an integer division for whole upscaling factors
    int_div = (method == "nearest_neighbor" and mode == "asymmetric" and rounding == "floor"
               and n_out % n_in == 0 and n_out / n_in <= 1 / (1e-5 * n_in + 1e-5))  # fmt: skip
    matrix = np.zeros((n_out, n_in))
    for x in range(n_out):
        coord = _source_coordinate(x, n_in, n_out, mode, *roi)
        if mode == "tf_crop_and_resize" and not 0 <= coord <= n_in - 1:
            continue  # the extrapolation value: no input
        if method == "nearest_neighbor":
            taps = [(x // (n_out // n_in) if int_div else _nearest_index(coord, rounding), 1.0)]
        elif method == "linear":
            first = int(np.floor(coord))
            t = coord - _F32(first)
            taps = [(first, _F32(1) - t), (first + 1, t)]
        elif method == "cubic":
            first = int(np.floor(coord)) - 1
            weights = _cubic_weights(coord - np.floor(coord), float(attrs.cubic_alpha), first,
                                     n_in, bool(int(attrs.cubic_exclude)))  # fmt: skip
            taps = list(zip(range(first, first + 4), weights))
        else:
            raise GradientError(f"Gradient: relax.image.resize2d has no rule for method={method!r}")
        for index, weight in taps:  # reads outside the image are clamped to the border
            matrix[x, min(max(index, 0), n_in - 1)] += float(weight)
    return matrix


@register_gradient("relax.image.resize2d")
def resize2d_grad(orig_var, orig_call, output_grad, ctx):
    """Forward: ``y = resize2d(x, size, method, coordinate_transformation_mode, ...)``;
    backward: ``[R_h^T g R_w, no_grad]``, R the interpolation matrices of the two axes."""
    x, size = orig_call.args
    attrs = orig_call.attrs
    name, dtype, layout = "relax.image.resize2d", _ty.dtype_of(x), str(attrs.layout)
    g = relayout(output_grad, layout, "NCHW", name)  # refuses packed layouts
    if _ty.dtype_of(output_grad) != dtype:  # out_dtype
        g = astype(g, dtype)
    ins, outs = (static_dims(t, name, [layout.index(c) for c in "HW"]) for t in (x, orig_var))
    roi = [float(v) for v in attrs.roi]  # start_h, start_w, end_h, end_w
    rows, cols = (resize_matrix(ins[i], outs[i], attrs, (roi[i], roi[i + 2])) for i in range(2))
    rows_t = relax.const(np.ascontiguousarray(rows.T).astype(dtype), dtype)
    grad = matmul(matmul(rows_t, g), relax.const(cols.astype(dtype), dtype))
    return [relayout(grad, "NCHW", layout, name), no_grad(size)]
