"""Training steps at published model sizes: relaxgrad against PyTorch eager and
``torch.compile``, with each one's compile time and peak memory.

Models (Hugging Face ``transformers`` configs, random weights, no hub access; batch
``--batch``, default 8):

- ``bert``: ``BertConfig()`` (BERT-base: 12 layers, hidden 768, 12 heads) as
  ``BertForSequenceClassification`` with 2 labels, on sequences of 128 tokens;
- ``resnet50``: ``ResNetConfig()`` (ResNet-50) as ``ResNetForImageClassification`` with 1000
  labels, on 3x224x224 images (batch norm in training mode);
- ``gpt2``: ``GPT2Config()`` (GPT-2 small: 12 layers, hidden 768, vocabulary 50257, the LM
  head tied to the token embedding) as ``GPT2LMHeadModel`` on sequences of 256 tokens, with
  the language-modeling loss: the mean cross-entropy of each token's logits against the next
  token (the per-token logits flattened to ``(batch * 256, 50257)``, as the zoo trains LM heads).

Every dropout probability is 0, so that the three frameworks compute the same steps (their
losses after the same steps are printed side by side as a check), and attention is
transformers' ``"eager"`` implementation in all three (relaxgrad's ``from_torch`` traces it;
PyTorch runs the same module). The step is forward, loss (cross-entropy), backward and Adam
(lr 1e-3): relaxgrad's ``Trainer.step``; PyTorch's ``zero_grad``, ``cross_entropy``,
``backward`` and ``Adam.step``, the model eager or wrapped in ``torch.compile`` (inductor, CPU;
the optimizer step stays eager). All run with ``--threads`` threads (TVM_NUM_THREADS,
``torch.set_num_threads``, inductor's ``compile_threads``) and denormals flushed to zero.

Below the table, each framework's line names the kernels its matrix products ran: OpenBLAS's
core for relaxgrad (``OPENBLAS_CORETYPE``, where set, pins it: ``Haswell`` runs AVX2 kernels on
an AVX-512 CPU, at about half of their speed), PyTorch's CPU capability for the others (MKL and
oneDNN dispatch on it, whatever ``OPENBLAS_CORETYPE`` says), and relaxgrad's adjoint / forward
time (the loss's adjoint against the loss alone, alternately, on the step's batch).

Each (model, framework) runs in a child process of its own: it builds the model (seed 0), the
batch and the targets, compiles, takes one untimed first step and ``--steps`` timed steps, and
prints a line of JSON. *Compile* is relaxgrad's ``from_torch`` plus the ``Trainer``'s
construction with the compile cache off (a real compile), and for ``torch.compile`` the time of
its first step (inductor compiles while it runs it, the step included); each child starts with
empty compile caches (a fresh ``TORCHINDUCTOR_CACHE_DIR``; inductor would otherwise load the
previous round's kernels). *Peak RSS* is the child's ``ru_maxrss``: the whole process, Python,
torch and transformers included (relaxgrad's child also holds the PyTorch model ``from_torch``
read, and TVM). Below the table, *built* is the peak after building the PyTorch model, before
any framework ran, *compiled* the peak after the compile (relaxgrad's; the others' is the
built one), *before the first step* the RSS then, and *peak of the steps* the largest RSS
during the steps (Linux's ``VmHWM``, reset before the first step). relaxgrad's child drops the
PyTorch module once the Trainer holds the weights, as a user training with relaxgrad can
(``trainer.state_dict()`` returns them). Inductor compiles its kernels in worker processes whose
memory is not in its RSS (their largest peak is printed as ``workers``). While a child's timed
steps run it measures the CPU time the rest of the machine took (``/proc/stat`` less its own),
printed as *others' load* in cores (the largest over its rounds): PyTorch's thread pool suffers
most from a busy core (its 2 threads meet at every op; on 2 cores with one taken by another
job, tiny BERT's eager step took 20x longer).

What is interleaved: per model, ``--runs`` rounds, each a child of every framework in turn
(eager, ``torch.compile``, relaxgrad, the order rotated each round), so that load from other
jobs falls on all alike. A framework's step time is the median of its rounds' medians (each
the median of ``--steps`` steps), with their spread (min-max); a ratio is the median of the
rounds' ratios (relaxgrad's median over the other's, same round), with their spread; compile
times and RSS are medians over the rounds. A framework that fails (an op relaxgrad cannot
import or differentiate, a crash) shows ``failed`` and the last line of its error, and is not
run again for that model. ``--small`` builds tiny configs (2 layers, hidden 128, 32 tokens,
32x32 images, a 1000-word vocabulary) to try the bench in a minute.

``--precision bf16`` trains in mixed precision: relaxgrad's ``Trainer(precision="bf16")``
(products in bfloat16 through oneDNN, float32 master weights), and PyTorch's forward under
``torch.autocast("cpu", dtype=torch.bfloat16)``, eager and compiled (what a PyTorch user adds
for bf16 on a CPU). The header names the CPU and its bf16 instructions: figures differ between
machines (an Intel Xeon with AMX runs bf16 products several times faster than float32; a CPU
without bf16 instructions, not at all).

``--precision fp32 bf16`` runs both in each round, interleaved (a table each, then relaxgrad's
bf16 step and peak RSS against its float32 ones); ``--frameworks bf16:eager bf16:compile
bf16:relaxgrad fp32:relaxgrad`` runs only those children.

Run ``python bench/real_models.py [--models bert resnet50 gpt2] [--runs 3] [--steps 5]
[--precision fp32 bf16] [--frameworks PRECISION:FRAMEWORK ...] [--small]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

MODELS = ("bert", "resnet50", "gpt2")
FRAMEWORKS = ("eager", "compile", "relaxgrad")
LABELS = {"eager": "eager", "compile": "torch.compile", "relaxgrad": "relaxgrad"}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per child")
    parser.add_argument("--runs", type=int, default=3, help="rounds (children per framework)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--small", action="store_true", help="tiny configs, to try the bench")
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16"), default=["fp32"],
                        help="one or both, interleaved in each round")
    parser.add_argument("--frameworks", nargs="+", default=None, metavar="PRECISION:FRAMEWORK",
                        help="run only these, e.g. bf16:eager fp32:relaxgrad (default: all)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per child")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "FRAMEWORK"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


ARGS = parse_args()
PRECISION = ARGS.precision[0]  # a child's
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)  # read when TVM's thread pool starts


# ---------------------------------------------------------------- the child: one framework


def build(name: str, rng):
    """``(module, input, targets, label)`` of model ``name``, weights from seed 0."""
    import torch
    import transformers as hf
    from _common import Logits

    torch.manual_seed(0)
    batch, small = ARGS.batch, ARGS.small
    if name == "bert":
        sizes = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                     intermediate_size=512) if small else {}
        config = hf.BertConfig(num_labels=2, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0, **sizes)
        config._attn_implementation = "eager"
        seq = 32 if small else 128
        ids = torch.from_numpy(rng.integers(0, config.vocab_size, (batch, seq)))
        module = Logits(hf.BertForSequenceClassification(config), "input_ids")
        return module, ids, rng.integers(0, 2, batch), f"BERT-base, seq {seq}"
    if name == "resnet50":
        sizes = dict(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1]) \
            if small else {}
        config = hf.ResNetConfig(num_labels=1000, **sizes)
        size = 32 if small else 224
        images = rng.standard_normal((batch, 3, size, size)).astype("float32")
        module = Logits(hf.ResNetForImageClassification(config), "pixel_values")
        return module, torch.from_numpy(images), rng.integers(0, 1000, batch), \
            f"ResNet-50, {size}x{size}"
    if name == "gpt2":
        sizes = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=1000) if small else {}
        config = hf.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **sizes)
        config._attn_implementation = "eager"
        seq = 32 if small else 256
        text = rng.integers(0, config.vocab_size, (batch, seq + 1))
        module = Logits(hf.GPT2LMHeadModel(config), "input_ids", flat=True)
        # the language-modeling loss: each token's logits against the next token
        return module, torch.from_numpy(text[:, :-1]), text[:, 1:].reshape(-1), \
            f"GPT-2 small, seq {seq}"
    raise ValueError(f"unknown model {name!r}")


def peak_rss_mib(who: int = resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024  # KiB on Linux


def cpu_seconds() -> tuple[float, float]:
    """``(busy CPU seconds of the whole machine, of this process)`` so far (``/proc/stat``)."""
    with open("/proc/stat") as f:
        jiffies = [int(v) for v in f.readline().split()[1:]]
    idle = jiffies[3] + jiffies[4]  # idle, iowait
    own = os.times()
    return (sum(jiffies) - idle) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def timed(fn, *args) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def torch_step(module, x, y, compiled: bool):
    import torch
    from _common import torch_adam_step

    module.train()
    net = torch.compile(module) if compiled else module
    autocast = torch.bfloat16 if PRECISION == "bf16" else None
    return torch_adam_step(net, x, torch.from_numpy(y), module.parameters(), autocast)


def relaxgrad_trainer(module, x):
    from relaxgrad.training import Adam, CrossEntropyLoss, Trainer, from_torch

    model = from_torch(module, (x,))
    trainer = Trainer.for_model(model, CrossEntropyLoss(), Adam(1e-3), cache=False,
                                progress=False, precision=PRECISION)
    return trainer, x.numpy()


def relaxgrad_adjoint_over_forward(trainer, inputs, y) -> float:
    """The loss's adjoint time over the loss's alone (the forward) on the step's batch, one
    call of each in turn per round, 5 rounds."""
    from _common import adjoint_over_forward, loss_function

    args = trainer.adjoint_args(inputs, y)
    forward, adjoint = loss_function(trainer), trainer.vm[f"{trainer.func_name}_loss_adjoint"]
    forward(*args)
    return adjoint_over_forward(forward, adjoint, args, rounds=5)


def kernels(framework: str) -> str:
    """The kernel set the framework's matrix products run: OpenBLAS's core for relaxgrad
    (``OPENBLAS_CORETYPE`` pins it), PyTorch's CPU capability (its MKL and oneDNN dispatch)."""
    if framework == "relaxgrad":
        import ctypes

        from _common import bf16_products

        from relaxgrad.schedules import blas

        if PRECISION == "bf16":
            return f"bf16 products in {bf16_products()}"

        if blas.SGEMM is None:
            return "TVM's own matmuls"
        lib = ctypes.CDLL(blas.library_path())
        lib.scipy_openblas_get_corename.restype = ctypes.c_char_p
        return f"OpenBLAS {lib.scipy_openblas_get_corename().decode()}"
    import torch

    return f"PyTorch {torch.backends.cpu.get_cpu_capability()}"


def child(name: str, framework: str) -> dict:
    """Build, compile and time ``name`` with ``framework``; the result as a JSON-able dict."""
    import numpy as np
    import torch

    torch.set_num_threads(ARGS.threads)
    torch.set_flush_denormal(True)
    if framework == "compile":
        import torch._inductor.config

        torch._inductor.config.compile_threads = ARGS.threads
    module, x, y, label = build(name, np.random.default_rng(0))
    from _common import reset_peak_rss, rss_mib

    out = {"label": label, "base_rss_mib": peak_rss_mib()}
    if framework == "relaxgrad":
        out["compile_s"], (trainer, inputs) = timed(relaxgrad_trainer, module, x)
        del module  # the Trainer holds the weights (trainer.state_dict() gives them back)
        step = lambda: trainer.step(inputs, y)  # noqa: E731
    else:
        out["compile_s"], step = 0.0, torch_step(module, x, y, framework == "compile")
    out["compile_rss_mib"] = peak_rss_mib()  # the peak so far: the build and the compile
    out["ready_rss_mib"] = rss_mib()  # what the process holds before its first step
    reset_peak_rss()
    out["first_step_s"], first_loss = timed(step)
    if framework == "compile":
        out["compile_s"] = out["first_step_s"]
    out["kernels"] = kernels(framework)
    times, losses = [], [first_loss]
    (busy, own), start = cpu_seconds(), time.perf_counter()
    for _ in range(ARGS.steps):
        spent, loss = timed(step)
        times.append(spent)
        losses.append(loss)
    (busy_end, own_end), wall = cpu_seconds(), time.perf_counter() - start
    # the CPUs other processes kept busy while the steps ran, in cores
    out["others_cores"] = max(0.0, (busy_end - busy) - (own_end - own)) / wall
    out.update(step_s=times, losses=losses, peak_rss_mib=peak_rss_mib(),
               steps_peak_rss_mib=rss_mib("VmHWM"),
               workers_rss_mib=peak_rss_mib(resource.RUSAGE_CHILDREN))
    if framework == "relaxgrad":
        out["adjoint_over_forward"] = relaxgrad_adjoint_over_forward(trainer, inputs, y)
    return out


# ---------------------------------------------------------------- the parent: rounds, table


def run_child(name: str, framework: str, precision: str) -> dict:
    args = [sys.executable, __file__, "--child", name, framework, "--steps", str(ARGS.steps),
            "--threads", str(ARGS.threads), "--batch", str(ARGS.batch),
            "--precision", precision]
    if ARGS.small:
        args.append("--small")
    from _common import run_json_child

    return run_json_child(args, ARGS.timeout, "real-models-")


def rounds(name: str) -> dict[tuple[str, str], list[dict]]:
    """``--runs`` rounds of one child per (precision, framework), the order rotated each
    round."""
    pairs = [(p, fw) for p in ARGS.precision for fw in FRAMEWORKS
             if ARGS.frameworks is None or f"{p}:{fw}" in ARGS.frameworks]
    results: dict[tuple[str, str], list[dict]] = {pair: [] for pair in pairs}
    for r in range(ARGS.runs):
        shift = r % len(pairs)
        for precision, framework in pairs[shift:] + pairs[:shift]:
            if any("error" in res for res in results[(precision, framework)]):
                continue
            res = run_child(name, framework, precision)
            results[(precision, framework)].append(res)
            brief = res.get("error") or (f"compile {res['compile_s']:.1f} s, median step "
                                         f"{sorted(res['step_s'])[len(res['step_s']) // 2]:.3f} s")
            print(f"  {name} round {r + 1} {precision} {LABELS[framework]}: {brief}",
                  file=sys.stderr, flush=True)
            if "stderr" in res:
                print(res["stderr"], file=sys.stderr)
    return results


def summary(results: dict[str, list[dict]]) -> dict[str, dict]:
    """Per framework: step (median, min, max) over its rounds' medians, compile, first step and
    RSS medians, the final losses; ``{"error": ...}`` for a framework that failed."""
    import statistics

    from _common import spread

    out = {}
    for framework, runs in results.items():
        failed = [r["error"] for r in runs if "error" in r]
        if failed or not runs:
            out[framework] = {"error": failed[0] if failed else "not run", "not_run": not runs}
            continue
        medians = [statistics.median(r["step_s"]) for r in runs]
        out[framework] = {"step": spread(medians), "medians": medians,
                          **{k: statistics.median(r[k] for r in runs) for k in (
                              "compile_s", "first_step_s", "peak_rss_mib", "base_rss_mib",
                              "compile_rss_mib", "workers_rss_mib", "ready_rss_mib",
                              "steps_peak_rss_mib")},
                          "others_cores": max(r["others_cores"] for r in runs),
                          "label": runs[0]["label"], "loss": runs[0]["losses"][-1],
                          "kernels": runs[0]["kernels"]}
        if "adjoint_over_forward" in runs[0]:
            out[framework]["adjoint_over_forward"] = spread(
                r["adjoint_over_forward"] for r in runs)
    return out


def paired_ratio(ours: dict, theirs: dict):
    from _common import spread

    if "error" in ours or "error" in theirs:
        return None
    return spread(a / b for a, b in zip(ours["medians"], theirs["medians"]))


def cell_step(s: dict) -> str:
    from _common import fmt

    if s.get("not_run"):
        return "-"
    return "failed" if "error" in s else fmt(s["step"], 1e3, 0 if s["step"][0] >= 0.1 else 1)


def row(name: str, s: dict[str, dict]) -> str:
    from _common import fmt

    ours, eager, compiled = s["relaxgrad"], s["eager"], s["compile"]
    label = next((v["label"] for v in s.values() if "label" in v), name)
    ratios = [paired_ratio(ours, other) for other in (eager, compiled)]
    rss = " / ".join("-" if "error" in s[fw] else f"{s[fw]['peak_rss_mib']:.0f}"
                     for fw in ("relaxgrad", "eager", "compile"))
    cells = [label, cell_step(ours), cell_step(eager), cell_step(compiled),
             *("-" if r is None else fmt(r, 1, 2) for r in ratios),
             "-" if "error" in ours else f"{ours['compile_s']:.1f}",
             "-" if "error" in compiled else f"{compiled['compile_s']:.1f}", rss]
    return "| " + " | ".join(cells) + " |"


HEADER = ("| model, batch {batch} | relaxgrad step ms | eager ms | torch.compile ms | "
          "relaxgrad / eager | relaxgrad / torch.compile | relaxgrad compile s | "
          "torch.compile first step s | peak RSS MiB: relaxgrad / eager / torch.compile |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def notes(framework: str, s: dict) -> str:
    """What the table leaves out of one framework's summary ``s``."""
    if s.get("not_run"):
        return f"{LABELS[framework]} not run"
    if "error" in s:
        return f"{LABELS[framework]} failed: {s['error']}"
    workers = f", workers' RSS {s['workers_rss_mib']:.0f} MiB" if framework == "compile" else ""
    ratio = s.get("adjoint_over_forward")
    adjoint = "" if ratio is None else \
        f", adjoint / forward {ratio[0]:.2f} ({ratio[1]:.2f}-{ratio[2]:.2f})"
    return (f"{LABELS[framework]} ({s['kernels']}){adjoint}: first step "
            f"{s['first_step_s']:.2f} s, peak RSS "
            f"{s['base_rss_mib']:.0f} MiB built, {s['compile_rss_mib']:.0f} MiB compiled{workers}, "
            f"RSS before the first step {s['ready_rss_mib']:.0f} MiB, peak of the steps "
            f"{s['steps_peak_rss_mib']:.0f} MiB, "
            f"loss after {ARGS.steps + 1} steps {s['loss']:.4f}, others' load up to "
            f"{s['others_cores']:.2f} cores")


def main() -> None:
    import torch

    pinned = os.environ.get("OPENBLAS_CORETYPE")
    if pinned:
        print(f"OPENBLAS_CORETYPE={pinned} pins OpenBLAS (relaxgrad's gemms) to that core's "
              f"kernels; run `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python "
              f"bench/real_models.py` to let it pick this CPU's own", flush=True)
    from _common import cpu_model

    print(f"{cpu_model()}; precision {' and '.join(ARGS.precision)}; "
          f"threads: {ARGS.threads}, batch {ARGS.batch}, torch {torch.__version__}, "
          f"{ARGS.runs} rounds x {ARGS.steps} timed steps{', small configs' if ARGS.small else ''}"
          f"; step: median of round medians (min-max); ratio: median of the rounds' ratios "
          f"(min-max)", flush=True)
    summaries = {}
    for name in ARGS.models:
        results = rounds(name)
        for precision in ARGS.precision:
            summaries[(name, precision)] = summary(
                {fw: results.get((precision, fw), []) for fw in FRAMEWORKS})
    for precision in ARGS.precision:
        print(f"\n{precision}:\n" + HEADER.format(batch=ARGS.batch))
        for (name, p), s in summaries.items():
            if p == precision:
                print(row(name, s))
    for (name, precision), s in summaries.items():
        print(f"{name} {precision}: " + "; ".join(notes(fw, s[fw]) for fw in FRAMEWORKS))
    for name in ARGS.models if set(ARGS.precision) == {"fp32", "bf16"} else ():
        bf16, fp32 = (summaries[(name, p)]["relaxgrad"] for p in ("bf16", "fp32"))
        if "error" in bf16 or "error" in fp32:
            continue
        print(f"{name}: relaxgrad bf16 / fp32: step {bf16['step'][0] / fp32['step'][0]:.2f}, "
              f"peak RSS {bf16['peak_rss_mib']:.0f} / {fp32['peak_rss_mib']:.0f} MiB "
              f"({bf16['peak_rss_mib'] / fp32['peak_rss_mib']:.2f}x)")


if __name__ == "__main__":
    if ARGS.child:
        print(json.dumps(child(*ARGS.child)))
    else:
        main()
