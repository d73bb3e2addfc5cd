"""The graph mode's routing kernel (`_route`, Note: [One routing kernel per call] in
torchoffload/moe/_kernels.py) against the tensor operations it replaces, on the CPU under
Triton's interpreter: a check of the kernel's logic where no GPU is at hand. Not a pytest file
(CI's CPU torch has no triton, and the interpreter must be chosen before triton is imported):

    pip install triton
    TRITON_INTERPRET=1 python tests/interpret_routing.py

The same random walk as tests/test_moe_gpu.py's routing-kernel test (calls and prefetches of a
small Qwen3-MoE, a hot set of experts, "none" experts, a drawn prefetch cap, NaN scores of three
dtypes), at top_k 3 to 6 (the kernel pads to a power of two) and in one part or parts of 12
slots: tables, plans and copies' addresses equal element for element, a prefetch's cap held, no
slot given twice. The GPU test stays the one that counts (the compiled kernel, on CUDA
tensors); this one took 10-20 s a setting on a 2-core VM (triton 3.9, 2026-11-29)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torchoffload as to  # noqa: E402
from torchoffload.moe import _graphed, _kernels, _layout  # noqa: E402

TABLES = ("slot_of", "key_of", "stamp", "uses", "clock", "counts", "used")
# a call's plan (`CallPlan`)
FIELDS = ("place", "inv", "valid", "miss", "held", "also", "write", "inside", "src", "first",
          "dst", "dead", "back", "offs")  # fmt: skip


def _model(k: int):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=16, num_experts_per_tok=k, max_position_embeddings=256,
        experts_implementation="grouped_mm",
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).eval()


def _plan(tables, fused: bool, kind: str, li: int, index, score, direct: bool) -> dict:
    if kind == "call":
        p = (_graphed._fused(tables, li, index, direct=direct) if fused
             else tables.call(li, index, direct))  # fmt: skip
        return {f: getattr(p, f) for f in FIELDS if getattr(p, f) is not None}
    if fused:
        p = _graphed._fused(tables, li, index, prefetch=True, score=score)
        return {"src": p.src, "dst": p.dst, "write": p.write}
    src, dst, write = tables.plan_prefetch(li, index, score)
    return {"src": src, "dst": dst, "write": write}


def walk(policy: str, slots: int, block: int, limit: int, k: int, steps: int = 60) -> dict:
    """One setting's walk; raises AssertionError at the first difference."""
    _kernels.ROUTE_BLOCK = block
    _layout.GROUP_LIMIT = limit
    model = _model(k)
    least = to.minimum_cache_bytes(model)
    h = to.stream_experts(model, "cpu", cache_bytes=least + slots * (least // k), policy=policy,
                          pin_memory=False)  # fmt: skip
    tables = _graphed.DeviceTables(h._runtime)
    tables.push()
    n = 16
    g = torch.Generator().manual_seed(slots * 7 + block + k)
    hot = torch.randperm(n, generator=g)[:6].tolist()
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    done = {"call": 0, "prefetch": 0, "written": 0, "capped": 0}
    with torch.no_grad():
        for step in range(steps):
            li = int(torch.randint(4, (1,), generator=g))
            pool = hot if step % 3 else list(range(n))
            pick = [pool[i] for i in torch.randperm(len(pool), generator=g)[:k].tolist()]
            if step % 5 == 2:  # experts outside the layer (none), anywhere in the order
                for i in torch.randperm(k, generator=g)[: 1 + step % 2].tolist():
                    pick[i] = (n, -1, n + 3)[int(torch.randint(3, (1,), generator=g))]
            kind = "prefetch" if step % 2 else "call"
            tables.ahead = int(torch.randint(1, k + 1, (1,), generator=g))
            score = torch.randint(3, (k,), generator=g).float()
            score[torch.rand(k, generator=g) < 0.2] = float("nan")
            score = score.to(dtypes[step % 3])
            index = torch.tensor(pick)
            before = {t: getattr(tables, t).clone() for t in TABLES}
            outs = []
            for fused in (False, True):
                for t in TABLES:
                    getattr(tables, t).copy_(before[t])
                got = _plan(tables, fused, kind, li, index, score, bool(step % 5))
                got = {f: v.clone() for f, v in got.items()}
                outs.append(got | {t: getattr(tables, t).clone() for t in TABLES})
            ref, out = outs
            for name in ref:
                a, b = ref[name], out[name]
                if name in ("stamp", "key_of"):  # their trash entries aside
                    a, b = a[: tables.trash], b[: tables.trash]
                elif name == "dst":  # written only where a slot was taken
                    a, b = a[ref["write"]], b[ref["write"]]
                assert torch.equal(a, b), (policy, slots, block, limit, k, step, kind, name)
            written = ref["dst"][ref["write"]][:, 0]
            assert len(set(written.tolist())) == len(written), (step, "a slot given twice")
            done[kind] += 1
            done["written"] += len(written)
            if kind == "prefetch":
                assert len(written) <= tables.ahead
                done["capped"] += tables.ahead < k
    h.remove()
    return done


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("run with TRITON_INTERPRET=1 (Triton's interpreter, on the CPU)")
        return 2
    for setting in [("lru", 40, 16, 12, 3), ("lfu", 40, 4096, 1023, 4),
                    ("lru", 64, 16, 1023, 5), ("lfu", 9, 4096, 12, 6)]:  # fmt: skip
        print(setting, walk(*setting), flush=True)
    print("the routing kernel plans as the tensor operations in every setting")
    return 0


if __name__ == "__main__":
    sys.exit(main())
