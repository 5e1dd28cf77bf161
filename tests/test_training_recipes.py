"""Recipes: built by name, frozen, validated, extensible (the FP8-LM levels register later)."""

import dataclasses

import pytest

from fp8sim.formats import get_format
from fp8sim.training.recipes import CastConfig, LinearRecipe, Recipe, get_recipe, list_recipes, register_recipe


def test_builtin_recipes():
    assert list_recipes()[:5] == ["fp32", "bf16", "te-delayed", "te-current", "mx"]
    assert get_recipe("fp32").linear is None and get_recipe("fp32").autocast is None
    assert get_recipe("bf16").autocast == "bfloat16" and not get_recipe("bf16").is_fp8
    for name in ("te-delayed", "te-current"):
        lin = get_recipe(name).linear
        # Transformer Engine's hybrid format: E4M3 forward operands, E5M2 output gradients
        assert (lin.input.fmt, lin.weight.fmt, lin.grad_output.fmt) == ("e4m3", "e4m3", "e5m2")
        assert lin.weight_grad is None and lin.skip == ("lm_head",)
        assert all(get_format(c.fmt).bits == 8 for c in lin.casts().values())
    assert get_recipe("te-delayed").linear.input.policy.startswith("delayed")
    assert get_recipe("te-current").linear.input.policy == "current"
    mx = get_recipe("mx").linear
    assert {c.granularity for c in mx.casts().values()} == {"mx"}


def test_recipes_are_frozen_and_overridable():
    r = get_recipe("te-delayed")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.name = "x"
    r2 = get_recipe("te-delayed", autocast="bfloat16")
    assert r2.autocast == "bfloat16" and r.autocast is None
    assert r.to_dict()["linear"]["grad_output"]["fmt"] == "e5m2"


def test_recipe_validation():
    with pytest.raises(ValueError, match="unknown recipe 'nope'; valid: fp32"):
        get_recipe("nope")
    with pytest.raises(ValueError, match="optimizer"):
        Recipe("x", "bad", optimizer="sgd")
    with pytest.raises(ValueError, match="granularity"):
        CastConfig(granularity="row-ish")
    with pytest.raises(ValueError, match="already registered"):
        register_recipe("fp32", lambda: get_recipe("fp32"))


def test_fp8lm_style_level_slots_in():
    # what the FP8-LM issue adds: E4M3 weight gradients, FP8 Adam states, FP8 all-reduce
    def o2() -> Recipe:
        cast = CastConfig("e4m3", "current")
        lin = LinearRecipe(cast, cast, CastConfig("e5m2", "current"), weight_grad=CastConfig("e4m3", "autoscale"))
        return Recipe("test-o2", "FP8-LM O2 shape", linear=lin, optimizer="fp8-adamw", grad_comm="fp8")

    from fp8sim.training import recipes

    register_recipe("test-o2", o2)
    try:
        r = get_recipe("test-o2")
        assert r.linear.casts()["weight_grad"].fmt == "e4m3" and r.optimizer == "fp8-adamw"
        assert "test-o2" in list_recipes()
    finally:
        recipes._REGISTRY.pop("test-o2")
