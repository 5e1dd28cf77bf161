"""Recipes: typed families built by name, frozen, validated; today's spellings still work for one
release with a DeprecationWarning naming the new one."""

import dataclasses

import pytest

from fp8sim.formats import Rounding, get_format
from fp8sim.granularity import E8M0Rule, Granularity
from fp8sim.recipes import (AmaxAlgo, Autocast, BlockScalingRecipe, CastConfig, CurrentScalingRecipe, CustomRecipe,
                            DelayedScalingRecipe, Fp8Grads, FP8LMRecipe, GemmRule, Gemms, GradComm, GradScaling,
                            HighPrecision, LinearRecipe, MXRecipe, NVFP4Recipe, Optimizer, Recipe, TorchaoRecipe,
                            get_recipe, list_recipes, register_recipe)
from fp8sim.scaling_config import (AutoScaleConfig, CurrentScalingConfig, DelayedScalingConfig, MSAMPScalingConfig,
                                   StaticScalingConfig)

E4M3, E5M2, E2M1 = get_format("e4m3"), get_format("e5m2"), get_format("e2m1")


def test_every_builtin_name_builds_its_family():
    want = {"fp32": HighPrecision, "bf16": HighPrecision, "te-delayed": DelayedScalingRecipe,
            "te-current": CurrentScalingRecipe, "mx": MXRecipe, "te-block": BlockScalingRecipe, "nvfp4": NVFP4Recipe,
            "nvfp4-no-rht": NVFP4Recipe, "nvfp4-no-sr": NVFP4Recipe, "nvfp4-no-rht-no-sr": NVFP4Recipe,
            "fp8lm-o1": FP8LMRecipe, "fp8lm-o2": FP8LMRecipe, "fp8lm-o3": FP8LMRecipe,
            "torchao-tensorwise": TorchaoRecipe, "torchao-rowwise": TorchaoRecipe,
            "torchao-rowwise-gw-hp": TorchaoRecipe}
    assert list_recipes() == list(want)
    for name, family in want.items():
        r = get_recipe(name)
        assert type(r) is family and r.name == name and r.description


def test_te_recipes_are_transformer_engines_defaults():
    assert get_recipe("fp32").linear is None and get_recipe("fp32").autocast is None
    assert get_recipe("bf16").autocast is Autocast.BF16 and not get_recipe("bf16").is_fp8
    delayed = DelayedScalingConfig(history=16, algo=AmaxAlgo.MAX, margin=0.0)
    assert get_recipe("te-delayed").linear == LinearRecipe(CastConfig(E4M3, delayed), CastConfig(E4M3, delayed),
                                                           CastConfig(E5M2, delayed))
    cur = CurrentScalingConfig()
    assert get_recipe("te-current").linear == LinearRecipe(CastConfig(E4M3, cur), CastConfig(E4M3, cur),
                                                           CastConfig(E5M2, cur))
    mx = Granularity.mx(E8M0Rule.RCEIL)  # TE and cuBLAS round the E8M0 scale up
    assert get_recipe("mx").linear == LinearRecipe(*(CastConfig(E4M3, granularity=mx),) * 3)
    pow2 = CurrentScalingConfig(pow2=True)  # TE Float8BlockScaling: E4M3, pow2 scales, 1x128 / 128x128
    assert get_recipe("te-block").linear == LinearRecipe(
        CastConfig(E4M3, pow2, Granularity.blocks(1, 128)), CastConfig(E4M3, pow2, Granularity.blocks(128, 128)),
        CastConfig(E4M3, pow2, Granularity.blocks(1, 128)))
    for lin in (get_recipe(n).linear for n in ("te-delayed", "te-current", "mx", "te-block")):
        assert lin.skip == ("lm_head",) and lin.gemm_rule is GemmRule.EXACT and lin.gemms == Gemms()


def test_nvfp4_and_fp8lm_recipes():
    one_d, two_d = Granularity.nvfp4("1x16"), Granularity.nvfp4("16x16")
    assert get_recipe("nvfp4").linear == LinearRecipe(
        CastConfig(E2M1, granularity=one_d, rht=True), CastConfig(E2M1, granularity=two_d),
        CastConfig(E2M1, granularity=one_d, rounding=Rounding.STOCHASTIC, rht=True))
    assert get_recipe("nvfp4-no-rht-no-sr").linear.grad_output == CastConfig(E2M1, granularity=one_d)
    act, w = MSAMPScalingConfig(window=16), MSAMPScalingConfig(window=1)
    for level in (1, 2, 3):
        r = get_recipe(f"fp8lm-o{level}")
        assert r.linear.casts() == {"activation": CastConfig(E4M3, act), "weight": CastConfig(E4M3, w),
                                    "grad_output": CastConfig(E5M2, act), "weight_grad": CastConfig(E4M3, w)}
        assert r.grad_comm is GradComm.FP8 and r.grad_scaling is GradScaling.AUTOSCALE and r.fp8_grads is Fp8Grads.ALL
        assert r.optimizer is (Optimizer.ADAMW if level == 1 else Optimizer.FP8_ADAMW)
        assert (r.weight_storage == "fp8") == (level == 3) and not r.single_process
    assert get_recipe("te-delayed").single_process and get_recipe("te-delayed").fp8_grads is Fp8Grads.LINEAR


def test_recipes_are_frozen_and_overridable_at_the_edge():
    r = get_recipe("te-delayed")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "x"
    r2 = get_recipe("te-delayed", autocast="bfloat16", amax_history_len=32, amax_compute_algo="most_recent")
    assert r2.autocast is Autocast.BF16 and r.autocast is None
    assert r2.linear.input.scaling == DelayedScalingConfig(32, AmaxAlgo.MOST_RECENT)
    assert r.to_dict()["linear"]["grad_output"]["format"] == "e5m2"
    assert r.to_dict()["linear"]["activation"]["policy"] == "delayed:history=16,algo=max,margin=0"
    with pytest.raises(ValueError, match="no field 'history'; valid: name, autocast"):
        get_recipe("te-delayed", history=3)
    with pytest.raises(ValueError, match="amax_compute_algo must be one of max, most_recent"):
        get_recipe("te-delayed", amax_compute_algo="mean")
    assert get_recipe(r) is r


def test_recipe_validation_names_the_field():
    with pytest.raises(ValueError, match="unknown recipe 'nope'; valid: fp32"):
        get_recipe("nope")
    with pytest.raises(ValueError, match="optimizer must be one of adamw, fp8-adamw"):
        CustomRecipe("x", optimizer="sgd")
    with pytest.raises(TypeError, match="CastConfig.fmt must be a FloatFormat"):
        CastConfig(3)
    with pytest.raises(TypeError, match="CastConfig.granularity must be a Granularity"):
        CastConfig(E4M3, granularity=("row",))
    with pytest.raises(TypeError, match="CurrentScalingConfig.pow2 must be True or False"):
        CurrentScalingConfig(pow2="no")
    with pytest.raises(TypeError, match="DelayedScalingConfig.history must be an integer"):
        DelayedScalingConfig(history=1.5)
    with pytest.raises(ValueError, match="takes its block scales just in time"):
        CastConfig(E4M3, DelayedScalingConfig(), Granularity.blocks(1, 128))
    with pytest.raises(ValueError, match="casts to e2m1"):
        CastConfig(E4M3, granularity=Granularity.nvfp4())
    with pytest.raises(ValueError, match="level must be 1, 2 or 3"):
        FP8LMRecipe(level=4)
    with pytest.raises(ValueError, match="all be per-tensor scaled or all"):
        LinearRecipe(CastConfig(E4M3), CastConfig(E4M3, granularity=Granularity.mx()), CastConfig(E4M3))


def test_a_custom_recipe_holds_its_levels_as_typed_fields():
    lin = LinearRecipe(CastConfig(E4M3, CurrentScalingConfig(pow2=True)), CastConfig(E4M3),
                       CastConfig(E5M2, DelayedScalingConfig(history=4, margin=1)),
                       weight_grad=CastConfig(E4M3, AutoScaleConfig()), gemm_rule=GemmRule.ACCUMULATOR)
    r = CustomRecipe("my-o2", description="FP8-LM O2 shape", linear=lin, optimizer="fp8-adamw", grad_comm="fp8",
                     fp8_grads="all")
    assert r.optimizer is Optimizer.FP8_ADAMW and r.grad_comm is GradComm.FP8 and r.fp8_grads is Fp8Grads.ALL
    assert r.gemm_rule is GemmRule.ACCUMULATOR and r.linear is lin and not r.single_process
    assert r.to_dict()["linear"]["weight_grad"]["policy"].startswith("autoscale:")


# -- today's spellings: one more release, with a word -----------------------------------------------


def test_legacy_cast_config_strings_warn_and_mean_the_same():
    with pytest.warns(DeprecationWarning, match="CastConfig with string fmt, scaling.*CastConfig\\(get_format"):
        old = CastConfig("e4m3", "current:pow2", granularity="block:1x128")
    assert old == CastConfig(E4M3, CurrentScalingConfig(pow2=True), Granularity.blocks(1, 128))
    with pytest.warns(DeprecationWarning):
        assert CastConfig("e4m3", "mx:rceil", granularity="mx").granularity == Granularity.mx("rceil")
    with pytest.warns(DeprecationWarning):
        assert CastConfig("e5m2", "static:scale=2").scaling == StaticScalingConfig(2.0)
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="unknown granularity 'row-ish'"):
        CastConfig("e4m3", granularity="row-ish")


def test_legacy_recipe_constructor_register_and_extra_warn():
    lin = LinearRecipe(CastConfig(E4M3), CastConfig(E4M3), CastConfig(E5M2))
    with (pytest.warns(DeprecationWarning, match=r"Recipe\(name, description.*use CustomRecipe"),
          pytest.warns(DeprecationWarning, match="extra=.*pass grad_scaling= and fp8_grads=")):
        old = Recipe("my-pow2", "pow2 current scaling", linear=lin, optimizer="fp8-adamw", grad_comm="fp8",
                     extra=(("grad_scaling", "msamp"), ("fp8_grads", "all")))
    assert isinstance(old, CustomRecipe) and isinstance(old, Recipe)
    assert old.description == "pow2 current scaling" and old.grad_scaling is GradScaling.MSAMP
    assert old.fp8_grads is Fp8Grads.ALL and old.optimizer is Optimizer.FP8_ADAMW
    with pytest.warns(DeprecationWarning, match="Recipe.extra"):
        assert dict(get_recipe("fp8lm-o1").extra) == {"grad_scaling": "autoscale", "fp8_grads": "all"}
    from fp8sim import recipes

    with pytest.warns(DeprecationWarning, match="pass the recipe object itself"):
        register_recipe("test-legacy", lambda: old)
    try:
        assert get_recipe("test-legacy") is old and "test-legacy" in list_recipes()
        with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="already registered"):
            register_recipe("fp32", lambda: get_recipe("fp32"))
    finally:
        recipes._REGISTRY.pop("test-legacy")


def test_the_docs_recipe_example_runs_as_written(tmp_path, monkeypatch):
    import re
    import warnings
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    section = doc[doc.index("### Recipe objects"):doc.index("### GEMM rules")]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    monkeypatch.chdir(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling: no deprecation
        scope: dict = {}
        exec(compile(code, "docs/training.md", "exec"), scope)
    assert type(scope["model"]["body"]).__name__ == "Fp8Linear" and type(scope["model"]["head"]).__name__ == "Linear"
    assert scope["te"].linear.input.scaling.history == 1024 and scope["te"].autocast == "bfloat16"
    assert scope["blocks"].linear.weight.granularity == Granularity.blocks(1, 128)
