"""Expert streaming (`stream_experts`) on the CPU: a small Qwen3-MoE from transformers and a
ModuleList mixture of experts give tokens bitwise equal to the resident model at the least
cache, a middle one and every expert cached; the stats count what the routers picked; the
stream protocol's order is checked with a recording copy engine; remove() restores."""

from __future__ import annotations

import copy
import io
import itertools

import pytest
import torch
from fuzz_models import MoEBlock, MoESpec, build_moe, tokens  # tests/ is on sys.path
from torch import nn

import torchoffload as to
from torchoffload import stream_experts, stream_weights
from torchoffload._hosted import HostedError
from torchoffload.moe._cache import CachePolicy, ExpertCache

SPEC = MoESpec(vocab=50, dim=16, hidden=24, layers=3, experts=6, top_k=2, bias=True,
               norm_topk=True, dense_first=False, dtype="float32", seed=0)  # fmt: skip


def moe(**kw):
    from dataclasses import replace

    return build_moe(replace(SPEC, **kw)).eval()


def inputs():
    """Batch 1, one token, new shapes, and a shape again."""
    return [
        tokens(SPEC, b, s, i) for i, (b, s) in enumerate([(1, 1), (2, 5), (1, 1), (3, 2), (2, 5)])
    ]


def count_uses(model):
    """Forward hooks on a resident model: the routed expert uses each block call makes (for a
    ModuleList: each call of an expert module; fused: each distinct routed expert)."""
    uses = []
    hooks = []
    for name, m in model.named_modules():
        if name.endswith("experts") and isinstance(m, nn.ModuleList):
            for e in m:
                hooks.append(e.register_forward_hook(lambda *a: uses.append(1)))
        elif name.endswith("mlp.experts"):

            def hook(mod, args, out):
                uses.append(len(set(args[1].flatten().tolist())))

            hooks.append(m.register_forward_hook(hook))
    return uses, hooks


def check_stats(handle, uses: int):
    st = handle.stats()
    assert st.hits + st.misses == uses, st
    assert sum(layer.uses for layer in st.layers) == uses
    for layer in st.layers:
        # a large grouped_mm call copies its layer's missing experts: routed ones are
        # misses, the others staged (Note: [Whole layers for large calls])
        assert layer.h2d_bytes == (layer.misses + layer.staged) * layer.expert_bytes, layer
    assert st.h2d_bytes == sum(layer.h2d_bytes for layer in st.layers)
    assert st.h2d_copies == st.misses + st.staged and st.unused == 0
    assert st.cached <= st.slots
    assert st.bytes_per_token == st.h2d_bytes / st.tokens
    return st


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a
    )


# -- a ModuleList mixture of experts ------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("slots", ["least", 5, "all"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_module_list_bitwise(policy, slots, dtype):
    ref, model = moe(dtype=dtype), moe(dtype=dtype)
    xs = inputs()
    uses, hooks = count_uses(ref)
    with torch.no_grad():
        expected = [ref(x) for x in xs]
    least = to.minimum_cache_bytes(model)
    per = least // SPEC.top_k
    cache = {"least": least, 5: 5 * per, "all": 10**9}[slots]
    before = snapshot(model)
    params = list(model.parameters())
    h = stream_experts(model, "cpu", cache_bytes=cache, policy=policy, pin_memory=False)
    with torch.inference_mode():
        for x, e in zip(xs, expected, strict=True):
            assert torch.equal(model(x), e)
    st = check_stats(h, len(uses))
    # "all": every expert and a graph's stage (one block's top_k), Note: [Routed experts in a
    # CUDA graph]
    every = SPEC.layers * SPEC.experts + SPEC.top_k
    assert st.slots == {"least": 2, 5: 5, "all": every}[slots]
    assert st.tokens == sum(x.numel() for x in xs) and st.calls == len(xs)
    if slots == "all":  # every expert copied once at most
        assert st.misses <= SPEC.layers * SPEC.experts and st.evictions == 0
    h.remove()
    assert list(model.parameters()) == params and all(type(p) is nn.Parameter for p in params)
    assert same(snapshot(model), before)
    for hk in hooks:
        hk.remove()


def test_module_list_dense_first_block_and_one_expert_routed():
    ref, model = moe(dense_first=True, top_k=1), moe(dense_first=True, top_k=1)
    h = stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model), pin_memory=False)
    assert h.layers == ["blocks.1.experts", "blocks.2.experts"]
    with torch.no_grad():
        for x in inputs():
            assert torch.equal(model(x), ref(x))
    h.remove()


def test_least_cache_is_top_k_slots_and_refused_below():
    model = moe()
    least = to.minimum_cache_bytes(model)
    e = model.blocks[0].experts[0]
    regions = sum((t.numel() * t.element_size() + 511) // 512 * 512 for t in e.parameters())
    assert least == SPEC.top_k * regions
    before = snapshot(model)
    with pytest.raises(
        ValueError, match=rf"cache_bytes={least - 1} holds 1 experts.*least is {least}"
    ):
        stream_experts(model, "cpu", cache_bytes=least - 1, pin_memory=False)
    assert same(snapshot(model), before) and not hasattr(model, "_torchoffload_experts")
    stream_experts(model, "cpu", cache_bytes=least, pin_memory=False).remove()


# -- Hugging Face Qwen3-MoE ----------------------------------------------------------------------


def qwen3(impl="eager", layers=2, dtype=torch.float32, hidden=32, width=16):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=64, moe_intermediate_size=width,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=8, num_experts_per_tok=2, max_position_embeddings=64,
        experts_implementation=impl,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(cfg).to(dtype).eval()


GEN = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


def prompt(batch=2, seq=5, seed=1):
    return torch.randint(1, 64, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("slots", ["least", 5, "all"])
def test_qwen3_moe_generate_bitwise(slots, dtype, impl):
    """Generated tokens bitwise the resident model's, with the per-expert loop and with
    transformers' grouped_mm (its default) and batched_mm (what its generate() decodes with on
    a GPU): Note: [Grouped experts, one group at a time]."""
    ref, model = qwen3(impl=impl, dtype=dtype), qwen3(impl=impl, dtype=dtype)
    with torch.no_grad():  # tokens of a tiny model can hide a wrong expert: logits too
        logits = [ref(prompt()).logits, ref(prompt(1, 1, 3)).logits]
    uses, hooks = count_uses(ref)
    expected = [ref.generate(prompt(), **GEN), ref.generate(prompt(1, 3, 2), **GEN)]
    least = to.minimum_cache_bytes(model)
    cache = {"least": least, 5: 5 * least // 2, "all": 1 << 30}[slots]
    before = snapshot(model)
    h = stream_experts(model, "cpu", cache_bytes=cache, pin_memory=False)
    assert h.layers == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert torch.equal(model.generate(prompt(), **GEN), expected[0])
    assert torch.equal(model.generate(prompt(1, 3, 2), **GEN), expected[1])
    st = check_stats(h, sum(uses))
    assert st.calls == 2 * GEN["max_new_tokens"]
    with torch.no_grad():
        assert torch.equal(model(prompt()).logits, logits[0])
        assert torch.equal(model(prompt(1, 1, 3)).logits, logits[1])
    if slots == "least":
        assert st.slots == 2 and st.hits < st.misses
    if slots == "all":  # a staged prefill (grouped_mm) overwrites cached experts: misses again
        assert st.evictions == 0 and st.hit_rate > 0.5
        assert st.misses <= 16 if impl != "grouped_mm" else st.staged > 0
    h.remove()
    assert same(snapshot(model), before)
    assert "forward" not in model.model.layers[0].mlp.experts.__dict__
    assert torch.equal(model.generate(prompt(), **GEN), expected[0])
    for hk in hooks:
        hk.remove()


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_the_views_of_the_cache_are_made_once_and_dropped_on_remove(impl):
    """`member_views` keeps the tensors it makes over the cache's storage (made anew for each
    routed expert, they took about a fifth of an eager block call's host time): the same tensor
    for the same place, whether the first call ran under inference mode or not, and none left
    after remove() (they would keep the device storage alive)."""
    ref, model = qwen3(impl=impl), qwen3(impl=impl)
    h = stream_experts(model, "cpu", cache_bytes=3 * to.minimum_cache_bytes(model),
                       pin_memory=False)  # fmt: skip
    cache = h._runtime.cache
    xs = [prompt(1, 1, s) for s in range(6)]
    with torch.inference_mode():
        first = [model(x).logits for x in xs]
    made = dict(cache.views)
    assert made and all(isinstance(v, torch.Tensor) for v in made.values())
    with torch.no_grad():
        again = [model(x).logits for x in xs]
        expected = [ref(x).logits for x in xs]
    assert all(cache.views[k] is v for k, v in made.items())
    for a, b, e in zip(first, again, expected, strict=True):
        assert torch.equal(a, e) and torch.equal(b, e)
    h.remove()
    assert cache.views == {} and cache.storage is None


@pytest.mark.parametrize(
    ("dtype", "hidden", "width", "cache", "runs"),
    [
        (torch.float32, 32, 16, "all", [2]),  # one run of top_k = 2 per one-token call
        (torch.float32, 32, 16, "least", [2]),  # top_k slots: the routed experts fill them
        (torch.float16, 40, 8, "all", [1, 1]),  # slices of 1280 and 640 bytes: not stacked
    ],
    ids=["stacked", "least", "unaligned"],
)
def test_routed_experts_are_stacked_in_runs_where_the_cache_holds_them(
    monkeypatch, dtype, hidden, width, cache, runs
):
    """Note: [Routed experts stacked]: a grouped_mm call computes the routed experts already in
    their slots in runs of up to top_k, one grouped GEMM per projection each, and the logits
    are the resident model's, bitwise, with several tokens' rows per expert too; runs of one
    where a member's slice is not a multiple of 512 bytes."""
    from torchoffload.moe import _grouped

    ref = qwen3(impl="grouped_mm", dtype=dtype, hidden=hidden, width=width)
    model = qwen3(impl="grouped_mm", dtype=dtype, hidden=hidden, width=width)
    least = to.minimum_cache_bytes(model)
    h = stream_experts(model, "cpu", cache_bytes=least if cache == "least" else 1 << 30,
                       pin_memory=False)  # fmt: skip
    seen = []
    real = _grouped.grouped_linear

    def spy(rows, weight, offs, module):
        seen.append(1 if weight.dim() == 2 else weight.shape[0])
        return real(rows, weight, offs, module)

    monkeypatch.setattr(_grouped, "grouped_linear", spy)
    rt = h._runtime
    rt.engine = eng = RecordingEngine()
    read, stack = rt.views, _grouped.stacked
    monkeypatch.setattr(rt, "views", lambda li, e, slot: eng.log.append(("read", slot.offset))
                        or read(li, e, slot))  # fmt: skip
    monkeypatch.setattr(_grouped, "stacked", lambda views: eng.log.append(("stack",))
                        or stack(views))  # fmt: skip
    with torch.no_grad():
        for s in range(4):
            x = prompt(1, 1, s)
            model(x)  # the first fills the cache
            seen.clear()
            assert torch.equal(model(x).logits, ref(x).logits)
            # per layer, two projections per run
            assert seen == [n for n in runs for _ in range(2)] * 2
        x = prompt(2, 3, 9)  # rows of several tokens per expert: the offsets of each run
        assert torch.equal(model(x).logits, ref(x).logits)
    # each slot's "done" is recorded after its last reader: one event for a run's slots after
    # its stack, a lone expert's after its GEMMs (the next read or the block's end)
    kinds = "".join({"read": "r", "stack": "s", "record": "d"}.get(e[0], "") for e in eng.log)
    stacks = [i for i, k in enumerate(kinds) if k == "s"]
    if runs == [2]:
        assert stacks and all(kinds[i - 2 : i + 2] == "rrsd" for i in stacks), kinds
    else:
        assert "s" not in kinds and "rd" in kinds and "rr" not in kinds
    # and a later copy into any slot of a run waits on that event
    base, sb = rt.cache.data.data_ptr(), rt.cache.slot_bytes
    last_done, reads, checked = {}, [], 0
    for entry in eng.log:
        if entry[0] == "read":
            reads.append(entry[1])
        elif entry[0] == "record":
            last_done.update(dict.fromkeys(reads, entry[1]))
            reads = []
        elif entry[0] == "load":
            off = (entry[1] - base) // sb * sb
            if off in last_done:
                assert last_done[off] in entry[2], (entry, last_done[off])
                checked += 1
    from torchoffload.moe._runtime import load

    for slot in rt.cache.slots:  # each slot read, copied into again (no call evicted here)
        if slot.offset in last_done and slot.key is not None:
            key = slot.key
            rt.cache.forget(key)
            load(rt, slot, key)
            assert last_done[slot.offset] in eng.log[-1][2]
            checked += 1
    assert checked >= 2
    h.remove()


def test_qwen3_moe_slot_alignment_follows_the_resident_slices():
    """A member lies where its address is congruent mod 512 to the resident slice's (Note:

    [Experts as units]): at hidden 24 and width 12 in fp16 the slices are 1152 and 576 bytes,
    not multiples of 512; generate is bitwise at the least cache."""
    from torchoffload.moe._layout import find_experts

    ref = qwen3(dtype=torch.float16, hidden=24, width=12)
    model = qwen3(dtype=torch.float16, hidden=24, width=12)
    layer = find_experts(model).layers[0]
    assert [m.nbytes for m in layer.members] == [1152, 576]
    assert {layer.shift(e, 0) for e in range(8)} == {e * 1152 % 512 for e in range(8)} != {0}
    for e in range(8):
        for m, member in enumerate(layer.members):
            resident = e * member.nbytes
            assert (member.region + layer.shift(e, m)) % 512 == resident % 512
            assert (
                layer.shift(e, m) + member.nbytes
                <= (layer.members[m + 1].region if m + 1 < len(layer.members) else layer.slot_bytes)
                - member.region
            )
    h = stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model), pin_memory=False)
    assert torch.equal(model.generate(prompt(), **GEN), ref.generate(prompt(), **GEN))
    h.remove()


def test_qwen3_moe_placeholders_serve_reads_and_writes():
    ref, model = qwen3(), qwen3()
    h = stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)
    x = prompt()
    with torch.no_grad():
        model(x)  # fills the cache
        w = model.model.layers[1].mlp.experts.down_proj
        assert w.shape == (8, 32, 16) and torch.equal(
            w.norm(), ref.model.layers[1].mlp.experts.down_proj.norm()
        )
        for m in (model, ref):  # an in-place write outside the forward: the cache forgets it
            m.model.layers[1].mlp.experts.down_proj[3].mul_(0.5)
        assert torch.equal(model(x).logits, ref(x).logits)
    sd = model.state_dict()
    assert same(sd, ref.state_dict())
    buf = io.BytesIO()
    torch.save({k: v * 0.5 for k, v in sd.items()}, buf)
    buf.seek(0)
    model.load_state_dict(torch.load(buf))
    ref.load_state_dict({k: v * 0.5 for k, v in ref.state_dict().items()})
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)
    h.remove()
    assert same(snapshot(model), snapshot(ref))


@pytest.mark.parametrize("layout", ["fused", "list"])
def test_set_on_an_expert_placeholder_is_refused(layout):
    """``p.set_(x)`` never reaches ``__torch_function__`` (torch binds it outside the override
    machinery): it pointed the placeholder at ``x``'s storage while the forward kept computing
    from the host store, so the resident model used ``x`` and the streamed one the old values
    (logits off, silently). It is refused like ``.data = x``; the values and outputs are
    unchanged, and ``copy_`` (the way the error names) reaches the outputs."""
    ref, model = (qwen3(), qwen3()) if layout == "fused" else (moe(), moe())
    h = stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)
    x = prompt() if layout == "fused" else tokens(SPEC, 2, 3, 0)

    def out(m):
        with torch.no_grad():
            y = m(x)
        return y.logits if layout == "fused" else y

    def expert(m):
        if layout == "fused":
            return m.model.layers[1].mlp.experts.down_proj
        return next(m.blocks[1].experts[4].parameters())

    out(model)  # the cache holds the experts
    p = expert(model)
    before = snapshot(model)
    new = torch.ones(p.shape, dtype=p.dtype)
    with torch.no_grad(), pytest.raises(HostedError, match=r"set_ on streamed .*copy_"):
        p.set_(new)
    assert type(p) is not nn.Parameter and same(snapshot(model), before)
    assert torch.equal(out(model), out(ref))
    with torch.no_grad():
        p.copy_(new)
        expert(ref).set_(new.clone())
    assert torch.equal(out(model), out(ref))
    h.remove()
    assert same(snapshot(model), snapshot(ref))


@pytest.mark.parametrize("root", ["model", "layer"])
def test_qwen3_moe_refused_assign_loads_nothing(root):
    """load_state_dict(assign=True) is refused before any tensor is assigned (the experts'
    parameters kept: the forward reads their host store); a later load without assign, as the
    error says, reaches the outputs. A state dict without expert keys assigns as resident."""
    ref, model = qwen3(), qwen3()
    h = stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model), pin_memory=False)
    params = dict(model.named_parameters())
    new = {k: v * 2 for k, v in ref.state_dict().items()}
    at = "model.layers.1."
    target = model if root == "model" else model.model.layers[1]
    sd = new if root == "model" else {k[len(at) :]: v for k, v in new.items() if k.startswith(at)}
    with pytest.raises(RuntimeError, match=r"load_state_dict\(assign=True\) would replace"):
        target.load_state_dict(sd, assign=True)
    assert all(p is params[n] for n, p in model.named_parameters())
    x = prompt()
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)
    ref.load_state_dict(new)
    model.load_state_dict(new)
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)
    w = ref.lm_head.weight.detach() * 3
    for m in (ref, model):
        m.load_state_dict({"lm_head.weight": w.clone()}, strict=False, assign=True)
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)
    h.remove()


def test_qwen3_moe_expert_parameter_replaced_on_its_module():
    """``experts.down_proj = nn.Parameter(new)`` while the experts stream: the forward, which
    computes from the replaced tensor's host store, refuses (eager and graph calls);
    state_dict holds the new tensor's values; after remove() the outputs are the resident
    model's with the new tensor. A list expert reads its module's tensors: bitwise."""
    ref, model = qwen3(), qwen3()
    h = stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model), pin_memory=False)
    graphed = h.cuda_graph(lambda ids: model(input_ids=ids).logits)
    x, one = prompt(), prompt()[:1, :1]
    with torch.no_grad():
        for _ in range(3):  # eager, captured, replayed
            assert torch.equal(graphed(one), ref(one).logits)
    new = ref.model.layers[0].mlp.experts.down_proj.detach() * 2
    for m in (ref, model):
        m.model.layers[0].mlp.experts.down_proj = nn.Parameter(new.clone())
    with torch.no_grad(), pytest.raises(RuntimeError, match="was replaced on its module"):
        model(x)
    with pytest.raises(RuntimeError, match="was replaced on its module"):
        graphed(one)
    assert same(snapshot(model), snapshot(ref))
    h.remove()
    with torch.no_grad():
        assert torch.equal(model(x).logits, ref(x).logits)

    ref, model = moe(), moe()
    h = stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model), pin_memory=False)
    w = ref.blocks[1].experts[2].w1.weight.detach() * 2
    for m in (ref, model):
        m.blocks[1].experts[2].w1.weight = nn.Parameter(w.clone())
    with torch.no_grad():
        for x in inputs():
            assert torch.equal(model(x), ref(x))
    assert same(snapshot(model), snapshot(ref))
    h.remove()


def test_qwen3_other_experts_implementations_are_refused_with_the_fix():
    pytest.importorskip("transformers")
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if "sonicmoe" not in ALL_EXPERTS_FUNCTIONS:
        pytest.skip("this transformers has no other experts implementation to refuse")
    model = qwen3(impl="grouped_mm")
    model.config._experts_implementation = "sonicmoe"  # its kernels are not installed here
    before = snapshot(model)
    with pytest.raises(
        ValueError,
        match=r"experts_implementation='sonicmoe'.*set_experts_implementation\('grouped_mm'\)",
    ):
        stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False)
    assert same(snapshot(model), before)
    model.set_experts_implementation("grouped_mm")
    h = stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False)
    # switched after setup: the next call is refused, nothing computed with another kernel
    model.config._experts_implementation = "sonicmoe"
    refused = r"'model.layers.0.mlp.experts' run with .*'sonicmoe'"
    with pytest.raises(ValueError, match=refused), torch.no_grad():
        model(prompt())
    model.set_experts_implementation("eager")
    with torch.no_grad():
        model(prompt())
    h.remove()


def test_qwen3_grouped_mm_options_it_does_not_compute_are_refused():
    """A grouped_mm experts module with a decorator option other than Qwen3-MoE's (here expert
    parallelism, whose sentinel rows transformers masks) is refused at setup and at a call;
    so is host_compute, whose host results the grouped sum cannot join."""
    model = qwen3(impl="grouped_mm")
    experts = model.model.layers[1].mlp.experts
    experts._is_expert_parallel = True
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts' have _is_expert_parallel=True"):
        stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False)
    assert same(snapshot(model), before)
    experts._is_expert_parallel = False
    with pytest.raises(ValueError, match=r"host_compute serves the experts' eager .*grouped_mm"):
        stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False, host_compute=True)
    assert same(snapshot(model), before)
    h = stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False)
    experts._is_expert_parallel = True
    with pytest.raises(RuntimeError, match=r"have _is_expert_parallel=True"), torch.no_grad():
        model(prompt())
    experts._is_expert_parallel = False
    h.remove()
    assert same(snapshot(model), before)
    # an eager model streamed with host compute, then switched to grouped_mm: refused
    model.set_experts_implementation("eager")
    h = stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False, host_compute=True)
    model.set_experts_implementation("grouped_mm")
    with pytest.raises(RuntimeError, match=r"host_compute serves"), torch.no_grad():
        model(prompt())
    h.remove()


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_qwen3_kernels_routing_outside_the_layer_is_refused(impl):
    """transformers' grouped kernel leaves the rows of an expert index outside [0, E) unwritten
    (batched_mm clamps or masks it, by version): the streamed call raises instead of adding
    stale rows."""
    model = qwen3(impl=impl)
    stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False)
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(3, 32)
    index = torch.tensor([[0, 1], [2, 8], [3, 4]])
    outside = r"routed to an expert index outside \[0, 8\)"
    with pytest.raises(ValueError, match=outside), torch.no_grad():
        experts(x, index, torch.full((3, 2), 0.5))
    with torch.no_grad():  # the block was ended: the next call runs
        experts(x, index.clamp(max=7), torch.full((3, 2), 0.5))


# -- unknown layouts and bad input -----------------------------------------------------------------


class OtherExperts(nn.Module):
    """Fused experts with biases: a forward that is not Qwen3MoeExperts'."""

    def __init__(self):
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.randn(4, 8, 4))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(4, 8))
        self.down_proj = nn.Parameter(torch.randn(4, 4, 4))

    def forward(self, x, idx, w):
        return x


class NoRouter(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        return sum(e(x) for e in self.experts)


class Wrapper(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.mlp = inner


def test_unknown_layouts_are_named():
    cases = [
        (Wrapper(nn.Module()), r"found no mixture-of-experts layers in Wrapper"),
        (
            Wrapper(Wrapper(OtherExperts())),
            r"does not know: mlp\.mlp: OtherExperts whose eager forward is not",
        ),
        (Wrapper(NoRouter()), r"'mlp\.experts' has no router beside it in NoRouter"),
    ]
    for model, match in cases:
        before = snapshot(model)
        with pytest.raises(ValueError, match=match):
            stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False)
        with pytest.raises(ValueError, match=match):
            to.minimum_cache_bytes(model)
        assert same(snapshot(model), before)


def test_bad_arguments():
    model = moe()
    before = snapshot(model)
    bad = [
        (dict(cache_bytes=1.5), TypeError, "cache_bytes must be an int"),
        (dict(cache_bytes=0), ValueError, "cache_bytes must be >= 1"),
        (
            dict(cache_bytes=1 << 20, policy="fifo"),
            ValueError,
            "policy must be 'lru' or 'lfu', got 'fifo'",
        ),
        (dict(cache_bytes=1 << 20, use_streams=1), TypeError, "use_streams must be a bool"),
        (dict(cache_bytes=1 << 20, pin_memory=None), TypeError, "pin_memory must be a bool"),
    ]
    for kw, exc, match in bad:
        with pytest.raises(exc, match=match):
            stream_experts(model, "cpu", pin_memory=kw.pop("pin_memory", False), **kw)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        stream_experts("model", cache_bytes=1 << 20)
    with pytest.raises(TypeError, match="use torchoffload.stream_experts"):
        to.ExpertStreamHandle()
    assert same(snapshot(model), before)


def test_streaming_twice_or_under_another_engine_is_refused():
    model = moe()
    h = stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False)
    with pytest.raises(RuntimeError, match="already streams its experts"):
        stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False)
    h.remove()
    w = stream_weights(model, "cpu", budget_bytes=1 << 20, pin_memory=False)
    with pytest.raises(RuntimeError, match="already streams with stream_weights"):
        stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False)
    w.remove()


def test_refusals_change_nothing():
    ref, model = moe(), moe()
    x = tokens(SPEC, 2, 3, 0)
    h = stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model), pin_memory=False)
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="ran with gradients enabled"):
        model(x)
    with pytest.raises(TypeError, match="cannot copy or pickle a model while stream_experts"):
        copy.deepcopy(model)
    with pytest.raises(HostedError, match="would be converted from torch.float32"):
        model.to(torch.float64)
    with pytest.raises(RuntimeError, match=r"load_state_dict\(assign=True\) would replace"):
        model.load_state_dict(ref.state_dict(), assign=True)
    with pytest.raises(TypeError, match="cannot copy or pickle"):
        copy.deepcopy(h)
    assert same(snapshot(model), before)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    h.remove()


def test_in_place_write_of_a_bound_expert_is_an_error():
    def double(module, args):
        module.weight.mul_(2)

    model = moe(layers=1)
    hook = model.blocks[0].experts[0].w1.register_forward_pre_hook(double)
    h = stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False)
    x = tokens(SPEC, 4, 8, 0)  # 32 tokens: every expert is routed
    with (
        torch.no_grad(),
        pytest.raises(
            RuntimeError, match=r"blocks\.0\.experts\.0\.w1\.weight was modified in place"
        ),
    ):
        model(x)
    hook.remove()
    with torch.no_grad():
        model(x)  # the block recovered
    h.remove()


def test_a_failing_expert_leaves_a_usable_model():
    ref, model = moe(), moe()
    x = tokens(SPEC, 3, 4, 0)
    h = stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model), pin_memory=False)
    fails = [e.w2.register_forward_pre_hook(lambda *a: 1 / 0) for e in model.blocks[1].experts]
    with torch.no_grad():
        with pytest.raises(ZeroDivisionError):
            model(x)  # inside an expert's forward, its tensors bound
        for f in fails:
            f.remove()
        assert torch.equal(model(x), ref(x))
    assert all(type(p) is not nn.Parameter for p in model.blocks[1].experts.parameters())
    assert all(s.pins == 0 for s in h._runtime.cache.slots)
    h.remove()


@pytest.mark.parametrize("then", ["call", "remove", "state_dict"])
def test_an_interrupted_forward_is_undone(then):
    """A KeyboardInterrupt inside an expert skips the always_call hooks (Note: [Interrupted
    expert blocks]): the next call, remove() or state_dict finds the block's call gone and
    unbinds and unpins what it left."""

    def interrupt(module, args):
        raise KeyboardInterrupt

    ref, model = moe(), moe()
    x = tokens(SPEC, 3, 4, 0)
    h = stream_experts(model, "cpu", cache_bytes=to.minimum_cache_bytes(model), pin_memory=False)
    hooks = [e.w2.register_forward_pre_hook(interrupt) for e in model.blocks[1].experts]
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        model(x)
    for hk in hooks:
        hk.remove()
    left = [p for p in model.blocks[1].experts.parameters() if type(p) is nn.Parameter]
    assert left  # bound, as the interrupt left it
    if then == "call":
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
    elif then == "state_dict":
        assert same(snapshot(model), snapshot(ref))
    if then != "remove":
        assert all(type(p) is not nn.Parameter for p in model.blocks[1].experts.parameters())
        assert all(s.pins == 0 for s in h._runtime.cache.slots)
    h.remove()
    assert same(snapshot(model), snapshot(ref))


def test_handle_context_manager_reset_and_cached():
    model = moe()
    with stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False) as h:
        with torch.no_grad():
            model(tokens(SPEC, 1, 1, 0))
        st = h.stats()
        assert len(h.cached()) == st.cached == st.misses == SPEC.top_k * SPEC.layers
        assert all(name.startswith("blocks.") for name, _ in h.cached())
        h.reset_stats()
        assert h.stats().misses == 0 and h.stats().cached == st.cached
        assert "3 layers" in repr(h) and "policy=lru" in repr(h)
    assert h.removed and repr(h) == "ExpertStreamHandle(removed)"
    assert not hasattr(model, "_torchoffload_experts")
    h.remove()  # idempotent


# -- the cache's policies -----------------------------------------------------------------------


def cache(slots, policy):
    return ExpertCache(slots, 64, torch.device("cpu"), CachePolicy(policy))


def fill(c, key):
    slot = c.lookup(key)
    if slot is None:
        slot = c.take(key[0], lambda k: False)
        c.assign(slot, key, None)
    c.use(key)
    return slot


def test_lru_evicts_the_least_recently_used():
    c = cache(3, "lru")
    for k in [(0, 1), (0, 2), (0, 3), (0, 1), (0, 4)]:
        fill(c, k)
    assert set(c.where) == {(0, 1), (0, 3), (0, 4)} and c.evictions == 1


def test_lfu_keeps_the_hot_expert():
    c = cache(2, "lfu")
    for k in [(0, 1), (0, 1), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5)]:
        fill(c, k)
    assert (0, 1) in c.where and (0, 5) in c.where
    c2 = cache(2, "lru")
    for k in [(0, 1), (0, 1), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5)]:
        fill(c2, k)
    assert (0, 1) not in c2.where


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_pinned_and_spared_slots_are_not_evicted(policy):
    c = cache(2, policy)
    a, b = fill(c, (0, 0)), fill(c, (0, 1))
    a.pins = 1
    assert c.take(0, lambda k: k == (0, 1)) is None  # 0 pinned, 1 spared
    assert c.take_routed([(0, 1)]) is b and (0, 1) not in c.where
    a.pins = 0


# -- parts of the cache (Note: [Parts of the cache]) ---------------------------------------------


@pytest.mark.parametrize("limit", [2, 3, 5, 9, 12, 1023])
@pytest.mark.parametrize("layers", [1, 3, 4])
def test_the_cache_is_cut_into_parts_of_at_most_the_limit(limit, layers, monkeypatch):
    """Parts are consecutive slots for consecutive layers, cover every slot the cache keeps,
    hold ``top_k`` slots at least and at most the limit (where it allows a stage), one part
    where the slots fit the limit; the largest cache gives each part its experts and a stage."""
    from torchoffload.moe import _layout

    monkeypatch.setattr(_layout, "GROUP_LIMIT", limit)
    layout = _layout.find_experts(qwen3(layers=layers))
    k, experts = layout.top_k, [layer.experts for layer in layout.layers]
    top = layout.slots_for(1 << 40)
    for slots in range(k, top + 1):
        parts = layout.parts(layout.slots_for(slots * layout.slot_bytes))
        assert parts[0].slots.start == 0 and parts[0].layers.start == 0
        assert parts[-1].layers.stop == layers
        for a, b in zip(parts, parts[1:], strict=False):
            assert a.slots.stop == b.slots.start and a.layers.stop == b.layers.start
        assert all(len(p.layers) and k <= len(p.slots) <= max(limit, k) for p in parts)
        if slots <= limit:
            assert len(parts) == 1 and len(parts[0].slots) == slots
        assert parts[-1].slots.stop <= slots
    for p in layout.parts(top):
        held = sum(experts[i] for i in p.layers)
        assert len(p.slots) == held + k or len(p.slots) == max(limit, k) < held + k


@pytest.mark.parametrize(
    ("layers", "experts", "top_k", "fewest"),
    [(48, 128, 8, 7), (94, 128, 8, 14), (58, 256, 8, 20), (60, 384, 8, 30), (48, 512, 10, 48),
     (24, 32, 4, 1)],
)  # fmt: skip
def test_a_cache_of_every_expert_holds_every_expert_in_graph_mode(layers, experts, top_k, fewest):
    """For the shapes of Qwen3-30B-A3B, Qwen3-235B-A22B, DeepSeek-V3, Kimi K2, Qwen3-Next and
    Mixtral-like: at the least budget that holds every expert (each part its layers' experts and
    a stage), the fewest parts, no run of layers overflowing a part's 1023 slots (found in
    review: cut by slots alone, 8 layers of 128 experts overflowed, and the cap shrank). Each
    stage more buys a part more, down to a part per layer at the largest cache (`slots_for` of
    any budget more): a graph call's window is then its layer's experts and stage (Note:
    [Parts of the cache])."""
    from torchoffload.planner import ExpertShape

    layout = ExpertShape.fused_mlp(layers=layers, experts=experts, top_k=top_k, hidden=64,
                                   width=32).layout()  # fmt: skip
    total = layers * experts
    least = total + fewest * top_k
    assert layout.slots_for(least * layout.slot_bytes) == least
    cut = layout.parts(least)
    assert len(cut) == fewest
    assert all(len(p.slots) == len(p.layers) * experts + top_k <= 1023 for p in cut)
    assert layout.slots_for((least - 1) * layout.slot_bytes) < least  # an expert short
    top = layout.slots_for(1 << 60)
    cut = layout.parts(top)
    per_layer = total > 1023
    assert len(cut) == (layers if per_layer else 1)
    assert top == total + len(cut) * top_k
    assert all(len(p.slots) == len(p.layers) * experts + top_k for p in cut)
    more = layout.slots_for((least + 3 * top_k + 1) * layout.slot_bytes)  # three stages more
    assert more == least + 3 * top_k if per_layer and fewest + 3 <= layers else more <= top
    if per_layer and fewest + 3 <= layers:
        assert len(layout.parts(more)) == fewest + 3


def test_more_parts_are_cut_only_where_each_run_fits_a_part(monkeypatch):
    """Found in review: with unequal layers (10, 13, 23, 6, 18 experts, top 4, parts of at most
    31 slots) the slots past every expert bought 4 parts, whose runs put 23 + 6 experts and a
    stage in one part: over 31, so a fifth part was added whose stage the slots could not pay,
    and budgets of 86-89 slots held 66-69 experts where 82 held all 70. More parts are cut only
    where every run still fits (Note: [Parts of the cache])."""
    from types import SimpleNamespace

    from torchoffload.moe import _layout

    monkeypatch.setattr(_layout, "GROUP_LIMIT", 31)
    experts = [10, 13, 23, 6, 18]
    layout = SimpleNamespace(layers=[SimpleNamespace(experts=e) for e in experts], top_k=4,
                             slot_bytes=1, total_experts=sum(experts))  # fmt: skip
    layout.parts = lambda s: _layout.ExpertLayout.parts(layout, s)

    def held(slots):  # experts the parts of ``slots`` slots hold (each less its stage)
        return sum(min(len(p.slots) - 4, sum(experts[i] for i in p.layers))
                   for p in layout.parts(slots))  # fmt: skip

    for budget in range(82, 120):
        slots = _layout.ExpertLayout.slots_for(layout, budget)
        assert held(slots) == 70, (budget, slots, layout.parts(slots))
        assert all(len(p.slots) <= 31 for p in layout.parts(slots))


def test_an_expert_is_cached_only_in_its_layers_part():
    """Each part has its own free slots and policy: a layer's experts take and evict only its
    part's slots, and the map goes out and back in (`policy_order`, `load_map`) unchanged."""
    from torchoffload.moe._layout import Part

    for policy in ("lru", "lfu"):
        parts = (Part(range(0, 2), range(0, 3)), Part(range(2, 3), range(3, 5)))
        c = ExpertCache(5, 64, torch.device("cpu"), CachePolicy(policy), parts=parts)
        for key in [(2, 0), (2, 1), (2, 2), (0, 0), (1, 0), (2, 3), (0, 1), (1, 1)]:
            slot = fill(c, key)
            assert slot.index in (range(3, 5) if key[0] == 2 else range(0, 3))
        assert sum(k[0] == 2 for k in c.where) == 2 and sum(k[0] < 2 for k in c.where) == 3
        order, uses = c.policy_order(), c.policy_uses()
        where = {k: s.index for k, s in c.where.items()}
        c.load_map([(k, where[k]) for k in order], uses)
        assert {k: s.index for k, s in c.where.items()} == where and c.policy_order() == order
        assert fill(c, (0, 5)).index in range(0, 3) and fill(c, (2, 6)).index in range(3, 5)
        with pytest.raises(ValueError, match="do not cover"):
            ExpertCache(6, 64, torch.device("cpu"), CachePolicy(policy), parts=parts)


# -- the stream protocol, recorded --------------------------------------------------------------


class RecordingEngine:
    """A copy engine that records, with labelled events: loads (slot offset, the events
    waited on) and compute-stream waits; `views` are recorded by a wrapper of the runtime."""

    synchronous = True

    def __init__(self):
        self.log = []
        self.n = itertools.count()

    def current_stream(self):
        return "compute"

    def load(self, pairs, after):
        for dst, src in pairs:
            dst.copy_(src)
        ready = f"ready{next(self.n)}"
        self.log.append(("load", pairs[0][0].data_ptr() if pairs else None, list(after), ready))
        return ready

    def load_many(self, groups):
        return [self.load(pairs, after) for pairs, after in groups]

    def wait(self, event, stream=None):
        assert stream in (None, "compute")
        self.log.append(("wait", event))

    def record(self, stream=None):
        assert stream in (None, "compute")
        event = f"done{next(self.n)}"
        self.log.append(("record", event))
        return event


@pytest.mark.parametrize("kind", ["list", "fused"])
def test_every_copy_waits_on_its_slots_last_reader_and_every_read_on_its_copy(kind):
    """Note: [Routed experts and the copy stream], checked on the order of calls: a copy into
    a slot waits on the "done" event of the last compute that read the slot; the compute of an
    expert copied for it waits on that copy's "ready" first; a hit waits on nothing. (Fails
    without either wait.)"""
    if kind == "list":
        ref, model = moe(), moe()
        xs, run = inputs(), lambda m, x: m(x)
    else:
        ref, model = qwen3(), qwen3()
        xs, run = [prompt(1, 1, i) for i in range(6)] + [prompt()], lambda m, x: m(x).logits
    h = stream_experts(model, "cpu", cache_bytes=4 * to.minimum_cache_bytes(model),
                       pin_memory=False)  # fmt: skip
    rt = h._runtime
    rt.engine = eng = RecordingEngine()
    name = "bind_offsets" if kind == "list" else "views"
    read = getattr(rt, name)

    def recorded(li, e, slot):
        eng.log.append(("read", slot.offset, e))
        return read(li, e, slot)

    setattr(rt, name, recorded)
    with torch.no_grad():
        for x in xs:
            assert torch.equal(run(model, x), run(ref, x))
    base = rt.cache.data.data_ptr()
    last_done: dict[int, str] = {}  # slot offset -> done event of its last reader
    unwaited: dict[str, int] = {}  # ready events not waited on yet -> their slot
    copied: set[int] = set()  # slots whose copy was waited on and not read yet
    reading = None
    loads = waits = 0
    for entry in eng.log:
        if entry[0] == "load":
            _, ptr, after, event = entry
            off = (ptr - base) // rt.cache.slot_bytes * rt.cache.slot_bytes
            if off in last_done:
                assert last_done[off] in after, (entry, last_done[off])
            assert reading != off
            unwaited[event] = off
            loads += 1
        elif entry[0] == "wait":
            copied.add(unwaited.pop(entry[1]))
            waits += 1
        elif entry[0] == "read":
            reading = entry[1]
            assert reading not in unwaited.values(), entry  # its copy was waited on first
            copied.discard(reading)
        elif entry[0] == "record":
            last_done[reading] = entry[1]
            reading = None
    st = h.stats()
    assert loads == waits == st.misses and st.hits > 0
    h.remove()


class SizedEngine(RecordingEngine):
    """`RecordingEngine`, its loads recording their bytes too."""

    def load(self, pairs, after):
        ready = super().load(pairs, after)
        self.log[-1] = (*self.log[-1], sum(dst.numel() for dst, _ in pairs))
        return ready


def test_a_large_grouped_mm_call_copies_its_layer_whole_after_the_region_is_read():
    """Note: [Whole layers for large calls]: a grouped_mm call of at least 2 rows per expert
    (a 10-token prompt at top 2 of 8) copies its layer whole into a region of the cache's
    storage, after the last reader of every slot the region overlaps, and runs transformers'
    forward there (logits bitwise the resident model's); a later copy into such a slot waits on
    the staged call's compute. Routed experts count as misses, the rest as staged."""
    ref, model = qwen3(impl="grouped_mm"), qwen3(impl="grouped_mm")
    uses, hooks = count_uses(ref)
    h = stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)
    rt = h._runtime
    rt.engine = eng = SizedEngine()
    read = rt.views

    def recorded(li, e, slot):
        eng.log.append(("read", slot.offset, e))
        return read(li, e, slot)

    rt.views = recorded
    # one-token calls, then prompts (staged: their experts cached outside the region come from
    # their slots)
    xs = [prompt(1, 1, i) for i in range(2)] + [prompt()] + [prompt(1, 1, i) for i in range(2, 4)]
    xs += [prompt(seed=7)]
    with torch.no_grad():
        for x in xs:
            assert torch.equal(model(x).logits, ref(x).logits)
    whole, sb = rt.staged, rt.cache.slot_bytes
    assert whole.regions == 2
    base = rt.cache.data.data_ptr()
    last_done: dict[int, str] = {}  # slot offset -> done event of its last reader
    # slots read and not yet exited: a run of stacked experts reads each of its slots, then
    # exits them all after one event (Note: [Routed experts stacked])
    reading: list[int] = []
    staged_slots, staged, staged_ready, computing = None, 0, None, False
    for entry in eng.log:
        if entry[0] == "load":
            _, ptr, after, ready, nbytes = entry
            start = ptr - base
            if nbytes > sb:  # a layer's region: after the last reader of each slot it covers
                staged, staged_ready, computing = staged + 1, ready, False
                start = start // whole.region * whole.region  # its first copy may be later
                staged_slots = [o for o in range(0, rt.cache.data.numel(), sb)
                                if o < start + whole.region and o + sb > start]  # fmt: skip
                missing = [o for o in staged_slots if o in last_done and last_done[o] not in after]
                assert not missing, (entry, missing)
            else:
                off = start // sb * sb
                if off in last_done:
                    assert last_done[off] in after, (entry, last_done[off])
        elif entry[0] == "read":
            reading.append(entry[1])
        elif entry[0] == "wait" and entry[1] == staged_ready:
            computing = True  # the staged compute: its record is the region's "done"
        elif entry[0] == "record":
            if staged_slots and not computing:
                continue  # after the copies from slots outside the region: theirs
            for off in staged_slots or reading:
                last_done[off] = entry[1]
            staged_slots, reading = None, []
    assert staged == 2 * 2  # two prompts, two layers
    st = check_stats(h, sum(uses))
    assert st.staged > 0 and st.layers[0].staged + st.layers[0].misses >= 2 * 8
    h.remove()
    for hk in hooks:
        hk.remove()


def test_chunked_staging_rules_refusals_and_stats():
    """Note: [Layers in chunks]: where the cache's storage holds one layer but not two, a large
    grouped_mm call stages its layer in two regions of half a layer each; an expert index
    outside the layer refused before any compute (both regions' copies then ordered before a
    later device copy there), reset_stats(), and eager calls after: every output bitwise the
    resident's."""
    ref, model = qwen3(impl="grouped_mm"), qwen3(impl="grouped_mm")
    from torchoffload.moe._handle import expert_layout

    layout = expert_layout(model)
    layer = layout.layers[0]
    region = sum(-(-layer.experts * m.nbytes // 512) * 512 for m in layer.members)
    slots = -(-region // layout.slot_bytes)  # the fewest slots that hold one layer
    h = stream_experts(model, "cpu", cache_bytes=slots * layout.slot_bytes, pin_memory=False)
    rt = h._runtime

    def run(x):
        with torch.no_grad():
            assert torch.equal(model(x).logits, ref(x).logits)

    run(prompt(1, 8, 3))  # 16 rows per layer: both layers staged, in chunks of 4 experts
    assert rt.staged.regions == 2 and rt.staged.chunk == [4, 4]
    st = h.stats()
    assert st.misses + st.staged == 16 and st.h2d_bytes == 16 * st.layers[0].expert_bytes
    run(prompt(1, 8, 4))
    h.reset_stats()
    assert h.stats().misses == h.stats().staged == 0
    x = torch.randn(8, 32)
    index = torch.tensor([[0, 1]] * 7 + [[2, 8]])
    experts = model.model.layers[0].mlp.experts
    rt.engine = eng = RecordingEngine()
    with pytest.raises(ValueError, match=r"outside \[0, 8\)"), torch.no_grad():
        experts(x, index, torch.full((8, 2), 0.5))
    # the refused call's copies into both regions: a later device copy there waits for them
    readies = [entry[3] for entry in eng.log if entry[0] == "load"]
    assert len(readies) == 2
    for j, ready in enumerate(readies):
        assert all(s.done["region copy"] == ready for s in rt.staged.slots_of(rt, j))
    st = h.stats()
    assert st.staged == 8 and st.h2d_bytes == 8 * st.layers[0].expert_bytes
    run(prompt(1, 8, 5))  # the regions after a refused call: staged and bitwise again
    h.remove()


def test_a_staged_call_that_fails_before_its_compute_leaves_its_copies_ordered(monkeypatch):
    """Note: [Layers in chunks]: a chunked call that fails after its first copies were queued
    and before its compute (here its sort runs out of memory) leaves each region's last copy
    under its slots' "region copy" event, which the next staged call's device copies and a
    graph's push wait on; its copied experts count as staged; the next calls are bitwise."""
    from torchoffload.moe._graphed import tables_of

    ref, model = qwen3(impl="grouped_mm"), qwen3(impl="grouped_mm")
    from torchoffload.moe._handle import expert_layout

    layout = expert_layout(model)
    h = stream_experts(model, "cpu", cache_bytes=7 * layout.slot_bytes, pin_memory=False)
    rt = h._runtime
    with torch.no_grad():
        for seed in range(3):  # one-token calls: experts cached, some outside the regions
            x = prompt(1, 1, seed)
            assert torch.equal(model(x).logits, ref(x).logits)
    rt.engine = eng = RecordingEngine()
    sort = torch.sort

    def failing(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory (simulated)")

    experts = model.model.layers[0].mlp.experts
    monkeypatch.setattr(torch, "sort", failing)
    with pytest.raises(torch.OutOfMemoryError), torch.no_grad():
        experts(torch.randn(10, 32), torch.randint(0, 8, (10, 2)), torch.full((10, 2), 0.5))
    monkeypatch.setattr(torch, "sort", sort)
    readies = [entry[3] for entry in eng.log if entry[0] == "load"]
    assert len(readies) == 2  # chunks 0 and 1 queued
    staged = rt.staged
    for j, ready in enumerate(readies):
        assert all(s.done["region copy"] == ready for s in staged.slots_of(rt, j))
    st = h.stats()
    assert st.h2d_copies == st.misses + st.staged
    eng.log.clear()
    tables_of(rt).push()  # a graph's copies into any slot wait for the abandoned ones
    assert set(readies) <= {entry[1] for entry in eng.log if entry[0] == "wait"}
    rt.own_map()
    with torch.no_grad():
        for x in (prompt(1, 9, 2), prompt(1, 1, 5)):  # staged again, then one token
            assert torch.equal(model(x).logits, ref(x).logits)
    h.remove()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_is_copied_after_the_chunk_before_it_in_its_region_computed(monkeypatch, dtype):
    """Note: [Layers in chunks]: at a cache of 4 experts, a large call's layer is staged in
    chunks of 2 or 3 experts (hidden 40, width 8: a down projection is 640 or 1280 bytes, so
    a chunk's first expert starts off a 512 boundary, as in the resident parameter). The
    first two chunks' copies wait on the regions' last readers; chunk i's copy (i >= 2) waits
    on the event after chunk i - 2's compute; every grouped GEMM reads its chunk's region
    after waiting on that chunk's copy. Logits bitwise the resident's."""
    import torchoffload.moe._grouped as grouped

    ref = qwen3(impl="grouped_mm", layers=1, dtype=dtype, hidden=40, width=8)
    model = qwen3(impl="grouped_mm", layers=1, dtype=dtype, hidden=40, width=8)
    from torchoffload.moe._handle import expert_layout

    layout = expert_layout(model)
    h = stream_experts(model, "cpu", cache_bytes=4 * layout.slot_bytes, pin_memory=False)
    rt = h._runtime
    rt.engine = eng = SizedEngine()
    linear = grouped.grouped_linear

    def logged(rows, weight, offs, module):
        eng.log.append(("gemm", weight.data_ptr(), weight.shape[0]))
        return linear(rows, weight, offs, module)

    monkeypatch.setattr(grouped, "grouped_linear", logged)
    with torch.no_grad():
        x = prompt(1, 1, 0)  # one token: a slot before
        assert torch.equal(model(x).logits, ref(x).logits)
        x = prompt(1, 9, 2)  # 18 rows: staged
        eng.log.clear()
        assert torch.equal(model(x).logits, ref(x).logits)
    staged, layer = rt.staged, layout.layers[0]
    c, total = staged.chunk[0], rt.cache.data.numel()
    assert layer.members[1].nbytes % 512 and staged.regions == 2
    # as many as two regions of whole slots hold, in chunks of equal sizes
    room = total // 2 // layout.slot_bytes * layout.slot_bytes
    assert 2 <= c < 8 and c == grouped._balanced(8, grouped._most(layer, room))
    assert 2 * staged.region <= total and staged.region % layout.slot_bytes == 0
    base, region = rt.cache.data.data_ptr(), staged.region
    loads = [entry for entry in eng.log if entry[0] == "load"]
    chunks = -(-8 // c)
    assert len(loads) == chunks
    chunk, waited, done = -1, set(), {}
    for entry in eng.log:
        if entry[0] == "load":
            i = loads.index(entry)
            if i >= 2:  # after the compute of chunk i - 2, in the same region
                assert entry[2] == [done[i - 2]], (i, entry)
        elif entry[0] == "wait":
            waited.add(entry[1])
        elif entry[0] == "gemm":
            j = (entry[1] - base) // region
            if chunk < 0 or (chunk % 2) != j:
                chunk += 1
            assert j == chunk % 2 and entry[2] == min(c, 8 - chunk * c)
            assert loads[chunk][3] in waited, (chunk, "its copy not waited on")
        elif entry[0] == "record" and chunk >= 0 and chunk not in done:
            done[chunk] = entry[1]
    assert chunk == chunks - 1 and sorted(done) == list(range(chunks))
    h.remove()


class PairsEngine(RecordingEngine):
    """`RecordingEngine`, its loads recording every pair (destination, source, bytes) too."""

    def load(self, pairs, after):
        ready = super().load(pairs, after)
        self.log[-1] = (*self.log[-1], [(d.data_ptr(), s.data_ptr(), d.numel()) for d, s in pairs])
        return ready


def test_a_cached_layer_is_assembled_from_its_slots_and_the_host(monkeypatch):
    """Note: [Whole layers for large calls]: a staged call copies the layer's experts that are
    not cached outside its region from the host store, one copy per run of them (the link
    carries the missing experts only), and the others from their slots on the compute stream,
    after their copies' "ready" events and any copy into the region no compute waited on; a
    later copy into a source slot waits for those device copies. Routed cached experts count
    as hits. Logits bitwise the resident's."""
    import torchoffload.moe._grouped as grouped
    from torchoffload.moe._runtime import load

    # three layers: the cache (one slot per expert) holds two regions and a layer's slots
    # beside them
    ref, model = qwen3(impl="grouped_mm", layers=3), qwen3(impl="grouped_mm", layers=3)
    uses, hooks = count_uses(ref)
    h = stream_experts(model, "cpu", cache_bytes=1 << 30, pin_memory=False)
    rt = h._runtime
    rt.engine = eng = PairsEngine()
    near = grouped.copy_near

    def logged(pairs):
        eng.log.append(("near", len(pairs)))
        near(pairs)

    monkeypatch.setattr(grouped, "copy_near", logged)
    with torch.no_grad():
        for i in range(12):  # one-token calls: most experts cached
            x = prompt(1, 1, i)
            assert torch.equal(model(x).logits, ref(x).logits)
        layer, whole, data = rt.layout.layers[0], rt.staged, rt.cache.data
        start, base, sb = whole.next * whole.region, data.data_ptr(), rt.cache.slot_bytes
        region = [s for s in rt.cache.slots if s.offset < start + whole.region
                  and s.offset + sb > start]  # fmt: skip
        held = {e: s for e in range(8) if (s := rt.cache.lookup((0, e))) is not None
                and s not in region}  # fmt: skip
        assert 0 < len(held) < 8, held  # some outside the region (it is forgotten)
        for s in [*held.values(), *region]:
            s.waited.clear()  # as if their copies were not waited on yet
        readies = [s.ready for s in [*held.values(), *region] if s.ready is not None]
        assert len(readies) > len(held)
        before = h.stats().layers[0]
        eng.log.clear()
        x = prompt(1, 8, 3)  # 16 rows per layer: staged
        assert torch.equal(model(x).logits, ref(x).logits)
    i = next(i for i, entry in enumerate(eng.log) if entry[0] == "load")
    pairs = eng.log[i][4]
    missing = [e for e in range(8) if e not in held]
    want, off = [], start
    for member, size in zip(layer.members, whole.sizes[0], strict=True):
        runs = [[e] for j, e in enumerate(missing) if j == 0 or missing[j - 1] != e - 1]
        for run in runs:
            while run[-1] + 1 in missing:
                run.append(run[-1] + 1)
            want.append((off + run[0] * member.nbytes, len(run) * member.nbytes))
        off += size
    assert sorted((d - base, n) for d, _, n in pairs) == sorted(want)  # the missing, by runs
    k = next(k for k in range(i, len(eng.log)) if eng.log[k][0] == "near")
    assert eng.log[k][1] == len(held) * len(layer.members)  # from their slots
    waits = [entry[1] for entry in eng.log[i:k] if entry[0] == "wait"]
    assert all(r in waits for r in readies)  # the source's and the region's copies first
    assert eng.log[k + 1][0] == "record"  # then an event, the source slots' "done"
    done = eng.log[k + 1][1]
    st = check_stats(h, sum(uses)).layers[0]
    assert st.h2d_bytes - before.h2d_bytes == len(missing) * layer.expert_bytes
    assert st.hits > before.hits
    assert st.misses + st.staged - before.misses - before.staged == len(missing)
    # a later copy into a source slot (one outside both regions) waits for its read
    slot = next(s for s in held.values() if s.offset >= 2 * whole.region)
    assert slot.done["compute"] == done
    rt.cache.forget(slot.key)
    eng.log.clear()
    load(rt, slot, (0, 0))
    assert done in eng.log[0][2]
    h.remove()
    for hk in hooks:
        hk.remove()


@pytest.mark.parametrize("engine", ["cpu", "recording"])
@pytest.mark.parametrize("kind", ["list", "eager", "grouped_mm"])
def test_a_copy_that_cannot_be_queued_leaves_no_expert_half_cached(kind, engine):
    """Note: [A block's copies queued together]: a block's copies are queued together, each
    slot assigned to its expert as it is taken; where queuing fails (a copy failure injected
    before anything is queued), every expert of the batch is forgotten and unpinned, with its
    slot's "done" events back: nothing pinned after the call, no slot without the "done"
    event of its last reader (checked with a recording engine), and every later call bitwise
    the resident model's (a slot left holding an expert whose bytes were never copied would be
    read as a hit)."""
    from torchoffload._transfer import CopyTestHooks, InjectedCopyError

    if kind == "list":
        ref, model = moe(), moe()
        xs, run = inputs(), lambda m, x: m(x)
    else:
        ref, model = qwen3(impl=kind), qwen3(impl=kind)
        xs = [prompt(1, 1, i) for i in range(6)]
        run = lambda m, x: m(x).logits  # noqa: E731
    slot = to.minimum_cache_bytes(model) // model_top_k(model)
    h = stream_experts(model, "cpu", cache_bytes=5 * slot, pin_memory=False)
    rt = h._runtime
    real = rt.engine
    if engine == "recording":
        rt.engine = FailingEngine()
    failed = 0
    with torch.no_grad():
        for i, x in enumerate(xs * 2):
            if i % 2:  # the (1 + i % 3)-th batch of copies of this call fails
                if engine == "cpu":
                    real.testing = CopyTestHooks(fail_at=1 + i % 3, fail_kinds=frozenset({"load"}))
                else:
                    rt.engine.fail_at = 1 + i % 3
                done = {s.index: bool(s.done) for s in rt.cache.slots}
                try:
                    run(model, x)
                except InjectedCopyError:
                    failed += 1
                finally:
                    real.testing = None
                    if engine == "recording":
                        rt.engine.fail_at = 0
                assert all(s.pins == 0 for s in rt.cache.slots)
                assert not any(b.acquired or b.active for b in rt.blocks)
                assert all(s.done or not done[s.index] for s in rt.cache.slots)
            assert torch.equal(run(model, x), run(ref, x)), i
    assert failed >= 3
    h.remove()


def model_top_k(model: nn.Module) -> int:
    cfg = getattr(model, "config", None)
    return cfg.num_experts_per_tok if cfg is not None else SPEC.top_k


class FailingEngine(RecordingEngine):
    """`RecordingEngine` whose ``fail_at``-th batch of loads raises before queuing any."""

    fail_at = 0

    def load_many(self, groups):
        from torchoffload._transfer import InjectedCopyError

        if self.fail_at:
            self.fail_at -= 1
            if self.fail_at == 0:
                raise InjectedCopyError("injected")
        return super().load_many(groups)


def test_list_block_copies_its_routed_experts_at_the_router():
    """A list block's router output predicts its routing: the copies of all its routed misses
    are queued before its first expert computes (the recorded log has several loads before the
    block's first read)."""
    ref, model = moe(layers=1, top_k=3), moe(layers=1, top_k=3)
    h = stream_experts(model, "cpu", cache_bytes=1 << 20, pin_memory=False)
    rt = h._runtime
    rt.engine = eng = RecordingEngine()
    read = rt.bind_offsets
    rt.bind_offsets = lambda li, e, slot: eng.log.append(("read",)) or read(li, e, slot)
    x = tokens(SPEC, 1, 1, 0)
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    kinds = [entry[0] for entry in eng.log]
    assert kinds[:6] == ["load", "load", "load", "wait", "read", "record"], kinds
    h.remove()


class Contrary(MoEBlock):
    """A block whose router output does not predict its routing: it routes each token to the
    experts of *lowest* score."""

    def forward(self, h):
        x = self.norm(h)
        flat = x.reshape(-1, x.shape[-1])
        scores = self.gate(flat)
        weights, chosen = torch.topk(-scores.float(), self.top_k, dim=-1)
        weights = torch.softmax(weights, dim=-1).to(x.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, pos = torch.where(chosen == e)
            if token.numel():
                out.index_add_(0, token, expert(flat[token]) * weights[token, pos, None])
        return h + out.view_as(h)


@pytest.mark.parametrize("slots", ["least", "all"])
def test_a_wrong_prediction_costs_copies_not_results(slots):
    ref, model = moe(), moe()
    for b in (*ref.blocks, *model.blocks):
        b.__class__ = Contrary
    least = to.minimum_cache_bytes(model)
    h = stream_experts(model, "cpu", cache_bytes=least if slots == "least" else 1 << 20,
                       pin_memory=False)  # fmt: skip
    with torch.no_grad():
        for x in inputs():
            assert torch.equal(model(x), ref(x))
    st = h.stats()
    assert st.unused > 0
    assert st.h2d_copies == st.misses + st.unused
    assert st.h2d_bytes == st.h2d_copies * st.layers[0].expert_bytes
    h.remove()
