import pytest
from tvm.relax import op

from relaxgrad import GradientError

from ._spec import Case, ids, run_case

# resize2d computes in float32 whatever the dtype; it is linear in x, so a large step is exact.
LINEAR = {"eps": 0.1, "tol": 1e-4}


def _resize(x_shape, size, **attrs):
    return {"fn": lambda x: op.image.resize2d(x, size, **attrs), "shapes": [x_shape], **LINEAR}


CASES = [
    Case("resize2d_linear_up", **_resize((1, 2, 3, 4), (5, 7))),
    Case("resize2d_linear_down", **_resize((2, 1, 6, 5), (4, 2))),
    Case("resize2d_linear_align_corners", **_resize((1, 2, 3, 4), (5, 6),
                                                    coordinate_transformation_mode="align_corners")),
    Case("resize2d_linear_asymmetric", **_resize((1, 1, 4, 3), (6, 5),
                                                 coordinate_transformation_mode="asymmetric")),
    Case("resize2d_linear_pytorch_half_pixel", **_resize(
        (1, 1, 4, 3), (1, 5), coordinate_transformation_mode="pytorch_half_pixel")),
    Case("resize2d_linear_tf_crop_and_resize", **_resize(
        (1, 1, 4, 5), (3, 4), roi=(0.1, -0.2, 0.9, 0.8),
        coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=0.5)),
    Case("resize2d_linear_nhwc", **_resize((1, 3, 4, 2), (5, 3), layout="NHWC")),
    Case("resize2d_nearest_up", **_resize((1, 2, 3, 4), (6, 8), method="nearest_neighbor")),
    Case("resize2d_nearest_down_half_pixel", **_resize((1, 1, 6, 5), (3, 2),
                                                       method="nearest_neighbor")),
    Case("resize2d_nearest_asymmetric_floor", **_resize(
        (1, 1, 3, 2), (6, 5), method="nearest_neighbor", rounding_method="floor",
        coordinate_transformation_mode="asymmetric")),
    Case("resize2d_nearest_align_corners", **_resize(
        (1, 1, 3, 4), (5, 7), method="nearest_neighbor",
        coordinate_transformation_mode="align_corners")),
    Case("resize2d_nearest_tf_half_pixel_ceil", **_resize(
        (1, 1, 4, 5), (7, 3), method="nearest_neighbor", rounding_method="ceil",
        coordinate_transformation_mode="tf_half_pixel_for_nn")),
    Case("resize2d_nearest_round_prefer_ceil", **_resize(
        (1, 1, 4, 2), (8, 5), method="nearest_neighbor", rounding_method="round_prefer_ceil")),
    Case("resize2d_cubic", **_resize((1, 1, 4, 5), (6, 3), method="cubic")),
    Case("resize2d_cubic_exclude", **_resize((1, 1, 4, 5), (6, 7), method="cubic",
                                             cubic_exclude=1, cubic_alpha=-0.5)),
    Case("resize2d_float32", **_resize((1, 2, 3, 4), (5, 7)), dtype="float32"),
    Case("resize2d_float16", **{**_resize((1, 2, 3, 4), (5, 7), method="nearest_neighbor"),
                                "tol": None}, dtype="float16"),
]


@pytest.mark.parametrize("case", CASES, ids=ids(CASES))
def test_numeric(case):
    run_case(case)


def test_resize2d_packed_layout_has_no_rule():
    case = Case("packed", **_resize((1, 1, 3, 3, 4), (5, 5), layout="NCHW4c"))
    with pytest.raises(GradientError, match="relax.image.resize2d .*layout NCHW4c"):
        run_case(case)
