"""Every shipped recipe YAML maps 1:1 onto Recipe."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from quantspec.quant.recipe import Recipe

RECIPES = sorted(p for p in (Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml")
                 if not p.name.startswith("sweep"))
# the float schemes' recipes, each the recipe its CLI flags build (so --recipe NAME and the flags agree)
FLOAT_RECIPES = {
    "rtn-fp8-dynamic": ["--method", "rtn", "--scheme", "fp8-dynamic"],
    "rtn-fp8-static": ["--method", "rtn", "--scheme", "fp8-static"],
    "rtn-fp8-block": ["--method", "rtn", "--scheme", "fp8-block"],
    "rtn-nvfp4": ["--method", "rtn", "--scheme", "nvfp4"],
    "rtn-mxfp4": ["--method", "rtn", "--scheme", "mxfp4"],
    "gptq-nvfp4": ["--method", "gptq", "--scheme", "nvfp4"],
    "gptq-mxfp4": ["--method", "gptq", "--scheme", "mxfp4"],
    "gptq-nvfp4-kv-fp8": ["--method", "gptq", "--scheme", "nvfp4", "--kv-cache", "fp8"],
}
EXPECTED = {"rtn-w4g128", "rtn-w8pc", "gptq-w4g128", "gptq-w3g128", "gptq-w4g64", "awq-w4g128", "awq-gptq-w4g128",
            "smoothquant-w8a8", *FLOAT_RECIPES}


def test_the_recipe_set_is_complete():
    assert EXPECTED <= {p.stem for p in RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_and_round_trips(path):
    recipe = Recipe.from_yaml(path)
    assert recipe.name == path.stem
    raw = yaml.safe_load(path.read_text())
    assert recipe.scheme.bits == raw["scheme"]["bits"] and recipe.scheme.group_size == raw["scheme"]["group_size"]
    assert Recipe.from_dict(yaml.safe_load(recipe.to_yaml())) == recipe


@pytest.mark.parametrize("name", sorted(FLOAT_RECIPES))
def test_float_recipe_is_what_its_flags_build(name):
    from dataclasses import replace

    from quantspec.cli.main import build_parser
    from quantspec.cli.quantize import recipe_from_args

    parser = build_parser()
    by_flags = recipe_from_args(parser.parse_args(["quantize", "m", *FLOAT_RECIPES[name]]))
    by_name = recipe_from_args(parser.parse_args(["quantize", "m", "--recipe", name]))
    assert by_name.name == name and replace(by_flags, name=name) == by_name
