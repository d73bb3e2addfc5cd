"""Hit rates of a w-way set-associative expert cache against a fully associative one (LRU),
simulated on the planner's synthetic routing at the Qwen3-30B-A3B shape, on the CPU.

    PYTHONPATH=. python3 benchmarks/moe_assoc.py

A question for copies made by the copy engine inside a graph (benchmarks/switch_copy.py): a
copy node's destination is fixed at capture, so a miss could land in its final slot only if
the slots an expert may use were fixed (a set-associative cache). Each expert gets a random
set; a call's own experts are never evicted for each other (one that finds its set full of
them is not cached)."""

import collections
import random
import sys
import time

sys.path.insert(0, ".")
from torchoffload.planner import ExpertShape, synthetic_routing

shape = ExpertShape.fused_mlp(layers=48, experts=128, top_k=8, hidden=2048, width=768)
slot = shape.layout().slot_bytes
WARM, STEPS = 200, 1000


def run(calls, slots, ways):
    """LRU; ways=None: fully associative. A call's k experts are pinned while it runs: an
    expert whose set is full of the call's own experts is not cached (computed from a stage)."""
    nsets = 1 if ways is None else max(1, slots // ways)
    cap = slots if ways is None else ways
    rnd = random.Random(1)
    setof = {}
    sets = [collections.OrderedDict() for _ in range(nsets)]
    hits = total = 0
    for i, c in enumerate(calls):
        step = i // 48
        mine = set((c.layer, e) for e in c.experts)
        for e in c.experts:
            key = (c.layer, e)
            s = setof.setdefault(key, rnd.randrange(nsets))
            od = sets[s]
            if key in od:
                od.move_to_end(key)
                h = 1
            else:
                h = 0
                if len(od) >= cap:
                    victim = next((k for k in od if k not in mine), None)
                    if victim is None:
                        continue  # every way holds this call's experts: not cached
                    del od[victim]
                od[key] = True
            if step >= WARM:
                hits += h
                total += 1
    return hits / total


def main() -> None:
    for kind in ("uniform", "zipf"):
        t0 = time.time()
        prof = synthetic_routing(shape, WARM + STEPS, routing=kind, a=1.0, drift=8, seed=0)
        calls = prof.calls
        print(
            f"# {kind}: {len(calls)} block calls, slot {slot} bytes ({time.time() - t0:.1f} s)",
            flush=True,
        )
        print("| cache | slots | fully assoc. | 16-way | 8-way | 4-way | 2-way |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for gib in (8, 16, 32):
            slots = gib * 2**30 // slot
            row = [run(calls, slots, w) for w in (None, 16, 8, 4, 2)]
            print(
                f"| {gib} GiB | {slots} | " + " | ".join(f"{x:.3f}" for x in row) + " |", flush=True
            )


if __name__ == "__main__":
    main()
