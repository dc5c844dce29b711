"""Mixed precision across the model zoo: each Hugging Face architecture of ``tests/zoo`` (tiny
configs) trained with ``Trainer(precision="bf16" | "fp16")``, its first gradients against
PyTorch's float64 ones and PyTorch's own autocast's.

    python bench/zoo_precision.py                      # every model, bf16
    python bench/zoo_precision.py --precision fp16 --models llama qwen2 vit

Per model it prints the parameter whose gradient comes nearest its bound, and how near: its
distance to float64's gradient (norm-wise) over the bound ``--slack`` times autocast's distance
plus ``--rtol`` of the whole gradient's norm (for gradients that are rounding noise); how many
parameters are over their bound; whether any gradient is not finite; the loss against
autocast's and float64's; and the import + compile time. In fp16 the gradients are taken at a
loss scale of 1, as autocast's without a ``GradScaler`` (at the Trainer's first scale, 2^16,
they overflow, and the step would be skipped). A model that fails to import or compile is
reported with its error; where PyTorch's autocast itself fails (DeBERTa's mask overflows bf16
there), the peer is PyTorch with the whole model in the low dtype. The suite checks a few of
these architectures (``tests/zoo/test_zoo_precision.py``); this runs them all (10-80 s each
on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import cpu_model  # noqa: E402

from relaxgrad.training import SGD, CrossEntropyLoss, Trainer, from_torch  # noqa: E402
from tests.zoo.models import ZOO  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def torch_gradients(module, inputs, y, dtype, autocast=None):
    """PyTorch's loss and gradients (float64 arrays) of ``module``'s cross-entropy in ``dtype``,
    the forward under ``torch.autocast`` of the dtype ``autocast`` when given."""
    twin = copy.deepcopy(module).to(dtype).train()
    given = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        logits = twin(*given)
    loss = torch.nn.functional.cross_entropy(logits.float(), y)
    loss.backward()
    return loss.item(), {n: p.grad.double().numpy() for n, p in twin.named_parameters()
                         if p.requires_grad}  # fmt: skip


def check(name: str, precision: str, slack: float, rtol: float, verbose: bool = False,
          seed: int = 0) -> dict:
    """One model's comparison (see the module docstring)."""
    module, inputs, y = ZOO[name](np.random.default_rng(seed))
    y = torch.from_numpy(y)
    start = time.perf_counter()
    model = from_torch(module, inputs)
    trainer = Trainer.for_model(model, CrossEntropyLoss(), SGD(0.1), precision=precision,
                                cache=False)
    compile_s = time.perf_counter() - start
    if trainer.loss_scale is not None:  # fp16: unscaled, as autocast's without a GradScaler
        trainer.loss_scale = 1.0  # (at 2^16 the first gradients overflow, as GradScaler's do)
    loss, ours = trainer.gradients(tuple(t.numpy() for t in inputs), y.numpy())
    loss64, exact = torch_gradients(module, inputs, y, torch.float64)
    try:
        loss_ac, autocast = torch_gradients(module, inputs, y, torch.float32, DTYPES[precision])
        peer = "autocast"
    except RuntimeError as err:  # (DeBERTa's mask overflows bf16 under autocast)
        print(f"  {name}: PyTorch's autocast failed ({str(err).splitlines()[0][:80]}); "
              f"the peer is PyTorch with the whole model in {precision}")
        loss_ac, autocast = torch_gradients(module, inputs, y, DTYPES[precision])
        peer = precision
    scale = np.sqrt(sum(np.sum(g**2) for g in exact.values()))
    worst, worst_name, over, nonfinite = 0.0, "", [], []
    for key, g in ours.items():
        if verbose:
            print(f"  {key}: ours {np.linalg.norm(g - exact[key]):.3e}, autocast "
                  f"{np.linalg.norm(autocast[key] - exact[key]):.3e}, norm "
                  f"{np.linalg.norm(exact[key]):.3e} (of all {scale:.3e})")
        g = g.astype("float64")
        if not np.isfinite(g).all():
            nonfinite.append(key)
            continue
        error = np.linalg.norm(g - exact[key])
        theirs = np.linalg.norm(autocast[key] - exact[key])
        ratio = error / (slack * theirs + rtol * scale)  # of the bound: over it above 1
        if error > slack * theirs + rtol * scale:
            over.append(key)
            if ratio > worst:
                worst, worst_name = ratio, key
        elif not over and ratio > worst:
            worst, worst_name = ratio, key
    return dict(name=name, peer=peer, compile_s=compile_s, worst=worst, worst_name=worst_name,
                over=over, nonfinite=nonfinite, loss=loss, loss_autocast=loss_ac, loss64=loss64,
                params=len(ours), missing=sorted(set(exact) - set(ours)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--models", nargs="*", default=list(ZOO))
    parser.add_argument("--slack", type=float, default=2.0)
    parser.add_argument("--rtol", type=float, default=1e-3)
    parser.add_argument("--verbose", action="store_true", help="every parameter's errors")
    parser.add_argument("--seed", type=int, default=0, help="of the batch (the weights: 0)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"CPU: {cpu_model()}; precision {args.precision}; slack {args.slack}, "
          f"rtol {args.rtol}")
    print(f"{'model':20s} {'params':>6s} {'over':>5s} {'worst error / bound':>30s} "
          f"{'loss':>9s} {'autocast':>9s} {'float64':>9s} {'compile s':>9s}")
    failed = []
    for name in args.models:
        try:
            r = check(name, args.precision, args.slack, args.rtol, args.verbose, args.seed)
        except Exception as err:  # noqa: BLE001 - reported, the sweep goes on
            failed.append(name)
            print(f"{name:20s} FAILED: {type(err).__name__}: {str(err).splitlines()[0][:200]}")
            traceback.print_exc(limit=3)
            continue
        bad = r["over"] or r["nonfinite"] or r["missing"]
        if bad:
            failed.append(name)
        print(f"{name:20s} {r['params']:6d} {len(r['over']):5d} "
              f"{r['worst']:8.2f} {r['worst_name'][-21:]:>21s} {r['loss']:9.5f} "
              f"{r['loss_autocast']:9.5f} {r['loss64']:9.5f} {r['compile_s']:9.1f}"
              + (f"  NON-FINITE {r['nonfinite']}" if r["nonfinite"] else "")
              + (f"  MISSING {r['missing']}" if r["missing"] else "")
              + (f"  OVER {r['over'][:4]}" if r["over"] else ""), flush=True)
    print(f"{len(args.models) - len(failed)}/{len(args.models)} within bounds; "
          f"outside: {failed}")


if __name__ == "__main__":
    main()
