from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from torchoffload.cli import main


def test_demo_runs_and_reports_bitwise_equal(capsys):
    rc = main(["demo", "--steps", "2", "--hidden", "64", "--layers", "2", "--seq", "32"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "offload_activations" in out and "ms/step" in out
    assert "bitwise equal over 2 steps: True" in out
    assert "stream_weights" in out and "tokens bitwise equal: True" in out


def test_python_dash_m_entry_point_and_a_light_import():
    """``python -m torchoffload --help`` works, and importing the package pulls in neither
    matplotlib, transformers nor Dynamo (one child process: each takes seconds of a CI core)."""
    code = (
        "import sys\n"
        "import torchoffload\n"
        "bad = [m for m in ('matplotlib', 'transformers', 'torch._dynamo') if m in sys.modules]\n"
        "print('heavy imports:', bad)\n"
        "import runpy\n"
        "sys.argv = ['torchoffload', '--help']\n"
        "runpy.run_module('torchoffload', run_name='__main__', alter_sys=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "heavy imports: []" in proc.stdout, proc.stdout
    assert "demo" in proc.stdout
    # plan places optimizer state and parameters too, not only activations
    assert "activations, optimizer state, parameters" in " ".join(proc.stdout.split())


def test_bad_arguments_get_a_message_not_a_traceback(capsys):
    for argv, flag in (
        (["demo", "--steps", "0"], "--steps: must be >= 1"),
        (["demo", "--seq", "8"], "--seq: must be >= 16"),
        (["demo", "--batch", "0"], "--batch: must be >= 1"),
        (["plan", "--prefetch-layers", "-1"], "--prefetch-layers: must be >= 0"),
        (["demo", "--device", "bogus"], "--device: 'bogus': "),
        (["demo", "--device", "meta"], "--device: 'meta': cannot offload from the meta device"),
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        err = capsys.readouterr().err
        assert info.value.code == 2 and flag in err and len(err.strip().splitlines()) == 1, err
    assert "(allowed: cpu" in err
    with pytest.raises(SystemExit) as info:
        main(["plan", "--hf-config", "/nonexistent/config.json"])
    assert info.value.code == 2 and "no such file or folder" in capsys.readouterr().err


# `torchoffload plan` (issue 39, item 5): every bad argument is one line naming the flag and
# what it allows, exit status 2, before any tracing.
GPT_PLAN = ["plan", "--model", "gpt", "--hidden", "256", "--layers", "2", "--heads", "8",
            "--vocab", "1000", "--seq", "64", "--link-gbps", "55", "--tflops", "100"]  # fmt: skip


@pytest.fixture
def no_work(monkeypatch):
    """Tracing or measuring the machine fails the test: the checks come first."""
    import torchoffload.planner as planner

    def work(*args, **kwargs):
        raise AssertionError("the plan command started work before checking its arguments")

    monkeypatch.setattr(planner, "trace", work)
    monkeypatch.setattr(planner.Hardware, "detect", work)


def one_line_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("torchoffload plan: error: argument --"), err
    return lines[0]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--heads", "7"], "--heads: must divide --hidden 256, got 7 (allowed near it: 1, 2, 4, 8"),
        (["--link-gbps", "0"], "--link-gbps: must be a number > 0, got 0"),
        (["--link-gbps", "nan"], "--link-gbps: must be a number > 0, got nan"),
        (["--tflops", "-1"], "--tflops: must be a number > 0, got -1"),
        (["--efficiency", "2"], "--efficiency: must be a number > 0 and <= 1, got 2"),
        (["--parameters", "host", "--optimizer-state", "device"],
         "--parameters: 'host' needs --optimizer-state host or auto"),
        (["--optimizer", "none", "--parameters", "host"],
         "--parameters: 'host' places optimizer state, and --optimizer none counts none: "
         "allowed with --optimizer adamw or sgd"),
        (["--offload-fraction", "0.5", "--optimizer-state", "device"],
         "--offload-fraction: 0.5 of the optimizer state on the host needs --optimizer-state "
         "host or auto"),
        (["--kv-heads", "2"], "--kv-heads: only --model llama has it"),
        (["--host-state", "bf16-8bit", "--optimizer", "sgd"],
         "--host-state: bf16-8bit is AdamW's state: needs --optimizer adamw, got sgd"),
        (["--host-state", "bf16", "--dtype", "fp32"],
         "--host-state: bf16 keeps bf16 masters of bf16 parameters: needs --dtype bf16"),
        (["--host-state", "8bit", "--optimizer-state", "device"],
         "--host-state: 8bit is state on the host: needs --optimizer-state host or auto"),
        (["--host-state", "8bit", "--offload-fraction", "0.5"],
         "--host-state: 8bit is planned with all of the state on the host: needs "
         "--offload-fraction 1 or auto, got 0.5"),
        (["--host-step-rate", "0"], "--host-step-rate: must be a number > 0, got 0"),
        # a traceback before: OverflowError, and the planner's "found no repeated layers"
        (["--budget", "1e400"], "--budget: not a finite size: '1e400'"),
        (["--budget", "1e300TiB"], "--budget: not a finite size: '1e300TiB'"),
        (["--host-budget", "0.5"], "--host-budget: a size must be at least 1 byte, got '0.5'"),
        (["--layers", "1"], "--layers: must be >= 2, got 1"),
        (["--plot", "/nonexistent/folder/memory.png"],
         "--plot: "),  # matplotlib missing, or the folder: either before any work
    ],
)  # fmt: skip
def test_plan_argument_errors_are_one_line_before_any_work(capsys, no_work, args, expected):
    assert expected in one_line_error(capsys, [*GPT_PLAN, *args])


def test_plan_llama_shape_errors_name_the_allowed_values(capsys, no_work):
    line = one_line_error(capsys, ["plan", "--heads", "32", "--kv-heads", "3"])
    assert "--kv-heads: must divide --heads 32, got 3 (allowed: 1, 2, 4, 8, 16, 32)" in line
    line = one_line_error(capsys, ["plan", "--hidden", "96", "--heads", "32"])
    assert (
        "--heads: --hidden 96 / --heads 32 = 3 per head, which rotary embeddings need even" in line
    )


def test_plan_unwritable_plot_fails_before_the_plan(capsys, no_work, tmp_path):
    pytest.importorskip("matplotlib")
    line = one_line_error(capsys, [*GPT_PLAN, "--plot", str(tmp_path / "no" / "m.png")])
    assert f"--plot: cannot write {tmp_path / 'no' / 'm.png'}: no such folder" in line
    line = one_line_error(capsys, [*GPT_PLAN, "--plot", str(tmp_path)])
    assert "it is a folder" in line


def test_plan_hf_config_of_an_unknown_model_type(capsys, no_work, tmp_path):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "no-such-model", "hidden_size": 64}')
    line = one_line_error(capsys, ["plan", "--hf-config", str(path)])
    assert "--hf-config: model_type 'no-such-model'" in line and "e.g. llama" in line
    line = one_line_error(capsys, ["plan", "--hf-config", str(tmp_path)])  # its folder
    assert "model_type 'no-such-model'" in line
    try:  # transformers 5 validates a config's shape when it loads it
        transformers.LlamaConfig(hidden_size=100, num_attention_heads=7)
    except Exception:  # noqa: BLE001 - whatever it raises becomes one line
        path.write_text('{"model_type": "llama", "hidden_size": 100, "num_attention_heads": 7}')
        line = one_line_error(capsys, ["plan", "--hf-config", str(path)])
        assert "--hf-config: " in line and "(100) is not a multiple of the number of" in line
    path.write_text('{"model_type": "llama", "num_hidden_layers": 1}')  # a traceback before
    line = one_line_error(capsys, ["plan", "--hf-config", str(path)])
    assert "num_hidden_layers is 1; the planner works on repeated layers: at least 2" in line
    path.write_text("{not json")
    assert "is not a readable config.json" in one_line_error(
        capsys, ["plan", "--hf-config", str(path)]
    )


def test_plan_sgd_counts_momentum_and_streams_parameters(capsys):
    """--optimizer sgd is SGD with momentum: its buffer is counted, and it can go to the host
    with the parameters (it used to be refused, blaming optimizer 'none')."""
    assert main([*GPT_PLAN, "--optimizer", "sgd", "--parameters", "host"]) == 0
    out = capsys.readouterr().out
    assert "parameters in pinned host memory" in out
    static = next(line for line in out.splitlines() if line.startswith("static:"))
    params = static.split("parameters ")[1].split(",")[0]
    assert f"optimizer state {params}" in static  # one momentum buffer per parameter


def test_plan_low_precision_host_state_takes_its_bytes_and_measured_rate(capsys, monkeypatch):
    """--host-state: the host bytes a parameter of that format and the host step's rate,
    measured on this machine (here stubbed: the measuring is `measure_host_step`'s test) or
    given; the predicted optimizer time follows the rate."""
    from torchoffload import optim

    calls = []

    def measured(cls, **kw):
        calls.append((cls.__name__, kw))
        return 1e8

    monkeypatch.setattr(optim, "measure_host_step", measured)
    host = [*GPT_PLAN, "--optimizer-state", "host"]

    def opt_ms(out):
        row = next(line for line in out.splitlines() if line.startswith("no plan"))
        return float(row.split()[-2])

    assert main([*host, "--host-state", "bf16-8bit"]) == 0
    captured = capsys.readouterr()
    assert calls == [("AdamW8bit", {"master_dtype": torch.bfloat16})]
    assert "host step measured: 0.10 B parameters a second (AdamW8bit" in captured.err
    assert "host step 0.10 B parameters a second" in captured.out
    assert "state at 10.06 bytes a parameter" in captured.out  # with copies aside
    assert "2 bytes a parameter over the link each way" in captured.out  # bf16 masters
    slow = opt_ms(captured.out)
    assert main([*host, "--host-state", "bf16-8bit", "--host-step-rate", "1e10"]) == 0
    out = capsys.readouterr().out
    assert len(calls) == 1 and "host step 10.00 B parameters a second" in out
    assert opt_ms(out) < slow / 10
