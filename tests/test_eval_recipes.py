"""Every shipped recipe YAML maps 1:1 onto Recipe."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from quantspec.quant.recipe import Recipe

RECIPES = sorted(p for p in (Path(__file__).resolve().parents[1] / "recipes").glob("*.yaml")
                 if not p.name.startswith("sweep"))
EXPECTED = {"rtn-w4g128", "rtn-w8pc", "gptq-w4g128", "gptq-w3g128", "gptq-w4g64", "awq-w4g128", "awq-gptq-w4g128",
            "smoothquant-w8a8"}


def test_the_recipe_set_is_complete():
    assert EXPECTED <= {p.stem for p in RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_recipe_loads_and_round_trips(path):
    recipe = Recipe.from_yaml(path)
    assert recipe.name == path.stem
    raw = yaml.safe_load(path.read_text())
    assert recipe.scheme.bits == raw["scheme"]["bits"] and recipe.scheme.group_size == raw["scheme"]["group_size"]
    assert Recipe.from_dict(yaml.safe_load(recipe.to_yaml())) == recipe
