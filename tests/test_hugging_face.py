"""Hugging Face transformers models, built from tiny configs with random weights (never
downloaded), through prediction, checkpoints and the planner: predictions equal measurements,
whatever path the model's masks take; a key-value cache the layers fill is replayed as found;
keyword inputs (a batch) plan through the model's own forward, which returns its ModelOutput."""

import copy
import re
import warnings

import pytest
import torch

import revnets

from conftest import max_grad_error

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, LENGTH = 64, 2, 32


def build(name: str, attention: str = "sdpa", **options) -> torch.nn.Module:
    """A two-layer model of each family, width 64, in training mode."""
    t = transformers
    configs = {
        "llama": lambda: t.LlamaForCausalLM(t.LlamaConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=VOCAB, **options)),
        "gpt2": lambda: t.GPT2LMHeadModel(t.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, **options)),
        "bert": lambda: t.BertForMaskedLM(t.BertConfig(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2,
            vocab_size=VOCAB, **options)),
        "bart": lambda: t.BartForConditionalGeneration(t.BartConfig(
            encoder_layers=2, decoder_layers=2, d_model=64, encoder_ffn_dim=128,
            decoder_ffn_dim=128, encoder_attention_heads=2, decoder_attention_heads=2,
            vocab_size=VOCAB, max_position_embeddings=LENGTH, **options)),
        "t5": lambda: t.T5ForConditionalGeneration(t.T5Config(
            num_layers=2, num_decoder_layers=2, d_model=64, d_ff=128, num_heads=2, d_kv=32,
            vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0, **options)),
        "vit": lambda: t.ViTForImageClassification(t.ViTConfig(
            image_size=32, patch_size=8, num_hidden_layers=2, hidden_size=64,
            intermediate_size=128, num_attention_heads=2, num_labels=10, **options)),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # token ids of the default configs outside VOCAB
        model = configs[name]()
    model.config._attn_implementation = attention
    return model.train()


def batch(padded: bool = True) -> dict:
    """Token ids, an attention mask with the end of one row padded, and labels."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(BATCH, LENGTH, dtype=torch.long)
    if padded:
        mask[1, LENGTH - 8:] = 0
    return {"input_ids": torch.randint(1, VOCAB, (BATCH, LENGTH), generator=g),
            "attention_mask": mask,
            "labels": torch.randint(1, VOCAB, (BATCH, LENGTH), generator=g)}


def step(model, inputs):
    model.zero_grad(set_to_none=True)
    model(**inputs).loss.backward()


def hf_checkpointing_peak(model, inputs) -> int:
    """The measured peak of ``model``'s step under transformers' own checkpointing of every
    layer."""
    model.gradient_checkpointing_enable()
    return revnets.measure_memory(step, model, inputs).peak_bytes


def least_budget(model, inputs, **options) -> int:
    """The smallest budget the planner reaches, read from its refusal of 1 byte."""
    with pytest.raises(revnets.PlanningError) as refused:
        revnets.auto_checkpoint(model, inputs, 1, loss_fn=lambda out: out.loss, **options)
    return int(re.search(r"\((\d+) bytes", str(refused.value))[1])


CASES = [(name, attention) for name in ("llama", "gpt2", "bert", "bart", "t5")
         for attention in ("sdpa", "eager") if (name, attention) != ("t5", "sdpa")]


@pytest.mark.parametrize("name, attention", CASES)
@pytest.mark.parametrize("padded, hf_checkpointing", [(False, False), (True, False), (True, True)],
                         ids=["unpadded", "padded", "padded_hf_checkpointing"])
def test_a_steps_prediction_equals_its_measurement(name, attention, padded, hf_checkpointing):
    """transformers skips building a mask where its position ids run in one sequence and
    nothing is padded (values it reads, and a prediction must compute: NOTE [ Real tensors in a
    prediction ], 1), and sdpa then runs its causal kernel without one."""
    model = build(name, attention)
    if hf_checkpointing:  # every layer, HF's own checkpointing
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    inputs = batch(padded)
    measured = revnets.measure_memory(step, model, inputs).peak_bytes
    assert revnets.predict_memory(step, model, inputs).peak_bytes == measured


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_decoder_that_fills_its_cache_in_training_plans_and_trains_as_the_model(attention):
    """Llama builds a DynamicCache in training where ``use_cache`` is on (the default) and hands
    it to every layer, whose attention appends its keys and values: a checkpointed layer's
    recomputation finds the cache as its forward did (NOTE [ Replay ], rule 2). With a 4-D
    mask (eager attention) a second append made planning fail with a broadcast error."""
    model = build("llama", attention, attention_dropout=0.1).double()
    assert model.config.use_cache
    reference = copy.deepcopy(model)
    inputs = batch()
    least = least_budget(model, inputs, measure_time=False)
    planned = revnets.auto_checkpoint(model, inputs, least, loss_fn=lambda out: out.loss,
                                      measure_time=False)
    assert any(isinstance(part.decision, revnets.Checkpoint)
               for part in planned.memory_plan.parts)
    for m in (planned, reference):
        torch.manual_seed(1)  # the same dropout masks for both
        step(m, inputs)
    assert max_grad_error(model, reference) < 1e-10
    measured = revnets.measure_memory(step, planned, inputs).peak_bytes
    assert measured == revnets.predict_memory(step, planned, inputs).peak_bytes <= least


def test_a_batch_of_keywords_plans_through_the_models_own_forward():
    """T5 needs its labels (or decoder inputs) in the forward: a mapping is the forward's
    keyword arguments (NOTE [ Example inputs ]). The planned model is the model, with some of
    its modules checkpointed: it returns the model's ModelOutput, with its loss."""
    model = build("t5", "eager", dropout_rate=0.1).double()
    reference = copy.deepcopy(model)
    inputs = batch()
    least = least_budget(model, inputs, measure_time=False)
    planned = revnets.auto_checkpoint(model, inputs, least, loss_fn=lambda out: out.loss,
                                      measure_time=False)
    out = planned(**inputs)
    assert type(out) is transformers.modeling_outputs.Seq2SeqLMOutput and out.loss.ndim == 0
    for m in (planned, reference):
        torch.manual_seed(1)
        step(m, inputs)
    assert max_grad_error(model, reference) < 1e-10
    measured = revnets.measure_memory(step, planned, inputs).peak_bytes
    assert measured == revnets.predict_memory(step, planned, inputs).peak_bytes <= least


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_loose_budget_keeps_the_products_and_recomputes_the_rest_as_the_model_computes(name):
    """Just below the unplanned peak the plan recomputes only what is cheap (GPT-2's MLP's
    tanh GELU, Llama's norms and SiLU) and keeps the products: decisions
    Checkpoint(selective=True), gradients with dropout replayed those of the model, its
    ModelOutput returned, measured == predicted within the budget."""
    model = build(name, "sdpa", **({"resid_pdrop": 0.1} if name == "gpt2"
                                   else {"attention_dropout": 0.1})).double()
    reference = copy.deepcopy(model)
    inputs = batch()
    unplanned = revnets.measure_memory(step, model, inputs).peak_bytes
    budget = int(0.95 * unplanned)
    planned = revnets.auto_checkpoint(model, inputs, budget, loss_fn=lambda out: out.loss,
                                      measure_time=False)
    assert planned.decisions and all(d.selective for d in planned.decisions.values())
    assert type(planned(**inputs)) is type(reference(**inputs))
    for m in (planned, reference):
        torch.manual_seed(1)
        step(m, inputs)
    assert max_grad_error(model, reference) < 1e-10
    measured = revnets.measure_memory(step, planned, inputs).peak_bytes
    assert measured == planned.memory_plan.peak_bytes <= budget


def test_a_lora_adapter_on_a_frozen_base_plans_and_trains_as_the_model():
    """peft's LoRA on Llama's attention, the base and its embeddings frozen, without
    ``enable_input_require_grads`` (which transformers' reentrant checkpointing needs for the
    adapters to get gradients): only the adapters get gradients, those of the model itself."""
    peft = pytest.importorskip("peft")
    base = build("llama", "sdpa", attention_dropout=0.1).double()
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.1)).train()
    reference = copy.deepcopy(model)
    inputs = batch()
    least = least_budget(model, inputs, measure_time=False)
    planned = revnets.auto_checkpoint(model, inputs, least, loss_fn=lambda out: out.loss,
                                      measure_time=False)
    for m in (planned, reference):
        torch.manual_seed(1)
        step(m, inputs)
    trained = [(name, p.grad, q.grad) for (name, p), q in
               zip(model.named_parameters(), reference.parameters()) if p.requires_grad]
    assert trained and all("lora_" in name for name, _, _ in trained)
    assert all(torch.equal(a, b) for _, a, b in trained)  # lora_B starts at zero: exactly
    del trained
    measured = revnets.measure_memory(step, planned, inputs).peak_bytes
    assert measured == revnets.predict_memory(step, planned, inputs).peak_bytes <= least


def inputs_of(name: str) -> dict:
    if name == "vit":
        g = torch.Generator().manual_seed(0)
        return {"pixel_values": torch.randn(4, 3, 32, 32, generator=g),
                "labels": torch.randint(0, 10, (4,), generator=g)}
    return batch()


def lora(model):
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


@pytest.mark.slow  # 24 plans of six models: about 35 s; the least budgets above, by default
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "vit", "llama_lora"])
def test_every_budget_gets_a_plan_within_it_or_a_refusal_naming_one_that_plans(name):
    """At 80, 60, 40 and 30 % of the unplanned step's peak: a plan whose measured peak is its
    prediction and within the budget, or a refusal whose named budget then plans."""
    model = lora(build("llama")) if name == "llama_lora" else build(name)
    inputs = inputs_of(name)
    unplanned = revnets.measure_memory(step, model, inputs).peak_bytes
    for share in (0.8, 0.6, 0.4, 0.3):
        budget = int(share * unplanned)
        try:
            planned = revnets.auto_checkpoint(model, inputs, budget,
                                              loss_fn=lambda out: out.loss, measure_time=False)
        except revnets.PlanningError as refused:
            budget = int(re.search(r"\((\d+) bytes", str(refused))[1])
            planned = revnets.auto_checkpoint(model, inputs, budget,
                                              loss_fn=lambda out: out.loss, measure_time=False)
        measured = revnets.measure_memory(step, planned, inputs).peak_bytes
        assert measured == planned.memory_plan.peak_bytes <= budget, (share, name)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit"])
def test_at_hf_checkpointings_own_peak_the_plan_recomputes_each_part_once(name):
    """HF's checkpointing of every layer keeps each layer's inputs and the generator state
    torch's checkpoint copies for it (NOTE [ Generator states torch keeps ]); at its measured
    peak the planner's plan fits, measured == predicted, and recomputes no part twice, as HF
    recomputes its layers once: none is nested inside another (benchmarks/hf_checkpointing.py
    times the two side by side)."""
    inputs = inputs_of(name)
    hf = build(name, use_cache=False) if name != "vit" else build(name)
    hf_peak = hf_checkpointing_peak(hf, inputs)
    assert revnets.predict_memory(step, hf, inputs).peak_bytes == hf_peak
    model = build(name, use_cache=False) if name != "vit" else build(name)
    planned = revnets.auto_checkpoint(model, inputs, hf_peak, loss_fn=lambda out: out.loss,
                                      measure_time=False)
    measured = revnets.measure_memory(step, planned, inputs).peak_bytes
    assert measured == planned.memory_plan.peak_bytes <= hf_peak
    inside = revnets.planning.modules.install.is_inside
    parts = [p for part in planned.decisions
             for p in (part if isinstance(part, tuple) else (part,))]
    assert not any(inside(a, b) for a in parts for b in parts if a != b), parts


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "vit", "llama_lora"])
def test_the_least_budget_is_below_hf_checkpointings_peak(name):
    """Each family's least reachable budget (read from the refusal of 1 byte) is below the
    measured peak of transformers' own checkpointing of every layer, and plans there."""
    options = {} if name in ("vit", "bert") else {"use_cache": False}
    made = (lambda: lora(build("llama", **options))) if name == "llama_lora" else (
        lambda: build(name, **options))
    inputs = inputs_of(name)
    hf_peak = hf_checkpointing_peak(made(), inputs)
    model = made()
    least = least_budget(model, inputs, measure_time=False)
    planned = revnets.auto_checkpoint(model, inputs, least, loss_fn=lambda out: out.loss,
                                      measure_time=False)
    assert revnets.measure_memory(step, planned, inputs).peak_bytes <= least < hf_peak


def deep(name: str, **options) -> torch.nn.Module:
    """Eight layers, width 64, a vocabulary of 4096, the cache off (as HF's checkpointing sets
    it): a step that peaks at the logits, where a run of layers pays."""
    t = transformers
    torch.manual_seed(0)
    if name == "llama":
        model = t.LlamaForCausalLM(t.LlamaConfig(
            num_hidden_layers=8, hidden_size=64, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=4096, use_cache=False, **options))
    else:
        model = t.GPT2LMHeadModel(t.GPT2Config(n_layer=8, n_embd=64, n_head=4, vocab_size=4096,
                                               n_positions=128, use_cache=False, **options))
    model.config._attn_implementation = "sdpa"
    return model.train()


@pytest.mark.parametrize("name", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_runs_of_layers_go_below_hf_checkpointing_of_every_layer(name):
    """HF's checkpointing keeps every layer's input; the least budget checkpoints runs of
    layers as one (NOTE [ Runs of modules ]), each run keeping its first layer's input alone:
    measured == predicted below HF's measured peak, and the same plan on the model in float64
    (dropout on) gives the model's gradients."""
    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(1, 4096, (2, 128), generator=g),
              "labels": torch.randint(1, 4096, (2, 128), generator=g)}
    hf_peak = hf_checkpointing_peak(deep(name), inputs)
    model = deep(name)
    least = least_budget(model, inputs, measure_time=False)
    planned = revnets.auto_checkpoint(model, inputs, least, loss_fn=lambda out: out.loss,
                                      measure_time=False)
    assert any(isinstance(part, tuple) for part in planned.decisions)
    measured = revnets.measure_memory(step, planned, inputs).peak_bytes
    assert measured == planned.memory_plan.peak_bytes <= least < hf_peak

    dropout = {"attention_dropout": 0.1} if name == "llama" else {"resid_pdrop": 0.1}
    model = deep(name, **dropout).double()
    reference = copy.deepcopy(model)
    runs = revnets.planning.CheckpointedModules(model, dict(planned.decisions))
    for m in (runs, reference):
        torch.manual_seed(1)
        step(m, inputs)
    assert max_grad_error(model, reference) < 1e-10



def test_a_plan_for_a_compiled_model_has_no_runs():
    """Under torch.compile a run of layers runs eagerly (NOTE [ Plans of modules compiled ]):
    planned with ``compiled=True``, the least budget is reached by parts dynamo traces, each
    one module, and the plan fits it, measured == predicted; above the least budget of the
    eager planner, which runs reach."""
    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(1, 4096, (2, 128), generator=g),
              "labels": torch.randint(1, 4096, (2, 128), generator=g)}
    model = deep("llama")
    eager_least = least_budget(model, inputs, measure_time=False)
    least = least_budget(model, inputs, measure_time=False, compiled=True)
    planned = revnets.auto_checkpoint(model, inputs, least, loss_fn=lambda out: out.loss,
                                      measure_time=False, compiled=True)
    assert all(isinstance(part, str) for part in planned.decisions)
    measured = revnets.measure_memory(step, planned, inputs).peak_bytes
    assert measured == planned.memory_plan.peak_bytes <= least
    assert eager_least < least


def narrow_gpt2(layers: int, **options) -> torch.nn.Module:
    """GPT-2 with width 64 and a vocabulary of 128, its cache off: a step that peaks in one
    layer's recomputation and backward, not at the logits."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=layers, n_embd=64, n_head=4, vocab_size=128, n_positions=64, use_cache=False,
        **options))
    model.config._attn_implementation = "sdpa"
    return model.train()


@pytest.mark.parametrize("layers", [6, pytest.param(16, marks=pytest.mark.slow)])
def test_where_a_layer_peaks_the_least_budget_is_under_075x_of_hf_checkpointing(layers):
    """HF's checkpointing holds one layer's every activation in that layer's backward; the
    least budget checkpoints the attention and the MLP of each layer (6 layers), nested inside
    the layers' own checkpoints where the layers' inputs add up (16 layers: NOTE [ Nested
    checkpoints ]). Trained without optimizer state (SGD's step), the peak above parameters
    and gradients is under 0.75x HF's, measured == predicted; the plan's gradients are the
    model's (float64, dropout on)."""
    g = torch.Generator().manual_seed(0)
    inputs = {"input_ids": torch.randint(1, 128, (2, 64), generator=g),
              "labels": torch.randint(1, 128, (2, 64), generator=g)}
    hf_peak = hf_checkpointing_peak(narrow_gpt2(layers), inputs)
    model = narrow_gpt2(layers)
    state = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    least = least_budget(model, inputs, measure_time=False)
    planned = revnets.auto_checkpoint(model, inputs, least, loss_fn=lambda out: out.loss,
                                      measure_time=False)
    parts = list(planned.decisions)
    nested = any(revnets.planning.modules.install.is_inside(a, b) for a in parts for b in parts)
    assert nested == (layers == 16)
    measured = revnets.measure_memory(step, planned, inputs).peak_bytes
    assert measured == planned.memory_plan.peak_bytes <= least
    assert measured - state < 0.75 * (hf_peak - state)

    model = narrow_gpt2(layers, resid_pdrop=0.1, attn_pdrop=0.1).double()
    reference = copy.deepcopy(model)
    same_plan = revnets.planning.CheckpointedModules(model, dict(planned.decisions))
    for m in (same_plan, reference):
        torch.manual_seed(1)
        step(m, inputs)
    assert max_grad_error(model, reference) < 1e-10


@pytest.mark.slow  # compiles the model (about 20 s)
def test_a_compiled_plan_of_layers_compiles_once_and_traces_its_checkpoints():
    """Under torch.compile each checkpointed layer of Llama (whose attention writes a
    module-level variable of the ``kernels`` package) is traced into the graph, and the plan's
    forwards are the same objects at every step: nothing is compiled after the first step, no
    region falls back to eager, and the gradients are the eager model's to compile's float64
    error, dropout on, its masks drawn as eager draws them (inductor's ``fallback_random``;
    NOTE [ Plans of modules compiled ])."""
    from torch._dynamo.utils import counters

    model = build("llama", use_cache=False, attention_dropout=0.1).double()
    reference = copy.deepcopy(model)
    planned = revnets.planning.CheckpointedModules(model, ["model.layers.0", "model.layers.1"])
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(planned)
    inputs = batch()
    graphs = []
    with torch._inductor.config.patch(fallback_random=True):
        for seed in (1, 2, 3):
            for m in (compiled, reference):
                m.zero_grad(set_to_none=True)
                torch.manual_seed(seed)
                m(**inputs).loss.backward()
            graphs.append(counters["stats"]["unique_graphs"])
            assert max_grad_error(model, reference) < 1e-6
    assert graphs[0] == graphs[1] == graphs[2]
    assert not [reason for reason in counters["graph_break"] if "side effect" in reason]


@pytest.mark.slow  # compiles the model (about 20 s)
def test_a_plan_with_a_run_of_layers_trains_under_torch_compile():
    """A run's checkpoint opens in one layer's call and closes in another's, which dynamo
    cannot trace: its layers run eagerly, the rest compiled, and the step (dropout on) gets
    the eager model's gradients to compile's own float64 error."""
    model = build("llama", use_cache=False, attention_dropout=0.1).double()
    reference = copy.deepcopy(model)
    planned = revnets.planning.CheckpointedModules(
        model, {("model.layers.0", "model.layers.1"): revnets.Checkpoint()})
    compiled = torch.compile(planned)
    inputs = batch()
    for seed in (1, 2):  # the compiled step twice: the second runs the compiled code as it is
        for m in (compiled, reference):
            m.zero_grad(set_to_none=True)
            torch.manual_seed(seed)
            m(**inputs).loss.backward()
        assert max_grad_error(model, reference) < 1e-6
