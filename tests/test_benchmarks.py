"""The README's demo and the results scripts keep running: their quick modes, end to end."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run_quick(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, script, "--quick", *args],
        cwd=BENCHMARKS,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_reversible_stack_demo_compares_every_strategy():
    out = run_quick("reversible_stack.py")
    plans = ("none", "checkpoint", "reversible", "reversible(store_last_blocks=1)")
    for strategy in (*plans, "reversible(store_last_blocks=3)"):
        assert f"memory  depth  16  {strategy} " in out
        assert f"speed   fresh  {strategy} " in out
    # The float64 gradient check of both couplings, exact to round-off.
    errors = [line for line in out.splitlines() if line.lstrip().startswith("grads")]
    assert len(errors) == 2
    for line in errors:
        assert "float64" in line
        assert float(line.split("relative error")[1].split()[0]) < 1e-10


@pytest.mark.slow
def test_zoo_memory_quick_run():
    out = run_quick("zoo_memory.py")
    assert "revnet992" in out and "'ratio_to_resnet'" in out


@pytest.mark.slow
def test_vit_memory_quick_run():
    out = run_quick("vit_memory.py")
    assert "revvit_small_patch16_224" in out and "speed" in out


@pytest.mark.slow  # two scripts' processes; tests/test_exact.py checks the same guarantees
def test_exact_scripts_quick_runs():
    out = run_quick("exact_error_vs_depth.py")
    assert "'precision': 'bf16', 'exact': True, 'relative_error': 0.0}" in out
    assert "'precision': 'fp16', 'exact': True, 'relative_error': 0.0}" in out
    assert "'plan': 'reversible, exact=True'" in run_quick("exact_step_time.py")


@pytest.mark.slow
def test_exact_accuracy_quick_run():
    out = run_quick("exact_accuracy.py")
    assert "'model': 'revnet exact', 'precision': 'bf16'" in out


# Slow: the same chain (conv_chain(12) at 4x3x16x16) at budgets that never get a higher measured
# peak as they fall is the default run's test_planning_speed.py::test_a_smaller_budget_never_gives_
# a_higher_measured_peak and ::test_a_smaller_budget_than_one_a_cheaper_plan_fits_finds_that_plan.
@pytest.mark.slow
@pytest.mark.parametrize("times", [[], ["--measured"]], ids=["sizes", "measured"])
def test_budget_sweep_finds_no_smaller_budget_with_a_higher_peak(tmp_path, times):
    done = subprocess.run(
        [sys.executable, "budget_sweep.py", "--only", "conv_chain", "--steps", "4", *times,
         "--results", str(tmp_path)], cwd=BENCHMARKS, capture_output=True, text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    row = next(line for line in next(tmp_path.glob("*.md")).read_text().splitlines()
               if line.startswith("| conv_chain_12"))
    budgets, violations = [cell.strip() for cell in row.strip("|").split("|")][3::2]
    assert (budgets, violations) == ("5", "0")


@pytest.mark.slow  # about a minute
def test_planner_zoo_plans_or_refuses_every_row_correctly(tmp_path):
    done = subprocess.run(
        [sys.executable, "planner_zoo.py", "--only", "gpt", "--repeats", "1", "--results",
         str(tmp_path)],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in (tmp_path / next(p.name for p in tmp_path.glob("*.md")))
            .read_text().splitlines() if line.startswith("| gpt")]
    assert len(rows) == 2 and not any("WRONG" in row for row in rows)


@pytest.mark.slow
def test_planner_zoo_covers_every_torchvision_classification_model(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import torchvision
    from planner_zoo import torchvision_cases

    names = torchvision.models.list_models(module=torchvision.models)
    assert [case.name for case in torchvision_cases()] == [f"tv_{name}" for name in names]
    done = subprocess.run(
        [sys.executable, "planner_zoo.py", "--set", "torchvision", "--only", "squeezenet1_1",
         "--cuts", "0.5", "--repeats", "1", "--results", str(tmp_path)],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    table = next(tmp_path.glob("*-torchvision.md")).read_text()
    rows = [line for line in table.splitlines() if line.startswith("| tv_squeezenet1_1")]
    assert len(rows) == 1 and "WRONG" not in rows[0] and "| True |" in rows[0]


@pytest.mark.slow
def test_planner_zoo_timm_set_builds_each_model_at_its_size_and_plans_an_untraceable_one(tmp_path):
    """One model built for 64x64 (a ViT) and one whose own forward torch.fx cannot trace:
    planned as whole modules, its row says so."""
    done = subprocess.run(
        [sys.executable, "planner_zoo.py", "--set", "timm", "--only",
         "timm_vit_tiny,crossvit", "--cuts", "0.5", "--repeats", "1", "--results",
         str(tmp_path)],
        cwd=BENCHMARKS, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    table = next(tmp_path.glob("*-timm.md")).read_text()
    vit = next(line for line in table.splitlines() if line.startswith("| timm_vit_tiny"))
    crossvit = next(line for line in table.splitlines() if line.startswith("| timm_crossvit"))
    assert "2x3x64x64" in vit and "WRONG" not in vit and "| True |" in vit
    assert "WRONG" not in crossvit and "| True |" in crossvit
    assert "(whole modules: torch.fx cannot trace its own forward)" in crossvit


@pytest.mark.slow  # a process timing revnets beside ordinary autograd and the peers installed
def test_peers_overhead_quick_run_times_revnets_beside_ordinary_autograd():
    out = run_quick("peers_overhead.py")
    assert "'library': 'none'" in out and "'library': 'revnets'" in out


@pytest.mark.slow  # pretrains and fine-tunes two small models (about 40 s)
def test_conversion_quick_run_fine_tunes_every_method_and_measures_depth():
    out = run_quick("conversion.py")
    for method in ("'full'", "'checkpointing'", "'difference 1'", "'momentum 0.1'",
                   "'meft 0.1/0.1'"):
        assert f"'method': {method}" in out
    assert "'construction': 'meft 0.1/0.1'" in out and "'gradient_error'" in out
    assert "'depth': 8" in out and "'predicted_equal': False" not in out


@pytest.mark.slow  # plans two small transformers models two ways (about 20 s)
def test_hf_capture_quick_run_plans_modules_and_the_exported_graph(tmp_path):
    pytest.importorskip("transformers")
    out = run_quick("hf_capture.py", "--results", str(tmp_path))
    for model in ("'llama'", "'gpt2'"):
        assert f"'model': {model}, 'route': 'modules'" in out
        assert f"'model': {model}, 'route': 'export graph'" in out
    assert "'predicted_equal': False" not in out
    assert list(tmp_path.glob("hf_capture-*-quick.md"))


@pytest.mark.slow  # plans and times two small transformers models (about 15 s)
def test_hf_checkpointing_quick_run_plans_at_transformers_peak(tmp_path):
    pytest.importorskip("transformers")
    out = run_quick("hf_checkpointing.py", "--results", str(tmp_path))
    for model in ("'llama'", "'gpt2'"):
        assert f"'model': {model}" in out
    assert out.count("'method': \"revnets at hf's peak\"") == 2
    assert list(tmp_path.glob("hf_checkpointing-*-quick.md"))


@pytest.mark.slow  # compiles the model at each budget, in two processes
def test_frontier_quick_run_measures_every_family(tmp_path):
    out = run_quick("frontier.py", "--only", "gpt", "--processes", "2", "--results",
                    str(tmp_path))
    for family in ("'eager'", "'revnets ", "'revnets + compile ", "'torch checkpoint per block'",
                   "'compile budget 0.3'"):
        assert family in out
    assert "'process': 0" in out and "'process': 1" in out
    assert list(tmp_path.glob("frontier-*-quick-gpt.png"))


def test_a_frontier_point_is_beaten_only_by_compile_reaching_no_more_memory_faster(
        monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from frontier import beaten_by

    def point(method, peak, time):
        return {"method": method, "peak_mib": peak, "time_ratio": time}

    compile_points = [point("compile budget 0.7", 224.0, 0.95),
                      point("compile budget 0.5", 212.0, 0.97)]
    rows = [*compile_points, point("revnets + compile keep 0.7", 221.0, 0.98),
            point("revnets + compile keep 0.5", 197.0, 1.00),
            point("revnets + compile keep 0.9", 230.0, 0.96),
            point("revnets keep 0.7", 220.0, 0.96)]
    assert [beaten_by(r, rows) for r in rows[2:]] == [
        "compile budget 0.5",  # 212 MiB in 0.97x: less memory, less time
        "",                    # lower than compile reaches
        "compile budget 0.7",  # 224 MiB in 0.95x
        "",                    # the only faster point needs more memory
    ]


def test_gradient_sensitivity_compares_a_moved_input_with_float64(tmp_path):
    done = subprocess.run(
        [sys.executable, "gradient_sensitivity.py", "--models", "revnet38", "--results",
         str(tmp_path)], cwd=BENCHMARKS, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr
    rows = [line for line in next(tmp_path.glob("*.md")).read_text().splitlines()
            if line.startswith("| revnet38")]
    assert [row.split(" | ")[1] for row in rows] == ["none", "checkpoint"]
    # A shallow RevNet's float32 gradient is well conditioned: all three agree to round-off.
    assert all(float(value) < 1e-3 for row in rows for value in row.strip(" |").split(" | ")[2:])


def test_compile_speed_counts_the_kernels_compiling_leaves_alone(monkeypatch):
    # What compile_speed.py reports as the floor of a compiled step: the share of operator time
    # in matrix products, convolutions and attention, and none of the elementwise work.
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from compile_speed import product_share

    a = torch.randn(512, 512)  # products long enough that the dispatcher's share stays small
    image, conv = torch.randn(2, 8, 32, 32), torch.nn.Conv2d(8, 8, 3)
    q = torch.randn(1, 2, 64, 32)
    assert product_share(lambda: [a @ a for _ in range(10)]) > 0.9
    assert product_share(lambda: conv(image)) > 0.5
    assert product_share(lambda: F.scaled_dot_product_attention(q, q, q)) > 0.5
    assert product_share(lambda: [a.exp().relu_() for _ in range(10)]) == 0.0
    assert 0.0 < product_share(lambda: (a @ a).exp().exp().exp()) < 1.0


def test_cuda_peak_probe_names_the_allocation_that_set_the_peak(tmp_path):
    """``cuda_peak_probe.py explain`` on a snapshot in the allocator's trace format: a tensor, a
    cuDNN workspace that reaches the peak while the tensor lives, frees. The workspace is named as
    the peak's maker and counted among the blocks no tensor holds; the tensor freed before the
    peak is not alive there."""
    import pickle

    def frames(*names):
        names = ("torch::unwind::unwind()", *names)
        return [{"name": n, "filename": "??", "line": 0} for n in names]

    tensor = frames("c10::cuda::CUDACachingAllocator::malloc", "at::detail::empty_generic(x)")
    workspace = frames("at::native::run_conv_plan(cudnnContext*)", "at::native::run_single_conv()")
    trace = [
        {"action": "alloc", "addr": 1, "size": 4096, "frames": tensor},
        {"action": "free_requested", "addr": 1, "size": 4096, "frames": tensor},
        {"action": "alloc", "addr": 2, "size": 2048, "frames": tensor},
        {"action": "alloc", "addr": 3, "size": 3072, "frames": workspace},
        {"action": "free_requested", "addr": 3, "size": 3072, "frames": workspace},
        {"action": "free_requested", "addr": 2, "size": 2048, "frames": tensor},
    ]
    (tmp_path / "conv.pickle").write_bytes(pickle.dumps({"device_traces": [trace]}))
    done = subprocess.run([sys.executable, "cuda_peak_probe.py", "explain", str(tmp_path)],
                          cwd=BENCHMARKS, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert ("alive together: 5120 B" in done.stdout
            and "3072 B, cuDNN convolution workspace (`at::native::run_conv_plan`)" in done.stdout)
    assert "no tensor holds: 1, 3072 B." in done.stdout
