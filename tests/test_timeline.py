"""The memory timeline: live bytes after every operator, by category and top-level module."""

import timm
import torch
import torch.nn.functional as F
from torch import nn

import revnets
from revnets.memory import plot_timelines, predict_timeline, record_timeline

KiB = 1024


def test_known_allocations_give_a_known_timeline():
    def fn():
        a = torch.empty(256 * KiB, dtype=torch.uint8)  # tick 1
        b = torch.empty(512 * KiB, dtype=torch.uint8)  # tick 2
        del a
        c = torch.empty(128 * KiB, dtype=torch.uint8)  # tick 3: a's storage went at tick 2
        return b, c

    report, timeline = record_timeline(fn)
    assert timeline.total == [0, 256 * KiB, 768 * KiB, 640 * KiB]
    assert timeline.peak_bytes == report.peak_bytes == 768 * KiB
    assert timeline.series["activations: backward and other"] == timeline.total


def train_step(model, optimizer, x, y):
    optimizer.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()
    optimizer.step()


def test_a_training_step_split_by_category_and_module():
    model = timm.create_model("revnet38")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    train_step(model, optimizer, x, y)
    report, timeline = record_timeline(train_step, model, optimizer, x, y)
    measured = revnets.measure_memory(train_step, model, optimizer, x, y)
    assert timeline.peak_bytes == measured.peak_bytes == report.peak_bytes
    at_peak = {label: values[timeline.peak_tick] for label, values in timeline.series.items()}
    assert at_peak["parameters"] == measured.parameters
    assert at_peak["optimizer_state"] == measured.optimizer_state
    assert set(timeline.series) >= {
        "parameters", "gradients", "optimizer_state", "inputs", "activations: stem",
        "activations: stages", "activations: backward and other",
    }
    # Before the step only model state and the batch are alive; zero_grad frees the last step's
    # gradients, and backward brings new ones.
    assert timeline.series["activations: stages"][0] == 0
    gradient_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert timeline.series["gradients"][0] == gradient_bytes
    assert min(timeline.series["gradients"]) == 0
    assert timeline.series["gradients"][-1] == gradient_bytes


def test_the_prediction_on_meta_equals_the_measurement():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
    train_step(model, optimizer, x, y)
    _, measured = record_timeline(train_step, model, optimizer, x, y)
    _, predicted = predict_timeline(train_step, model, optimizer, x, y)
    assert predicted.total == measured.total
    assert predicted.series == measured.series


def test_plot_beside_the_baseline(tmp_path):
    timelines = {}
    for strategy in ("reversible", "none"):
        model = timm.create_model("revnet38", memory=strategy)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
        timelines[strategy] = record_timeline(train_step, model, optimizer, x, y)[1]
    assert timelines["reversible"].peak_bytes < timelines["none"].peak_bytes
    path = plot_timelines(timelines, tmp_path / "timeline.png", title="revnet38")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_planned_models_activations_go_to_the_runs_of_its_plan():
    # auto_checkpoint's model runs its plan's steps, not the model's children: the timeline
    # names the plan's runs (a checkpointed segment, the steps stored between two), and the
    # planned model, which refuses hooks on modules it runs as a graph, trains under it.
    model = timm.create_model("test_resnet", num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))
    planned = revnets.auto_checkpoint(model, x, int(14.2 * 2**20),
                                      lambda out: F.cross_entropy(out, y), optimizer)
    runs = {name for name, _ in planned.timeline_parts()}
    assert any(str(part.decision).startswith("checkpoint") for part in planned.memory_plan.parts)
    report, timeline = record_timeline(train_step, planned, optimizer, x, y)
    named = {label.removeprefix("activations: ") for label in timeline.series
             if label.startswith("activations: ")} - {"backward and other"}
    assert named and named <= runs
    assert timeline.peak_bytes == report.peak_bytes
