"""Schedule steps for relaxgrad.compile: a rule per PrimFunc, chosen by trying them in order.

:class:`ScheduleGPU` (dlight's CUDA rules plus :class:`FullReduction`) and :class:`ScheduleCPU`
(:class:`TiledMatmul`, :class:`RowLocal`, :class:`ColumnLocal`, :class:`ParallelLoops`) share one
mechanism: a rule that raises or whose schedule fails verification falls through to the next, and
the choice is recorded in ``choices`` / ``errors``. Before legalization, CPU builds compute a
gradient that is zero but at a few rows of a sequence (a classifier's first token) on those rows
(:class:`RowSparseGradients`), drop a float's round trips through a wider float
(:class:`ExactCastPairs`), write an overlapping max pool's gradient as a scatter
(:class:`WindowScatter`), small whole powers as products (:class:`IntegerPowers`) and rewrite
convolutions into matmuls
(:class:`ConvToMatmul`), bfloat16 matmuls into oneDNN calls (:class:`Bf16MatmulToOneDNN`), large
float32 matmuls into OpenBLAS calls (:class:`MatmulToBLAS`), batch statistics
into means of the gradient's form (:class:`ShareStatistics`) and means into sums that fuse with the
products they reduce (:class:`MeanAsSum`), float32 sums over rows accumulate in float64
(:class:`WideColumnSums`), then legalize with each operator's legalization reused
for calls of the same kind (:class:`LegalizeOpsOnce`); before fusion, cheap elementwise producers
read twice are copied for each reader (:class:`DuplicateCheapProducers`) and reductions along rows
may fuse with their readers (:class:`FuseRowReductions`), and ``FuseOps`` emits each kernel
where its last operation was (:class:`FuseOpsInOrder`); after fusion, a sum over the rows joins
the elementwise kernel that computes its input for other readers too (:class:`FuseColumnSums`), and
kernels over the same rows merge (:class:`FuseRowGroups`, scheduled by :class:`RowColumnLocal`)
and a Trainer's optimizer step writes the new parameters and state over the old
(:class:`UpdateInPlace`);
after scheduling, vectorized loops over ``sinh`` and ``cosh`` or blocks of several results run
serially (:class:`SerialVectorLoops`: TVM 0.27 cannot build the first, builds the second wrong) and
float32 ``exp``, ``tanh``, ``sigmoid`` and ``erf`` become polynomials LLVM vectorizes
(:class:`FastMath`).
"""

from .accumulate import WideColumnSums
from .blas import MatmulToBLAS
from .casts import ExactCastPairs
from .columns import ColumnLocal, FuseColumnSums
from .conv import ConvToMatmul
from .cpu import ParallelLoops, TiledMatmul
from .duplicate import DuplicateCheapProducers
from .fast_math import FastMath
from .fold import FoldConstantCalls
from .fold_ops import FoldConstantOps
from .gpu import FullReduction
from .groups import FuseRowGroups, RowColumnLocal
from .inplace import UpdateInPlace
from .legalize import LegalizeOpsOnce
from .losses import NllLossGradAsMask
from .means import MeanAsSum
from .onednn import Bf16MatmulToOneDNN
from .order import FuseOpsInOrder
from .powers import IntegerPowers
from .recomputed import HoldRecomputed, ReleaseRecomputed
from .reversed import KeepReversedReadsApart
from .rows import FuseRowReductions, RowLocal
from .scatter import WindowScatter
from .serial import SerialVectorLoops
from .siblings import MergeSiblingKernels
from .sparse_rows import RowSparseGradients
from .statistics import ShareStatistics
from .step import ScheduleCPU, ScheduleGPU, default_cpu_rules, default_gpu_rules
from .views import ReshapeOutputs

__all__ = [
    "Bf16MatmulToOneDNN",
    "ColumnLocal",
    "ConvToMatmul",
    "DuplicateCheapProducers",
    "ExactCastPairs",
    "FastMath",
    "FoldConstantCalls",
    "FoldConstantOps",
    "FullReduction",
    "FuseColumnSums",
    "FuseOpsInOrder",
    "FuseRowGroups",
    "FuseRowReductions",
    "HoldRecomputed",
    "IntegerPowers",
    "KeepReversedReadsApart",
    "LegalizeOpsOnce",
    "MatmulToBLAS",
    "MeanAsSum",
    "MergeSiblingKernels",
    "NllLossGradAsMask",
    "ShareStatistics",
    "ParallelLoops",
    "ReleaseRecomputed",
    "ReshapeOutputs",
    "RowColumnLocal",
    "RowLocal",
    "RowSparseGradients",
    "ScheduleCPU",
    "ScheduleGPU",
    "SerialVectorLoops",
    "TiledMatmul",
    "WideColumnSums",
    "UpdateInPlace",
    "WindowScatter",
    "default_cpu_rules",
    "default_gpu_rules",
]
