"""The planner's placement of the optimizer state (device or host, `OffloadedOptimizer`): the
device timeline without gradients and state, the host memory it needs, the choice under a
device and a host budget, refusals that say what the plan is made of, and `plan.optimizer`."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import torchoffload
from torchoffload._transfer import CAST_CHUNK
from torchoffload.models import GPT, GPTConfig
from torchoffload.planner import (
    Hardware,
    InfeasibleBudgetError,
    OptimizerState,
    plan_from_profile,
    trace,
)
from torchoffload.planner._cost import (
    CostModel,
    bucket_bytes,
    device_part_bytes,
    host_optimizer_bytes,
)

CFG = GPTConfig(hidden=256, layers=4, heads=4, vocab=32000, max_seq=128)
# Placement at exact thresholds: no workspaces and no margin (test_planner.py tests the margin)
HW = Hardware(workspace_bytes=0, margin_bytes=0, margin_fraction=0.0)


@pytest.fixture(scope="module")
def profile():
    with torch.device("meta"):
        model = GPT(CFG).to(torch.bfloat16)
    x = torch.zeros(2, 128, dtype=torch.long, device="meta")
    return trace(model, (x,), loss_fn=lambda out: out.float().mean())


def least(profile, host, params=False, fraction=1.0, hw=HW):
    from torchoffload.planner._search import least_peak

    model = CostModel(profile, hw, 1, 1, host_optimizer=host, host_params=params,
                      host_fraction=fraction)  # fmt: skip
    return least_peak(model)[1]


def test_the_trace_records_each_gradient_as_backward_finishes_it(profile):
    assert sum(b for _, b in profile.grad_events) == profile.grad_bytes
    numel = sum(p.numel() for p in GPT(CFG).parameters())
    assert profile.trainable_numel == numel and profile.trainable_bytes == 2 * numel
    marks = profile.step_marks
    assert all(marks["forward_end"] < at <= marks["backward_end"] for at, _ in profile.grad_events)


def test_host_placement_removes_gradients_and_state_from_the_device(profile):
    dev = CostModel(profile, HW, 1, 1)
    host = CostModel(profile, HW, 1, 1, host_optimizer=True)
    end = profile.step_marks["backward_end"]
    # at the end of backward: the device placement holds every gradient and the state, the
    # host one at most two buckets of gradients, plus the scratch of the copies that convert
    # (one fp32 chunk of the largest parameter per copy stream)
    scratch = 2 * 4 * min(CAST_CHUNK, profile.largest_trainable_numel)
    assert 0 < scratch < profile.grad_bytes
    removed = dev.steady[end] - host.steady[end]
    in_flight = 2 * bucket_bytes(profile)
    assert removed >= profile.optimizer_bytes + profile.grad_bytes - in_flight - scratch
    assert removed <= profile.optimizer_bytes + profile.grad_bytes - scratch
    assert all(h <= d for h, d in zip(host.steady, dev.steady, strict=True))
    # host bytes: fp32 master and gradient, AdamW's two fp32 moments (no bf16 staging: the
    # copies convert on the device)
    assert host_optimizer_bytes(profile) == profile.trainable_numel * 16


def test_a_budget_only_the_host_placement_meets_chooses_it(profile):
    budget = (least(profile, True) + least(profile, False)) // 2
    plan = plan_from_profile(profile, budget, hardware=HW, host_budget_bytes=64 << 30)
    assert plan.optimizer_state == OptimizerState.HOST
    assert plan.predicted.peak_bytes <= budget
    assert plan.host_bytes >= host_optimizer_bytes(profile)
    text = str(plan)
    assert "gradients and optimizer state on the host" in text and "host memory needed" in text
    # Forced on the device, the same budget is refused, saying what takes the room.
    with pytest.raises(InfeasibleBudgetError, match="optimizer state on the device"):
        plan_from_profile(profile, budget, hardware=HW, optimizer_state="device")


def test_an_ample_budget_keeps_the_state_on_the_device_where_it_is_faster(profile):
    plan = plan_from_profile(profile, None, hardware=HW)
    assert plan.optimizer_state == OptimizerState.DEVICE
    assert "on the device" in str(plan)
    forced = plan_from_profile(profile, None, hardware=HW, optimizer_state="host")
    assert forced.optimizer_state == OptimizerState.HOST
    assert forced.predicted.step_s > plan.predicted.step_s  # the host step is exposed


def test_a_host_budget_that_cannot_hold_the_plan_is_refused_with_its_parts(profile):
    budget = (least(profile, True) + least(profile, False)) // 2
    need = host_optimizer_bytes(profile)
    with pytest.raises(InfeasibleBudgetError, match="of host memory") as info:
        plan_from_profile(profile, budget, hardware=HW, host_budget_bytes=need - 1,
                          offload_fraction=1.0)  # fmt: skip
    assert "fp32 master weights, gradients and state" in str(info.value)
    # A part of the state on the host needs less of it: tried before refusing. (For this
    # model, with its large embedding, a part on the device with fp32 masters takes more
    # device memory than the traced bf16 AdamW all on the device: the state is placed on the
    # host here.)
    three_quarters = least(profile, True, fraction=0.75)
    assert least(profile, True) < three_quarters
    plan = plan_from_profile(profile, three_quarters, hardware=HW, host_budget_bytes=need - 1,
                             optimizer_state="host")  # fmt: skip
    assert plan.offload_fraction == 0.75 and plan.host_bytes <= need - 1


def test_without_a_host_budget_a_plan_for_a_bigger_host_is_stated_not_refused(profile, monkeypatch):
    """No host budget given: the plan is for this machine where one fits its memory; where none
    does, the plan that fits the device comes with its host need and a warning. A host budget
    given is a limit (the test above)."""
    import torchoffload.planner._plan as plan_module

    budget = least(profile, True)  # only all of the state on the host fits
    need = host_optimizer_bytes(profile)
    monkeypatch.setattr(plan_module, "physical_memory", lambda: need // 2)
    with pytest.warns(UserWarning, match="more than this machine's"):
        plan = plan_from_profile(profile, budget, hardware=HW)
    assert plan.optimizer_state == OptimizerState.HOST and plan.host_bytes >= need
    assert "more than this machine's" in str(plan)
    monkeypatch.setattr(plan_module, "physical_memory", lambda: 64 << 30)
    plan = plan_from_profile(profile, budget, hardware=HW)  # fits here: no warning
    assert "of a 64.00 GiB host budget" in str(plan)


def test_a_fraction_of_the_state_on_the_host_in_the_cost_model(profile):
    """Note: [A fraction of the state on the host]: the device keeps the gradients backward
    finishes last and fp32 masters and state for them; the host steps and moves the rest."""
    whole = CostModel(profile, HW, 1, 1, host_optimizer=True)
    half = CostModel(profile, HW, 1, 1, host_optimizer=True, host_fraction=0.5)
    end = profile.step_marks["backward_end"]
    numel = profile.trainable_numel
    on_device = device_part_bytes(profile, 0.5)
    assert on_device == numel // 2 * (4 + 2 * 4)  # bf16: fp32 masters and AdamW's two moments
    kept = half.steady[end] - whole.steady[end] - on_device
    # about half of the gradients stay (those backward finishes last), less the two buckets
    # the whole placement may still hold in flight
    assert profile.grad_bytes // 2 - 2 * bucket_bytes(profile) <= kept <= profile.grad_bytes // 2
    assert half.t_host == pytest.approx(whole.t_host / 2)
    assert half.t_link == pytest.approx(whole.t_link / 2)
    assert 0 < half.t_opt < half.t_host  # the device part steps at the memory bandwidth
    assert host_optimizer_bytes(profile, 0.5) == pytest.approx(
        host_optimizer_bytes(profile) / 2, rel=1e-6
    )
    peaks = [least(profile, True, fraction=f) for f in (1.0, 0.75, 0.5)]
    assert peaks == sorted(set(peaks))  # more on the device, a higher least peak
    with pytest.raises(ValueError, match="host_fraction"):
        CostModel(profile, HW, 1, 1, host_optimizer=True, host_fraction=0.0)


def test_the_planner_chooses_the_fraction_that_is_fastest_within_the_budget(profile):
    """A host step slower than backward: a part of the state on the device shortens it, so
    the planner keeps on the device as much as the budget allows; a host step hidden by
    backward: all of the state goes to the host (less device memory, same time)."""
    slow_host = dataclasses.replace(HW, host_adam_params_per_s=1e6)
    half = least(profile, True, fraction=0.5, hw=slow_host)
    quarter = least(profile, True, fraction=0.25, hw=slow_host)
    assert half < quarter
    kw = dict(host_budget_bytes=64 << 30, optimizer_state="host")
    plan = plan_from_profile(profile, (half + quarter) // 2, hardware=slow_host, **kw)
    assert plan.optimizer_state == OptimizerState.HOST and plan.offload_fraction == 0.5
    assert plan.predicted.peak_bytes <= (half + quarter) // 2
    whole = plan_from_profile(profile, (half + quarter) // 2, hardware=slow_host, **kw,
                              offload_fraction=1.0)  # fmt: skip
    assert whole.offload_fraction == 1.0
    assert plan.predicted.step_s < whole.predicted.step_s
    text = str(plan)
    assert "50% of the gradients and optimizer state on the host" in text
    assert "OffloadedOptimizer(offload_fraction=0.5)" in text
    # a host step and copies that cost nothing next to backward: all of it goes to the host
    # (with this small model's default link, the last upload, after backward, is what a part
    # on the device shortens)
    fast_host = Hardware(workspace_bytes=0, host_adam_params_per_s=1e12, link_gbps=1e6)
    fast = plan_from_profile(profile, (half + quarter) // 2, hardware=fast_host, **kw)
    assert fast.optimizer_state == OptimizerState.HOST and fast.offload_fraction == 1.0


def test_plan_optimizer_builds_the_fraction_it_chose(profile):
    slow_host = dataclasses.replace(HW, host_adam_params_per_s=1e6)
    budget = least(profile, True, fraction=0.25, hw=slow_host)
    plan = plan_from_profile(profile, budget, hardware=slow_host, host_budget_bytes=64 << 30,
                             optimizer_state="host")  # fmt: skip
    assert plan.offload_fraction == 0.25
    model = GPT(CFG)
    opt = plan.optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    assert opt.stats().device_params > 0
    model.loss(torch.randint(0, CFG.vocab, (2, 16))).backward()
    opt.step()
    opt.remove()
    with pytest.raises(ValueError, match="plan with offload_fraction=1.0"):
        plan.optimizer(GPT(CFG).parameters(), torch.optim.AdamW, lr=1e-3, max_grad_norm=1.0)
    with pytest.raises(ValueError, match="the plan chose 0.25"):
        plan.optimizer(GPT(CFG).parameters(), torch.optim.AdamW, offload_fraction=0.5)


def test_parameters_that_do_not_fit_are_named(profile):
    with pytest.raises(InfeasibleBudgetError, match="allow them on the host"):
        plan_from_profile(profile, profile.param_bytes // 2, hardware=HW, parameters="device")
    with pytest.raises(InfeasibleBudgetError, match="parameters streamed from the host"):
        plan_from_profile(profile, profile.param_bytes // 2, hardware=HW)


def test_parameters_go_to_the_host_only_when_nothing_else_fits(profile):
    assert least(profile, True, True) < least(profile, True)
    budget = (least(profile, True, True) + least(profile, True)) // 2
    plan = plan_from_profile(profile, budget, hardware=HW, host_budget_bytes=64 << 30)
    assert plan.parameters == "host" and plan.optimizer_state == OptimizerState.HOST
    assert plan.predicted.peak_bytes <= budget
    assert 0 < plan.parameter_budget_bytes < profile.param_bytes
    assert plan.host_bytes >= profile.param_bytes + host_optimizer_bytes(profile)
    text = str(plan)
    assert "parameters in pinned host memory, streamed per layer" in text
    # Each pass moves every parameter up: the link bounds forward and backward.
    t_params = profile.param_bytes / (HW.link_gbps * 1e9)
    assert plan.predicted.forward_s >= t_params and plan.predicted.backward_s >= t_params
    # With room for them on the device, they stay there.
    roomy = plan_from_profile(profile, None, hardware=HW, host_budget_bytes=64 << 30)
    assert roomy.parameters == "device"
    # Too little host memory for the store and the optimizer: refused with the parts.
    with pytest.raises(InfeasibleBudgetError, match="the parameters' store"):
        plan_from_profile(profile, budget, hardware=HW, host_budget_bytes=plan.host_bytes - 1)


def test_plan_streams_parameters_and_builds_the_optimizer_it_placed(profile):
    budget = (least(profile, True, True) + least(profile, True)) // 2
    plan = plan_from_profile(profile, budget, hardware=HW, host_budget_bytes=64 << 30)
    model = GPT(CFG).to(torch.bfloat16)  # as traced
    handle = plan.stream_parameters(model)
    opt = plan.optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    assert handle.stats().budget_bytes == plan.parameter_budget_bytes
    model.loss(torch.randint(0, CFG.vocab, (2, 16))).backward()
    opt.step()
    assert handle.stats().backward_passes == 1
    opt.remove()
    handle.remove()
    assert plan_from_profile(profile, None, hardware=HW).stream_parameters(model) is None


def test_bad_placement_arguments(profile):
    with pytest.raises(ValueError, match="optimizer_state"):
        plan_from_profile(profile, None, optimizer_state="gpu")
    with pytest.raises(ValueError, match="host_budget_bytes"):
        plan_from_profile(profile, None, host_budget_bytes=-1)
    with pytest.raises(ValueError, match="parameters"):
        plan_from_profile(profile, None, parameters="gpu")
    with pytest.raises(ValueError, match="needs optimizer_state"):
        plan_from_profile(profile, None, parameters="host", optimizer_state="device")
    for bad in (0, 1.5, "half", True):
        with pytest.raises(ValueError, match="offload_fraction"):
            plan_from_profile(profile, None, offload_fraction=bad)


def test_plan_optimizer_builds_what_the_plan_placed(profile):
    budget = (least(profile, True) + least(profile, False)) // 2
    plan = plan_from_profile(profile, budget, hardware=HW, host_budget_bytes=64 << 30)
    model = GPT(CFG)
    opt = plan.optimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)
    assert isinstance(opt, torchoffload.OffloadedOptimizer)
    model.loss(torch.randint(0, CFG.vocab, (2, 16))).backward()
    opt.step()
    opt.remove()
    plain = plan_from_profile(profile, None, hardware=HW).optimizer(
        GPT(CFG).parameters(), torch.optim.AdamW, lr=1e-3
    )
    assert type(plain) is torch.optim.AdamW


def test_cli_prints_where_state_lives(capsys):
    from torchoffload.cli import main

    args = ["plan", "--model", "gpt", "--hidden", "256", "--layers", "4", "--heads", "4",
            "--vocab", "32000", "--seq", "128", "--batch", "2", "--link-gbps", "55",
            "--tflops", "790", "--optimizer-state", "host", "--host-budget", "64GiB"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "gradients and optimizer state on the host" in out
    assert "host memory needed" in out and "64.00 GiB host budget" in out


def test_the_70b_plan_fits_80_gib_with_parameters_and_state_on_the_host(capsys, monkeypatch):
    """The issue's 70B-class command, as written: parameters streamed, gradients and AdamW
    state on the host, where each kind of state lives printed, and the host memory it needs
    stated: more than a 128 GiB machine (the GPU machine's) has, so the plan is for a bigger
    host, not refused (Note: [The default host budget])."""
    import torchoffload.planner._plan as plan_module
    from torchoffload.cli import main

    monkeypatch.setattr(plan_module, "physical_memory", lambda: 128 << 30)
    args = ["plan", "--model", "llama", "--hidden", "8192", "--layers", "80", "--heads", "64",
            "--batch", "1", "--seq", "4096", "--budget", "80GiB"]  # fmt: skip
    assert main(args) == 0  # the warning is the plan's host line, not a second message
    out = capsys.readouterr().out
    assert "parameters in pinned host memory, streamed per layer" in out
    assert "gradients and optimizer state on the host" in out
    need = next(line for line in out.splitlines() if line.startswith("host memory needed: "))
    assert float(need.split()[3]) > 1024  # GiB: 70 B parameters' store, masters and state
    assert "more than this machine's 128.00 GiB" in need
    row = next(line for line in out.splitlines() if line.startswith("this plan"))
    assert float(row.split()[2]) <= 80.0  # predicted peak GiB


@pytest.mark.parametrize(
    "placement",
    [dict(optimizer_state="host"), dict(optimizer_state="host", parameters="host"),
     dict(optimizer_state="host", offload_fraction=0.5)],
)  # fmt: skip
def test_the_plotted_timelines_are_the_placed_ones(profile, placement):
    """`memory_timelines` (what `plot` draws) use the plan's placement: the plan's curve peaks
    at its predicted peak at most, the no-plan curve at the baseline's."""
    plan = plan_from_profile(profile, None, hardware=HW, host_budget_bytes=64 << 30, **placement)
    base, planned = plan.memory_timelines()
    assert max(planned) <= plan.predicted.peak_bytes
    assert max(base) <= plan.baseline.peak_bytes


def test_low_precision_host_state_is_counted_at_its_bytes_per_parameter(profile):
    """`host_bytes_per_param` (bf16 masters and 8-bit AdamW moments: 6.03 bytes a parameter
    against 16) lets all of the state on the host meet a host budget that fp32 state cannot."""
    from torchoffload.optim import host_bytes_per_param

    per = host_bytes_per_param(torch.bfloat16, master_dtype=torch.bfloat16, state_bits=8,
                               overlap=False)  # fmt: skip
    numel = profile.trainable_numel
    assert host_optimizer_bytes(profile) == 16 * numel  # bf16 parameters, AdamW, fp32 masters
    assert host_optimizer_bytes(profile, 0.5, per) == int(numel * 0.5 * per)
    host_budget = 10 * numel  # between the two
    with pytest.raises(InfeasibleBudgetError, match="fp32 master weights") as info:
        plan_from_profile(profile, None, hardware=HW, optimizer_state="host",
                          offload_fraction=1.0, host_budget_bytes=host_budget)  # fmt: skip
    assert "of host memory" in str(info.value)
    plan = plan_from_profile(profile, None, hardware=HW, optimizer_state="host",
                             offload_fraction=1.0, host_budget_bytes=host_budget,
                             host_bytes_per_param=per)  # fmt: skip
    assert plan.host_bytes_per_param == per and plan.offload_fraction == 1.0
    assert host_optimizer_bytes(profile, 1.0, per) <= plan.host_bytes <= host_budget
    assert "masters, gradients and state at 6.03 bytes a parameter" in str(plan)
    with pytest.raises(ValueError, match="host_bytes_per_param must be > 0"):
        plan_from_profile(profile, None, hardware=HW, host_bytes_per_param=0.0)


def all_state_on_the_host():
    """A bf16 GPT on the meta device, its input, and `plan`'s arguments for all of its
    optimizer state on the host."""
    with torch.device("meta"):
        model = GPT(CFG).to(torch.bfloat16)
    x = torch.zeros(2, 128, dtype=torch.long, device="meta")
    kw = dict(budget_bytes=None, loss_fn=lambda out: out.float().mean(), optimizer_state="host",
              offload_fraction=1.0, host_budget_bytes=64 << 30)  # fmt: skip
    return model, x, kw


def test_plan_prices_the_host_step_at_the_rate_given(monkeypatch):
    """``plan(host_step_params_per_s=...)``: the host step of that rate (a low-precision host
    state's, from `measure_host_step`) instead of the hardware default; refused when bad."""
    monkeypatch.setattr(Hardware, "detect", classmethod(lambda cls, *a: HW))
    model, x, kw = all_state_on_the_host()
    default = torchoffload.plan(model, (x,), **kw)
    slow = torchoffload.plan(model, (x,), **kw, host_step_params_per_s=1e6)
    numel = sum(p.numel() for p in model.parameters())
    assert slow.hardware.host_adam_params_per_s == 1e6
    assert default.hardware.host_adam_params_per_s == HW.host_adam_params_per_s
    # the host step is then all but the whole step: numel / rate, less what backward hides
    assert slow.predicted.step_s > numel / 1e6 - default.predicted.step_s
    assert slow.predicted.step_s > 100 * default.predicted.step_s
    with pytest.raises(ValueError, match="host_step_params_per_s"):
        torchoffload.plan(model, (x,), **kw, host_step_params_per_s=0)


def test_plan_prices_the_link_at_the_bytes_given(monkeypatch):
    """``plan(link_bytes_per_param=...)``: a hosted parameter's gradient and new value cross
    the link at that many bytes each way (2 for bf16 masters, `link_bytes_per_param`), not
    fp32's 4; where the link binds, the predicted step halves. Refused when bad."""
    from torchoffload.optim import link_bytes_per_param

    slow_link = dataclasses.replace(HW, link_gbps=0.01)  # the link binds the step
    monkeypatch.setattr(Hardware, "detect", classmethod(lambda cls, *a: slow_link))
    model, x, kw = all_state_on_the_host()
    fp32 = torchoffload.plan(model, (x,), **kw)  # link-bound: beside backward and the tail
    bf16 = torchoffload.plan(
        model, (x,), **kw, link_bytes_per_param=link_bytes_per_param(master_dtype=torch.bfloat16)
    )
    numel = sum(p.numel() for p in model.parameters())
    link_s = 4 * numel / (slow_link.link_gbps * 1e9)
    assert fp32.link_bytes_per_param is None and bf16.link_bytes_per_param == 2
    assert fp32.predicted.optimizer_s > link_s  # fp32 crosses 4 bytes each way
    assert bf16.predicted.optimizer_s == pytest.approx(fp32.predicted.optimizer_s / 2, rel=1e-3)
    assert "2 bytes a parameter over the link each way" in str(bf16)
    assert "4 bytes a parameter over the link each way" in str(fp32)
    with pytest.raises(ValueError, match="link_bytes_per_param"):
        torchoffload.plan(model, (x,), **kw, link_bytes_per_param=-1)
