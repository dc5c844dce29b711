"""The gathers and scatters ConvToMatmul writes (im2col, col2im, the max-pool gradient's
unpooling) and the overlapping max-pool gradient's window argmax read nothing outside their
buffers: each kernel runs on operands laid against an
unreadable page, before and after, and gives the values it gives on ordinary memory.

A select evaluates both of its operands, and TVM's simplifier drops the clamps of a read in a
select's first operand (it knows the select's condition there): im2col read one element before
its input, which crashed ResNet-50's training step where the input began a page. The kernels run
in a child process, so that a crash fails the test instead of killing the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap

# The child: build each kernel of the rewritten adjoints alone, run it on operands that start
# right after, or end right at, a PROT_NONE page, and compare with a run on numpy's memory.
CHILD = textwrap.dedent(
    """
    import ctypes, mmap, sys
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.relax import op
    import relaxgrad
    from relaxgrad.pipeline import host_target
    from relaxgrad.schedules import ScheduleCPU
    from relaxgrad.schedules.conv import ConvToMatmul
    from relaxgrad.schedules._common import static_shape
    from relaxgrad._ty import dtype_of

    PAGE = mmap.PAGESIZE
    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    KEEP = []

    def fenced(values, at_end):
        # a copy of `values` whose first byte follows an unreadable page, or whose last byte
        # precedes one (as near as 64-byte alignment allows: the cases' gather inputs are
        # multiples of 64 bytes)
        nbytes = values.nbytes
        pages = -(-nbytes // PAGE)
        area = mmap.mmap(-1, (pages + 2) * PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(area))
        assert libc.mprotect(base, PAGE, 0) == 0
        assert libc.mprotect(base + (pages + 1) * PAGE, PAGE, 0) == 0
        start = PAGE + ((pages * PAGE - nbytes) // 64 * 64 if at_end else 0)
        KEEP.append(area)
        array = np.frombuffer(area, values.dtype, values.size, start).reshape(values.shape)
        array[...] = values
        return tvm.runtime.from_dlpack(array)

    def adjoint(body, params):
        bb = relax.BlockBuilder()
        vs = [relax.Var(n, relax.TensorType(s, "float32")) for n, s in params]
        with bb.function("main", vs):
            with bb.dataflow():
                out = bb.emit_output(body(*vs))
            bb.emit_func_output(out)
        return relaxgrad.Gradient("main")(bb.get())

    def conv(x_shape, w_shape, **attrs):
        def body(x, w):
            y = op.nn.conv2d(x, w, **attrs)
            return op.sum(op.multiply(y, y))
        return adjoint(body, [("x", x_shape), ("w", w_shape)])

    def pool(x_shape, window, strides=None, padding=0):
        def body(x):
            y = op.nn.max_pool2d(op.nn.relu(x), window, strides or window, padding)
            return op.sum(op.multiply(y, y))
        return adjoint(body, [("x", x_shape)])

    CASES = {
        # each image in turn (the forward's im2col, col2im), without BLAS's summed form too
        "conv 3x3": (conv((2, 16, 8, 8), (4, 16, 3, 3), padding=1), {}),
        "conv 3x3, transposed im2col": (conv((2, 16, 8, 8), (4, 16, 3, 3), padding=1),
                                        dict(summed_batches=False)),
        "conv 3x3 stride 2, uneven padding": (
            conv((2, 16, 7, 6), (4, 16, 3, 2), strides=2, padding=(1, 0, 2, 1)), {}),
        "conv dilated": (conv((1, 16, 9, 9), (3, 16, 3, 3), dilation=2, padding=1), {}),
        # the batch in the matmuls' columns (small images)
        "conv, batch in columns": (conv((4, 8, 6, 6), (16, 8, 3, 3), padding=1),
                                   dict(summed_batches=True, batch_columns_below=1000)),
        "max pool, windows not tiling": (pool((2, 8, 9, 7), 2), {}),
        # overlapping windows (ResNet's stem): the rule's window argmax
        "max pool 3x3, stride 2, padding 1": (pool((2, 8, 8, 8), 3, 2, 1), {}),
    }

    KERNELS = ("im2col", "col2im", "max_unpool", "window_argmax")
    rng = np.random.default_rng(0)
    for name, (mod, options) in CASES.items():
        rewritten = ConvToMatmul(**options)(mod)
        calls = [b.value for block in rewritten["main_adjoint"].body.blocks
                 for b in block.bindings if isinstance(b.value, relax.Call)
                 and b.value.op.same_as(tvm.ir.Op.get("relax.call_tir"))
                 and b.value.args[0].name_hint.startswith(KERNELS)]
        assert calls, name
        for call in calls:
            gv, operands = call.args[0], list(call.args[1].fields)
            kernel = tvm.IRModule({"main": rewritten[gv].with_attr("global_symbol", "main")})
            with host_target():  # as relaxgrad.compile schedules the rule's kernels
                kernel = ScheduleCPU()(kernel)
            built = tvm.compile(kernel, host_target())
            shapes = [static_shape(e) for e in operands + [call]]
            dtypes = [dtype_of(e) for e in operands + [call]]
            inputs = [(rng.standard_normal(s) * 4).astype(d) for s, d in
                      zip(shapes[:-1], dtypes[:-1])]
            want = tvm.runtime.tensor(np.zeros(shapes[-1], dtypes[-1]))
            built["main"](*[tvm.runtime.tensor(a) for a in inputs], want)
            for at_end in (False, True):
                out = fenced(np.zeros(shapes[-1], dtypes[-1]), at_end)
                built["main"](*[fenced(a, at_end) for a in inputs], out)
                np.testing.assert_array_equal(out.numpy(), want.numpy())
            print("ok", name, gv.name_hint, flush=True)
    print("done")
    """
)


def test_gathers_read_only_their_buffers():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("done"), (
        f"exit {done.returncode} after:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    )
    kernels = [line for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert any(" im2col" in k for k in kernels) and any(" col2im" in k for k in kernels)
    assert any(" max_unpool" in k for k in kernels) and any(" window_argmax" in k for k in kernels)
