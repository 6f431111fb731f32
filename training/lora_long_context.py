"""Long-context LoRA fine-tuning of Qwen 2.5 0.5B on the tiled attention engine: attn_implementation="tiled".

transformers' own Qwen2 with the real Qwen 2.5 0.5B configuration (hidden 896, 14 query / 2 key-value heads, head
dim 64, MLP 4864, RoPE theta 1e6) and random weights, depth reduced (--layers, default 2 of 24) and vocabulary reduced
(--vocab, default 8192 of 151936: the real one's logits alone take 9.3 GiB fp32 at 16K tokens), a PEFT LoraConfig
on the attention projections, trained with a plain AdamW loop on documents packed into one row by transformers'
DataCollatorWithFlattening (--packed) or one long document, gradient checkpointing on or off.

    python training/lora_long_context.py --tokens 4096 --packed --steps 3
    python training/lora_long_context.py --tokens 16384 --gradient-checkpointing --steps 1
    python training/lora_long_context.py --bench --tokens 4096 16384      # one step, engine vs math SDPA

--bench runs one training step (forward + backward) per configuration twice, each in a fresh process: on
attn_implementation="tiled" and on "sdpa" with torch's math backend; it prints time, peak memory (growth of the
process's peak RSS on the CPU, torch's max_memory_allocated on a GPU) and how far the engine's loss and LoRA
gradients are from math's. Where math's score matrices would not fit in the memory available, math is not run and
the table says "out of memory" with what it would need; a real out-of-memory error is reported the same way.
Needs transformers (>= 4.56) and peft; the pack's attention_core importable (run from the repository root, or with
the engine installed).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False, sliding_window=32768,
                  max_window_layers=21, hidden_act="silu", attention_dropout=0.0)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
DOC_SHARES = (0.4, 0.3, 0.2, 0.1)  # --packed: four documents of these shares of the row
GIB = 1024 ** 3


def qwen25_config(layers: int, vocab: int, **over):
    """The real Qwen 2.5 0.5B configuration with `layers` layers and a `vocab`-token vocabulary."""
    from transformers import Qwen2Config
    return Qwen2Config(**{**QWEN25_05B, "num_hidden_layers": layers, "vocab_size": vocab, **over})


def make_model(impl: str, layers: int = 2, vocab: int = 8192, dtype="float32", seed: int = 0, rank: int = 8,
               checkpointing: bool = False, random_lora: bool = False, config=None):
    """A random-weight Qwen2 on attention `impl` with a PEFT LoRA adapter (rank `rank`, alpha 2*rank) on the
    attention projections; random_lora=True draws both LoRA matrices at random (PEFT's default makes B zero, so
    the first step's A gradients are zero: a comparison of gradients wants them all non-zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    if impl == "tiled":
        import attention_core.integrations.transformers  # noqa: F401  registers "tiled"
    torch.manual_seed(seed)
    cfg = config if config is not None else qwen25_config(layers, vocab)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=getattr(torch, dtype))
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                                             target_modules=LORA_TARGETS, init_lora_weights=not random_lora))
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def make_batch(tokens: int, packed: bool, vocab: int, seed: int = 1, device="cpu"):
    """One row of `tokens` tokens: four documents packed by transformers' DataCollatorWithFlattening (input_ids,
    labels with -100 at each document's first token, position_ids restarting) or one document."""
    import torch
    from transformers import DataCollatorWithFlattening
    g = torch.Generator().manual_seed(seed)
    if packed:
        lengths = [int(tokens * s) for s in DOC_SHARES]
        lengths[0] += tokens - sum(lengths)
    else:
        lengths = [tokens]
    docs = [{"input_ids": torch.randint(0, vocab, (n,), generator=g).tolist()} for n in lengths]
    batch = DataCollatorWithFlattening(return_position_ids=True)(docs)
    return {k: v.to(device) for k, v in batch.items() if k in ("input_ids", "labels", "position_ids")}


def train_step(model, batch):
    """Forward with labels, backward: (loss, {LoRA parameter name: gradient})."""
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    return out.loss.detach(), grads


def math_context(impl: str):
    import contextlib
    if impl != "sdpa":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel(SDPBackend.MATH)


# ---- the benchmark -----------------------------------------------------------------------------------------------

def math_bytes(tokens: int, layers: int, checkpointing: bool, heads: int = 14, itemsize: int = 4) -> int:
    """What math SDPA keeps of its score matrices in one training step, at least: the probabilities of every
    layer for the backward (one layer's with checkpointing) plus the scores and their gradient while one layer runs
    its backward."""
    one = heads * tokens * tokens * itemsize
    return one * ((1 if checkpointing else layers) + 2)


def available_bytes(device: str) -> int:
    import torch
    if device.startswith("cuda"):
        return torch.cuda.mem_get_info(torch.device(device))[0]
    import psutil
    return psutil.virtual_memory().available


def _peak_rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def run_case(case: dict) -> dict:
    """One training step of one configuration in this process: time, peak memory growth, loss; the LoRA
    gradients saved to case['grads'] (torch.save)."""
    import torch
    model = make_model(case["impl"], case["layers"], case["vocab"], case["dtype"], rank=case["rank"],
                       checkpointing=case["checkpointing"], random_lora=True).to(case["device"])
    batch = make_batch(case["tokens"], case["packed"], case["vocab"], device=case["device"])
    cuda = case["device"].startswith("cuda")
    with math_context(case["impl"]):
        train_step(model, make_batch(64, case["packed"], case["vocab"], device=case["device"]))  # warm-up
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = _peak_rss()
        t0 = time.perf_counter()
        loss, grads = train_step(model, batch)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() if cuda else _peak_rss()) - base
    torch.save({k: v.double().cpu() for k, v in grads.items()}, case["grads"])
    return {"seconds": seconds, "peak_gib": max(0, peak) / GIB, "loss": float(loss)}


def _subprocess(case: dict, timeout: int) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    try:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--case", json.dumps(case)],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
        if p.returncode in (-9, 137) or "out of memory" in tail.lower():
            return {"error": f"out of memory ({tail[-120:]})"}
        return {"error": f"exit {p.returncode}: {tail[-200:]}"}
    return json.loads(lines[-1])


def bench(args) -> list:
    import torch
    rows = []
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        for tokens in args.tokens:
            for packed in ([False, True] if args.packed == "both" else [args.packed == "yes"]):
                for ckpt in ([False, True] if args.gradient_checkpointing == "both"
                             else [args.gradient_checkpointing == "on"]):
                    base = dict(tokens=tokens, packed=packed, checkpointing=ckpt, layers=args.layers, vocab=args.vocab,
                                dtype=args.dtype, rank=args.rank, device=args.device)
                    res = {}
                    for impl in ("tiled", "sdpa"):
                        case = dict(base, impl=impl, grads=os.path.join(tmp, f"{impl}.pt"))
                        size = torch.finfo(getattr(torch, args.dtype)).bits // 8
                        need = math_bytes(tokens, args.layers, ckpt, itemsize=size)
                        have = available_bytes(args.device)
                        if impl == "sdpa" and need > 0.8 * have:
                            res[impl] = {"error": f"out of memory: needs >= {need / GIB:.1f} GiB for its score "
                                                  f"matrices, {have / GIB:.1f} GiB available (not run)"}
                            continue
                        print(f"[bench] {tokens} tokens, {'packed' if packed else 'one document'}, checkpointing "
                              f"{'on' if ckpt else 'off'}: {'engine' if impl == 'tiled' else 'math SDPA'} ...",
                              file=sys.stderr, flush=True)
                        res[impl] = _subprocess(case, args.timeout)
                    diff = None
                    if all("error" not in r for r in res.values()):
                        a, b = torch.load(os.path.join(tmp, "tiled.pt")), torch.load(os.path.join(tmp, "sdpa.pt"))
                        scale = max(v.abs().max().item() for v in b.values())
                        diff = {"grad_rel": max((a[k] - b[k]).abs().max().item() for k in b) / scale,
                                "loss_abs": abs(res["tiled"]["loss"] - res["sdpa"]["loss"]), "grads": len(b)}
                    rows.append(dict(base, engine=res["tiled"], math=res["sdpa"], diff=diff))
    return rows


def print_table(rows, args):
    print(f"\nOne LoRA training step (forward + backward), Qwen 2.5 0.5B config, {args.layers} of 24 layers, vocab "
          f"{args.vocab}, {args.dtype}, LoRA rank {args.rank} on {', '.join(LORA_TARGETS)}, {args.device}")
    print("| tokens | rows | checkpointing | engine: time, peak | math SDPA: time, peak | LoRA grads max rel. diff "
          "| loss diff |")
    print("|---|---|---|---|---|---|---|")

    def cell(r):
        return r["error"] if "error" in r else f"{r['seconds']:.2f} s, {r['peak_gib']:.2f} GiB"
    for r in rows:
        d = r["diff"]
        print(f"| {r['tokens']} | {'packed (4 docs)' if r['packed'] else 'one document'} | "
              f"{'on' if r['checkpointing'] else 'off'} | {cell(r['engine'])} | {cell(r['math'])} | "
              f"{'-' if d is None else format(d['grad_rel'], '.1e')} ({d['grads'] if d else 0} tensors) | "
              f"{'-' if d is None else format(d['loss_abs'], '.1e')} |")


def train(args):
    import torch
    model = make_model(args.attn, args.layers, args.vocab, args.dtype, rank=args.rank,
                       checkpointing=args.gradient_checkpointing == "on").to(args.device)
    model.print_trainable_parameters()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    for step in range(args.steps):
        batch = make_batch(args.tokens[0], args.packed == "yes", args.vocab, seed=step, device=args.device)
        t0 = time.perf_counter()
        with math_context("sdpa" if args.math else "tiled"):
            loss, _ = train_step(model, batch)
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step + 1}/{args.steps}: loss {loss.item():.4f}, {time.perf_counter() - t0:.2f} s", flush=True)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096], help="tokens per row (default 4096; --bench: "
                   "each of them)")
    p.add_argument("--packed", default=None, choices=["yes", "no", "both"], nargs="?", const="yes",
                   help="four documents packed in the row (DataCollatorWithFlattening) or one (default: no; --bench: both)")
    p.add_argument("--gradient-checkpointing", default=None, choices=["on", "off", "both"], nargs="?", const="on",
                   help="gradient checkpointing (default: off; --bench: both)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (the real model has 24; default 2)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary (real: 151936; default 8192)")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank (default 8)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--attn", default="tiled", choices=["tiled", "sdpa"], help="attention implementation (training)")
    p.add_argument("--math", action="store_true", help="with --attn sdpa: torch's math backend only")
    p.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--bench", action="store_true", help="one step per configuration, engine vs math SDPA")
    p.add_argument("--timeout", type=int, default=3600, help="--bench: seconds per run (default 3600)")
    p.add_argument("--case", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    args.packed = args.packed or ("both" if args.bench else "no")
    args.gradient_checkpointing = args.gradient_checkpointing or ("both" if args.bench else "off")
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return 0
    if args.bench:
        print_table(bench(args), args)
        return 0
    train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
