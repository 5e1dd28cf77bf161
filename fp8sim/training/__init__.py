"""FP8 training path: a tiny byte-level GPT, recipes, FP8 linears, recorder, checkpoints.

Nothing here patches torch: a model -- any ``nn.Module``, e.g. a Hugging Face one -- becomes FP8 by
an explicit ``convert_to_fp8(model, "te-delayed", backend="emulator")``; the FP8-LM recipes, whose
optimizer, gradient communication and weight storage levels need more than the linear layers, by
``fp8sim.training.fp8lm.prepare(model, "fp8lm-o2")``.

The names below are imported on first use (PEP 562): the command line registers ``fp8sim train``
without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fp8sim.lazy_exports import lazy_attributes

#: public name -> the module that defines it
_EXPORTS = {
    "GPT": "fp8sim.training.model",
    "GPTConfig": "fp8sim.training.config",
    "CastConfig": "fp8sim.recipes",
    "LinearRecipe": "fp8sim.recipes",
    "Recipe": "fp8sim.recipes",
    "get_recipe": "fp8sim.recipes",
    "list_recipes": "fp8sim.recipes",
    "register_recipe": "fp8sim.recipes",
    "Fp8Linear": "fp8sim.training.fp8_linear",
    "Fp8State": "fp8sim.training.fp8_state",
    "convert_to_fp8": "fp8sim.training.convert",
    "get_fp8_state": "fp8sim.training.convert",
    "load_fp8_state": "fp8sim.training.pretrained",
    "TrainConfig": "fp8sim.training.config",
    "Trainer": "fp8sim.training.trainer",
    "Recorder": "fp8sim.training.recorder",
    "record": "fp8sim.training.recorder",
}

__all__ = list(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs: the eager imports
    from fp8sim.training.config import GPTConfig, TrainConfig
    from fp8sim.training.convert import convert_to_fp8, get_fp8_state
    from fp8sim.training.pretrained import load_fp8_state
    from fp8sim.training.fp8_linear import Fp8Linear
    from fp8sim.training.fp8_state import Fp8State
    from fp8sim.training.model import GPT
    from fp8sim.recipes import CastConfig, LinearRecipe, Recipe, get_recipe, list_recipes, register_recipe
    from fp8sim.training.recorder import Recorder, record
    from fp8sim.training.trainer import Trainer


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())
