"""``python train.py model=<any timm name or a Hugging Face config> memory=auto memory.budget=...``:
the trainer plans the model it builds with auto_checkpoint, prints the plan, trains within the
budget and reports against the model unplanned; a budget no plan reaches is a message naming the
least one that is."""

import contextlib
import json
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

import revnets
from revnets.facts import MiB
from revnets.training import create_model
from revnets.training.memory_options import AutoPlan, MemoryConfigError, parse_size
from revnets.training.settings import Settings
from tests.test_training import config, model_of, train_py_in_process

TINY = ["data.image_size=64", "data.train_size=32", "data.val_size=16", "data.batch_size=16",
        "trainer.max_steps=2", "trainer.log_every=1"]


def unplanned_peak(*overrides: str) -> int:
    """The peak of the run's training step with every activation stored, as auto_checkpoint
    predicts it (the model and SGD the run builds, one batch of its data's shape)."""
    settings = Settings.of(config(*overrides, *TINY))
    model = create_model(settings.model, settings.data.num_classes, image_size=64)
    optimizer = settings.optim.make([{"params": list(model.parameters())}])
    x = torch.zeros(16, 3, 64, 64)
    y = torch.zeros(16, dtype=torch.long)
    with warnings.catch_warnings():  # a model torch.fx cannot trace: whole modules (below)
        warnings.simplefilter("ignore")
        as_it_is = revnets.auto_checkpoint(
            model, x, 2**40, lambda out: F.cross_entropy(getattr(out, "logits", out), y),
            optimizer)
    assert as_it_is is model
    return as_it_is.memory_plan.peak_bytes


def first_step_peak(run_dir) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r["peak_mib"] for r in records if "peak_mib" in r) * MiB


@pytest.mark.parametrize("model", [
    ["model=timm", "model.name=test_resnet"],  # traced: a plan of its graph
    ["model=hf_vit"],  # torch.fx cannot trace it: checkpoints of the modules it calls
])
def test_any_model_trains_within_a_budget_below_its_unplanned_peak(model, tmp_path):
    if model == ["model=hf_vit"]:
        pytest.importorskip("transformers")
    unplanned = unplanned_peak(*model)
    budget = int(0.75 * unplanned)
    with pytest.warns(UserWarning, match="planned as checkpoints of whole modules") if (
            model == ["model=hf_vit"]) else contextlib.nullcontext():
        done = train_py_in_process(*model, "memory=auto", f"memory.budget={budget}", *TINY,
                                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    name = "test_resnet" if model[0] == "model=timm" else "hf:ViTForImageClassification"
    assert f"memory plan of {name}: auto ({budget / MiB:.1f} MiB)" in done.stdout
    assert re.search(r"\bcheckpoint\b", done.stdout.split("predicted peak")[0])  # the plan's table
    predicted = float(re.search(r"predicted peak of a training step: ([\d.]+) MiB",
                                done.stdout)[1]) * MiB
    measured = first_step_peak(tmp_path)
    assert measured <= predicted + 0.01 * MiB <= budget + 0.01 * MiB
    # The report's row: the first step's peak against the same step of the model unplanned.
    row = re.search(rf"{re.escape(name)} \| auto [^|]* \| ([\d.]+) +\| ([\d.]+) +\| ([\d.]+)x",
                    done.stdout)
    assert float(row[1]) == pytest.approx(measured / MiB, abs=0.05)
    assert float(row[2]) > float(row[1]) and float(row[3]) > 1


def test_a_budget_below_every_plan_names_the_least_reachable_one(tmp_path):
    done = train_py_in_process("model=timm", "model.name=test_resnet", "memory=auto",
                               "memory.budget=1MiB", *TINY, cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    least = int(re.search(r"set memory\.budget=(\d+) \(bytes\) or more", done.stderr)[1])
    assert "no plan trains within 1.00 MiB" in done.stderr
    done = train_py_in_process("model=timm", "model.name=test_resnet", "memory=auto",
                               f"memory.budget={least}", *TINY, cwd=tmp_path)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("overrides, message", [
    (["memory=auto"], "memory=auto needs a budget: memory.budget=2GiB"),
    (["memory=auto", "memory.budget=2XB"], "memory.budget='2XB' is not a size"),
    (["memory=auto", "memory.budget=0"], "a budget is more than 0 bytes"),
    (["memory=auto", "memory.budget=2GiB", "+memory.segments=2"],
     "memory=auto plans the model within memory.budget and takes no other option"),
    (["memory=reversible", "memory.budget=2GiB"], "memory.budget is memory=auto's option"),
])
def test_budget_settings_that_name_no_budget_are_refused(overrides, message):
    with pytest.raises(MemoryConfigError, match=re.escape(message)):
        Settings.of(config(*overrides))


def test_a_model_outside_the_zoo_follows_none_or_a_budget():
    assert model_of(config("model=timm", "memory=none")).__class__.__name__ == "ResNet"
    with pytest.raises(MemoryConfigError, match=re.escape(
            "model=resnet18 is not a model of revnets' zoo and follows no preset but none: plan "
            "it within a budget with memory=auto")):
        model_of(config("model=timm", "memory=checkpoint"))


@pytest.mark.parametrize("text, size", [
    ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000), ("64 kib", 65536),
    ("123", 123), (123, 123), ("3B", 3),
])
def test_sizes_are_bytes_or_a_number_and_a_unit(text, size):
    assert parse_size(text) == size
    assert Settings.of(config("memory=auto", f"memory.budget={text}")).memory == AutoPlan(size)



TEXT = ["data=text", "data.sequence_length=64", "data.train_size=32", "data.val_size=16",
        "data.batch_size=8", "trainer.max_steps=2", "trainer.log_every=1"]


@pytest.mark.parametrize("model", ["hf_gpt2", "hf_llama"])
def test_a_language_model_on_text_trains_within_a_budget_below_its_unplanned_peak(
        model, tmp_path):
    """``model=hf_gpt2 data=text``: a causal language model of bytes, each position's target
    the next byte, planned by auto_checkpoint under 75 % of its unplanned step's peak (the
    model and SGD the run builds, one batch of token ids), measured within the plan."""
    transformers = pytest.importorskip("transformers")  # noqa: F841
    settings = Settings.of(config(f"model={model}", *TEXT))
    built = create_model(settings.model, 256, tokens=True)
    optimizer = settings.optim.make([{"params": list(built.parameters())}])
    x = torch.zeros(8, 64, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        unplanned = revnets.auto_checkpoint(
            built, x, 2**40, lambda out: F.cross_entropy(out.logits.flatten(0, 1), x.flatten()),
            optimizer).memory_plan.peak_bytes
    budget = int(0.75 * unplanned)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        done = train_py_in_process(f"model={model}", *TEXT, "memory=auto",
                                   f"memory.budget={budget}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"memory plan of {settings.model.name}: auto ({budget / MiB:.1f} MiB)" in done.stdout
    predicted = float(re.search(r"predicted peak of a training step: ([\d.]+) MiB",
                                done.stdout)[1]) * MiB
    assert first_step_peak(tmp_path) <= predicted + 0.01 * MiB <= budget + 0.01 * MiB


def test_a_language_model_step_measures_what_its_baseline_predicts(tmp_path):
    """Unplanned (``memory=none``), the run's first step holds what the baseline predicted on
    the meta device: the logits are not kept through the backward."""
    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        done = train_py_in_process("model=hf_gpt2", *TEXT, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    row = re.search(r"hf:GPT2LMHeadModel \| none +\| ([\d.]+) +\| ([\d.]+) +\| 1.00x", done.stdout)
    assert row and row[1] == row[2]


def test_text_is_the_next_byte_of_the_documentation_topics_every_fifth_held_out():
    from pydoc_data.topics import topics

    from revnets.training.data import text

    x, y = text(16, 4, split=0).tensors
    first = "\n".join(topics[k] for i, k in enumerate(sorted(topics)) if i % 5 != 4).encode()
    assert bytes(x[0].tolist()) == first[:16] and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(x[1, 0], y[0, -1]) and len(x) == 4
    train, held_out = (bytes(text(1, None, split).tensors[0].flatten().tolist())
                       for split in (0, 1))
    for i, key in enumerate(sorted(topics)):
        start = topics[key][:200].encode()
        assert (start in held_out, start in train) == ((True, False) if i % 5 == 4 else
                                                      (False, True)), key


def test_a_language_models_loss_and_accuracy_are_per_token(tmp_path):
    """Per token, not per sample: at initialisation the loss is near ln(256) and the accuracy
    a share of the tokens."""
    pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        done = train_py_in_process("model=hf_gpt2", *TEXT, "trainer.eval_every=2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evaluation = next(r for r in records if "val_loss" in r)
    for loss, accuracy in [(r["loss"], r["accuracy"]) for r in steps] + [
            (evaluation["val_loss"], evaluation["val_accuracy"])]:
        assert 4 < loss < 7 and 0 <= accuracy <= 1


BERT = ["~model.n_embd", "~model.n_layer", "~model.n_head", "~model.n_positions",
        "+model.hidden_size=64", "+model.num_hidden_layers=2", "+model.num_attention_heads=4",
        "+model.intermediate_size=128"]  # a BERT-like config in place of GPT-2's keys


@pytest.mark.parametrize("overrides, message", [
    (["model=timm", "data=text"], "text trains a Hugging Face causal language model"),
    (["model=hf_gpt2"], "a language model takes tokens, e.g. data=text"),
    (["model=hf_gpt2", "data=text", "data.num_classes=100"], "set data.num_classes=256"),
    (["model=hf_gpt2", "data=text", "data.sequence_length=300"],
     "data.sequence_length=300 is more than model=hf:GPT2LMHeadModel's 256 positions"),
    (["model=hf_gpt2", "data=text", *BERT, "model.name=hf:XLMRobertaForSequenceClassification"],
     "text trains a causal language model"),
    # Masked, or a decoder class built as an encoder (is_decoder false): they see the answer.
    (["model=hf_gpt2", "data=text", *BERT, "model.name=hf:BertForMaskedLM"], "sees later tokens"),
    (["model=hf_gpt2", "data=text", *BERT, "model.name=hf:XLMRobertaForCausalLM"],
     "sees later tokens"),
])
def test_a_model_and_data_that_do_not_match_are_refused_by_name(overrides, message, tmp_path):
    pytest.importorskip("transformers")
    done = train_py_in_process(*overrides, "trainer.max_steps=1", cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert message in done.stderr
