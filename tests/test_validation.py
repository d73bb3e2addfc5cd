"""Input validation at every public entry point: a wrong type or value raises `TypeError` or
`ValueError` naming the argument, before anything is changed. One row per bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchoffload
import torchoffload.compile as toc
from torchoffload import (
    ActivationOffloadConfig,
    Hardware,
    PinnedPool,
    apply_activation_offloading,
    default_pool,
    find_layers,
    minimum_budget,
    offload_activations,
    plan,
    register_flattener,
    stream_weights,
    trace,
    unregister_flattener,
)
from torchoffload._validate import physical_memory
from torchoffload.models import GPT, GPTConfig

CFG = GPTConfig(hidden=32, layers=2, heads=2, vocab=64, max_seq=16)
HUGE = 1 << 62  # beyond any machine's physical memory


class Sub(torch.Tensor):
    pass


def model():
    torch.manual_seed(0)
    return GPT(CFG)


def experts(model=None, device="cpu", **kw):
    from fuzz_models import MoESpec, build_moe  # tests/ is on sys.path

    if model is None:
        spec = MoESpec(vocab=20, dim=8, hidden=8, layers=1, experts=4, top_k=2, bias=False,
                       norm_topk=True, dense_first=False, dtype="float32", seed=0)  # fmt: skip
        model = build_moe(spec)
    kw = {"cache_bytes": 1 << 20, "pin_memory": False, **kw}
    return torchoffload.stream_experts(model, device, **kw)


def tokens():
    return torch.randint(0, CFG.vocab, (1, 16))


def gm():
    return torch.fx.symbolic_trace(nn.Linear(2, 2))


def apply(**kw):
    return apply_activation_offloading(model(), device="cpu", **kw)


def stream(**kw):
    kw.setdefault("budget_bytes", 1 << 24)
    kw.setdefault("pin_memory", False)
    return stream_weights(model().eval(), "cpu", **kw)


def offopt(**kw):
    return torchoffload.OffloadedOptimizer(model().parameters(), torch.optim.AdamW, **kw)


CASES = [
    # (id, call, exception, a regex naming the argument)
    # -- OffloadedOptimizer and its config
    (
        "oo-class",
        lambda: torchoffload.OffloadedOptimizer([], "adamw"),
        TypeError,
        "optimizer_class",
    ),  # fmt: skip
    (
        "oo-params",
        lambda: torchoffload.OffloadedOptimizer(torch.ones(2), torch.optim.SGD),
        TypeError,
        "params",
    ),  # fmt: skip
    (
        "oo-empty",
        lambda: torchoffload.OffloadedOptimizer([], torch.optim.SGD),
        ValueError,
        "params",
    ),  # fmt: skip
    ("oo-config", lambda: offopt(config={"bucket_bytes": 1}), TypeError, "config"),
    ("oo-bucket", lambda: offopt(bucket_bytes=0), ValueError, "bucket_bytes"),
    ("oo-bucket-type", lambda: offopt(bucket_bytes=1.5), TypeError, "bucket_bytes"),
    ("oo-norm", lambda: offopt(max_grad_norm=0.0), ValueError, "max_grad_norm"),
    ("oo-norm-type", lambda: offopt(norm_type=-2.0), ValueError, "norm_type"),
    ("oo-overlap", lambda: offopt(overlap="yes"), TypeError, "overlap"),
    ("oo-threads", lambda: offopt(host_threads=0), ValueError, "host_threads"),
    (
        "ooc-pin",
        lambda: torchoffload.OptimizerOffloadConfig(pin_memory=1),
        TypeError,
        "pin_memory",
    ),  # fmt: skip
    # -- offload_activations
    ("oa-min_bytes-type", lambda: offload_activations(min_bytes="1"), TypeError, "min_bytes"),
    ("oa-min_bytes-neg", lambda: offload_activations(min_bytes=-1), ValueError, "min_bytes"),
    ("oa-min_bytes-bool", lambda: offload_activations(min_bytes=True), TypeError, "min_bytes"),
    ("oa-pool", lambda: offload_activations(pool="big"), TypeError, "pool"),
    ("oa-pin", lambda: offload_activations(pin_memory="yes"), TypeError, "pin_memory"),
    ("oa-streams", lambda: offload_activations(use_streams=1), TypeError, "use_streams"),
    (
        "oa-exhausted",
        lambda: offload_activations(on_pool_exhausted="drop"),
        ValueError,
        "on_pool_exhausted",
    ),
    ("oa-prefetch", lambda: offload_activations(prefetch_bytes=-1), ValueError, "prefetch_bytes"),
    (
        "oa-inflight",
        lambda: offload_activations(max_inflight_bytes=0.5),
        TypeError,
        "max_inflight_bytes",
    ),
    ("oa-device", lambda: offload_activations(device="meta"), ValueError, "meta"),
    ("oa-device-type", lambda: offload_activations(device=[0]), TypeError, "device"),
    (
        "oa-device-bad",
        lambda: offload_activations(device="gpu7"),
        (ValueError, RuntimeError),
        "device",
    ),
    # -- ActivationOffloadConfig and apply_activation_offloading
    (
        "cfg-prefetch",
        lambda: ActivationOffloadConfig(prefetch_layers=-1),
        ValueError,
        "prefetch_layers",
    ),
    ("cfg-defer", lambda: ActivationOffloadConfig(defer_layers="1"), TypeError, "defer_layers"),
    (
        "cfg-skip",
        lambda: ActivationOffloadConfig(skip_last_layers=-2),
        ValueError,
        "skip_last_layers",
    ),
    (
        "cfg-budget",
        lambda: ActivationOffloadConfig(max_offload_bytes=-5),
        ValueError,
        "max_offload_bytes",
    ),
    (
        "cfg-budget-huge",
        lambda: ActivationOffloadConfig(max_offload_bytes=2.5),
        TypeError,
        "max_offload_bytes",
    ),
    (
        "cfg-policy",
        lambda: ActivationOffloadConfig(budget_policy="random"),
        ValueError,
        "budget_policy",
    ),
    (
        "cfg-outside",
        lambda: ActivationOffloadConfig(offload_outside_layers="no"),
        TypeError,
        "offload_outside_layers",
    ),
    (
        "cfg-layers",
        lambda: ActivationOffloadConfig(offload_layers=[1, -1]),
        ValueError,
        "offload_layers",
    ),
    (
        "cfg-layers-type",
        lambda: ActivationOffloadConfig(offload_layers="01"),
        TypeError,
        "offload_layers",
    ),
    ("apply-model", lambda: apply_activation_offloading("model"), TypeError, "model"),
    ("apply-config", lambda: apply(config={"min_bytes": 0}), TypeError, "config"),
    ("apply-pool", lambda: apply(pool=1 << 20), TypeError, "pool"),
    ("apply-layers", lambda: apply(layers=3), TypeError, "layers"),
    ("apply-layers-str", lambda: apply(layers="blocks"), ValueError, "layers"),
    ("apply-plan", lambda: apply(plan="offload all"), TypeError, "plan"),
    ("find-model", lambda: find_layers([nn.Linear(2, 2)]), TypeError, "model"),
    # -- PinnedPool
    ("pool-capacity-type", lambda: PinnedPool("1GiB"), TypeError, "capacity_bytes"),
    ("pool-capacity-neg", lambda: PinnedPool(-1), ValueError, "capacity_bytes"),
    ("pool-capacity-huge", lambda: PinnedPool(HUGE), ValueError, "capacity_bytes"),
    ("pool-slab", lambda: PinnedPool(1 << 20, slab_bytes=0), ValueError, "slab_bytes"),
    ("pool-pin", lambda: PinnedPool(1 << 20, pin_memory="no"), TypeError, "pin_memory"),
    (
        "pool-exhausted",
        lambda: PinnedPool(1 << 20, on_exhausted="block"),
        ValueError,
        "on_exhausted",
    ),
    (
        "pool-reserve",
        lambda: PinnedPool(1 << 20, pin_memory=False).reserve(2 << 20),
        ValueError,
        "nbytes",
    ),
    (
        "pool-reserve-type",
        lambda: PinnedPool(1 << 20, pin_memory=False).reserve(1.5),
        TypeError,
        "nbytes",
    ),
    (
        "pool-allocate",
        lambda: PinnedPool(1 << 20, pin_memory=False).allocate(-3),
        ValueError,
        "nbytes",
    ),
    ("pool-free", lambda: PinnedPool(1 << 20, pin_memory=False).free("block"), TypeError, "block"),
    ("default-pool", lambda: default_pool("yes"), TypeError, "pin_memory"),
    # -- register_flattener
    ("flat-cls", lambda: register_flattener("T", flatten=len, unflatten=len), TypeError, "cls"),
    (
        "flat-fn",
        lambda: register_flattener(Sub, flatten=1, unflatten=len),
        TypeError,
        "flatten",
    ),
    ("flat-unreg", lambda: unregister_flattener(3), TypeError, "cls"),
    # -- stream_weights and minimum_budget
    ("sw-model", lambda: stream_weights("model", "cpu", budget_bytes=1), TypeError, "model"),
    ("sw-budget-type", lambda: stream(budget_bytes="1GiB"), TypeError, "budget_bytes"),
    ("sw-budget-neg", lambda: stream(budget_bytes=-1), ValueError, "budget_bytes"),
    ("sw-budget-huge", lambda: stream(budget_bytes=HUGE), ValueError, "budget_bytes"),
    ("sw-depth", lambda: stream(prefetch_depth=-1), ValueError, "prefetch_depth"),
    ("sw-resident", lambda: stream(resident=5), TypeError, "resident"),
    (
        "sw-resident-name",
        lambda: stream(resident=("no_such_module",)),
        ValueError,
        "no_such_module",
    ),
    ("sw-unit", lambda: stream(unit="rows"), ValueError, "unit"),
    ("sw-pin", lambda: stream(pin_memory="no"), TypeError, "pin_memory"),
    ("sw-streams", lambda: stream(use_streams=None), TypeError, "use_streams"),
    (
        "sw-device",
        lambda: stream_weights(model(), "meta", budget_bytes=1 << 20),
        ValueError,
        "meta",
    ),
    # -- stream_experts and minimum_cache_bytes
    ("se-model", lambda: torchoffload.stream_experts("m", cache_bytes=1), TypeError, "model"),
    ("se-cache-type", lambda: experts(cache_bytes="1GiB"), TypeError, "cache_bytes"),
    ("se-cache-neg", lambda: experts(cache_bytes=-1), ValueError, "cache_bytes"),
    ("se-cache-small", lambda: experts(cache_bytes=1), ValueError, "cache_bytes"),
    ("se-policy", lambda: experts(policy="mru"), ValueError, "policy"),
    ("se-pin", lambda: experts(pin_memory="no"), TypeError, "pin_memory"),
    ("se-streams", lambda: experts(use_streams=None), TypeError, "use_streams"),
    ("se-device", lambda: experts(device="meta"), ValueError, "meta"),
    ("se-no-experts", lambda: experts(model=model()), ValueError, "mixture-of-experts"),
    ("se-host", lambda: experts(host_compute="on"), ValueError, "host_compute"),
    ("se-host-type", lambda: experts(host_compute=1), TypeError, "host_compute"),
    ("se-host-list", lambda: experts(host_compute=True), ValueError, "host_compute serves fused"),
    ("mc-model", lambda: torchoffload.minimum_cache_bytes(nn.Linear), TypeError, "model"),
    # -- stream_parameters
    (
        "sp-model",
        lambda: torchoffload.stream_parameters("model", 1 << 20),
        TypeError,
        "model",
    ),
    (
        "sp-budget-type",
        lambda: torchoffload.stream_parameters(model(), "1GiB"),
        TypeError,
        "budget_bytes",
    ),  # fmt: skip
    (
        "sp-budget-neg",
        lambda: torchoffload.stream_parameters(model(), -1),
        ValueError,
        "budget_bytes",
    ),  # fmt: skip
    (
        "sp-budget-small",
        lambda: torchoffload.stream_parameters(model(), 64),
        ValueError,
        "budget_bytes",
    ),  # fmt: skip
    (
        "sp-depth",
        lambda: torchoffload.stream_parameters(model(), 1 << 20, prefetch_depth=-1),
        ValueError,
        "prefetch_depth",
    ),  # fmt: skip
    (
        "sp-unit",
        lambda: torchoffload.stream_parameters(model(), 1 << 20, unit="rows"),
        ValueError,
        "unit",
    ),  # fmt: skip
    (
        "sp-resident",
        lambda: torchoffload.stream_parameters(model(), 1 << 20, resident=("zz",)),
        ValueError,
        "zz",
    ),  # fmt: skip
    (
        "sp-pin",
        lambda: torchoffload.stream_parameters(model(), 1 << 20, pin_memory="no"),
        TypeError,
        "pin_memory",
    ),  # fmt: skip
    ("cg-fn", lambda: stream().cuda_graph("step"), TypeError, "fn"),
    ("cg-max", lambda: stream().cuda_graph(print, max_graphs=0), ValueError, "max_graphs"),
    ("cg-max-type", lambda: stream().cuda_graph(print, max_graphs=1.5), TypeError, "max_graphs"),
    ("mb-model", lambda: minimum_budget(nn.Linear), TypeError, "model"),
    ("mb-depth", lambda: minimum_budget(model(), prefetch_depth="2"), TypeError, "prefetch_depth"),
    # -- planner
    ("plan-model", lambda: plan("gpt", (tokens(),), budget_bytes=1 << 20), TypeError, "model"),
    (
        "plan-state",
        lambda: plan(model(), (tokens(),), budget_bytes=None, optimizer_state="cpu"),
        ValueError,
        "optimizer_state",
    ),  # fmt: skip
    (
        "plan-host-budget",
        lambda: plan(model(), (tokens(),), budget_bytes=None, host_budget_bytes=-1),
        ValueError,
        "host_budget_bytes",
    ),  # fmt: skip
    (
        "plan-inputs",
        lambda: plan(model(), 42, budget_bytes=1 << 20),
        TypeError,
        "example_inputs",
    ),
    (
        "plan-budget",
        lambda: plan(model(), (tokens(),), budget_bytes="1GiB"),
        TypeError,
        "budget_bytes",
    ),
    (
        "plan-budget-neg",
        lambda: plan(model(), (tokens(),), budget_bytes=-1),
        ValueError,
        "budget_bytes",
    ),
    (
        "plan-link",
        lambda: plan(model(), (tokens(),), budget_bytes=None, link_gbps=-3),
        ValueError,
        "link_gbps",
    ),
    (
        "plan-flops",
        lambda: plan(model(), (tokens(),), budget_bytes=None, compute_tflops="x"),
        TypeError,
        "compute_tflops",
    ),
    (
        "plan-optimizer",
        lambda: plan(model(), (tokens(),), budget_bytes=None, optimizer="adam"),
        ValueError,
        "optimizer",
    ),
    (
        "plan-loss",
        lambda: plan(model(), (tokens(),), budget_bytes=None, loss_fn="mse"),
        TypeError,
        "loss_fn",
    ),
    (
        "plan-prefetch",
        lambda: plan(model(), (tokens(),), budget_bytes=None, prefetch_layers=-1),
        ValueError,
        "prefetch_layers",
    ),
    ("trace-min", lambda: trace(model(), (tokens(),), min_bytes=-1), ValueError, "min_bytes"),
    (
        "trace-progress",
        lambda: trace(model(), (tokens(),), progress="stdout"),
        TypeError,
        "progress",
    ),
    ("hw-link", lambda: Hardware(link_gbps=0), ValueError, "link_gbps"),
    ("hw-eff", lambda: Hardware(efficiency=1.5), ValueError, "efficiency"),
    ("hw-type", lambda: Hardware(compute_tflops="fast"), TypeError, "compute_tflops"),
    # -- torchoffload.compile
    ("pass-config", lambda: toc.backend(activations="on"), TypeError, "activations"),
    ("pool-set", lambda: toc.set_op_pool("pool"), TypeError, "pool"),
    ("probes-gm", lambda: toc.insert_weight_probes(nn.Linear(2, 2)), TypeError, "gm"),
    (
        "pass-modules",
        lambda: toc.offload_activations_pass(nn.Linear(2, 2), nn.Linear(2, 2), num_fwd_outputs=1),
        TypeError,
        "fw_module",
    ),
    (
        "pass-outputs",
        lambda: toc.offload_activations_pass(gm(), gm(), num_fwd_outputs=-1),
        ValueError,
        "num_fwd_outputs",
    ),
    (
        "partitioner-config",
        lambda: toc.ActivationPartitioner(config="x"),
        TypeError,
        "config",
    ),
    ("esp-model", lambda: toc.export_streamed("m", (torch.ones(1),)), TypeError, "model"),
    ("esp-args", lambda: toc.export_streamed(nn.Linear(2, 2), torch.ones(2)), TypeError, "args"),
    (
        "esp-kwargs",
        lambda: toc.export_streamed(nn.Linear(2, 2), (torch.ones(2),), [1]),
        TypeError,
        "kwargs",
    ),
    (
        "ssp-path",
        lambda: toc.save_streamed_package(nn.Linear(2, 2), (torch.ones(2),), "m.zip"),
        ValueError,
        "package_path",
    ),
    (
        "ssp-weights",
        lambda: toc.save_streamed_package(nn.Linear(2, 2), (torch.ones(2),), "m.pt2", weights=1),
        TypeError,
        "weights",
    ),
    (
        "lsp-budget",
        lambda: toc.load_streamed_package("m.pt2", "w", budget_bytes="1"),
        TypeError,
        "budget_bytes",
    ),
    (
        "lsp-depth",
        lambda: toc.load_streamed_package("m.pt2", "w", budget_bytes=1, prefetch_depth=-1),
        ValueError,
        "prefetch_depth",
    ),
    (
        "lsp-weights",
        lambda: toc.load_streamed_package("m.pt2", None, budget_bytes=1),
        TypeError,
        "weights",
    ),
    (
        "lsp-resident",
        lambda: toc.load_streamed_package("m.pt2", "w", budget_bytes=1, resident=3),
        TypeError,
        "resident",
    ),
    ("lsp-package", lambda: toc.read_catalog(3), TypeError, "package_path"),
    ("catalog-json", lambda: toc.Catalog.from_json("[]"), ValueError, "catalog"),
    # -- verify
    ("verify-model", lambda: torchoffload.verify(lambda x: x, ()), TypeError, "model"),
    ("verify-steps", lambda: torchoffload.verify(model(), (), steps=0), ValueError, "steps"),
    ("verify-apply", lambda: torchoffload.verify(model(), (), apply=1), TypeError, "apply"),
    (
        "verify-optimizer",
        lambda: torchoffload.verify(model(), (), optimizer=lambda m: None),
        ValueError,
        "loss",
    ),
    (
        "sew-ep",
        lambda: toc.stream_exported_weights(model(), "cpu", budget_bytes=1 << 20),
        TypeError,
        "ep",
    ),
]


@pytest.mark.parametrize(
    ("call", "exc", "names"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_names_the_argument(call, exc, names):
    with pytest.raises(exc, match=names):
        call()


def test_every_public_callable_has_a_row():
    """A public function or class added without validation rows fails here."""
    covered = {
        "OffloadedOptimizer",
        "OptimizerOffloadConfig",
        "ActivationOffloadConfig",
        "apply_activation_offloading",
        "find_layers",
        "Hardware",
        "plan",
        "trace",
        "minimum_budget",
        "PinnedPool",
        "default_pool",
        "offload_activations",
        "register_flattener",
        "stream_weights",
        "stream_experts",
        "minimum_cache_bytes",
        "stream_parameters",
        "unregister_flattener",
        "verify",
    }
    # Types users receive rather than build, exceptions, and the argument-free context manager:
    exempt = {
        "ActivationOffloadHandle",
        "CheckpointError",
        "ActivationStats",
        "Difference",
        "VerificationError",
        "VerifyReport",
        "InfeasibleBudgetError",
        "Plan",
        "Profile",
        "PoolExhaustedError",
        "PoolStats",
        "WeightStats",
        "WeightStreamHandle",
        "ExpertLayerStats",
        "ExpertStats",
        "ExpertStreamHandle",
        "no_offload",
        "MovedGradError",
        "OptimizerStats",
        "ParameterStats",
        "ParameterStreamHandle",
    }
    public = {n for n in torchoffload.__all__ if callable(getattr(torchoffload, n))}
    assert public - covered - exempt == set()


def test_sizes_beyond_physical_memory_name_the_machine():
    for call in (
        lambda: PinnedPool(physical_memory() + (1 << 30)),
        lambda: ActivationOffloadConfig(max_offload_bytes=physical_memory() + 1),
        lambda: stream(budget_bytes=physical_memory() + 1),  # the "device" is the host here
    ):
        with pytest.raises(ValueError, match="physical memory"):
            call()
