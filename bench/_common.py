"""Helpers shared by the benches (``from _common import ...``: each bench runs as a script,
with ``bench/`` first on ``sys.path``)."""

from __future__ import annotations

import statistics

import torch


class Logits(torch.nn.Module):
    """A Hugging Face model as a module of one input returning its logits (``model(**{key:
    x}).logits``), flattened to ``(rows, classes)`` when ``flat`` (a language model's tokens)."""

    def __init__(self, model, key: str = "pixel_values", flat: bool = False):
        super().__init__()
        self.model, self.key, self.flat = model, key, flat

    def forward(self, x):
        logits = self.model(**{self.key: x}).logits
        return logits.reshape(-1, logits.shape[-1]) if self.flat else logits


def cpu_model() -> str:
    """This CPU's model name and its bf16 features (``/proc/cpuinfo``), for every bench's
    header: figures differ between machines."""
    from relaxgrad.schedules import onednn

    bf16 = sorted({"avx512_bf16", "amx_bf16", "avx512_fp16"} & onednn.cpu_flags())
    return f"{onednn.cpu_model()} ({', '.join(bf16) if bf16 else 'no bf16 instructions'})"


def bf16_products() -> str:
    """What relaxgrad's bf16 products run on this machine: oneDNN (and the ISA it picked), or
    OpenBLAS's sgemm of the float32 conversions."""
    from relaxgrad.schedules import onednn

    if onednn.available() and onednn.bf16_kernel() == "onednn":
        return f"oneDNN, ISA {onednn.isa()}"
    return "OpenBLAS sgemm of the float32 conversions"


def torch_adam_step(net, x: torch.Tensor, target: torch.Tensor, parameters=None,
                    autocast: torch.dtype | None = None):
    """One PyTorch training step of ``net`` on ``(x, target)`` as a function returning the loss:
    cross-entropy, backward and Adam (lr 1e-3) over ``parameters`` (default: ``net``'s); the
    forward under ``torch.autocast("cpu", autocast)`` when given."""
    optimizer = torch.optim.Adam(net.parameters() if parameters is None else parameters, lr=1e-3)

    def step() -> float:
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            logits = net(x)
        loss = torch.nn.functional.cross_entropy(logits.float(), target)
        loss.backward()
        optimizer.step()
        return float(loss.detach())

    return step


def loss_function(trainer):
    """The Trainer's ``<func>_loss`` (the forward pass and loss its adjoint differentiates),
    compiled alone for the Trainer's target and device: the Trainer builds only the functions
    it calls."""
    import tvm

    import relaxgrad
    from relaxgrad._module import reachable

    name = f"{trainer.func_name}_loss"
    built = relaxgrad.compile(reachable(trainer.mod, [name]), trainer.target, cache=False)
    return tvm.relax.VirtualMachine(built, trainer.device)[name]


def adjoint_over_forward(forward, adjoint, args, rounds: int) -> float:
    """The median time of ``adjoint(*args)`` over that of ``forward(*args)``, the two called in
    turn ``rounds`` times, so that load from other processes falls on both alike."""
    import time

    times = {forward: [], adjoint: []}
    for _ in range(rounds):
        for func, spent in times.items():
            start = time.perf_counter()
            func(*args)
            spent.append(time.perf_counter() - start)
    return statistics.median(times[adjoint]) / statistics.median(times[forward])


def spread(values) -> tuple[float, float, float]:
    """``(median, min, max)`` of ``values``."""
    values = list(values)
    return statistics.median(values), min(values), max(values)


def fmt(t: tuple[float, float, float], scale: float = 1e3, digits: int = 2) -> str:
    """A ``(median, min, max)`` triple, scaled, as ``"median (min-max)"``."""
    median, low, high = (v * scale for v in t)
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def rss_mib(key: str = "VmRSS") -> float:
    """This process's resident memory now (``VmRSS``) or its peak since the last
    :func:`reset_peak_rss` (``VmHWM``), from ``/proc/self/status``."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak_rss() -> None:
    """Start ``VmHWM`` again from the current RSS (Linux's ``clear_refs``), so that
    ``rss_mib("VmHWM")`` is the peak of what follows."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def run_json_child(args: list[str], timeout: float, prefix: str) -> dict:
    """Run ``args`` (a bench's child) with empty compile caches (inductor's and relaxgrad's, in
    a temporary folder) and return the JSON of its last line of output, or ``{"error": ...}``
    with the last line of its stderr (and ``stderr``'s end) when it fails or times out."""
    import json
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix=prefix) as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
                   RELAXGRAD_CACHE_DIR=os.path.join(cache, "relaxgrad"))
        try:
            done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        return json.loads(lines[-1])
    errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return {"error": f"exit {done.returncode}: {errors[-1] if errors else '?'}",
            "stderr": done.stderr[-4000:]}
