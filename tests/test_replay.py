from torch import nn

from revnets.replay import state_tensors


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
