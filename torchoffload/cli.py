"""``torchoffload demo``: train a small GPT with and without activation offloading, then
generate from it with and without weight streaming, and compare. ``torchoffload plan``: plan
activation memory for a model under fake tensors (no GPU needed)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, NoReturn

import torch

from torchoffload import optim
from torchoffload._transfer import compute_device
from torchoffload.activations import offload_activations
from torchoffload.models import GPT, GPTConfig
from torchoffload.optim import AdamW8bit, LowPrecisionAdamW
from torchoffload.weights import minimum_budget, stream_weights


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize(device)


def _saved_bytes(model: torch.nn.Module, fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves in ``fn``, parameters excluded."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s._cdata not in params:
            seen[s._cdata] = s.nbytes()
        return t.detach()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _train(
    model: GPT,
    batches: list[torch.Tensor],
    offload: bool,
    device: torch.device,
) -> dict[str, object]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    times, losses, grads = [], [], []
    ctx = offload_activations(min_bytes=1 << 12) if offload else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for tokens in batches:
        _sync(device)
        start = time.perf_counter()
        with ctx if ctx is not None else nullcontext():
            loss = model.loss(tokens)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - start)
        losses.append(loss.detach())
    out: dict[str, object] = {
        "ms": statistics.median(times[1:] if len(times) > 1 else times) * 1e3,
        "losses": losses,
        "grads": grads,
        "params": [p.detach().clone() for p in model.parameters()],
        "stats": ctx.stats() if ctx is not None else None,
    }
    if device.type == "cuda":
        out["peak"] = torch.cuda.max_memory_allocated(device)
    return out


def _generate(model: GPT, prompt: torch.Tensor, n: int, device: torch.device):
    """Greedy decoding without a KV cache: ``n`` forwards of a growing sequence."""
    tokens = prompt
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for _ in range(n):
            logits = model(tokens)
            tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    _sync(device)
    return tokens, (time.perf_counter() - start) * 1e3 / n


def _inference(model: GPT, device: torch.device, seq: int) -> bool:
    model.eval()
    mib = 1 << 20
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    prompt = torch.randint(
        0, model.config.vocab, (2, 8), generator=torch.Generator().manual_seed(2)
    )
    prompt = prompt.to(device)
    n = min(24, seq - 8)
    _generate(model, prompt, 2, device)  # warm-up
    ref, ref_ms = _generate(model, prompt, n, device)
    budget = max(weights // 3, minimum_budget(model))
    handle = stream_weights(model, device, budget_bytes=budget)
    _generate(model, prompt, 2, device)  # records the schedule, places kept units
    handle.reset_stats()
    out, ms = _generate(model, prompt, n, device)
    st = handle.stats()
    handle.remove()
    same = torch.equal(out, ref)
    print()
    print(f"Inference: greedy decoding of {n} tokens (2 sequences, no KV cache)")
    print(f"{'mode':<22}{'ms/token':>10}{'weights on device MiB':>28}{'copied MiB/token':>21}")
    print(f"{'resident':<22}{ref_ms:>10.1f}{weights / mib:>28.1f}{0.0:>21.1f}")
    print(
        f"{'stream_weights':<22}{ms:>10.1f}{st.arena_bytes / mib:>28.1f}"
        f"{st.h2d_bytes / max(st.calls, 1) / mib:>21.1f}"
    )
    print()
    print(
        f"tokens bitwise equal: {same}; budget {budget / mib:.1f} MiB, {st.units} units "
        f"({st.kept_units} kept), prefetch hits {st.hits}, misses {st.misses}"
    )
    return same


class _Parser(argparse.ArgumentParser):
    """argparse, with each error one line: ``prog: error: argument --flag: what is allowed``
    (exit status 2), without the usage block above it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def _number(low: float, high: float | None = None):
    """An argparse type: a finite number > ``low``, at most ``high``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and value > low and (high is None or value <= high)):
            allowed = f"> {low:g}" + (f" and <= {high:g}" if high is not None else "")
            raise argparse.ArgumentTypeError(f"must be a number {allowed}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def _fraction(text: str) -> float | str:
    """An argparse type: "auto" or a number in (0, 1]."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'auto' or a number") from None
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


def _at_least(minimum: int):
    """An argparse type: an int >= ``minimum`` (argparse then names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def _demo_device(p: argparse.ArgumentParser, text: str | None) -> torch.device:
    """--device as a usable device of this machine, or a one-line error naming the allowed."""
    allowed = "cpu"
    if torch.accelerator.is_available():
        acc = torch.accelerator.current_accelerator()
        allowed += (
            f", {acc.type} or {acc.type}:0 to {acc.type}:{torch.accelerator.device_count() - 1}"
        )
    try:
        device = compute_device(text)
        if device.type != "cpu":
            module = torch.get_device_module(device.type)
            if not module.is_available() or device.index >= module.device_count():
                raise ValueError(f"no {device} on this machine")
    except (AssertionError, RuntimeError, ValueError) as e:
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        p.error(f"argument --device: {text!r}: {reason} (allowed: {allowed})")
    return device


def demo(argv: Sequence[str] | None = None) -> int:
    p = _Parser(prog="torchoffload demo", description=demo.__doc__)
    p.add_argument("--device", default=None, help="compute device (default: best available)")
    p.add_argument("--steps", type=_at_least(1), default=4, help="training steps (default 4)")
    p.add_argument(
        "--hidden", type=_at_least(64), default=None, help="model width (GPU 1024, CPU 256)"
    )
    p.add_argument("--layers", type=_at_least(1), default=None, help="blocks (GPU 8, CPU 4)")
    p.add_argument("--batch", type=_at_least(1), default=None, help="sequences per step (8)")
    p.add_argument(
        "--seq",
        type=_at_least(16),
        default=None,
        help="tokens per sequence, at least 16: generation decodes seq - 8 (GPU 1024, CPU 128)",
    )
    args = p.parse_args(argv)
    device = _demo_device(p, args.device)
    on_gpu = device.type == "cuda"
    if on_gpu:  # bitwise comparison needs deterministic kernels
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    hidden = args.hidden or (1024 if on_gpu else 256)
    layers = args.layers or (8 if on_gpu else 4)
    batch = args.batch or 8
    seq = args.seq or (1024 if on_gpu else 128)
    cfg = GPTConfig(hidden=hidden, layers=layers, heads=max(1, hidden // 64), max_seq=seq + 1)
    torch.manual_seed(0)
    base = GPT(cfg).to(device)
    gen = torch.Generator().manual_seed(1)
    batches = [
        torch.randint(0, cfg.vocab, (batch, seq + 1), generator=gen).to(device)
        for _ in range(args.steps)
    ]
    print(
        f"torchoffload demo: GPT hidden={hidden} layers={layers} batch={batch} seq={seq}, "
        f"{args.steps} training steps on {device} (torch {torch.__version__})"
    )

    def attn():
        if not on_gpu:
            return nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)  # deterministic backward

    with attn():
        held = _saved_bytes(base, lambda: base.loss(batches[0]))
        ref = _train(copy.deepcopy(base), batches, False, device)
        off = _train(copy.deepcopy(base), batches, True, device)

    stats = off["stats"]
    same = all(torch.equal(a, b) for a, b in zip(ref["losses"], off["losses"], strict=True))
    same = same and all(
        torch.equal(a, b)
        for ga, gb in zip(ref["grads"], off["grads"], strict=True)
        for a, b in zip(ga, gb, strict=True)
    )
    same = same and all(
        torch.equal(a, b) for a, b in zip(ref["params"], off["params"], strict=True)
    )
    mib = 1 << 20
    per_step = stats.offloaded_bytes / args.steps
    if on_gpu:
        mem_label = "peak device MiB"
        mem = [ref["peak"] / mib, off["peak"] / mib]
    else:
        mem_label = "saved acts on device MiB*"
        mem = [held / mib, max(held - per_step, 0) / mib]
    rows = [
        ("no offloading", ref["ms"], mem[0], 0.0),
        ("offload_activations", off["ms"], mem[1], per_step / mib),
    ]
    print()
    print(f"{'mode':<22}{'ms/step':>10}{mem_label:>28}{'offloaded MiB/step':>21}")
    for name, ms, m, o in rows:
        print(f"{name:<22}{ms:>10.1f}{m:>28.1f}{o:>21.1f}")
    print()
    print(f"gradients, losses and weights bitwise equal over {args.steps} steps: {same}")
    print(
        f"prefetch hits {stats.prefetch_hits}, misses {stats.prefetch_misses}, resident "
        f"{stats.resident_hits}; host pool peak {stats.pool.peak_bytes / mib:.1f} MiB"
    )
    if not on_gpu:
        print(
            "* on the CPU there is no separate device memory: this is the bytes of saved "
            "activations left on the compute device after forward (measured without "
            "offloading, minus what was offloaded)."
        )
    with attn():
        same_tokens = _inference(base, device, seq)
    return 0 if same and same_tokens else 1


_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3,
          "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``"60GiB"``, ``"512 MiB"``, ``"1.5e9"`` -> bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 60GiB, 512MiB or bytes)")
    try:
        value = float(m.group(1)) * _UNITS[unit]
    except ValueError:  # "1.2.3"
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (try 60GiB, 512MiB or bytes)"
        ) from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"not a finite size: {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, got {text!r}")
    if value < 1:  # int() would make it 0 bytes
        raise argparse.ArgumentTypeError(f"a size must be at least 1 byte, got {text!r}")
    return int(value)


def _transformers(p: argparse.ArgumentParser, flag: str) -> Any:
    try:
        import transformers
    except ImportError:
        p.error(f"argument {flag}: this model needs transformers (pip install torchoffload[hf])")
    return transformers


def _divisors_near(n: int, value: int, count: int = 6) -> str:
    """Up to ``count`` divisors of ``n`` nearest ``value``, in order, for an error message."""
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    return ", ".join(map(str, sorted(sorted(divisors, key=lambda d: abs(d - value))[:count])))


def _hf_config(p: argparse.ArgumentParser, path: str) -> Any:
    """The Hugging Face config at ``path`` (a config.json or its folder), checked to name a
    causal language model that transformers knows; a one-line error otherwise."""
    if not os.path.exists(path):
        p.error(f"argument --hf-config: no such file or folder: {path}")
    transformers = _transformers(p, "--hf-config")
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        with open(file) as f:
            model_type = json.load(f).get("model_type")
    except (OSError, ValueError, AttributeError) as e:
        p.error(f"argument --hf-config: {file} is not a readable config.json: {e}")
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        causal = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    except ImportError:  # pragma: no cover - another layout of transformers
        causal = []
    examples = [t for t in ("llama", "mistral", "qwen2", "gemma", "phi3", "gpt2") if t in causal]
    allowed = f"a causal language model type of transformers {transformers.__version__} " + (
        f"({len(causal)}, e.g. {', '.join(examples)})" if causal else ""
    )
    if causal and model_type not in causal:
        p.error(f"argument --hf-config: model_type {model_type!r} in {file}: allowed is {allowed}")
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any config transformers refuses: one line
        cause = e.__cause__ or e
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        p.error(f"argument --hf-config: {file}: {first}")
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers < 2:
        p.error(f"argument --hf-config: {file}: num_hidden_layers is {layers}; the planner works "
                "on repeated layers: at least 2")  # fmt: skip
    return config


def _check_plan_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """Every check the plan command can make before tracing, each failing as one line that
    names the flag and what it allows (exit status 2). Returns the Hugging Face config, if
    one was given."""
    if args.hf_config:
        for flag, value in (("--kv-heads", args.kv_heads), ("--intermediate", args.intermediate)):
            if value is not None:
                p.error(f"argument {flag}: the model's shape comes from --hf-config; drop {flag}")
    else:
        if args.hidden % args.heads:
            p.error(
                f"argument --heads: must divide --hidden {args.hidden}, got {args.heads} "
                f"(allowed near it: {_divisors_near(args.hidden, args.heads)})"
            )
        head_dim = args.hidden // args.heads
        if args.model == "llama" and args.hidden % 2:
            p.error(f"argument --hidden: llama's rotary embeddings need it even, got {args.hidden}")
        if args.model == "llama" and head_dim % 2:
            p.error(
                f"argument --heads: --hidden {args.hidden} / --heads {args.heads} = {head_dim} "
                "per head, which rotary embeddings need even (allowed near it: "
                f"{_divisors_near(args.hidden // 2, args.heads)})"
            )
        if args.model == "gpt":
            for flag, value in (("--kv-heads", args.kv_heads),
                                ("--intermediate", args.intermediate)):  # fmt: skip
                if value is not None:
                    p.error(f"argument {flag}: only --model llama has it (GPT: --heads, 4x MLP)")
        elif args.kv_heads is not None and args.heads % args.kv_heads:
            p.error(
                f"argument --kv-heads: must divide --heads {args.heads}, got {args.kv_heads} "
                f"(allowed: {_divisors_near(args.heads, args.kv_heads, count=args.heads)})"
            )
    if not args.hf_config and args.model == "llama":
        _transformers(p, "--model")
    if args.parameters == "host" and args.optimizer_state == "device":
        p.error(
            "argument --parameters: 'host' needs --optimizer-state host or auto (streamed "
            "trainable parameters are stepped on the host), got --optimizer-state device"
        )
    if args.optimizer == "none" and "host" in (args.parameters, args.optimizer_state):
        flag = "--parameters" if args.parameters == "host" else "--optimizer-state"
        p.error(
            f"argument {flag}: 'host' places optimizer state, and --optimizer none counts none: "
            "allowed with --optimizer adamw or sgd"
        )
    if args.host_state != "fp32":
        if args.optimizer != "adamw":
            p.error(f"argument --host-state: {args.host_state} is AdamW's state: needs "
                    f"--optimizer adamw, got {args.optimizer}")  # fmt: skip
        if args.host_state.startswith("bf16") and args.dtype != "bf16":
            p.error(f"argument --host-state: {args.host_state} keeps bf16 masters of bf16 "
                    f"parameters: needs --dtype bf16, got {args.dtype}")  # fmt: skip
        if args.optimizer_state == "device":
            p.error(f"argument --host-state: {args.host_state} is state on the host: needs "
                    "--optimizer-state host or auto")  # fmt: skip
        if args.offload_fraction not in ("auto", 1.0):
            p.error(f"argument --host-state: {args.host_state} is planned with all of the "
                    f"state on the host: needs --offload-fraction 1 or auto, got "
                    f"{args.offload_fraction}")  # fmt: skip
        args.offload_fraction = 1.0  # bf16 masters refuse less; the device part would be fp32
    fraction = args.offload_fraction
    if fraction != "auto" and (
        args.optimizer_state == "device" or (args.parameters == "host" and fraction < 1.0)
    ):
        p.error(
            f"argument --offload-fraction: {fraction} of the optimizer state on the host needs "
            "--optimizer-state host or auto, and below 1 --parameters device or auto"
        )
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            p.error("argument --plot: needs matplotlib (pip install matplotlib)")
        problem = _unwritable(args.plot)
        if problem:
            p.error(f"argument --plot: cannot write {args.plot}: {problem}")
    return _hf_config(p, args.hf_config) if args.hf_config else None


def _unwritable(path: str) -> str | None:
    """Why a new file cannot be written at ``path``, or None (checked before planning, so that
    a bad path fails before the work, not after it)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return "it is a folder"
    if not os.path.isdir(folder):
        return f"no such folder {folder}"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return "permission denied"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"permission denied in {folder}"
    return None


# --host-state: (class, master dtype, moments' bits, class options)
HOST_STATES: dict[str, tuple[type | None, torch.dtype, int]] = {
    "fp32": (None, torch.float32, 32),  # torch.optim.AdamW: the planner's defaults
    "bf16": (LowPrecisionAdamW, torch.bfloat16, 32),
    "8bit": (AdamW8bit, torch.float32, 8),
    "bf16-8bit": (AdamW8bit, torch.bfloat16, 8),
}


def _host_state_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host-state", choices=list(HOST_STATES), default="fp32",
        help="the format of optimizer state on the host: fp32 (fp32 masters and AdamW moments), "
        "bf16 (bf16 masters, LowPrecisionAdamW), 8bit (fp32 masters, AdamW8bit) or bf16-8bit "
        "(bf16 masters, AdamW8bit); the host step's rate is measured on this machine's CPU "
        "for all but fp32",
    )  # fmt: skip
    p.add_argument(
        "--host-step-rate", type=_number(0), default=None,
        help="parameters a second of the host step (default: measured for --host-state other "
        "than fp32, else 3.5e9, fused fp32 AdamW on 16 cores)",
    )  # fmt: skip


def _host_state(args: argparse.Namespace) -> tuple[float | None, float | None, int | None]:
    """The host state's bytes a parameter (None: fp32, the planner's default), the host
    step's rate (None: the hardware default), measured here for a low-precision state, and
    the bytes a parameter over the link each way (None: the planner's default, 4)."""
    cls, master, bits = HOST_STATES[args.host_state]
    rate = args.host_step_rate
    if cls is None:
        return None, rate, None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    per = optim.host_bytes_per_param(dtype, master_dtype=master, state_bits=bits)
    link = optim.link_bytes_per_param(dtype, master_dtype=master)
    if rate is None:
        rate = optim.measure_host_step(cls, master_dtype=master)
        print(f"host step measured: {rate / 1e9:.2f} B parameters a second ({cls.__name__}, "
              f"{torch.get_num_threads()} threads)", file=sys.stderr)  # fmt: skip
    return per, rate, link


def _build_for_plan(args: argparse.Namespace, hf_config: Any) -> tuple[torch.nn.Module, dict, str]:
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    if hf_config is not None or args.model == "llama":
        import transformers  # checked by _check_plan_args

        if hf_config is not None:
            config = hf_config
        else:
            hidden = args.hidden
            config = transformers.LlamaConfig(
                vocab_size=args.vocab,
                hidden_size=hidden,
                intermediate_size=args.intermediate or int(hidden * 8 / 3) // 256 * 256,
                num_hidden_layers=args.layers,
                num_attention_heads=args.heads,
                num_key_value_heads=args.kv_heads or args.heads,
                max_position_embeddings=max(args.seq, 2048),
            )
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
        ids = torch.zeros(args.batch, args.seq, dtype=torch.long)
        return model, {"input_ids": ids, "labels": ids}, type(model).__name__
    cfg = GPTConfig(hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab,
                    max_seq=args.seq)  # fmt: skip
    with torch.device("meta"):
        model = GPT(cfg).to(dtype)
    return model, {"tokens": torch.zeros(args.batch, args.seq, dtype=torch.long)}, "GPT"


def plan_command(argv: Sequence[str] | None = None) -> int:
    """Plan memory for a model without a GPU: trace one training step under fake tensors, print
    per-layer bytes and FLOPs, and choose keep/offload/recompute per layer and where the
    optimizer state lives (device or host) for a memory budget."""
    from torchoffload.planner import Hardware, InfeasibleBudgetError, plan_from_profile, trace

    p = _Parser(prog="torchoffload plan", description=plan_command.__doc__)
    p.add_argument("--model", choices=["llama", "gpt"], default="llama", help="architecture")
    p.add_argument("--hf-config", default=None, help="a Hugging Face config.json (or its folder)")
    p.add_argument("--hidden", type=_at_least(1), default=4096, help="model width (4096)")
    p.add_argument(
        "--layers", type=_at_least(2), default=32,
        help="blocks, at least 2: the planner works on repeated layers (32)",
    )  # fmt: skip
    p.add_argument(
        "--heads", type=_at_least(1), default=32, help="attention heads, dividing --hidden (32)"
    )
    p.add_argument(
        "--kv-heads", type=_at_least(1), default=None, help="KV heads, dividing --heads (= heads)"
    )
    p.add_argument(
        "--intermediate", type=_at_least(1), default=None, help="MLP width (llama: 3.5x hidden)"
    )
    p.add_argument("--vocab", type=_at_least(1), default=32000, help="vocabulary (32000)")
    p.add_argument("--batch", type=_at_least(1), default=1, help="sequences per step (1)")
    p.add_argument("--seq", type=_at_least(1), default=4096, help="tokens per sequence (4096)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="weights")
    p.add_argument(
        "--optimizer", choices=["adamw", "sgd", "none"], default="adamw",
        help="state counted: adamw (two values per parameter), sgd (with momentum: one), none",
    )  # fmt: skip
    p.add_argument(
        "--budget",
        type=parse_bytes,
        default=None,
        help="peak device memory, e.g. 60GiB (the plan keeps a margin below it)",
    )
    p.add_argument(
        "--optimizer-state", choices=["auto", "device", "host"], default="auto",
        help="where the optimizer state lives: auto (the faster that fits), device, or host",
    )  # fmt: skip
    p.add_argument(
        "--host-budget", type=parse_bytes, default=None,
        help="host memory the plan may use (default: this host's physical memory)",
    )  # fmt: skip
    p.add_argument(
        "--parameters", choices=["auto", "device", "host"], default="auto",
        help="where parameters live: auto (on the host only when nothing else fits), device, "
        "or host (streamed per layer, with the optimizer state on the host)",
    )  # fmt: skip
    p.add_argument(
        "--offload-fraction", type=_fraction, default="auto",
        help="with the optimizer state on the host: the fraction of it there, the rest stepped "
        "on the device (auto: the fastest that fits; 1 for all of it)",
    )  # fmt: skip
    _host_state_arguments(p)
    p.add_argument("--link-gbps", type=_number(0), default=None, help="default: measured, or 55")
    p.add_argument("--tflops", type=_number(0), default=None, help="default: measured, or 790")
    p.add_argument(
        "--efficiency", type=_number(0, 1), default=None,
        help="achieved share of --tflops, in (0, 1]",
    )  # fmt: skip
    p.add_argument(
        "--prefetch-layers", type=_at_least(0), default=1, help="reloads issued this early (1)"
    )
    p.add_argument(
        "--defer-layers", type=_at_least(0), default=1, help="copies freed this late (1)"
    )
    p.add_argument(
        "--min-bytes", type=parse_bytes, default=1 << 16, help="smaller storages stay (64KiB)"
    )
    p.add_argument("--plot", default=None, help="write memory over one step to this PNG")
    args = p.parse_args(argv)
    hf_config = _check_plan_args(p, args)
    model, inputs, name = _build_for_plan(args, hf_config)
    loss_fn = (lambda out: out.float().mean()) if name == "GPT" else None
    start = time.perf_counter()
    last = [0.0]

    def progress(msg: str) -> None:
        now = time.perf_counter()
        if now - last[0] > 2.0:  # a line every 2 s on long traces
            last[0] = now
            print(f"  tracing ({now - start:.0f} s): {msg}", file=sys.stderr, flush=True)

    print(f"tracing one training step of {name} under fake tensors ...", file=sys.stderr)
    profile = trace(model, inputs, loss_fn=loss_fn, optimizer=args.optimizer,
                    min_bytes=args.min_bytes, progress=progress)  # fmt: skip
    print(f"traced in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    hw = Hardware.detect(args.link_gbps, args.tflops)
    if args.efficiency is not None:
        hw = dataclasses.replace(hw, efficiency=args.efficiency)
    host_bytes, rate, link_bytes = _host_state(args)
    if rate is not None:
        hw = dataclasses.replace(hw, host_adam_params_per_s=rate)
    try:
        with warnings.catch_warnings():  # a host need over this machine's: printed in the plan
            warnings.filterwarnings("ignore", message=".*more than this machine's")
            plan = plan_from_profile(profile, args.budget, hardware=hw,
                                     prefetch_layers=args.prefetch_layers,
                                     defer_layers=args.defer_layers,
                                     optimizer_state=args.optimizer_state,
                                     host_budget_bytes=args.host_budget,
                                     parameters=args.parameters,
                                     offload_fraction=args.offload_fraction,
                                     host_bytes_per_param=host_bytes,
                                     link_bytes_per_param=link_bytes)  # fmt: skip
    except InfeasibleBudgetError as e:
        print(f"torchoffload plan: {e}", file=sys.stderr)
        return 1
    print(plan)
    if args.plot:
        plan.plot(args.plot)
        print(f"wrote {args.plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = _Parser(prog="torchoffload")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "demo", help="train and run a small GPT with and without offloading", add_help=False
    )
    sub.add_parser("plan", help="plan a training step's memory for a budget: activations, "
                   "optimizer state, parameters (no GPU needed)", add_help=False)  # fmt: skip
    args, rest = p.parse_known_args(argv)
    if args.command == "demo":
        return demo(rest)
    if args.command == "plan":
        return plan_command(rest)
    return 2  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
