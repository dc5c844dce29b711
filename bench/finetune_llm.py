"""LoRA fine-tuning of an LLM-sized causal language model: relaxgrad against PyTorch + PEFT, eager
and ``torch.compile``, in float32 and bfloat16, with tokens per second, the first step, peak
memory and the loss after the steps.

Model (random weights, seed 0, no hub access): ``--model qwen2-0.5b`` has Qwen2-0.5B's shape (24
layers, hidden 896, 14 query and 2 key/value heads, MLP 4864, vocabulary 151,936, tied
embeddings); ``llama-3.2-1b`` Llama-3.2-1B's (16 layers, hidden 2048, 32 / 8 heads, MLP 8192,
vocabulary 128,256, tied); ``--small`` a 2-layer model of hidden 64 to try the bench in a
minute. LoRA as PEFT's ``LoraConfig(r=32, lora_alpha=64, target_modules=["q_proj", "k_proj",
"v_proj"], lora_dropout=0.0)``, AdamW (lr 1e-4) on the adapters only, batch ``--batch`` (1) of
``--seq`` (512) tokens, the mean next-token cross-entropy over all of them. Attention is
transformers' ``"eager"`` implementation everywhere.

- *eager*, *compile*: ``peft.get_peft_model`` of the ``transformers`` model, trained by
  ``torch.optim.AdamW`` (``torch.compile`` wraps the model; inductor, CPU); in bf16, the forward
  runs under ``torch.autocast("cpu", dtype=torch.bfloat16)``.
- *relaxgrad*: :func:`relaxgrad.training.from_torch` of the plain model, then
  :func:`relaxgrad.training.lora` with the same targets, the adapters initialized to PEFT's
  (copied from a PEFT model of the same seed), ``Trainer(precision=..., share_frozen=True)``
  (the frozen weights read in the PyTorch module's tensors, not copied); the PyTorch model is
  dropped once the Trainer holds the weights. ``--frozen-dtype bf16``: in bf16, also
  ``frozen_dtype="bf16"`` (the frozen projections and the embedding held in bf16, cast once).

Each (precision, framework) runs in a child process of its own, ``--runs`` rounds in rotated
order (interleaved, so that load falls on all alike). *First step* is the time from the
model's construction to the end of the first step (relaxgrad: import, compile with the cache
off, first step; ``torch.compile``: its compile during the first step). *tokens/s* is the
tokens of a batch over the median step time of the ``--steps`` steps after the first.
*Peak RSS* is the child's ``ru_maxrss`` (the whole process). Prints the CPU model first.

Run ``python bench/finetune_llm.py [--model qwen2-0.5b] [--precision fp32 bf16] [--runs 1]
[--steps 10] [--small]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

MODELS = {
    "qwen2-0.5b": ("Qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                 num_hidden_layers=24, num_attention_heads=14,
                                 num_key_value_heads=2, max_position_embeddings=32768,
                                 tie_word_embeddings=True, rope_theta=1000000.0)),
    "llama-3.2-1b": ("Llama", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                   num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, max_position_embeddings=131072,
                                   tie_word_embeddings=True, rope_theta=500000.0)),
}
SMALL = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
             tie_word_embeddings=True)
FRAMEWORKS = ("eager", "compile", "relaxgrad")
TARGETS = ["q_proj", "k_proj", "v_proj"]
R, ALPHA, LR = 32, 64, 1e-4


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2-0.5b")
    parser.add_argument("--precision", nargs="+", choices=("fp32", "bf16"),
                        default=["fp32", "bf16"])
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS))
    parser.add_argument("--steps", type=int, default=10, help="steps after the first")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--packed", action="store_true",
                        help="each row packs 4 sequences (1/2, 1/4, 1/8, 1/8 of --seq)")
    parser.add_argument("--frozen-dtype", choices=("bf16",), default=None,
                        help="relaxgrad bf16 holds the frozen projections and embedding in bf16")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--child", nargs=2, metavar=("FRAMEWORK", "PRECISION"),
                        help=argparse.SUPPRESS)
    return parser.parse_args(argv)


ARGS = parse_args()
os.environ["TVM_NUM_THREADS"] = str(ARGS.threads)


def build():
    """``(transformers model, token batch (batch, seq + 1))``, seed 0; with ``--packed`` the
    batch is a :class:`relaxgrad.training.Packed` of four sequences a row."""
    import numpy as np
    import torch
    import transformers as hf

    family, sizes = ("Qwen2", SMALL) if ARGS.small else MODELS[ARGS.model]
    config = getattr(hf, f"{family}Config")(**sizes, use_cache=False, attention_dropout=0.0)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(hf, f"{family}ForCausalLM")(config)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config.vocab_size, (ARGS.batch, ARGS.seq + 1))
    if ARGS.packed:
        from relaxgrad.training import pack

        lengths = [ARGS.seq // 2, ARGS.seq // 4, ARGS.seq // 8]
        lengths.append(ARGS.seq - sum(lengths))
        sequences = [rng.integers(0, config.vocab_size, n) for _ in range(ARGS.batch)
                     for n in lengths]
        return model, pack(sequences, ARGS.seq, rows=ARGS.batch)
    return model, tokens


def inputs_targets(tokens):
    """The model's inputs (numpy arrays) and the flat targets of a batch from :func:`build`."""
    if ARGS.packed:
        return tokens.inputs, tokens.labels
    return (tokens[:, :-1],), tokens[:, 1:].reshape(-1)


def packed_logits(model):
    """``model`` as a module of ``(input_ids, attention_mask, position_ids)`` returning flat
    logits (a packed row: the 4-D block-diagonal causal mask and restarting positions)."""
    import torch

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids):
            logits = self.model(input_ids, attention_mask=attention_mask,
                                position_ids=position_ids).logits
            return logits.reshape(-1, logits.shape[-1])

    return Module()


def peft_model(base):
    import peft
    import torch

    torch.manual_seed(1)
    return peft.get_peft_model(base, peft.LoraConfig(
        r=R, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0))


def torch_step(framework: str, precision: str, base, tokens):
    import torch

    model = peft_model(base).train()
    net = torch.compile(model) if framework == "compile" else model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR)
    xs, y = inputs_targets(tokens)
    xs, y = [torch.from_numpy(a) for a in xs], torch.from_numpy(y)
    names = ("input_ids", "attention_mask", "position_ids")

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = net(**dict(zip(names, xs, strict=False))).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y,
                                                 ignore_index=-100)
        loss.backward()
        optimizer.step()
        return float(loss)

    return step


def relaxgrad_step(precision: str, base, tokens):
    import torch
    from _common import Logits

    from relaxgrad.training import AdamW, CrossEntropyLoss, Trainer, from_torch, lora

    wrapped = peft_model(base)  # PEFT's initial adapters, to start alike; then without them
    initial = {name.removeprefix("base_model.model.").replace(".default", ""): p.detach()
               for name, p in wrapped.named_parameters() if "lora_" in name}
    base = wrapped.unload()
    xs, y = inputs_targets(tokens)
    module = packed_logits(base) if ARGS.packed else Logits(base, "input_ids", flat=True)
    model = lora(from_torch(module, tuple(torch.from_numpy(a) for a in xs)), TARGETS, r=R,
                 alpha=ALPHA)
    for name in model.params:
        model.params[name] = initial[name.removeprefix("model.")].numpy().copy()
    frozen_dtype = ARGS.frozen_dtype if precision == "bf16" else None
    trainer = Trainer.for_model(model, CrossEntropyLoss(ignore_index=-100), AdamW(LR),
                                precision=precision, cache=False, progress=False,
                                share_frozen=True, frozen_dtype=frozen_dtype)
    return lambda: trainer.step(xs, y)


def child(framework: str, precision: str) -> dict:
    import torch
    from _common import reset_peak_rss, rss_mib

    torch.set_num_threads(ARGS.threads)
    if framework == "compile":
        import torch._inductor.config

        torch._inductor.config.compile_threads = ARGS.threads
    start = time.perf_counter()
    base, tokens = build()
    out = {"built_rss_mib": rss_mib()}
    if framework == "relaxgrad":
        step = relaxgrad_step(precision, base, tokens)
        del base  # the Trainer holds the weights
    else:
        step = torch_step(framework, precision, base, tokens)
    out["ready_rss_mib"] = rss_mib()
    reset_peak_rss()
    losses = [step()]
    out["first_step_s"] = time.perf_counter() - start
    times = []
    for _ in range(ARGS.steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    out.update(step_s=times, losses=losses, steps_peak_rss_mib=rss_mib("VmHWM"),
               peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return out


def run_child(framework: str, precision: str) -> dict:
    args = [sys.executable, __file__, "--child", framework, precision, "--model", ARGS.model,
            "--steps", str(ARGS.steps), "--threads", str(ARGS.threads), "--batch",
            str(ARGS.batch), "--seq", str(ARGS.seq)] + (["--small"] if ARGS.small else []) \
        + (["--packed"] if ARGS.packed else []) \
        + (["--frozen-dtype", ARGS.frozen_dtype] if ARGS.frozen_dtype else [])
    from _common import run_json_child

    return run_json_child(args, ARGS.timeout, "finetune-llm-")


def main() -> None:
    import torch
    from _common import bf16_products, cpu_model

    tokens = ARGS.batch * ARGS.seq
    name = "small" if ARGS.small else ARGS.model
    packed = ", each row 4 sequences packed" if ARGS.packed else ""
    print(f"{cpu_model()}; {name}, LoRA r={R} on {', '.join(TARGETS)}, batch {ARGS.batch} x "
          f"{ARGS.seq} tokens{packed}, {ARGS.threads} threads, torch {torch.__version__}, "
          f"{ARGS.runs} round(s) x {ARGS.steps} steps after the first; relaxgrad's bf16 products: "
          f"{bf16_products()}"
          f"{'; frozen weights held in bf16' if ARGS.frozen_dtype else ''}", flush=True)
    results = {}
    for r in range(ARGS.runs):
        order = [(p, f) for p in ARGS.precision for f in ARGS.frameworks]
        order = order[r % len(order):] + order[:r % len(order)]
        for precision, framework in order:
            res = run_child(framework, precision)
            results.setdefault((precision, framework), []).append(res)
            brief = res.get("error") or f"median step {statistics.median(res['step_s']):.2f} s"
            print(f"  round {r + 1} {precision} {framework}: {brief}", file=sys.stderr,
                  flush=True)
    print("| precision | framework | step s | tokens/s | relaxgrad / this, tokens/s | first "
          "step s | RSS before the first step MiB | peak RSS MiB | loss after the steps |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for precision in ARGS.precision:
        ours = results.get((precision, "relaxgrad"), [{}])
        ours_step = None if "error" in ours[0] or not ours[0] else statistics.median(
            statistics.median(r["step_s"]) for r in ours)
        for framework in ARGS.frameworks:
            runs = results[(precision, framework)]
            if any("error" in r for r in runs):
                print(f"| {precision} | {framework} | failed: {runs[0]['error']} |")
                continue
            step = statistics.median(statistics.median(r["step_s"]) for r in runs)
            ratio = "-" if ours_step is None else f"{step / ours_step:.2f}"
            med = {k: statistics.median(r[k] for r in runs)
                   for k in ("first_step_s", "ready_rss_mib", "peak_rss_mib")}
            print(f"| {precision} | {framework} | {step:.2f} | {tokens / step:.0f} | {ratio} | "
                  f"{med['first_step_s']:.1f} | {med['ready_rss_mib']:.0f} | "
                  f"{med['peak_rss_mib']:.0f} | {runs[0]['losses'][-1]:.4f} |")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if ARGS.child:
        print(json.dumps(child(*ARGS.child)))
    else:
        main()
