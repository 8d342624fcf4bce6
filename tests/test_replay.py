import pytest
import torch
from torch import nn

from revnets.replay import ModuleState, state_tensors


def test_state_tensors_walk_like_named_parameters_and_buffers():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, bias=False), nn.BatchNorm2d(4), nn.Sequential(nn.Linear(4, 2))
    )
    slots, names = state_tensors(model), state_tensors(model, names=True)
    # Module by module, parameters then buffers: bias=None keeps its slot.
    assert names == [
        "0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var",
        "1.num_batches_tracked", "2.0.weight", "2.0.bias",
    ]
    assert slots[1] is None
    named = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    assert all(named[n] is t for n, t in zip(names, slots) if t is not None)
    assert state_tensors(model, buffers=False, names=True) == [
        n for n in names if n in dict(model.named_parameters()) or n == "0.bias"
    ]


def test_module_state_names_what_was_swapped():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    state = ModuleState(model)
    state.forward_done()
    state.check("owner", "remedy")  # nothing changed
    original = model[1].bias
    model[1].bias = nn.Parameter(original.detach().clone())
    with pytest.raises(RuntimeError, match=r"owner: 1.bias is not the tensor the forward pass"):
        state.check("owner", "remedy")
    model[1].bias = original
    model.append(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="owner: its parameters and buffers are not those"):
        state.check("owner", "remedy")


def test_module_state_names_what_was_modified_in_place():
    model = nn.Sequential(nn.Linear(2, 2, bias=False), nn.BatchNorm1d(2).eval())
    model[0].weight.requires_grad_(False)  # a frozen weight is checked as well
    state = ModuleState(model)
    state.forward_done()
    with torch.no_grad():
        model[0].weight.mul_(2)
    with pytest.raises(RuntimeError, match=r"owner: 0.weight was modified in place"):
        state.check("owner", "remedy")


def test_module_state_replays_buffers_the_forward_changed_and_keeps_the_update_once():
    model = nn.Linear(2, 2)
    model.register_buffer("ema", torch.zeros(2))
    state = ModuleState(model)
    model.ema.add_(1)  # the forward's update
    state.forward_done()
    with state.replayed():
        assert torch.equal(model.ema, torch.zeros(2))  # what the forward found
        model.ema.add_(1)  # the replay's update is not kept
    assert torch.equal(model.ema, torch.ones(2))


def test_rng_state_of_an_accelerator_goes_through_its_own_device_module(monkeypatch):
    """Not through torch.cuda (what torch.utils.checkpoint's helper defaults to)."""
    calls = []

    class FakeAccelerator:
        def get_rng_state(self, device):
            calls.append(("get", device))
            return torch.zeros(16, dtype=torch.uint8)

        def set_rng_state(self, state, device):
            calls.append(("set", device))

    import revnets.replay as replay

    fake = FakeAccelerator()
    monkeypatch.setattr(replay, "_accelerator", lambda device: fake)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda *a, **k: calls.append("cuda"))
    device = torch.device("xpu", 1)
    state = replay.RngState(device)
    state.restore()
    assert calls == [("get", device), ("set", device)]
