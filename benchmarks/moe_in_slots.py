"""One token's routed experts computed in their cache slots (`_in_slots`: one grouped GEMM
pair over a part of the cache, at most 1023 slots: Note: [Parts of the cache] in
torchoffload/moe/_layout.py) against computed from the stage (each expert copied into the
stage by `copy_routed` between device addresses, then a grouped GEMM of one group per expert),
and against the resident call (one grouped GEMM over the layer's 128 experts), at the
Qwen3-30B-A3B expert shape in bf16, replayed in CUDA graphs: microseconds per layer call, and
whether every row is bitwise the resident call's (Note: [Experts computed in their slots] in
torchoffload/moe/_graphed.py). CUDA only.

    PYTHONPATH=. python3 benchmarks/moe_in_slots.py [--slots 16,600,1023]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from torchoffload.moe import _graphed
from torchoffload.moe._grouped import grouped_linear
from torchoffload.moe._kernels import DEVICE_PROGRAMS, copy_routed

DEV = torch.device("cuda")
E, H, W, K = 128, 2048, 768, 8  # experts, hidden, expert width, top-k
BF = torch.bfloat16


class Experts(torch.nn.Module):  # what `_in_slots` reads of transformers' experts module
    is_transposed = False

    def _apply_gate(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def replayed_us(fn, reps: int = 200) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps // 10):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def run(slots: int, module: Experts, gate_up: torch.Tensor, down: torch.Tensor) -> dict:
    members = [
        SimpleNamespace(dtype=BF, size=(2 * W, H), stride=(H, 1), region=0),
        SimpleNamespace(dtype=BF, size=(H, W), stride=(W, 1), region=2 * W * H * 2),
    ]
    slot_bytes = sum(m.size[0] * m.size[1] * 2 for m in members)
    cache = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=DEV)
    rt = SimpleNamespace(device=DEV, cache=SimpleNamespace(storage=cache.untyped_storage(),
                         slot_bytes=slot_bytes), layout=SimpleNamespace(layers=[
                         SimpleNamespace(members=members)]))  # fmt: skip
    if not K < slots <= 1023:
        raise SystemExit(f"--slots: a part of the cache has {K + 1} to 1023 slots, got {slots}")
    copies = SimpleNamespace(rt=rt, k=K, lo=[0], hi=[slots - K], _slot_views={})
    copies.window = lambda li: _graphed.Stage.window(copies, li)
    copies.slot_views = lambda *a: _graphed.Stage.slot_views(copies, *a)
    tables = SimpleNamespace(k=K, copies=copies, lo=[0], hi=[slots - K])
    gen = torch.Generator(device=DEV).manual_seed(slots)
    experts = torch.randperm(E, device=DEV, generator=gen)[:K].sort().values
    at = torch.randperm(slots - K, device=DEV, generator=gen)[:K]  # place r's slot
    for e, s in zip(experts.tolist(), at.tolist(), strict=True):
        for m, w in zip(members, (gate_up, down), strict=True):
            start = s * slot_bytes + m.region
            cache[start : start + w[e].numel() * 2].view(BF).copy_(w[e].reshape(-1))
    h = torch.randn(1, H, device=DEV, dtype=BF, generator=gen)
    offs = torch.cumsum(torch.histc(experts.int(), bins=E, min=0, max=E - 1), 0, dtype=torch.int32)

    def resident():
        rows = h.expand(K, H).contiguous()
        return grouped_linear(module._apply_gate(grouped_linear(rows, gate_up, offs, module)),
                              down, offs, module)  # fmt: skip

    computed_at = at  # every slot of a part is in its window

    base = cache.data_ptr()
    src = torch.tensor([[base + s * slot_bytes + m.region for m in members] for s in at.tolist()],
                       device=DEV)  # fmt: skip
    stage = torch.tensor([[base + (slots - K + r) * slot_bytes + m.region for m in members]
                          for r in range(K)], device=DEV)  # fmt: skip
    yes = torch.ones(K, dtype=torch.bool, device=DEV)
    no = torch.zeros(K, dtype=torch.bool, device=DEV)
    one = torch.ones(1, dtype=torch.int32, device=DEV)
    views = [_graphed.Stage.slot_views(copies, 0, slots - K + r, 1) for r in range(K)]
    sizes = [m.size[0] * m.size[1] * 2 for m in members]

    back, window_offs = _graphed._by_slot(tables, 0, computed_at)
    plan = SimpleNamespace(back=back, offs=window_offs)  # the CallPlan fields _in_slots reads

    def in_slots():
        return _graphed._in_slots(tables, 0, module, h, plan)

    def staged():
        for r in range(K):
            copy_routed(src[r : r + 1], stage[r : r + 1], yes[r : r + 1], stage[r : r + 1],
                        no[r : r + 1], sizes, DEVICE_PROGRAMS)  # fmt: skip
        outs = []
        for gu, dn in views:
            proj = module._apply_gate(grouped_linear(h, gu, one, module))
            outs.append(grouped_linear(proj, dn, one, module))
        return torch.cat(outs)

    want = resident()
    return {
        "slots": slots,
        "in_slots_bitwise": torch.equal(in_slots(), want),
        "staged_bitwise": torch.equal(staged(), want),
        "in_slots_us": round(replayed_us(in_slots), 1),
        "staged_us": round(replayed_us(staged), 1),
        "resident_us": round(replayed_us(resident), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", default="16,600,1023")
    args = ap.parse_args()
    torch.manual_seed(0)
    gate_up = torch.randn(E, 2 * W, H, device=DEV, dtype=BF) * 0.02
    down = torch.randn(E, H, W, device=DEV, dtype=BF) * 0.02
    rows = [run(int(s), Experts(), gate_up, down) for s in args.slots.split(",")]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {E} experts of "
          f"({2 * W}, {H}) and ({H}, {W}), top {K}, bf16; us per layer call, replayed")  # fmt: skip
    print("| slots | in slots us | staged us | resident us | in slots bitwise | staged bitwise |")
    print("|---:|---:|---:|---:|---|---|")
    for r in rows:
        cells = ("slots", "in_slots_us", "staged_us", "resident_us", "in_slots_bitwise",
                 "staged_bitwise")  # fmt: skip
        print("| " + " | ".join(str(r[c]) for c in cells) + " |")


if __name__ == "__main__":
    main()
