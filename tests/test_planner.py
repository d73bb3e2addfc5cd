"""The planner on CPU: tracing under fake tensors, byte and FLOP counts against a hand count,
decisions on synthetic profiles, applying a plan, and the CLI."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from conftest import assert_bitwise, train_steps
from torch import nn

import torchoffload
from torchoffload.cli import main, parse_bytes
from torchoffload.models import GPT, BlockStack, GPTConfig
from torchoffload.planner import (
    Hardware,
    InfeasibleBudgetError,
    plan_from_profile,
    synthetic_profile,
    trace,
)
from torchoffload.planner._cost import CostModel
from torchoffload.planner._search import least_peak
from torchoffload.planner._trace import MATMUL, MEMORY


class ReluStack(nn.Module):
    """Layers of ``relu(x @ W.T)``: what each saves is easy to count by hand."""

    def __init__(self, hidden=64, layers=3):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, hidden, bias=False), nn.ReLU()) for _ in range(layers)
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_trace_counts_bytes_and_flops_by_hand():
    b, h, n = 32, 64, 3
    model = ReluStack(h, n)
    p = trace(model, (torch.randn(b, h),), optimizer="adamw", min_bytes=0)
    act = b * h * 4  # one float32 [b, h] activation
    # Layer 0 saves its input x (for the weight gradient) and its ReLU output; layer i > 0 saves
    # only its ReLU output: its input is the ReLU output layer i - 1 saved already.
    assert [layer.saved_bytes for layer in p.layers] == [2 * act, act, act]
    # Recomputing a layer frees all it saved except its input.
    assert [layer.recompute_bytes for layer in p.layers] == [act, act, act]
    assert all(layer.input_bytes == act for layer in p.layers)
    # Forward: one [b, h] x [h, h] matmul. Backward: the weight gradient, plus the input
    # gradient except in layer 0 (x needs no gradient).
    mm = 2 * b * h * h
    assert [layer.fwd_flops for layer in p.layers] == [mm] * n
    assert [layer.bwd_flops for layer in p.layers] == [mm, 2 * mm, 2 * mm]
    weights = n * h * h * 4
    assert p.param_bytes == weights and p.grad_bytes == weights
    assert p.optimizer_bytes == 2 * weights  # AdamW: exp_avg and exp_avg_sq
    assert p.static_bytes == 4 * weights
    # the step starts with the parameters and the batch; forward adds the ReLU outputs
    assert p.timeline[0] == weights + act
    assert p.timeline[p.fwd_end[-1]] == weights + 4 * act


def test_trace_prices_each_op_and_records_saved_storages():
    """Per op: FLOPs, bytes read and written (views move nothing) and kind; what recomputing
    replays; when each saved storage was saved and freed."""
    b, h = 32, 64
    p = trace(ReluStack(h, 3), (torch.randn(b, h),), optimizer="none", min_bytes=0)
    act, weight = b * h * 4, h * h * 4
    mm = (2 * b * h * h, act + weight + act, MATMUL)  # reads x and W, writes x W^T
    relu = (0, 2 * act, MEMORY)
    for layer in p.layers:
        assert layer.fwd_ops == ((0, 0, MEMORY), mm, relu)  # W.t() is a view
        assert layer.recompute_ops == 3  # ReLU saves its output: recomputing replays it all
        assert sum(f for f, _, _ in layer.bwd_ops) == layer.bwd_flops
    # the batch (saved by layer 0's matmul) is the caller's: never counted as offloadable
    assert p.layers[0].offloadable_bytes == act
    assert [s[:2] for s in p.saved_storages] == [(0, act), (1, act), (2, act)]
    fwd_end, bwd_end = p.step_marks["forward_end"], p.step_marks["backward_end"]
    for _, _, saved_at, freed_at, in_model in p.saved_storages:
        assert saved_at <= fwd_end < freed_at <= bwd_end and in_model
    # freed in reverse order of saving, in backward
    assert [s[3] for s in p.saved_storages] == sorted(
        (s[3] for s in p.saved_storages), reverse=True
    )


def test_trace_keeps_the_optimizer_out_of_backward():
    """The optimizer step is priced on its own (at the memory bandwidth), not as backward."""
    model = ReluStack()
    x = torch.randn(4, 64)
    adamw = trace(model, (x,), layers=model.layers, optimizer="adamw")
    none = trace(model, (x,), layers=model.layers, optimizer="none")
    assert adamw.outside_bwd_ops == none.outside_bwd_ops
    assert adamw.optimizer_bytes > 0 == none.optimizer_bytes


def test_trace_counts_sgd_momentum_and_names_the_optimizer_streaming_needs():
    """optimizer="sgd" is SGD with momentum: one buffer per parameter. Parameters streamed for
    training need state on the host; a profile without any says which optimizers have it."""
    model = ReluStack()
    x = torch.randn(4, 64)
    sgd = trace(model, (x,), layers=model.layers, optimizer="sgd")
    assert sgd.optimizer_bytes == sgd.param_bytes == 3 * 64 * 64 * 4
    plan = plan_from_profile(sgd, None, parameters="host", host_budget_bytes=1 << 30)
    assert plan.parameters == "host"
    none = trace(model, (x,), layers=model.layers, optimizer="none")
    with pytest.raises(ValueError, match="traced with optimizer='none'.*'adamw' or 'sgd'"):
        plan_from_profile(none, None, parameters="host")


def test_trace_leaves_the_model_alone_and_allocates_nothing():
    model = GPT(GPTConfig(hidden=64, layers=2, heads=2, vocab=128, max_seq=33))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    p = trace(model, (torch.randint(0, 128, (2, 32)),), loss_fn=lambda out: out.float().mean())
    assert len(p.layers) == 2 and p.layers[0].saved_bytes > 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(param.grad is None for param in model.parameters())


def test_trace_70b_llama_under_a_minute():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
    )  # fmt: skip
    start = time.perf_counter()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.zeros(1, 4096, dtype=torch.long)
    p = trace(model, {"input_ids": ids, "labels": ids})
    elapsed = time.perf_counter() - start
    assert elapsed < 60, elapsed
    n_params = sum(t.numel() for t in model.parameters())
    assert 69e9 < n_params < 72e9
    assert 2 * n_params <= p.param_bytes < 2 * n_params + (1 << 20)  # + buffers (rotary)
    assert len(p.layers) == 80 and len({layer.saved_bytes for layer in p.layers[1:]}) == 1
    # layer 0 also saved the rotary cos/sin tables every layer uses (2 x [1, 4096, 128] bf16)
    assert p.layers[0].saved_bytes - p.layers[1].saved_bytes == 2 * 4096 * 128 * 2
    # per layer and token: at least the bf16 hidden state and the MLP's three 28672-wide tensors
    assert p.layers[0].saved_bytes > 4096 * (8192 + 3 * 28672) * 2
    assert p.layers[0].fwd_flops > 2 * 4096 * 0.8e9  # ~2 FLOPs per parameter and token


# -- decisions on synthetic profiles --------------------------------------------------------------

MB = 1 << 20


def test_everything_fits_keeps_everything():
    prof = synthetic_profile(layers=8, saved_bytes=100 * MB, fwd_flops=10**12, static_bytes=MB)
    plan = plan_from_profile(prof, 10 << 30)
    assert set(plan.decisions) == {"keep"}
    assert plan.predicted == plan.baseline
    # plus the workspaces cuBLAS and attention keep in the caching allocator
    assert plan.baseline.peak_bytes == MB + 8 * 100 * MB + Hardware().workspace_bytes


def test_infeasible_budget_is_explained():
    prof = synthetic_profile(layers=8, saved_bytes=100 * MB, fwd_flops=10**12,
                             static_bytes=2 << 30)  # fmt: skip
    with pytest.raises(InfeasibleBudgetError, match="needs at least .* alone take 2.00 GiB"):
        plan_from_profile(prof, 1 << 30)


def test_compute_bound_offloads():
    """100 MB per layer hides behind 5 ms of compute at 55 GB/s (1.8 ms): offload is free."""
    hw = Hardware(link_gbps=55, compute_tflops=100, efficiency=1.0)
    prof = synthetic_profile(layers=8, saved_bytes=100 * MB, fwd_flops=5 * 10**11)
    budget = prof.peak_bytes // 2
    plan = plan_from_profile(prof, budget, hardware=hw)
    assert plan.predicted.peak_bytes <= budget
    assert "offload" in plan.decisions and "recompute" not in plan.decisions
    assert plan.predicted.step_s == pytest.approx(plan.baseline.step_s, rel=0.02)


def test_engine_cost_makes_recomputation_win():
    """Offloading any layer installs the engine's hooks on every layer; when they cost more
    than recomputing, the plan recomputes only (the greedy alone, one layer at a time, would
    not see that)."""
    prof = synthetic_profile(layers=8, saved_bytes=100 * MB, fwd_flops=5 * 10**11)
    budget = prof.peak_bytes // 2
    hw = Hardware(link_gbps=55, compute_tflops=100, efficiency=1.0, host_us_layer=1e5)
    plan = plan_from_profile(prof, budget, hardware=hw)
    assert plan.predicted.peak_bytes <= budget
    assert set(plan.decisions) == {"keep", "recompute"}


def test_kernel_time_counts_launches_not_views():
    hw = Hardware(kernel_us=10.0, hbm_gbps=1000.0, memory_efficiency=1.0)
    ops = [(0, 0, MEMORY), (0, 10**9, MEMORY), (0, 0, MEMORY)]  # a view, a copy, an empty
    assert hw.op_seconds(ops) == pytest.approx(1e9 / 1e12 + 10e-6)


def test_host_measurement_runs_on_cpu():
    """`detect` measures host costs on the GPU; the same code runs on the CPU (tiny blocks),
    so CI checks that it yields a valid Hardware."""
    from torchoffload.planner._hardware import measure_host as _measure_host

    measured = _measure_host(torch.device("cpu"), reps=4, rounds=1)  # validity, not numbers
    assert set(measured) == {"host_us_fwd", "host_us_bwd", "host_us_layer", "host_us_saved",
                             "host_us_checkpoint_fwd", "host_us_checkpoint_bwd"}  # fmt: skip
    assert measured["host_us_fwd"] > 0 and measured["host_us_bwd"] > 0
    assert Hardware(**measured).host_us_fwd == measured["host_us_fwd"]


def test_host_runs_ahead_of_the_device():
    """The host launches ahead of the device: in a device-bound step, a recomputed layer whose
    own launches take longer than its device time costs only its device time, because the
    layers before it in backward left the host that much ahead."""
    with torch.device("meta"):
        model = BlockStack(1024, 8, heads=8).to(torch.bfloat16)
    x = torch.empty(8, 1024, 1024, dtype=torch.bfloat16, device="meta")
    prof = trace(model, (x,), loss_fn=lambda out: out.float().pow(2).mean(), optimizer="none")
    hw = Hardware(host_us_fwd=1.0, host_us_bwd=1.0, host_us_checkpoint_fwd=0.0,
                  host_us_checkpoint_bwd=150.0)  # fmt: skip
    m = CostModel(prof, hw, 1, 1)
    slack = sum(m.gpu_b[1:]) - sum(m.host_b[1:])
    excess = m.host_b[0] + m.host_r[0] - m.gpu_b[0] - m.gpu_r[0]
    assert 0 < excess < slack  # layer 0 alone is bound by the host; the rest left room
    keep = m.predict(["keep"] * 8)
    first = m.predict(["recompute"] + ["keep"] * 7)
    assert first.step_s == pytest.approx(keep.step_s + m.gpu_r[0], rel=1e-9)
    # all host-bound: the step takes the host's time
    slow = CostModel(prof, Hardware(host_us_fwd=1e3, host_us_bwd=1e3), 1, 1)
    total = sum(slow.host_f) + sum(slow.host_b) + slow.host_out_f + slow.host_out_b
    assert slow.predict(["keep"] * 8).step_s == pytest.approx(total, rel=1e-9)


def test_link_bound_recomputes():
    """1 GB per layer takes 18 ms to copy against 0.1 ms of compute: recomputing is cheaper."""
    hw = Hardware(link_gbps=55, compute_tflops=100, efficiency=1.0)
    prof = synthetic_profile(layers=8, saved_bytes=1000 * MB, fwd_flops=10**10)
    budget = prof.peak_bytes // 2
    plan = plan_from_profile(prof, budget, hardware=hw)
    assert plan.predicted.peak_bytes <= budget
    assert "recompute" in plan.decisions and "offload" not in plan.decisions
    # the copies would have bound the step: all-offload is predicted slower than the plan
    model = CostModel(prof, hw, 1, 1)
    offload_all = model.predict(["offload"] * 7 + ["keep"])
    assert offload_all.step_s > plan.predicted.step_s
    # ...and at the link bound: 7 GB each way over 55 GB/s
    assert offload_all.step_s == pytest.approx(2 * 7 * 1000 * MB / 55e9, rel=0.05)


def test_tighter_budgets_cost_more_and_fit():
    hw = Hardware(link_gbps=55, compute_tflops=100, efficiency=1.0)
    prof = synthetic_profile(layers=12, saved_bytes=300 * MB, fwd_flops=10**11, static_bytes=MB)
    steps = []
    for frac in (0.75, 0.5, 0.25):
        budget = int(prof.peak_bytes * frac)
        plan = plan_from_profile(prof, budget, hardware=hw)
        assert plan.margin_bytes == hw.margin(budget) > 0
        assert plan.predicted.peak_bytes + plan.margin_bytes <= budget
        steps.append(plan.predicted.step_s)
    assert steps == sorted(steps)


# Issue 38: on an H100 the plan for 75% of the measured no-offload peak of this GPT (bf16,
# AdamW) was predicted at 11.824 GiB and measured at 11.889 GiB, over its 11.855 GiB budget.
ISSUE38_GPT = GPTConfig(hidden=2048, layers=12, heads=16, vocab=1024, max_seq=2048)
ISSUE38_BUDGET = int(11.855 * 2**30)
ISSUE38_ERROR = int((11.889 - 11.824) * 2**30)  # measured minus predicted peak: 65 MiB


@pytest.fixture(scope="module")
def issue38_profile():
    with torch.device("meta"):
        model = GPT(ISSUE38_GPT).to(torch.bfloat16)
    tokens = torch.zeros(8, 2048, dtype=torch.long, device="meta")
    return trace(model, (tokens,), loss_fn=lambda out: out.float().mean())


def test_a_plan_keeps_the_measured_prediction_error_free_below_its_budget(issue38_profile):
    """Note: [The planning margin]. Planned to the byte, the issue's plan leaves less room than
    the error measured for it; the plan now keeps a margin that covers it, and says so."""
    exact = Hardware(margin_bytes=0, margin_fraction=0.0)
    to_the_byte = plan_from_profile(issue38_profile, ISSUE38_BUDGET, hardware=exact)
    assert to_the_byte.predicted.peak_bytes + ISSUE38_ERROR > ISSUE38_BUDGET  # the overshoot
    plan = plan_from_profile(issue38_profile, ISSUE38_BUDGET, hardware=Hardware())
    assert plan.predicted.peak_bytes + ISSUE38_ERROR <= ISSUE38_BUDGET
    assert ISSUE38_ERROR < plan.margin_bytes == Hardware().margin(ISSUE38_BUDGET)
    assert plan.predicted.peak_bytes + plan.margin_bytes <= ISSUE38_BUDGET
    spare = ISSUE38_BUDGET - plan.predicted.peak_bytes - plan.margin_bytes
    gib = 2**30
    assert (
        f"budget {ISSUE38_BUDGET / gib:.2f} GiB = predicted peak "
        f"{plan.predicted.peak_bytes / gib:.2f} + margin {plan.margin_bytes / gib:.2f} (for what "
        f"the model does not count) + {spare / gib:.2f} spare"
    ) in str(plan)


def test_a_budget_the_margin_does_not_leave_room_in_is_refused():
    """A budget above the least peak but within the margin of it is refused, naming the
    margin; without a plan that fits by less than the margin, layers are still changed."""
    hw = Hardware(link_gbps=55, compute_tflops=100, efficiency=1.0)
    prof = synthetic_profile(layers=8, saved_bytes=100 * MB, fwd_flops=10**12, static_bytes=MB)
    floor = least_peak(CostModel(prof, hw, 1, 1))[1]
    with pytest.raises(InfeasibleBudgetError, match="keeps .* of the budget free"):
        plan_from_profile(prof, floor + hw.margin_bytes // 2, hardware=hw)
    baseline = plan_from_profile(prof, None, hardware=hw).baseline.peak_bytes
    plan = plan_from_profile(prof, baseline + MB, hardware=hw)  # fits, but not by the margin
    assert set(plan.decisions) != {"keep"}
    assert plan.predicted.peak_bytes + plan.margin_bytes <= baseline + MB


# -- applying a plan ----------------------------------------------------------------------------

SMALL4 = GPTConfig(hidden=64, layers=4, heads=2, vocab=128, max_seq=33)


def small_plan(batches, decisions, **trace_kwargs):
    """The reference run of SMALL4, a fresh SMALL4 (same seed) and a plan for it with these
    decisions: (base, model, profile, plan)."""
    torch.manual_seed(0)
    base = train_steps(GPT(SMALL4), batches)
    torch.manual_seed(0)
    model = GPT(SMALL4)
    prof = trace(model, (batches[0][:, :-1],), loss_fn=lambda out: out.float().mean(),
                 **trace_kwargs)  # fmt: skip
    plan = dataclasses.replace(plan_from_profile(prof, None), decisions=tuple(decisions))
    return base, model, prof, plan


def test_apply_plan_offloads_and_recomputes_bitwise(batches):
    base, model, _, plan = small_plan(batches, ("offload", "recompute", "offload", "keep"))
    pool = torchoffload.PinnedPool(64 << 20, slab_bytes=1 << 20, pin_memory=False)
    handle = plan.apply(model, device="cpu", pool=pool)
    assert handle.recomputed_layers == [1]
    assert "forward" in vars(model.layers[1])
    got = train_steps(model, batches)
    assert set(handle.stats().per_layer_bytes) == {0, 2}  # only the planned layers
    handle.remove()
    assert "forward" not in vars(model.layers[1])
    assert_bitwise(base, got)


def test_apply_recompute_only_plan_installs_no_hooks(batches):
    """A plan that offloads nothing only wraps its recomputed layers: no module hooks, no
    global hook (Note: [Plans])."""
    from torch.nn.modules import module as nn_module

    base, model, _, plan = small_plan(batches, ("recompute", "recompute", "keep", "keep"))
    global_hooks = len(nn_module._global_forward_pre_hooks)
    handle = plan.apply(model, device="cpu")
    assert handle.recomputed_layers == [0, 1]
    assert len(nn_module._global_forward_pre_hooks) == global_hooks
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    got = train_steps(model, batches)
    assert handle.stats().offloaded_bytes == 0
    handle.remove()
    assert "forward" not in vars(model.layers[0])
    assert_bitwise(base, got)


def test_apply_plan_recompute_with_offloaded_input_bitwise(batches):
    """A "recompute+offload" layer is checkpointed and the input checkpointing saves goes to
    host memory through the engine's hooks."""
    both = "recompute+offload"
    base, model, prof, plan = small_plan(batches, (both, both, "keep", "keep"), min_bytes=0)
    assert [layer.input_offloadable_bytes > 0 for layer in prof.layers] == [True] * 4
    pool = torchoffload.PinnedPool(64 << 20, slab_bytes=1 << 20, pin_memory=False)
    handle = plan.apply(model, device="cpu", pool=pool)
    assert handle.recomputed_layers == [0, 1]
    handle.reset_stats()
    got = train_steps(model, batches)
    per_layer = handle.stats().per_layer_bytes
    steps = len(batches)
    # only each layer's input (one [batch, seq, hidden] float32 tensor) left the device
    assert per_layer == {i: steps * prof.layers[i].input_offloadable_bytes for i in (0, 1)}
    handle.remove()
    assert_bitwise(base, got)


def test_apply_stream_plan_bitwise(batches):
    """A "stream" plan runs the whole model under offload_activations."""
    base, model, _, plan = small_plan(batches, ("stream",) * 4)
    assert plan.stream and plan.offload_layers == frozenset(range(4))
    pool = torchoffload.PinnedPool(64 << 20, slab_bytes=1 << 20, pin_memory=False)
    handle = plan.apply(model, device="cpu", pool=pool)
    assert handle.mode.value == "stream"
    got = train_steps(model, batches)
    assert handle.stats().offloaded_bytes > 0 and handle.stats().prefetch_misses >= 0
    handle.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert_bitwise(base, got)
    # One handle type for every plan: its `with` removes it.
    with plan.apply(model, device="cpu", pool=pool) as h:
        model.loss(batches[0]).backward()
    assert h.stats().offloaded_bytes > 0 and not model._forward_pre_hooks


def test_stream_chosen_when_no_layer_plan_fits():
    """Recomputing or offloading whole layers still holds one layer's activations at the end
    of backward; streaming tensors one by one goes lower. Between the two, only streaming
    fits, and the plan says so."""
    with torch.device("meta"):  # the second GPT shape of benchmarks/activations.py
        model = BlockStack(2048, 12, heads=16).to(torch.bfloat16)
    x = torch.empty(8, 2048, 2048, dtype=torch.bfloat16, device="meta")
    prof = trace(model, (x,), loss_fn=lambda out: out.float().pow(2).mean(), optimizer="none")
    hw = Hardware(workspace_bytes=0)
    m = CostModel(prof, hw, 1, 1)
    least = least_peak(m)[1]
    stream = m.stream()[0]
    assert stream.peak_bytes < least
    plan = plan_from_profile(prof, (stream.peak_bytes + least) // 2, hardware=hw)
    assert plan.stream and plan.predicted == stream
    assert "stream" in str(plan)
    with pytest.raises(InfeasibleBudgetError, match="needs at least"):
        plan_from_profile(prof, stream.peak_bytes - 1, hardware=hw)


def test_apply_plan_checks_the_layer_count():
    prof = synthetic_profile(layers=3, saved_bytes=MB, fwd_flops=10**9)
    plan = plan_from_profile(prof, None)
    with pytest.raises(ValueError, match="plan is for 3 layers but the model has 4"):
        plan.apply(GPT(SMALL4), device="cpu")


def test_engines_take_no_plan():
    """The planner sits above the engines (no engine imports it): `Plan.apply` is the one way
    to apply a plan, and the engine's entry point says so."""
    plan = plan_from_profile(synthetic_profile(layers=4, saved_bytes=MB, fwd_flops=10**9), None)
    with pytest.raises(TypeError, match=r"plan\.apply\(model"):
        torchoffload.apply_activation_offloading(GPT(SMALL4), plan=plan, device="cpu")


# -- CLI ----------------------------------------------------------------------------------------

GPT_ARGS = ["plan", "--model", "gpt", "--hidden", "256", "--layers", "4", "--heads", "4",
            "--vocab", "1024", "--batch", "8", "--seq", "128", "--link-gbps", "55",
            "--tflops", "100"]  # fmt: skip


def test_cli_prints_a_table(capsys):
    assert main([*GPT_ARGS, "--budget", "140MiB"]) == 0
    out = capsys.readouterr().out
    assert "layer   saved MiB  offloadable   fwd GFLOP   bwd GFLOP  decision" in out
    assert "no plan" in out and "this plan" in out and "budget 140.00 MiB = predicted" in out
    assert "decisions: keep" in out
    peak = float(out.split("this plan")[1].split()[0])
    margin = float(out.split("+ margin ")[1].split()[0])
    assert margin > 32 and peak + margin <= 140.0


def test_cli_infeasible_budget(capsys):
    assert main([*GPT_ARGS, "--budget", "1MiB"]) == 1
    err = capsys.readouterr().err
    assert "needs at least" in err and "alone take" in err


def test_cli_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    assert main([*GPT_ARGS, "--budget", "140MiB", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_parse_bytes():
    assert parse_bytes("60GiB") == 60 << 30
    assert parse_bytes("512 MiB") == 512 << 20
    assert parse_bytes("1.5e9") == 1_500_000_000
    for bad in ("", "10 parsecs", "-1GiB"):
        with pytest.raises(Exception, match="size"):
            parse_bytes(bad)


def test_attention_flops_grouped_query_and_causal():
    """CPU flash attention (what a fake trace runs) is counted per query head, causal halved:
    forward Q K^T and P V, backward five matmuls of the same size."""

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Identity(), nn.Identity()])

        def forward(self, q, k):
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, k, is_causal=True, enable_gqa=True
            )
            return self.layers[1](self.layers[0](out))

    b, h, kv, s, d = 2, 8, 2, 128, 64
    q = torch.randn(b, h, s, d, requires_grad=True)
    k = torch.randn(b, kv, s, d, requires_grad=True)
    p = trace(Attn(), (q, k), optimizer="none")
    one = 2 * b * h * s * s * d // 2  # one causal [s, d] x [d, s] product over all query heads
    assert p.outside_fwd_flops == 2 * one
    # its backward runs after layer 0's backward started, so it is charged to layer 0
    assert p.outside_bwd_flops + sum(layer.bwd_flops for layer in p.layers) == 5 * one


def test_example_inputs_that_are_not_tensors_name_the_argument():
    model = ReluStack()
    with pytest.raises(TypeError, match="example_inputs holds no tensor"):
        trace(model, ("x",))
    with pytest.raises(TypeError, match="example_inputs must be"):
        trace(model, "x")


def test_decisions_are_parsed_into_the_enum():
    from torchoffload.planner import Decision

    prof = synthetic_profile(layers=2, saved_bytes=1 << 20, fwd_flops=1 << 30)
    plan = plan_from_profile(prof, None)
    assert all(type(d) is Decision for d in plan.decisions)
    replaced = dataclasses.replace(plan, decisions=("offload", "keep"))
    assert replaced.decisions == (Decision.OFFLOAD, Decision.KEEP)
    assert replaced.offload_layers == frozenset({0})
    with pytest.raises(ValueError, match="decisions must be among"):
        dataclasses.replace(plan, decisions=("offlaod", "keep"))
