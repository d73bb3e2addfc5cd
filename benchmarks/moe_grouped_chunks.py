"""Is a grouped GEMM over a chunk of a layer's experts bitwise the resident call over all of
them, row by row? (Note: [Layers in chunks] in torchoffload/moe/_grouped.py.)

For each token count and chunk size C: the resident call is transformers' ``_grouped_linear``
over all E experts' weights (offsets from the routed rows' histogram, as grouped_mm_experts_
forward makes them); the chunked call runs it once per chunk of C consecutive experts, on a
copy of the chunk's weights in a tensor of its own (as a region of the cache holds them), with
that chunk's rows and offsets; C ``stacked``: the routed experts in runs of top_k, each run's
weights stacked (Note: [Routed experts stacked] in torchoffload/moe/_grouped.py). Prints, per
(tokens, C), whether every row is equal and the host
time of the chunked calls. Needs a GPU.

    PYTHONPATH=. python3 benchmarks/moe_grouped_chunks.py [--experts 128] [--hidden 2048]
        [--width 768] [--top-k 8] [--tokens 1,32,256,2048,8192] [--chunks 1,2,4,8,16,64,stacked]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", default="1,32,256,2048,8192")
    p.add_argument("--chunks", default="1,2,4,8,16,64,stacked")
    p.add_argument("--dtypes", default="bfloat16")
    a = p.parse_args()
    from transformers.integrations.moe import _grouped_linear

    dev = torch.device("cuda")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    print("| dtype | tokens | C | rows equal (gate_up, down) | chunked host ms | resident ms |")
    print("|---|---:|---:|---|---:|---:|")
    bad = 0
    for dname in a.dtypes.split(","):
        dtype = getattr(torch, dname)
        g = torch.Generator(device=dev).manual_seed(0)
        E, H, W = a.experts, a.hidden, a.width
        gate_up = torch.randn(E, 2 * W, H, device=dev, dtype=dtype, generator=g) * 0.02
        down = torch.randn(E, H, W, device=dev, dtype=dtype, generator=g) * 0.02
        for tokens in map(int, a.tokens.split(",")):
            x = torch.randn(tokens, H, device=dev, dtype=dtype, generator=g)
            idx = torch.rand(tokens, E, device=dev, generator=g).topk(a.top_k, -1).indices
            ids, perm = torch.sort(idx.reshape(-1))
            rows = x[perm // a.top_k]
            hist = torch.histc(ids.int(), bins=E, min=0, max=E - 1)
            offs = torch.cumsum(hist, 0, dtype=torch.int32)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ref1 = _grouped_linear(rows, gate_up, offs)
            ref2 = _grouped_linear(ref1[:, :W].contiguous(), down, offs)
            torch.cuda.synchronize()
            resident_ms = (time.perf_counter() - t0) * 1e3
            counts = hist.long().tolist()
            routed = [e for e, c in enumerate(counts) if c]
            for C in a.chunks.split(","):
                chunks = []
                if C == "stacked":  # runs of top_k routed experts, stacked (torch.stack)
                    for s in range(0, len(routed), a.top_k):
                        run = routed[s : s + a.top_k]
                        chunks.append((run, torch.stack([gate_up[e] for e in run]),
                                       torch.stack([down[e] for e in run])))  # fmt: skip
                else:
                    for s in range(0, E, int(C)):
                        run = list(range(s, min(E, s + int(C))))
                        chunks.append((run, gate_up[s : s + int(C)].clone(),
                                       down[s : s + int(C)].clone()))  # fmt: skip
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                o1, o2, start = [], [], 0
                for run, gu, dn in chunks:
                    n = sum(counts[e] for e in run)
                    if not n:
                        continue
                    off = torch.cumsum(hist[run], 0, dtype=torch.int32)
                    r = rows[start : start + n]
                    h1 = _grouped_linear(r, gu, off)
                    o1.append(h1)
                    o2.append(_grouped_linear(h1[:, :W].contiguous(), dn, off))
                    start += n
                host_ms = (time.perf_counter() - t0) * 1e3
                torch.cuda.synchronize()
                eq1 = torch.equal(torch.cat(o1), ref1)
                eq2 = torch.equal(torch.cat(o2), ref2)
                bad += not (eq1 and eq2)
                print(f"| {dname} | {tokens} | {C} | {eq1}, {eq2} | {host_ms:.2f} | "
                      f"{resident_ms:.2f} |")  # fmt: skip
    print(f"# rows differing in {bad} cases")


if __name__ == "__main__":
    main()
