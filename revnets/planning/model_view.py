"""What the planner returns around a user's model: a module that is that model to everything
except its forward.

# NOTE [ A planned model is the model ]
# ``auto_checkpoint`` hands back a module that runs a plan in training steps. Everything else a
# training codebase does with a model walks its modules: saves and loads its state_dict (and
# resumes from it after planning again at another budget), builds optimizer groups from
# ``named_parameters`` (timm's ``no_weight_decay`` names), moves and casts it (``.to``,
# ``.half()``, ``channels_last``), switches train and eval, wraps it in DDP or FSDP. A wrapper
# that registered the plan (or the model) as a submodule gave all of these other names, which
# depended on the plan (``plan.0.module.0.module.weight``), held second references to tensors a
# graph reads directly, which a move replaced in the model alone (eval read the old buffer),
# and hid the model's own attributes. So the returned module shares the model's tables of
# parameters, buffers, submodules and state-dict hooks (the same dict objects), delegates
# ``_apply``, ``train`` and the model's own state-dict methods to it, and answers for
# attributes it lacks with the model's (``pretrained_cfg``, ``forward_features``). The plan is
# held unregistered: no name reaches a tensor through it. Attributes the model has are set on
# it, and ``apply`` reaches the model itself. Steps that read a tensor of the model directly
# (a traced graph's ``get_attr``: a parameter, a buffer, a plain attribute) follow the
# model's tensor of that name at each training step and after each move, so a replaced
# tensor (``load_state_dict(..., assign=True)``, ``model.scale = torch.tensor(2.0)``) is read
# as the model reads it. The planner's exact predictions are of this module too, so a plan's
# peak counts every tensor the model holds, those the plan never reads included (timm's
# EVA-02 rope buffers, which a trace folds into constants: predicted from the chain alone,
# they were measured on top of the plan). The view's own names (``model``, a planned model's
# ``plan`` and ``memory``) are the model's where it has an attribute of that name (a
# LightningModule's ``self.model``, the zoo's ``memory``): code written for the model reads
# what it reads there. ``ModelView.model_of`` and ``PlannedModel.plan_of`` reach the view's
# always, and ``memory_plan`` is the view's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["ModelView"]

# The tables nn.Module keeps its tensors, submodules and state-dict hooks in, shared with the
# model (NOTE [ A planned model is the model ]); forward hooks stay the view's own, since they
# wrap the view's forward.
_SHARED = (
    "_parameters", "_buffers", "_non_persistent_buffers_set", "_modules", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


class ModelView(nn.Module):
    """``model`` itself to everything that walks modules or their state (NOTE [ A planned model
    is the model ]); subclasses define what its forward runs."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._model = (model,)  # unregistered: its tables are this module's own
        for table in _SHARED:
            self.__dict__[table] = model.__dict__[table]
        self._version = type(model)._version  # the state_dict's metadata, as the model's
        self.training = model.training

    @property
    def model(self) -> nn.Module:
        """The model this view wraps, or its own ``model`` where it has one (NOTE [ A planned
        model is the model ]): ``ModelView.model_of`` is always the model wrapped."""
        return self.models_own("model", self._model[0])

    @staticmethod
    def model_of(view: ModelView) -> nn.Module:
        """The model ``view`` wraps, whatever attributes that model has."""
        return view._model[0]

    def models_own(self, name: str, own: Any) -> Any:
        """The model's attribute ``name`` where it has one, else the view's ``own``."""
        model = self._model[0]
        if name in vars(model) or name in model._modules or name in model._parameters or (
                name in model._buffers or hasattr(type(model), name)):
            return getattr(model, name)
        return own

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # Not the model's copy and pickle protocols (its __deepcopy__ would copy the model
            # alone), nor _model before it is set (unpickling).
            if name.startswith("__") or name == "_model":
                raise
            return getattr(self._model[0], name)

    def __setattr__(self, name: str, value: Any) -> None:
        # An attribute the model has and this module does not is the model's to change (a
        # temperature, a constant its forward reads): set here, the model would never see it.
        model = self.__dict__.get("_model", (None,))[0]
        if name not in self.__dict__ and model is not None and (
                name in vars(model) or hasattr(type(model), name)) and not hasattr(
                type(self), name):
            setattr(model, name, value)
        else:
            super().__setattr__(name, value)

    def apply(self, fn: Callable[[nn.Module], None]) -> ModelView:
        self._model[0].apply(fn)  # the model among the modules fn sees (an init keyed on its type)
        return self

    def train(self, mode: bool = True) -> ModelView:
        self.training = mode
        self._model[0].train(mode)
        return self

    def _apply(self, fn: Callable[..., Any], recurse: bool = True) -> ModelView:
        self._model[0]._apply(fn, recurse)
        return self

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        self._model[0]._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._model[0]._load_from_state_dict(*args, **kwargs)
