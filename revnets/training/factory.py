"""The model a training run names, with the memory plan it asks for: a model of revnets' zoo or
any other timm name (``timm.create_model``), or a Hugging Face model built from the keys of its
config (``name: hf:ViTForImageClassification``, ``hf:GPT2LMHeadModel``, random weights, never
downloaded); and the loss its outputs train with."""

from __future__ import annotations

import importlib
from typing import Any

import timm
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import revnets  # noqa: F401  (registers the zoo with timm)
from revnets.plan import PRESETS, MemoryPlan
from revnets.training.memory_options import MemoryConfigError
from revnets.training.settings import ModelSettings, SettingsError

__all__ = ["HF_PREFIX", "correct_of", "create_model", "logits_of", "loss_of", "memory_plan_of"]

HF_PREFIX = "hf:"  # model.name=hf:<a transformers class>: built from its config's keys


def create_model(
    model: ModelSettings, num_classes: int, device: torch.device | str = "cpu",
    memory: MemoryPlan | None = None, image_size: int | None = None, tokens: bool = False,
) -> nn.Module:
    """The model ``model.name`` under ``memory`` (None: the model's own plan). For a timm name,
    ``exact`` and every other key of the model group (``+model.units=[2,2,2]``) are keywords
    of its builder; for ``hf:<class>``, keys of the class's config (its images
    ``image_size`` x ``image_size``; with ``tokens``, a language model of ``num_classes``
    tokens). Only the zoo's models follow presets other than ``none``; any model is planned
    under a budget with ``memory=auto``."""
    if tokens and not model.name.startswith(HF_PREFIX):
        raise SettingsError(
            f"model={model.name} with text (data of tokens): text trains a Hugging Face causal "
            f"language model, e.g. model=hf_gpt2 (hf:GPT2LMHeadModel) or model=hf_llama")
    with torch.device(device):
        if model.name.startswith(HF_PREFIX):
            built = _hugging_face(model, num_classes, image_size, tokens)
        else:
            built = timm.create_model(
                model.name, num_classes=num_classes, drop_rate=model.drop_rate,
                **({"exact": True} if model.exact else {}), **model.keywords,
            )
        if memory is None:
            return built
        if not hasattr(built, "set_memory"):
            if memory == PRESETS["none"]:
                return built  # what a model outside the zoo does anyway
            raise MemoryConfigError(
                f"model={model.name} is not a model of revnets' zoo and follows no preset but "
                f"none: plan it within a budget with memory=auto memory.budget=<bytes or a "
                f"size such as 64MiB>")
        try:  # on the weights as built; a refusal names the presets the model can follow
            built.set_memory(memory)
        except ValueError as error:
            raise MemoryConfigError(f"model={model.name}: {error}") from None
    return built


def memory_plan_of(model: nn.Module) -> MemoryPlan:
    """The plan ``model`` follows: a planned model's ``memory_plan``, the zoo's ``memory``, or
    none (every activation stored) for any other."""
    plan = getattr(model, "memory_plan", None) or getattr(model, "memory", None)
    return plan if isinstance(plan, MemoryPlan) else PRESETS["none"]


def logits_of(output: Any) -> Tensor:
    """A model's logits: the tensor itself, or a Hugging Face output's ``logits``."""
    return output if isinstance(output, Tensor) else output.logits


def loss_of(logits: Tensor, targets: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy of ``logits`` against ``targets``, in float32: one class per sample
    (logits N x C) or per token (N x T x V against N x T next tokens)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction=reduction)


def correct_of(logits: Tensor, targets: Tensor) -> Tensor:
    """How many of ``targets`` (samples or tokens) the logits rank first."""
    return (logits.argmax(-1) == targets).sum()


def _hugging_face(model: ModelSettings, num_classes: int, image_size: int | None,
                  tokens: bool) -> nn.Module:
    name = model.name[len(HF_PREFIX):]
    try:
        transformers = importlib.import_module("transformers")
    except ImportError:
        raise SettingsError(f"model.name={model.name} needs transformers: pip install "
                            f"'revnets[hf]'") from None
    cls = getattr(transformers, name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module) and hasattr(cls, "config_class")):
        raise SettingsError(f"model.name={model.name}: transformers has no model class {name!r}; "
                            f"name one, e.g. hf:ViTForImageClassification or hf:GPT2LMHeadModel")
    auto = importlib.import_module("transformers.models.auto.modeling_auto")
    language = name in {*auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values(),
                        *auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES.values()}
    if tokens != language:
        raise SettingsError(
            f"model={model.name} with "
            + ("text (data of tokens): text trains a causal language model, e.g. "
               "model=hf_gpt2 (hf:GPT2LMHeadModel) or model=hf_llama" if tokens else
               "images: a language model takes tokens, e.g. data=text"))
    if model.exact or model.drop_rate:
        raise SettingsError(f"model.name={model.name}: model.exact and model.drop_rate are the "
                            f"zoo's keys; set the config's own, e.g. "
                            f"+model.hidden_dropout_prob=0.1")
    sizes = {} if image_size is None else {"image_size": image_size}
    classes = {"vocab_size": num_classes} if tokens else {"num_labels": num_classes}
    try:
        config = cls.config_class(**{**sizes, **model.keywords, **classes})
    except (TypeError, ValueError) as error:
        raise SettingsError(f"model.name={model.name}: its config refuses the model group's keys "
                            f"({error})") from None
    built = cls(config)
    if tokens and built.device.type != "meta":
        _check_causal(built, model.name, num_classes)
    return built


def _check_causal(model: nn.Module, name: str, vocabulary: int) -> None:
    """Refuse a language model whose logits at a position change with a later token: trained
    on the next byte, it would read the answer (a masked LM, a decoder class built as an
    encoder). Tried on 8 tokens, without grad, in eval mode, drawing from no shared generator."""
    tokens = torch.randint(0, vocabulary, (1, 8), generator=torch.Generator().manual_seed(0))
    changed = tokens.clone()
    changed[0, -1] = (tokens[0, -1] + 1) % vocabulary
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits, other = (logits_of(model(t.to(model.device))) for t in (tokens, changed))
    finally:
        model.train(training)
    if not torch.equal(logits[:, :-1], other[:, :-1]):
        raise SettingsError(
            f"model.name={name} sees later tokens: its logits at a position change with the "
            f"next one, which data=text asks it to predict; name a causal language model (e.g. "
            f"hf:GPT2LMHeadModel), or build a decoder class as one (+model.is_decoder=true)")
