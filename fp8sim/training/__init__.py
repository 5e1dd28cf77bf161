"""FP8 training path: a tiny byte-level GPT, recipes, FP8 linears, recorder, checkpoints.

Nothing here patches torch: a model becomes FP8 by an explicit
``convert_to_fp8(model, get_recipe("te-delayed"), backend="emulator")``.
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
