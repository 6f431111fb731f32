"""On paper: bytes moved, compute per GPU and expected speed-up of splitting attention over several GPUs.

    python -m tools.measure.multigpu_estimate                       # Wan 2.2 5B 720p and LTX-2.3 1080p, 2 and 4 MI50s
    python -m tools.measure.multigpu_estimate --link-gbs 12 --attn-tflops 3.0 --linear-tflops 13

Per transformer layer and sample (one self-attention call, fp16, forward):
  attention FLOPs 4 N^2 H D (QK^T and PV);  token-wise linear FLOPs 2 N * (MACs per token of projections + FFN)
  S = N H D * 2 bytes, one of q, k, v, out
  head split (one process, GPU 0 holds q, k, v):  GPU 0 sends 3 S (P-1)/P (q, k, v of the other heads) and receives
      S (P-1)/P (their out) over its own link; only attention is split, the rest of the layer stays on GPU 0
  Ulysses (P processes, whole model sharded by tokens):  each rank sends and receives 4 (S/P)(P-1)/P (q, k, v, out
      all-to-all), not overlapped with compute
  ring (same sharding):  each rank sends its K, V block P-1 times, 2 (S/P)(P-1), overlapped with the P^2 block steps
Assumed throughputs (MI50, 26.5 TFLOPS fp16 peak): attention in plain matmuls 3.0 TFLOPS (11 %), which the reported
1:19:39 of the bundled Wan 2.2 5B 720p workflow on one MI50 implies once the linear layers are counted at
13 TFLOPS (50 %, rocBLAS fp16 GEMMs); PCIe 3.0 x16 12 GB/s per direction per GPU.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Model:
    name: str
    tokens: int
    heads: int
    head_dim: int
    layers: int
    linear_macs_per_token: float  # per layer: self-attn q,k,v,o + cross-attn q,o + FFN (+ LTX audio cross q,o)
    evals: int  # model evaluations of the sampler (steps x CFG batch)


def _wan22_5b():
    d, ffn = 3072, 14336
    return Model("Wan 2.2 TI2V 5B, 1280x720, 121 frames", 28_520, 24, 128, 30,
                 4 * d * d + 2 * d * d + 2 * d * ffn, 20 * 2)


def _ltx23_1080p():
    d, ffn, a = 4096, 4 * 4096, 2048
    # stage 2 of LTX-2.3 Text to Video 1080p.json: 1920x1088 (cropped to 1080), 129 frames: (1 + 128/8) * 34 * 60 tokens
    return Model("LTX-2.3 22B, 1920x1088, 129 frames (stage 2)", 17 * 34 * 60, 32, 128, 48,
                 4 * d * d + 2 * d * d + 2 * d * ffn + 2 * d * a, 3 * 1)  # ManualSigmas: 3 steps, CFG 1


def estimate(m: Model, P: int, link: float, attn_tflops: float, linear_tflops: float):
    S = m.tokens * m.heads * m.head_dim * 2
    attn_s = 4 * m.tokens ** 2 * m.heads * m.head_dim / (attn_tflops * 1e12)
    lin_s = 2 * m.tokens * m.linear_macs_per_token / (linear_tflops * 1e12)
    one = attn_s + lin_s
    head_bytes = 3 * S * (P - 1) / P  # the busiest direction of GPU 0's link
    head = lin_s + attn_s / P + head_bytes / link
    uly_bytes = 4 * (S / P) * (P - 1) / P
    uly = one / P + uly_bytes / link
    ring_bytes = 2 * (S / P) * (P - 1)
    step = attn_s / P / P
    ring = lin_s / P + P * max(step, 2 * (S / P) / link)
    return dict(S=S, attn_s=attn_s, lin_s=lin_s, one=one, head_bytes=head_bytes, head=head, uly_bytes=uly_bytes,
                uly=uly, ring_bytes=ring_bytes, ring=ring, attn_tflop_per_gpu=4 * m.tokens ** 2 * m.heads *
                m.head_dim / P / 1e12)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.measure.multigpu_estimate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--link-gbs", type=float, default=12.0, help="PCIe bandwidth per direction per GPU, GB/s")
    ap.add_argument("--attn-tflops", type=float, default=3.0)
    ap.add_argument("--linear-tflops", type=float, default=13.0)
    ap.add_argument("--gpus", type=int, nargs="+", default=[2, 4])
    a = ap.parse_args(argv)
    link = a.link_gbs * 1e9
    for m in (_wan22_5b(), _ltx23_1080p()):
        base = estimate(m, 1, link, a.attn_tflops, a.linear_tflops)
        print(f"\n{m.name}: N={m.tokens:,}, {m.heads} heads x {m.head_dim}, {m.layers} layers; one of q/k/v/out "
              f"{base['S'] / 1e6:.0f} MB; per layer on one GPU: attention {base['attn_s']:.2f} s "
              f"({4 * m.tokens ** 2 * m.heads * m.head_dim / 1e12:.1f} TFLOP), linear {base['lin_s']:.2f} s")
        print(f"| GPUs | attention TFLOP per GPU | head split: MB over GPU 0's link, speed-up | "
              f"Ulysses: MB per rank, speed-up | ring: MB per rank, speed-up |")
        print("|---|---|---|---|---|")
        for P in a.gpus:
            e = estimate(m, P, link, a.attn_tflops, a.linear_tflops)
            print(f"| {P} | {e['attn_tflop_per_gpu']:.1f} | {e['head_bytes'] / 1e6:.0f} MB "
                  f"({e['head_bytes'] / link * 1e3:.0f} ms), {base['one'] / e['head']:.2f}x | "
                  f"{e['uly_bytes'] / 1e6:.0f} MB ({e['uly_bytes'] / link * 1e3:.0f} ms), "
                  f"{base['one'] / e['uly']:.2f}x | {e['ring_bytes'] / 1e6:.0f} MB (hidden), "
                  f"{base['one'] / e['ring']:.2f}x |")
        total = m.layers * m.evals * base["one"]
        print(f"(one GPU: {m.layers} layers x {m.evals} evaluations x {base['one']:.2f} s = "
              f"{total / 60:.0f} min of transformer time)")


if __name__ == "__main__":
    main()
