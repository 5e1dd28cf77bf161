"""FP8 training path: a tiny byte-level GPT, recipes, FP8 linears, recorder, checkpoints.

Nothing here patches torch: a model -- any ``nn.Module``, e.g. a Hugging Face one -- becomes FP8 by
an explicit ``convert_to_fp8(model, "te-delayed", backend="emulator")``; the FP8-LM recipes, whose
optimizer, gradient communication and weight storage levels need more than the linear layers, by
``fp8sim.training.fp8lm.prepare(model, "fp8lm-o2")``.
"""

from fp8sim.training.fp8_linear import Fp8Linear, Fp8State, convert_to_fp8, get_fp8_state
from fp8sim.training.model import GPT, GPTConfig
from fp8sim.training.recorder import Recorder, record
from fp8sim.training.recipes import CastConfig, LinearRecipe, Recipe, get_recipe, list_recipes, register_recipe
from fp8sim.training.trainer import TrainConfig, Trainer

__all__ = [
    "GPT",
    "GPTConfig",
    "CastConfig",
    "LinearRecipe",
    "Recipe",
    "get_recipe",
    "list_recipes",
    "register_recipe",
    "Fp8Linear",
    "Fp8State",
    "convert_to_fp8",
    "get_fp8_state",
    "TrainConfig",
    "Trainer",
    "Recorder",
    "record",
]
