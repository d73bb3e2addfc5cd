"""The scripts in examples/ run as written, and a benchmark at its smoke shape (on CPU here; on
GPUs: benchmarks/README.md)."""

from __future__ import annotations

import importlib.util

import pytest
from background import Job, output

# The scripts run in subprocesses, so they need not wait for their tests: they start as soon as
# the tests are collected and run beside the other modules' tests (background.py); each test
# asserts on its script's output as on a run of its own.
BACKGROUND = {
    "test_train_fsdp_offload_two_ranks_on_gloo": Job((
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "examples/train_fsdp_offload.py", "--model", "gpt", "--steps", "2",
    )),
    "test_train_fsdp_offload_single_process_llama": Job((
        "examples/train_fsdp_offload.py", "--steps", "2", "--batch", "1,2",
    ), needs=("transformers",)),
    # Two decoder layers (four by default on a CPU): torch.compile's work grows with them (48
    # CPU-s at four, 37 at two, 2026-11-28, this 2-core machine)
    # Without --compile (36 of its 44 CPU-s here, 2026-11-29): torch.compile of a streamed
    # model, its graph captured by cuda_graph, is tested in test_weights_graph and
    # test_weights_contract
    "test_generate_streamed": Job(
        ("examples/generate_streamed.py", "--new-tokens", "8", "--layers", "2"),
        needs=("transformers",),
    ),
    "test_generate_moe": Job(
        ("examples/generate_moe.py", "--routing", "zipf", "--new-tokens", "8"),
        needs=("transformers",),
    ),
    "test_train_offloaded_optimizer_bitwise_on_cpu": Job((
        "examples/train_offloaded_optimizer.py", "--dtype", "fp32", "--steps", "3",
        "--layers", "2", "--hidden", "256", "--heads", "4", "--kv-heads", "2",
        "--intermediate", "512", "--vocab", "2048", "--seq", "64",
    ), needs=("transformers",)),
    "test_train_loops_bitwise_on_cpu": Job(("examples/train_loops.py", "--steps", "3"),
                                           needs=("transformers", "accelerate")),
    # The AOTI decode benchmark at its smoke shape: a package whose program writes its KV
    # caches in place, replayed by cuda_graph with the caches held (tokens checked); the same
    # for compile_streamed's program, its weights read from the file into a model on meta.
    # Two of the shape's four layers: the three exports and compiles grow with the layers
    # (113 CPU-s at four, 76 at two, 2026-11-28, this 2-core machine); 0.006 GiB, below the
    # 8.5 MiB of weights with the embedding resident, still streams (asserted).
    "test_aoti_decode_graph_smoke": Job((
        "benchmarks/aoti_decode.py", "--shape", "tiny", "--layers", "2", "--prompt", "16",
        "--tokens", "4", "--budgets", "0.006", "--graph", "--compiled",
    )),
    # The MoE benchmark at a small shape: every row's logits equal the resident's (accelerate's
    # row too, where it is installed).
    "test_moe_benchmark_smoke": Job((
        "benchmarks/moe.py", "--shape", "small", "--layers", "2", "--prompt", "8",
        "--warmup", "1", "--tokens", "2", "--prefill", "16", "--caches", "0.01", "--host-compute",
    ), needs=("transformers",)),
    # Trainer at a tiny shape: offload_trainer keeps every bucket on the host, the optimizer
    # swapped in alone brings them back (its clip reads the gradients).
    "test_trainer_benchmark_smoke": Job((
        "benchmarks/trainer.py", "--layers", "2", "--hidden", "128", "--intermediate", "256",
        "--heads", "4", "--kv-heads", "2", "--vocab", "512", "--seq", "32", "--steps", "1",
        "--rows", "offload,offload-plain",
    ), needs=("transformers",)),
    # One decoder layer (the default is four): the AOTInductor compile is most of the time,
    # and it grows with the layers (53 CPU-s at two, 28 at one, 2026-11-28, this 2-core
    # machine); one still streams through a budget below the weights (asserted).
    # Last here, so first in the background (the longest).
    "test_generate_streamed_aoti": Job((
        "examples/generate_streamed.py", "--new-tokens", "4", "--no-compare", "--aoti",
        "--layers", "1",
    ), needs=("transformers",)),
}  # fmt: skip


def script_output(name: str) -> str:
    """The stdout of test ``name``'s script, which must succeed."""
    result = output(__name__, name)
    assert result.code == 0, result.stdout + result.stderr
    return result.stdout


def test_train_fsdp_offload_two_ranks_on_gloo():
    out = script_output("test_train_fsdp_offload_two_ranks_on_gloo")
    assert "2 rank(s) on cpu" in out
    assert "losses identical with and without offloading: True" in out
    lines = [line for line in out.splitlines() if line.startswith("offload ")]
    assert len(lines) == 1 and "MiB" in lines[0]  # it offloaded something


def test_train_fsdp_offload_single_process_llama():
    pytest.importorskip("transformers")
    out = script_output("test_train_fsdp_offload_single_process_llama")
    assert "llama" in out and "1 rank(s) on cpu" in out
    assert out.count("losses identical with and without offloading: True") == 2


def test_generate_streamed():
    pytest.importorskip("transformers")
    out = script_output("test_generate_streamed")
    assert "tokens identical to the all-on-device run: True" in out
    assert "verify (stream_weights against resident): equal" in out
    assert "stream_weights" in out
    assert "CUDA-graph tokens identical to the all-on-device static-cache decode: True" in out
    assert "CUDA-graph decode: 7 of 8 calls replayed (timed decode)" in out  # eager: prefill
    # transformers 5.24 renamed the static cache's argument: the old name warned at every run
    assert "past_key_values" not in output(__name__, "test_generate_streamed").stderr


def test_generate_moe():
    pytest.importorskip("transformers")
    out = script_output("test_generate_moe")
    assert "tokens identical to the resident run: True" in out, out
    assert "routing: zipf" in out and "expert cache 6.00 MiB, 16 experts" in out, out
    [line] = [line for line in out.splitlines() if line.startswith("stream_experts: hit rate")]
    misses = int(line.split(" misses")[0].split()[-1])
    assert misses > 0 and "16 of 16 cache slots used" in line, out  # a quarter of 64: it streamed
    table = [line.split()[0] for line in out.splitlines() if line.endswith(" n/a")]  # CPU
    assert table == ["resident", "stream_experts"], out


def test_train_loops_bitwise_on_cpu():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    out = script_output("test_train_loops_bitwise_on_cpu")
    assert "trainer: bitwise equal: True" in out
    assert "accelerate: bitwise equal: True" in out


def test_train_offloaded_optimizer_bitwise_on_cpu():
    pytest.importorskip("transformers")
    out = script_output("test_train_offloaded_optimizer_bitwise_on_cpu")
    assert "bitwise equal losses: True" in out
    assert "verify (params against host): equal" in out
    assert "host step" in out and out.count("tokens/s") == 3
    assert "parameters: at most" in out
    assert out.count("peak device    n/a GiB") == 3 and "nan" not in out  # no device memory


def test_generate_streamed_aoti():
    pytest.importorskip("transformers")
    out = script_output("test_generate_streamed_aoti")
    assert "holding no weight bytes" in out
    assert "AOTI streamed tokens identical to the same package all kept: True" in out
    [streamed] = [line for line in out.splitlines() if "aoti streamed" in line]
    units, kept = (int(streamed.split(word)[0].split()[-1]) for word in (" units", " kept"))
    assert kept < units  # the budget held fewer than all: it streamed


def test_aoti_decode_graph_smoke():
    """Note: [Arguments written in place]: the graphed package's tokens equal the resident
    package's (the script exits 1 otherwise) although its program writes the caches it is
    passed; so do compile_streamed's, eager and replayed, against its own resident row."""
    out = script_output("test_aoti_decode_graph_smoke")
    names = ("  aoti", "  graph", "  compiled")
    rows = [line[2:25].strip() for line in out.splitlines()
            if line.startswith(names) and "ms/token" in line]  # fmt: skip
    assert rows == [
        "aoti resident", "graph resident", "aoti streamed", "graph streamed",
        "compiled resident", "compiled graph resident", "compiled streamed",
        "compiled graph streamed",
    ], out  # fmt: skip
    assert out.count("equal True") == 8, out
    assert "compiled resident tokens equal the package's: " in out, out
    mib = {line[2:25].strip(): float(line.split("ms/token")[1].split("MiB/token")[0])
           for line in out.splitlines() if "MiB/token" in line}  # fmt: skip
    assert all(mib[row] > 0 for row in mib if row.endswith("streamed")), out  # it streamed


def test_copy_timeline_places_the_gaps_in_their_calls(monkeypatch):
    """benchmarks/profile_decode.py's `copy_timeline` on a made-up timeline: three calls of
    four 100 us copies, 5 us apart within a call and 300 us apart between calls."""
    from pathlib import Path
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from benchmarks.profile_decode import copy_timeline

    events, t = [], 0.0
    for _ in range(3):
        for k in range(4):
            span = SimpleNamespace(start=t, end=t + 100)
            events.append(SimpleNamespace(name="Memcpy HtoD (Pinned -> Device)", time_range=span))
            t += 100 + (5 if k < 3 else 300)
    events.append(SimpleNamespace(name="a kernel", time_range=SimpleNamespace(start=0, end=9e9)))
    lines = copy_timeline(events, 12 << 20, per_call=4)
    assert "busy 1.20 ms of a 1.84 ms span (0.650)" in lines[0], lines  # 1845 us
    assert lines[2].startswith("gaps over 20 us: 2, total 0.60 ms, median 300 us"), lines
    assert lines[3].endswith("0: 2 gaps, 0.60 ms"), lines
    assert len(copy_timeline(events, 12 << 20, per_call=5)) == 3  # 12 copies: not 5 a call


def test_moe_benchmark_smoke():
    out = script_output("test_moe_benchmark_smoke")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "decode" in line]
    names = [line.split(" | ")[2] for line in rows]
    if importlib.util.find_spec("accelerate") is not None:  # last, under the first routing only
        assert names.pop().startswith("accelerate ") and rows[-1].count("cpu_offload"), out
    engines = ("resident", "stream_experts least lru", "stream_experts 0.01 GiB lru",
               "stream_experts least lru host auto", "stream_experts least lru host all",
               "stream_weights 0.1 GiB")  # fmt: skip
    assert names == [name for name in engines for _ in ("uniform", "zipf")], out
    assert all(line.endswith("| True |") for line in rows), out


def test_trainer_benchmark_smoke():
    pytest.importorskip("transformers")
    out = script_output("test_trainer_benchmark_smoke")
    rows = {line.split("|")[1].strip(): line.split("|")[-2].strip()
            for line in out.splitlines() if line.startswith("| offload")}  # fmt: skip
    assert rows == {"offload": "0.0", "offload-plain": rows["offload-plain"]}
    assert float(rows["offload-plain"]) > 0
