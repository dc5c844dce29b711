"""The ``relaxgrad`` command line.

``relaxgrad grad FILE.py --func main [--require-grads x w]`` prints the adjoint as TVMScript
(with ``--split``: ``main_fwd``, ``main_bwd`` and the residuals passed between them);
``relaxgrad check FILE.py --func main`` checks its gradients numerically (exit 1 on failure);
``relaxgrad memory FILE.py --func main [--adjoint]`` prints a function's estimated and planned
memory;
``relaxgrad demo`` trains the digits MLP on CPU and prints the accuracy (data parallel under
``torchrun --nproc-per-node N -m relaxgrad.cli demo``).

``FILE.py`` defines an ``IRModule`` (e.g. an ``@I.ir_module`` class) at top level; with several,
pick one with ``--module NAME`` (which may also name a function returning one). The file's
folder is put on ``sys.path`` first, so it can import modules beside it.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Sequence

import tvm
from tvm import relax

from .errors import GradientError
from .testing import check_gradients, random_inputs
from .transforms import Gradient

_FILE_MODULE = "__relaxgrad_cli__"


def load_module(path: str, name: str | None = None) -> tvm.IRModule:
    """The IRModule defined at top level of the Python file ``path``.

    Parameters
    ----------
    path : str
        The Python file. Its folder is put on ``sys.path`` while it runs, so it can import
        modules that sit beside it.
    name : str, optional
        The top-level name of the IRModule, or of a function returning one; required when the
        file defines several IRModules.

    Returns
    -------
    tvm.IRModule
        The module.

    Raises
    ------
    GradientError
        If the file does not exist, or defines no IRModule (or no ``name``), or several
        without ``name``.
    """
    if not os.path.isfile(path):
        raise GradientError(f"{path}: no such file")
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    try:
        namespace = _run_file(path)
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    modules = {k: v for k, v in namespace.items() if isinstance(v, tvm.IRModule)}
    if name is not None:
        value = namespace.get(name)
        if callable(value) and not isinstance(value, tvm.IRModule):
            value = value()
        if not isinstance(value, tvm.IRModule):
            raise GradientError(f"{path} defines no IRModule named {name!r} (it has: "
                                f"{', '.join(sorted(modules)) or 'none'})")
        return value
    if not modules:
        functions = sorted(k for k, v in namespace.items()
                           if callable(v) and getattr(v, "__module__", None) == _FILE_MODULE)
        hint = (f"; if one of its functions ({', '.join(functions)}) returns one, name it with "
                "--module NAME" if functions else "")
        raise GradientError(f"{path} defines no IRModule at top level (define one, e.g. an "
                            f"@I.ir_module class){hint}")
    if len(modules) != 1:
        raise GradientError(f"{path} defines {len(modules)} IRModules "
                            f"({', '.join(sorted(modules))}); choose one with --module NAME")
    return next(iter(modules.values()))


def _run_file(path: str) -> dict:
    """Run ``path`` as module ``__relaxgrad_cli__`` (kept in ``sys.modules``, so TVMScript can
    parse functions defined in it even after it ran); returns its namespace."""
    spec = importlib.util.spec_from_file_location(_FILE_MODULE, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_FILE_MODULE] = module
    spec.loader.exec_module(module)
    return vars(module)


def _vars_by_name(func: relax.Function, names: Sequence[str], func_name: str) -> list:
    known = {p.name: p for p in func.params}
    for block in func.body.blocks:
        for binding in block.bindings:
            known.setdefault(binding.var.name, binding.var)
    missing = [n for n in names if n not in known]
    if missing:
        raise GradientError(f"function {func_name} has no var named {', '.join(missing)}")
    return [known[n] for n in names]


def _grad(args) -> int:
    mod = load_module(args.file, args.module)
    if args.func not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise GradientError(f"{args.file}: no function named {args.func!r} in the module")
    require = None
    if args.require_grads:
        require = _vars_by_name(mod[args.func], args.require_grads, args.func)
    if getattr(args, "split", False):
        from .transforms.split import split_info

        out = Gradient(args.func, require, args.target_index, split=True)(mod)
        if args.all:
            print(out.script())
        else:
            print(out[args.func + "_fwd"].script())
            print(out[args.func + "_bwd"].script())
        print(split_info(out, args.func))
        return 0
    out = Gradient(args.func, require, args.target_index)(mod)
    print(out.script() if args.all else out[args.func + "_adjoint"].script())
    return 0


def _check(args) -> int:
    mod = load_module(args.file, args.module)
    params = list(mod[args.func].params)
    wrt = None
    if args.require_grads:
        index = {p.name: i for i, p in enumerate(params)}
        unknown = [n for n in args.require_grads if n not in index]
        if unknown:
            raise GradientError(f"check: {', '.join(unknown)} are not parameters of {args.func}")
        wrt = [index[n] for n in args.require_grads]
    inputs = random_inputs(mod[args.func], args.seed, args.low, args.high)
    result = check_gradients(mod, args.func, inputs, wrt=wrt, target_index=args.target_index,
                             seed=args.seed, tol=args.tol)
    print(result)
    print("PASS" if result.ok else "FAIL")
    return 0 if result.ok else 1


def _memory(args) -> int:
    from .analysis import estimate_activation_bytes, planned_memory_split

    mod = load_module(args.file, args.module)
    if args.func not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise GradientError(f"{args.file}: no function named {args.func!r} in the module")
    func_name = args.func
    if args.adjoint:
        mod, func_name = Gradient(args.func)(mod), args.func + "_adjoint"
    estimate = estimate_activation_bytes(mod[func_name])
    split = planned_memory_split(mod, func_name, args.target)
    print(f"{func_name}: peak live intermediates, estimated before lowering: {estimate} bytes")
    print(f"{func_name}: planned storage after lowering for {args.target}: "
          f"outputs {split['outputs']} + other {split['other']} = {split['total']} bytes")
    return 0


def _demo(args) -> int:
    from .pipeline import host_target
    from .training.demo import run_demo

    return run_demo(epochs=args.epochs, target=host_target())


def build_parser() -> argparse.ArgumentParser:
    description = __doc__.split("\n\n")[0].replace("``", "")
    parser = argparse.ArgumentParser(prog="relaxgrad", description=description)
    sub = parser.add_subparsers(dest="command", required=True)

    def add_common(p):
        p.add_argument("file", help="Python file defining an IRModule")
        p.add_argument("--func", default="main", help="function to differentiate")
        p.add_argument("--module", help="name of the IRModule in FILE (when it has several)")
        p.add_argument("--require-grads", nargs="*", metavar="VAR",
                       help="vars to differentiate with respect to (default: all parameters)")
        p.add_argument("--target-index", type=int, default=0)

    grad = sub.add_parser("grad", help="print the adjoint function as TVMScript")
    add_common(grad)
    grad.add_argument("--all", action="store_true", help="print the whole module")
    grad.add_argument("--split", action="store_true",
                      help="print <func>_fwd and <func>_bwd and the residuals they pass")
    grad.set_defaults(run=_grad)

    check = sub.add_parser("check", help="check gradients against finite differences")
    add_common(check)
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--low", type=float, default=-1.0, help="random inputs' lower bound")
    check.add_argument("--high", type=float, default=1.0, help="random inputs' upper bound")
    check.add_argument("--tol", type=float, help="tolerance (default: from the dtype)")
    check.set_defaults(run=_check)

    memory = sub.add_parser("memory", help="print estimated and planned memory of a function")
    memory.add_argument("file", help="Python file defining an IRModule")
    memory.add_argument("--func", default="main", help="function to measure")
    memory.add_argument("--module", help="name of the IRModule in FILE (when it has several)")
    memory.add_argument("--adjoint", action="store_true",
                        help="measure the adjoint of FUNC (relaxgrad.Gradient) instead")
    memory.add_argument("--target", default="llvm", help="target to lower for")
    memory.set_defaults(run=_memory)

    demo = sub.add_parser("demo", help="train an MLP on scikit-learn's digits and print accuracy")
    demo.add_argument("--epochs", type=int, default=20)
    demo.set_defaults(run=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except GradientError as err:
        print(f"relaxgrad: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
