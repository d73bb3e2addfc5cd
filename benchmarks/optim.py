"""Full fine-tuning with the optimizer on the host: a Llama-shaped model (random weights from a
config, bf16, Hugging Face gradient checkpointing, AdamW), one row per way of training.

    python benchmarks/optim.py                      # Llama-3.2-3B shape, batch 2, seq 4096
    python benchmarks/optim.py --layers 4 --steps 3 # quick

Rows, each in its own process (host and device memory start clean):
- ``resident``: fused AdamW on the GPU over the bf16 parameters (bf16 state).
- ``fsdp2-cpu``: FSDP2 ``CPUOffloadPolicy`` on one rank (parameters, gradients and AdamW state
  on the host; its step is torch's foreach AdamW on the CPU, after backward).
- ``offload``: `torchoffload.OffloadedOptimizer` (fused AdamW on fp32 host masters, each
  bucket stepped while backward runs; gradients and new values cross the link in fp32,
  converted on the device). ``offload-host-converts``: the same with ``convert_on="host"``
  (bf16 over the link, converted by the host). ``offload-bucket32``/``-bucket128``/
  ``-bucket512``: buckets of 32/128/512 MiB of parameters instead of the
  default (about 50 buckets). ``offload-at-step``: with ``overlap=False``;
  ``offload-ahead``: with ``step_ahead=True`` (the host step also overlaps the next forward);
  ``offload-clip``/``offload-clip-ahead``: with ``max_grad_norm=--clip-norm`` (the host
  clips), without and with ``step_ahead``; ``offload-clip-model``: `clip_grad_norm_` on the
  model between backward and `step()`; ``*-switch``: the interpreter's GIL switch interval
  set to ``--switch-ms`` (`sys.setswitchinterval`) in the row's process;
  ``offload-half``/``offload-ahead-half``: ``offload_fraction=0.5`` (half the parameter bytes
  stepped on the host, the first half on the GPU with fp32 masters and state there);
  ``offload-f75``: ``offload_fraction=0.75``.
  ``offload-params``: also the parameters in the host store, streamed per decoder layer for
  forward and backward under ``--param-budget-gib`` (`torchoffload.stream_parameters`).
  ``offload-acts``/``offload-params-acts``: also the tensors saved in forward (with gradient
  checkpointing: each decoder layer's input) offloaded by `torchoffload.offload_activations`.
- ``calibrate``: the pinned link (GB/s each way), a host fp32 triad (GB/s of traffic), a
  fused AdamW step over fp32 host tensors of the model's size (ms), and copies that convert
  (bf16 on the device, fp32 on the host) through the copy engine: GB/s of fp32 each way and
  host time per chunk.

Bound of an offloaded step, per row: ``max(t_fwd+bwd (resident), host step, link)``. The host
step is the calibrated fused AdamW step, plus the bf16<->fp32 conversions (12 bytes a
parameter) at the measured triad bandwidth for ``offload-host-converts``, plus the rounding of
new values into the parameter store (6 bytes a parameter) for ``offload-params``. The link
time is the larger of the bytes down over the D2H bandwidth and the bytes up over the H2D one:
fp32 gradients and values when the device converts, bf16 when the host does, and for
``offload-params`` bf16 parameters up twice (forward and backward) instead of new values.
``--row parity`` instead trains a small fp32 GPT 50 steps with AdamW resident on the GPU and
offloaded, and prints how far their losses and parameters drift apart.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

import torch

GiB = 2**30


def llama(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
        vocab_size=args.vocab, max_position_embeddings=args.seq,
        tie_word_embeddings=not args.untied, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False
    model.train()
    return model


def host_rss() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / GiB
    return float("nan")


def forward(model, x, forward_context=None):
    """The model's loss on ``x``, its forward inside ``forward_context`` if one is given."""
    with forward_context if forward_context is not None else contextlib.nullcontext():
        return model(input_ids=x, labels=x).loss


def train(args, model, opt, *, sync_between: bool, on_step=None, forward_context=None,
          before_step=None, every_step=None):  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda", generator=g)
    times, fb, st, losses = [], [], [], []
    for step in range(args.steps + 1):
        torch.cuda.synchronize()
        if every_step is not None:
            every_step()
        if step == 1:
            torch.cuda.reset_peak_memory_stats()
            if on_step is not None:
                on_step()
        t0 = time.perf_counter()
        loss = forward(model, x, forward_context)
        loss.backward()
        if sync_between:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if before_step is not None:
            before_step(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        losses.append(float(loss))
        if step > 0:  # the first step allocates state
            times.append(t2 - t0)
            fb.append(t1 - t0)
            st.append(t2 - t1)
    med = sorted(times)[len(times) // 2]
    gpu = gpu_time(model, opt, x, forward_context) if args.profile else None

    def median_ms(xs):
        return sorted(xs)[len(xs) // 2] * 1e3 if sync_between else None

    return dict(
        step_ms=med * 1e3, mean_ms=sum(times) / len(times) * 1e3, fwd_bwd_ms=median_ms(fb),
        opt_ms=median_ms(st),
        tokens_s=args.batch * args.seq / med,
        peak_gib=torch.cuda.max_memory_allocated() / GiB, host_gib=host_rss(), losses=losses,
        gpu=gpu,
    )  # fmt: skip


def gpu_time(model, opt, x, forward_context, steps: int = 2):
    """GPU time per step over ``steps`` more steps under the profiler: kernels (all streams,
    the copies' casts included) and copies (the copy engines), ms per step, and the kernels
    that took the most. What the GPU does, not when: kernels of two streams may overlap."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            forward(model, x, forward_context).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    kernels, copies = {}, 0.0
    for e in prof.key_averages():
        if e.device_type != DeviceType.CUDA:
            continue
        t = getattr(e, "self_device_time_total", None)
        t = (t if t is not None else e.self_cuda_time_total) / 1e3 / steps
        if e.key.startswith(("Memcpy", "Memset")):
            copies += t
        else:
            kernels[e.key] = kernels.get(e.key, 0.0) + t
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
    return dict(kernel_ms=sum(kernels.values()), copy_ms=copies,
                top=[(k[:60], round(v, 1)) for k, v in top])  # fmt: skip


def row_resident(args):
    model = llama(args)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return train(args, model, opt, sync_between=True)


def row_offload(
    args,
    overlap: bool,
    host_threads: int | None = None,
    ahead: bool = False,
    params=False,
    convert_on: str = "device",
    bucket_mib: int | None = None,
    fraction: float = 1.0,
    acts: bool = False,
    clip: str | None = None,
    lowbit: str | None = None,
    switch_ms: float | None = None,
):
    import torchoffload as to

    if switch_ms is not None:  # the interpreter's GIL switch interval (default 5 ms)
        sys.setswitchinterval(switch_ms / 1e3)

    model = llama(args)
    t = time.perf_counter()
    handle = None
    if params:  # parameters streamed from the host store, stepped there
        handle = to.stream_parameters(model, int(args.param_budget_gib * GiB))
        torch.cuda.empty_cache()
    # lowbit: bf16 masters (stochastic rounding) and 8-bit moments ("8bit", AdamW8bit: 6 bytes
    # a parameter on the host instead of 16) or fp32 ones ("bf16", LowPrecisionAdamW: 12)
    cls, kw = {
        "8bit": (to.optim.AdamW8bit, dict(master_dtype=torch.bfloat16)),
        "bf16": (to.optim.LowPrecisionAdamW, dict(master_dtype=torch.bfloat16)),
        None: (torch.optim.AdamW, dict(fused=True)),
    }[lowbit]
    opt = to.OffloadedOptimizer(
        model.parameters(), cls, lr=1e-5, **kw, overlap=overlap,
        host_threads=host_threads, step_ahead=ahead, model=model if ahead else None,
        convert_on=convert_on, bucket_bytes=None if bucket_mib is None else bucket_mib << 20,
        offload_fraction=fraction, max_grad_norm=args.clip_norm if clip == "config" else None,
    )  # fmt: skip
    setup = time.perf_counter() - t
    norms = []  # clip == "model": clip_grad_norm_ on the model between backward and step()

    def clip_on_model(m):
        norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), args.clip_norm)))

    # Where the worker's time goes (this benchmark's instrumentation, not the library's): the
    # optimizer class's step per bucket, and queueing each bucket's upload.
    spent = {"class_step": 0.0, "upload_queue": 0.0}
    rt = opt._runtime

    def timed(fn, key):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t

        return wrapper

    for bucket in rt.buckets:
        bucket.optimizer.step = timed(bucket.optimizer.step, "class_step")
    rt.engine.load = timed(rt.engine.load, "upload_queue")
    # The worker's timeline of each step (ms since its forward began): what it did before and
    # after step() was called
    events = []  # (what, start, end)
    begun = {"t0": time.perf_counter(), "called": None}

    def traced(fn, what):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                events.append((what(*a, **k) if callable(what) else what, t, time.perf_counter()))

        return wrapper

    rt.stepper.arrive = traced(rt.stepper.arrive, "arrive")
    # The fused kernel apart from the class's Python around it: which of the two slows down
    # beside forward and backward (looked up on torch at each call by torch.optim)
    kernels = {k: getattr(torch, k) for k in ("_fused_adamw_", "_fused_adam_") if hasattr(torch, k)}
    for k, fn in kernels.items():
        setattr(torch, k, traced(fn, "kernel"))
    for bucket in rt.buckets:
        bucket.optimizer.step = traced(bucket.optimizer.step, "class")
    spec_idx = []  # buckets stepped during backward, in order

    def kind(bucket, speculative):
        if speculative:
            spec_idx.append(bucket.index)
        return "spec" if speculative else "step"

    rt.stepper.step = traced(rt.stepper.step, kind)
    rt.stepper.publish = traced(rt.stepper.publish, "publish")
    from torchoffload.optim import _undo  # Undo has slots: patched on the class

    copies = {"copied": 0, "ahead": 0, "stale": []}  # Note: [Copies aside made ahead]
    save = _undo.Undo.save

    def counted_save(self, optimizer, steps):
        ahead = self._ahead if steps == self._ahead_steps else {}
        for t in _undo._tensors(optimizer):
            st = ahead.get(_undo._key(t))
            good = _undo.unchanged(st, t)
            copies["ahead" if good else "copied"] += 1
            if st is not None and not good and len(copies["stale"]) < 4:
                copies["stale"].append([st[0]() is t, list(st[1:]), [t._version, t.data_ptr()]])
        return save(self, optimizer, steps)

    _undo.Undo.save = traced(counted_save, "save")
    timelines = []
    step_call = opt.step

    def step_and_mark(*a, **k):
        begun["called"] = time.perf_counter()
        return step_call(*a, **k)

    opt.step = step_and_mark
    ctx = to.offload_activations() if acts else None  # what checkpointing saves: layer inputs
    counts = {}

    def every_step():
        if begun["called"] is not None:
            timelines.append(timeline(events, begun["t0"], begun["called"]))
        events.clear()
        begun["t0"] = time.perf_counter()

    def on_step():
        spent.update(class_step=0.0, upload_queue=0.0)
        counts.update(speculated=rt.stepper.speculated, undone=rt.stepper.undone,
                      recalled=rt.recalls.recalled)  # fmt: skip

    clipped = []
    if clip == "config":  # whether each step clipped
        finish = rt.stepper.finish

        def finish_and_record(step_rest, snapshot):
            finish(step_rest, snapshot)
            if step_rest:
                clipped.append(rt.stepper.clipped)
                norms.append(float(rt.stepper.grad_norm))

        rt.stepper.finish = finish_and_record
    out = train(args, model, opt, sync_between=False, on_step=on_step, forward_context=ctx,
                before_step=clip_on_model if clip == "model" else None,
                every_step=every_step)  # fmt: skip
    every_step()  # the last step's timeline
    for k, fn in kernels.items():
        setattr(torch, k, fn)
    if clip == "model":
        clipped = [bool(n > args.clip_norm) for n in norms]
    if clip is not None:
        out.update(clip=clip, clipped_steps=sum(clipped[1:]), of_steps=len(clipped[1:]),
                   norms=norms)  # fmt: skip
    # Buckets stepped during backward, undone, recalled, per timed step (Note: [Steps taken
    # during backward])
    out.update(
        speculated=(rt.stepper.speculated - counts["speculated"]) / args.steps,
        undone=(rt.stepper.undone - counts["undone"]) / args.steps,
        recalled=(rt.recalls.recalled - counts["recalled"]) / args.steps,
        buckets=len(rt.buckets),
    )  # fmt: skip
    if ctx is not None:
        out.update(act_offloaded_gib=ctx.stats().offloaded_bytes / GiB / (args.steps + 1))
    out.update({f"{k}_ms": v / args.steps * 1e3 for k, v in spent.items()})
    out.update(
        timelines=timelines[-3:],
        copies=dict(
            copies, prepared=rt.stepper.prepared, hint=sorted(rt.stepper.hint), spec=spec_idx[-14:]
        ),
    )
    s = opt.stats()
    out.update(
        setup_s=setup, host_step_ms=s.host_step_ms, hidden=s.overlap, wait_ms=s.step_wait_ms,
        link_gb=(s.d2h_bytes + s.h2d_bytes) / s.steps / 1e9, convert_on=convert_on,
        fraction=fraction,
    )  # fmt: skip
    if handle is not None:
        ps = handle.stats()
        out.update(
            param_h2d_gb=ps.h2d_bytes / 1e9, param_peak_gib=ps.peak_loaded_bytes / GiB,
            over_budget=ps.over_budget, on_demand=ps.on_demand, prefetched=ps.prefetched,
        )  # fmt: skip
    return out


def timeline(events, t0, called):
    """A step's worker events summed by kind and by phase (before or after `step()` was
    called): count, ms of work, and the first start and last end, in ms since the forward."""
    ms = lambda t: round((t - t0) * 1e3)  # noqa: E731
    out = {"called": ms(called)}
    for what in sorted({e[0] for e in events}):
        for phase, keep in (("before", lambda s: s < called), ("after", lambda s: s >= called)):
            xs = [e for e in events if e[0] == what and keep(e[1])]
            if xs:
                out[f"{what} {phase}"] = (len(xs), round(sum(b - a for _, a, b in xs) * 1e3),
                                          ms(min(a for _, a, _ in xs)),
                                          ms(max(b for _, _, b in xs)))  # fmt: skip
    return out


def row_fsdp2(args):
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    model = llama(args)
    for layer in model.model.layers:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    out = train(args, model, opt, sync_between=True)
    dist.destroy_process_group()
    return out


def row_calibrate(args):
    n = int(1 * GiB)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def bw(fn, nbytes, reps=5):
        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return nbytes * reps / (time.perf_counter() - t) / 1e9

    d2h = bw(lambda: host.copy_(dev, non_blocking=True), n)
    h2d = bw(lambda: dev.copy_(host, non_blocking=True), n)
    m = n // 4
    a, b, c = (torch.ones(m) for _ in range(3))
    triad = bw(lambda: torch.add(a, b, out=c), 12 * m)
    model = llama(args)
    numel = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    # A fused AdamW step over fp32 host tensors of the model's size, in 32 MiB buckets of bf16
    # parameters as OffloadedOptimizer steps them (16 Mi elements each).
    chunk = 16 << 20
    ps = [torch.zeros(min(chunk, numel - i), requires_grad=True) for i in range(0, numel, chunk)]
    for p in ps:
        p.grad = torch.ones_like(p)
    opts = [torch.optim.AdamW([p], lr=1e-5, fused=True) for p in ps]
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for o in opts:
            o.step()
        times.append(time.perf_counter() - t)
    # The same step while one step's fp32 copies (4 bytes a parameter each way) run on two
    # side streams: how much the copy engines' host memory traffic slows the host step.
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with_copies = []
    for _ in range(3):
        torch.cuda.synchronize()
        for stream, go in ((s1, lambda: host.copy_(dev, non_blocking=True)),
                           (s2, lambda: dev.copy_(host, non_blocking=True))):  # fmt: skip
            with torch.cuda.stream(stream):
                for _ in range(max(1, 4 * numel // n)):
                    go()
        t = time.perf_counter()
        for o in opts:
            o.step()
        with_copies.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    del ps, opts
    conv = convert_speed()
    return dict(d2h_gbs=d2h, h2d_gbs=h2d, triad_gbs=triad, numel=numel,
                adamw_ms=sorted(times)[1] * 1e3, adamw_copies_ms=sorted(with_copies)[1] * 1e3,
                **conv)  # fmt: skip


def convert_speed(numel: int = 256 << 20):
    """Copies that convert, through the copy engine as the optimizer queues them: bf16 on the
    device <-> fp32 in pinned host memory. GB/s of fp32 each way, and host time per chunk."""
    from torchoffload._transfer import CAST_CHUNK, copy_engine

    engine = copy_engine(torch.device("cuda"))
    dev = torch.zeros(numel, dtype=torch.bfloat16, device="cuda")
    host = torch.zeros(numel, dtype=torch.float32, pin_memory=True)
    out = {}
    for name, go in (
        ("d2h", lambda: engine.offload_many([(host, dev)])),
        ("h2d", lambda: engine.load([(dev, host)], after=[])),
    ):
        go()
        torch.cuda.synchronize()
        reps, queued = 4, 0.0
        t = time.perf_counter()
        for _ in range(reps):
            q = time.perf_counter()
            go()
            queued += time.perf_counter() - q
        torch.cuda.synchronize()
        out[f"conv_{name}_gbs"] = 4 * numel * reps / (time.perf_counter() - t) / 1e9
        out[f"conv_{name}_us_per_chunk"] = queued / reps / (numel / CAST_CHUNK) * 1e6
    return out


def row_parity(args):
    """Resident fused AdamW on the GPU against OffloadedOptimizer (AdamW on the host), fp32."""
    import copy

    import torchoffload as to
    from torchoffload.models import GPT, GPTConfig

    torch.use_deterministic_algorithms(True)
    cfg = GPTConfig(hidden=512, layers=4, heads=8, vocab=4096, max_seq=256)
    torch.manual_seed(0)
    a = GPT(cfg).cuda()
    b = copy.deepcopy(a)
    oa = torch.optim.AdamW(a.parameters(), lr=1e-3, fused=True)
    ob = to.OffloadedOptimizer(b.parameters(), torch.optim.AdamW, lr=1e-3, fused=True)
    rows = []
    g = torch.Generator().manual_seed(0)
    for step in range(50):
        x = torch.randint(0, cfg.vocab, (8, 256), generator=g).cuda()
        la, lb = a.loss(x), b.loss(x)
        la.backward()
        lb.backward()
        oa.step()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()
        rows.append((step, float(la), float(lb)))
    pairs = list(zip(a.parameters(), b.parameters(), strict=True))
    diff = max((p - q).abs().max().item() for p, q in pairs)
    same = all(torch.equal(p, q) for p, q in pairs)
    # The kernel alone: 3 fused AdamW steps on equal fp32 tensors and gradients, CUDA vs CPU.
    w, gr = torch.randn(1 << 22, generator=g), torch.randn(1 << 22, generator=g) * 1e-3
    ws = [w.clone().requires_grad_(), w.cuda().requires_grad_()]
    for x in ws:
        opt = torch.optim.AdamW([x], lr=1e-3, fused=True)
        for _ in range(3):
            x.grad = gr.to(x.device)
            opt.step()
    kernel_diff = (ws[0] - ws[1].cpu()).abs().max().item()
    kernel_equal = torch.equal(ws[0], ws[1].cpu())
    return dict(rows=rows, max_param_diff=diff, bitwise=same, kernel_diff=kernel_diff,
                kernel_equal=kernel_equal)  # fmt: skip


ROWS = {
    "calibrate": row_calibrate,
    "resident": row_resident,
    "fsdp2-cpu": row_fsdp2,
    "offload": lambda a: row_offload(a, True),
    "offload-host-converts": lambda a: row_offload(a, True, convert_on="host"),
    "offload-at-step": lambda a: row_offload(a, False),
    "offload-clip": lambda a: row_offload(a, True, clip="config"),
    "offload-8bit": lambda a: row_offload(a, True, lowbit="8bit"),
    "offload-bf16": lambda a: row_offload(a, True, lowbit="bf16"),
    "offload-clip-model": lambda a: row_offload(a, True, clip="model"),
    "offload-ahead": lambda a: row_offload(a, True, ahead=True),
    "offload-clip-ahead": lambda a: row_offload(a, True, ahead=True, clip="config"),
    "offload-switch": lambda a: row_offload(a, True, switch_ms=a.switch_ms),
    "offload-ahead-switch": lambda a: row_offload(a, True, ahead=True, switch_ms=a.switch_ms),
    "offload-clip-switch": lambda a: row_offload(a, True, clip="config", switch_ms=a.switch_ms),
    "offload-clip-ahead-switch": lambda a: row_offload(
        a, True, ahead=True, clip="config", switch_ms=a.switch_ms
    ),
    "offload-params": lambda a: row_offload(a, True, params=True),
    "offload-params-acts": lambda a: row_offload(a, True, params=True, acts=True),
    "offload-acts": lambda a: row_offload(a, True, acts=True),
    "offload-14-threads": lambda a: row_offload(a, True, max(1, torch.get_num_threads() - 2)),
    "offload-15-threads": lambda a: row_offload(a, True, max(1, torch.get_num_threads() - 1)),
    "offload-12-threads": lambda a: row_offload(a, True, max(1, torch.get_num_threads() - 4)),
    "offload-ahead-12-threads": lambda a: row_offload(
        a, True, max(1, torch.get_num_threads() - 4), ahead=True
    ),
    "offload-half": lambda a: row_offload(a, True, fraction=0.5),
    "offload-ahead-half": lambda a: row_offload(a, True, ahead=True, fraction=0.5),
    "offload-f75": lambda a: row_offload(a, True, fraction=0.75),
    "offload-bucket32": lambda a: row_offload(a, True, bucket_mib=32),
    "offload-bucket128": lambda a: row_offload(a, True, bucket_mib=128),
    "offload-bucket512": lambda a: row_offload(a, True, bucket_mib=512),
    "parity": row_parity,
}


def bound_of(r, cal, fb):
    """``(fwd+bwd, host, link)`` seconds of an offloaded row (the bound is their max), or None
    without a calibration. See the module docstring."""
    if not cal or "convert_on" not in r:
        return None
    f = r.get("fraction", 1.0)  # the device steps the rest, and keeps its bytes off the link
    n = cal["numel"] * f
    host = cal["adamw_ms"] / 1e3 * f
    if r["convert_on"] == "host":
        host += 12 * n / 1e9 / cal["triad_gbs"]  # bf16 -> fp32 grads, fp32 -> bf16 values
        down = up = 2 * n
    else:
        down = up = 4 * n
    if "param_h2d_gb" in r:  # parameters go up for forward and backward; values stay home
        up = 2 * 2 * n
        host += 6 * n / 1e9 / cal["triad_gbs"]
    link = max(down / 1e9 / cal["d2h_gbs"], up / 1e9 / cal["h2d_gbs"])
    return fb, host, link


def model_arguments(p: argparse.ArgumentParser) -> None:
    """The model's shape (`llama`) and the batch: the Llama-3.2-3B shape by default."""
    p.add_argument("--hidden", type=int, default=3072)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--untied", action="store_true", help="an output head of its own")
    p.add_argument("--batch", type=int, default=2, help="per process")
    p.add_argument("--seq", type=int, default=4096)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    model_arguments(p)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rows", default="calibrate,resident,offload,offload-at-step,fsdp2-cpu")
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=int, default=240)
    p.add_argument(
        "--profile", action="store_true",
        help="also GPU kernel and copy time per step (torch.profiler), per row",
    )  # fmt: skip
    p.add_argument("--clip-norm", type=float, default=1.0,
                   help="max_grad_norm of the clip rows")  # fmt: skip
    p.add_argument(
        "--switch-ms",
        type=float,
        default=0.5,
        help="*-switch rows: sys.setswitchinterval, in ms (Python's default: 5)",
    )
    p.add_argument("--param-budget-gib", type=float, default=2.0,
                   help="offload-params: device budget of the streamed parameters")  # fmt: skip
    args = p.parse_args()
    if args.row:
        print("RESULT " + json.dumps(ROWS[args.row](args)), flush=True)
        return
    results = {}
    for name in args.rows.split(","):
        # "<row>-passive": the same row with OMP_WAIT_POLICY=PASSIVE (OpenMP threads sleep
        # between parallel regions instead of spinning), set before the process starts.
        row = name.removesuffix("-passive")
        env = dict(os.environ, **({"OMP_WAIT_POLICY": "PASSIVE"} if row != name else {}))
        cmd = [sys.executable, __file__, *sys.argv[1:], "--row", row]
        t = time.perf_counter()
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                                 env=env)  # fmt: skip
            out = run.stdout + run.stderr
        except subprocess.TimeoutExpired as e:
            out = f"timed out after {args.timeout} s\n{e.stdout or ''}{e.stderr or ''}"
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        if lines:
            results[name] = json.loads(lines[-1][7:])
            print(f"{name}: {time.perf_counter() - t:.0f} s", flush=True)
        else:
            print(f"{name}: FAILED\n{out[-3000:]}", flush=True)
    report(args, results)


def report(args, results) -> None:
    print(f"\ntorch {torch.__version__}, {torch.cuda.get_device_name()}, hidden {args.hidden}, "
          f"layers {args.layers}, intermediate {args.intermediate}, vocab {args.vocab}"
          f"{' untied' if args.untied else ''}, batch {args.batch}, seq {args.seq}")  # fmt: skip
    cal = results.get("calibrate")
    if "parity" in results:
        par = results["parity"]
        print("parity (fp32 GPT, AdamW resident on the GPU vs offloaded), step: loss a, loss b")
        for step, la, lb in par["rows"][:: max(1, len(par["rows"]) // 10)]:
            print(f"  {step:3d}  {la:.6f}  {lb:.6f}  diff {abs(la - lb):.2e}")
        print(f"  bitwise {par['bitwise']}, max parameter diff after 50 steps "
              f"{par['max_param_diff']:.3e}; fused AdamW alone, CUDA vs CPU, 3 steps on equal "
              f"tensors: equal {par['kernel_equal']}, max diff "
              f"{par['kernel_diff']:.3e}")  # fmt: skip
    fb = (results.get("resident", {}).get("fwd_bwd_ms") or 0) / 1e3
    if cal:
        print(f"calibration: D2H {cal['d2h_gbs']:.1f} GB/s, H2D {cal['h2d_gbs']:.1f} GB/s, host "
              f"triad {cal['triad_gbs']:.1f} GB/s, fused AdamW over {cal['numel'] / 1e9:.2f} B "
              f"fp32 params {cal['adamw_ms']:.0f} ms; converting copies (bf16 device, fp32 "
              f"host) D2H {cal['conv_d2h_gbs']:.1f} GB/s, H2D {cal['conv_h2d_gbs']:.1f} GB/s "
              f"of fp32, host {cal['conv_d2h_us_per_chunk']:.1f}/"
              f"{cal['conv_h2d_us_per_chunk']:.1f} us per chunk; fused AdamW while one "
              f"step's fp32 copies run {cal['adamw_copies_ms']:.0f} ms; fwd+bwd resident "
              f"{fb * 1e3:.0f} ms")  # fmt: skip
    print("| row | tokens/s | step ms | fwd+bwd ms | opt.step ms | peak GiB | host GiB "
          "| host step ms | hidden | bound ms (fwd+bwd, host, link) | x bound |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [r for r in results if r not in ("calibrate", "parity")]
    for name in rows:
        r = results.get(name)
        if not r:
            continue
        bound, parts, ratio = bound_of(r, cal, fb), "-", "-"
        if bound:
            parts = f"{max(bound) * 1e3:.0f} ({', '.join(f'{x * 1e3:.0f}' for x in bound)})"
            ratio = f"{r['step_ms'] / 1e3 / max(bound):.2f}"
        host_step = f"{r['host_step_ms']:.0f}" if "host_step_ms" in r else "-"
        hidden = f"{r['hidden']:.0%}" if "hidden" in r else "-"
        fbr, st = (f"{r[k]:.0f}" if r[k] is not None else "-" for k in ("fwd_bwd_ms", "opt_ms"))
        print(f"| {name} | {r['tokens_s']:.0f} | {r['step_ms']:.0f} | {fbr} | "
              f"{st} | {r['peak_gib']:.1f} | {r['host_gib']:.1f} | {host_step} | "
              f"{hidden} | {parts} | {ratio} |")  # fmt: skip
    for name, r in results.items():
        if "class_step_ms" in r:
            print(f"{name}: worker per step (mean of the timed steps): optimizer class step "
                  f"{r['class_step_ms']:.0f} ms, queueing uploads {r['upload_queue_ms']:.0f} ms, "
                  f"host step (stats, last step) {r['host_step_ms']:.0f} ms")  # fmt: skip
    for name, r in results.items():
        if "param_h2d_gb" in r:
            print(f"{name}: parameters streamed {r['param_h2d_gb']:.1f} GB up in all, peak "
                  f"{r['param_peak_gib']:.2f} GiB of them on the device (budget "
                  f"{args.param_budget_gib} GiB), {r['prefetched']} loads ahead, "
                  f"{r['on_demand']} on demand, {r['over_budget']} over the budget")  # fmt: skip
    for name, r in results.items():
        if r.get("gpu"):
            g = r["gpu"]
            print(f"{name}: GPU per step: kernels {g['kernel_ms']:.0f} ms, copies "
                  f"{g['copy_ms']:.0f} ms; top kernels {g['top']}")  # fmt: skip
    for name, r in results.items():
        if "act_offloaded_gib" in r:
            print(f"{name}: activations offloaded {r['act_offloaded_gib']:.2f} GiB a step")
    for name, r in results.items():
        if "speculated" in r:
            clip = (f", clipped in {r['clipped_steps']} of {r['of_steps']} timed steps "
                    f"({r['clip']}, max_grad_norm {args.clip_norm}; mean step "
                    f"{r['mean_ms']:.0f} ms; norms {[round(n, 3) for n in r['norms']]})"
                    if "clip" in r else "")  # fmt: skip
            print(f"{name}: buckets per step of {r['buckets']}: stepped during backward "
                  f"{r['speculated']:.1f}, undone {r['undone']:.1f}, recalled "
                  f"{r['recalled']:.1f}{clip}")  # fmt: skip
    for name, r in results.items():
        if "copies" in r:
            print(f"{name}: copies aside (tensors): {r['copies']}")
        for tl in r.get("timelines", []):
            print(f"{name} timeline (what phase: n, work ms, first start, last end; ms since "
                  f"the forward began): {tl}")  # fmt: skip
    for name, r in results.items():
        if "losses" in r:
            print(f"{name} losses: {r['losses']}")


if __name__ == "__main__":
    main()
