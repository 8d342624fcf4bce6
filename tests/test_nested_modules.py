"""Checkpoints nested inside others in plans of modules (NOTE [ Nested checkpoints ] in
revnets/planning/modules/install.py): a layer's sublayers checkpointed inside the layer's
checkpoint, and inside a run of layers, train as the model does (gradients, BatchNorm's
statistics updated once, dropout's draws, hooks run once), are predicted to the byte, and a
selective part in a nesting is refused by name."""

import pytest
import torch
from test_module_runs import LAYERS, decoder, steps_of

import revnets
from revnets.memory import measure_memory, predict_memory
from revnets.planning import CheckpointedModules

from conftest import train_step

WHOLE = revnets.Checkpoint()
NESTINGS = {
    "sublayers in each layer": {**dict.fromkeys(LAYERS, WHOLE),
                                **{f"{layer}.{sub}": WHOLE for layer in LAYERS
                                   for sub in ("norm", "mlp")}},
    "two levels down": {**dict.fromkeys(LAYERS, WHOLE),
                        **{f"{layer}.mlp": WHOLE for layer in LAYERS},
                        **{f"{layer}.mlp.{i}": WHOLE for layer in LAYERS for i in (0, 3)}},
    "in a run of layers": {LAYERS[:3]: WHOLE, LAYERS[3:]: WHOLE,
                           **{f"{layer}.mlp": WHOLE for layer in LAYERS}},
    "a run inside a layer": {**dict.fromkeys(LAYERS, WHOLE),
                             **{(f"{layer}.norm", f"{layer}.mlp"): WHOLE for layer in LAYERS}},
}


@pytest.mark.parametrize("nesting", NESTINGS)
def test_a_nested_plan_trains_as_the_model_gradients_buffers_draws_and_hooks(nesting):
    model, x = decoder(torch.float64)
    calls = []
    model.layers[1].mlp.register_forward_hook(lambda *args: calls.append(1))
    planned = CheckpointedModules(model, NESTINGS[nesting])

    own, theirs = steps_of(model, planned, x, between=calls.clear)
    assert max((a - b).abs().max().item() for a, b in zip(own[0], theirs[0])) < 1e-10
    assert all(torch.equal(a, b) for a, b in zip(own[1], theirs[1]))  # BatchNorm, once a step
    assert torch.equal(own[2], theirs[2])  # the generator left where the model leaves it
    assert calls == [1]  # the sublayer's hook once, as in the model
    assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("nesting", NESTINGS)
def test_a_nested_plans_peak_is_predicted_to_the_byte(nesting):
    model, x = decoder()
    planned = CheckpointedModules(model, NESTINGS[nesting])
    assert measure_memory(train_step, planned, x).peak_bytes \
        == predict_memory(train_step, planned, x).peak_bytes


@pytest.mark.parametrize("outer, inner", [(WHOLE, revnets.Checkpoint(selective=True)),
                                          (revnets.Checkpoint(selective=True), WHOLE)])
def test_a_selective_part_in_a_nesting_is_refused_by_name(outer, inner):
    model, _ = decoder()
    with pytest.raises(TypeError, match=r"'layers.0.mlp' is inside 'layers.0'.*selectively.*"
                                        r"checkpointed whole: Checkpoint\(\)"):
        CheckpointedModules(model, {"layers.0": outer, "layers.0.mlp": inner})

