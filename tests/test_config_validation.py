"""Bad input in recipes, checkpoint quantization_configs, model config.json files and quantize
flags: a one-line QuantspecError naming the field, the value and the fix, before any long work."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
from helpers import make_tiny_model

from quantspec.cli.main import build_parser, main
from quantspec.core.scheme import QuantScheme
from quantspec.errors import QuantspecError
from quantspec.quant.recipe import Recipe


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")  # max_position_embeddings 512


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and err.count("\n") == 0 and "error:" in err and "Fix:" in err, err
    return err


# --- recipes: every field type-checked when the recipe is built --------------------------------

@pytest.mark.parametrize("data,needle", [
    ({"method": ["rtn"]}, "recipe.method=['rtn'] is not a string"),
    ({"method": "rtn", "scheme": {"symmetric": "no"}}, "recipe.scheme.symmetric='no' is not true or false"),
    ({"method": "rtn", "scheme": {"symmetric": 1}}, "recipe.scheme.symmetric=1 is not true or false"),
    ({"method": "rtn", "scheme": {"bits": True}}, "recipe.scheme.bits=True is not an integer"),
    ({"method": "rtn", "scheme": {"bits": "4"}}, "recipe.scheme.bits='4' is not an integer"),
    ({"method": "smoothquant", "format": "compressed-tensors", "smoothquant": {"alpha": "x"}},
     "recipe.smoothquant.alpha='x' is not a number"),
    ({"method": "awq", "format": "awq", "awq": {"clip": "maybe"}}, "recipe.awq.clip='maybe' is not true or false"),
    ({"method": "awq", "format": "awq", "awq": {"grid": 20.0}}, "recipe.awq.grid=20.0 is not an integer"),
    ({"name": ["x"]}, "recipe.name=['x'] is not a string"),
    ({"calibration": {"samples": 64.0}}, "recipe.calibration.samples=64.0 is not an integer"),
    ({"calibration": {"data": 7}}, "recipe.calibration.data=7 is not a string"),
    ({"gptq": {"damp_percent": "0.01"}}, "recipe.gptq.damp_percent='0.01' is not a number"),
    ({"format": "compressed-tensors", "kv_cache": {"search_samples": "8"}},
     "recipe.kv_cache.search_samples='8' is not an integer"),
    ({"ignore": ["lm_head", 3]}, "recipe.ignore=('lm_head', 3) is not a list"),
])
def test_recipe_field_of_the_wrong_type_is_refused_when_built(data, needle):
    with pytest.raises(QuantspecError) as e:
        Recipe.from_dict(data)
    assert needle in e.value.problem and e.value.fix


def test_recipe_built_in_python_is_type_checked_too():
    with pytest.raises(QuantspecError, match=r"recipe.scheme.symmetric=1 is not true or false"):
        Recipe(method="rtn", scheme=QuantScheme(bits=4, group_size=32, symmetric=1))


def test_recipe_numbers_and_nulls_of_the_right_type_are_kept():
    r = Recipe.from_dict({"method": "smoothquant", "format": "compressed-tensors", "smoothquant": {"alpha": 1},
                          "gptq": {"single_pass_gb": 8, "damp_percent": 0.05}, "awq": {"clip": None},
                          "calibration": {"samples": None, "seqlen": 256}})
    assert (r.smoothquant.alpha, r.gptq.single_pass_gb, r.awq.clip, r.calibration.seqlen) == (1, 8, None, 256)


def test_recipe_yaml_of_the_wrong_type_exits_2_before_the_model_loads(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_text('method: rtn\nscheme: {symmetric: "no"}\n')
    assert main(["quantize", "no-such-model", "--recipe", str(tmp_path / "r.yaml"), "--out", "o"]) == 2
    assert "recipe.scheme.symmetric='no'" in _one_line_error(capsys)


# --- a recipe without a name is named after what it holds -----------------------------------------

def test_unnamed_recipe_is_named_after_its_method_and_scheme(tmp_path):
    from quantspec.quant.pipeline import default_out

    (tmp_path / "r.yaml").write_text("method: rtn\nscheme: {bits: 8, group_size: -1}\n")
    r = Recipe.from_yaml(tmp_path / "r.yaml")
    assert r.name == "rtn-w8gpc"
    assert "name: rtn-w8gpc" in r.to_yaml()
    assert default_out("tiny", r) == Path("quantspec-out") / "tiny-rtn-w8gpc"
    assert Recipe.from_dict({"name": "mine", "method": "rtn"}).name == "mine"  # a given name is kept


def test_unnamed_recipe_with_only_calibration_flags_keeps_its_derived_name(tmp_path):
    from quantspec.cli.quantize import recipe_from_args

    (tmp_path / "r.yaml").write_text("method: awq\nformat: awq\nscheme: {bits: 4, group_size: 64, symmetric: false}\n")
    args = build_parser().parse_args(["quantize", "m", "--recipe", str(tmp_path / "r.yaml"), "--calib-samples", "8"])
    assert recipe_from_args(args).name == "awq-w4g64-asym"


# --- quantize flags -----------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [["--bits", "4"], ["--group-size", "32"], ["--no-sym"], ["--sym"],
                                   ["--bits", "4", "--group-size", "32", "--no-sym"]])
def test_w8a8_with_explicit_scheme_flags_is_refused(extra):
    from quantspec.cli.quantize import recipe_from_args

    args = build_parser().parse_args(["quantize", "m", "--method", "rtn", "--w8a8", *extra])
    with pytest.raises(QuantspecError) as e:
        recipe_from_args(args)
    assert "--w8a8" in e.value.problem and extra[0] in e.value.problem and "drop" in e.value.fix


def test_w8a8_alone_still_gives_w8a8():
    from quantspec.cli.quantize import recipe_from_args

    r = recipe_from_args(build_parser().parse_args(["quantize", "m", "--method", "rtn", "--w8a8"]))
    assert r.scheme.short_name == "w8a8" and r.format == "compressed-tensors"


@pytest.mark.parametrize("argv,needle", [
    (["--kv-search-samples", "0"], "--kv-search-samples needs --kv-cache"),
    (["--kv-search-samples", "3"], "--kv-search-samples needs --kv-cache"),
    (["--kv-cache", "fp8", "--kv-search-samples", "0"], "search_samples must be >= 1, got 0"),
])
def test_kv_search_samples_zero_is_not_dropped(argv, needle):
    from quantspec.cli.quantize import recipe_from_args

    with pytest.raises(QuantspecError, match=needle):
        recipe_from_args(build_parser().parse_args(["quantize", "m", "--method", "rtn", *argv]))


def test_kv_search_samples_reach_the_recipe():
    from quantspec.cli.quantize import recipe_from_args

    r = recipe_from_args(build_parser().parse_args(["quantize", "m", "--method", "rtn", "--kv-cache", "int8",
                                                    "--kv-search-samples", "3"]))
    assert r.kv_cache.search_samples == 3


# --- checkpoint quantization_configs: the fields the readers take are type-checked ---------------

def _gptq() -> dict:
    from quantspec.formats import GPTQFormat

    return GPTQFormat().quantization_config(QuantScheme(bits=4, group_size=32, symmetric=False), ["lm_head"])


def _awq() -> dict:
    from quantspec.formats import AWQFormat

    return AWQFormat().quantization_config(QuantScheme(bits=4, group_size=32, symmetric=False), ["lm_head"])


def _ct(scheme: QuantScheme) -> dict:
    from quantspec.formats import CompressedTensorsFormat

    return CompressedTensorsFormat().quantization_config(scheme, ["lm_head"])


def _ct_weights(**fields) -> dict:
    cfg = _ct(QuantScheme(bits=4, group_size=32, symmetric=False))
    cfg["config_groups"]["group_0"]["weights"].update(fields)
    return cfg


def _ct_acts(scheme: QuantScheme, **fields) -> dict:
    cfg = _ct(scheme)
    cfg["config_groups"]["group_0"]["input_activations"].update(fields)
    return cfg


def _fp8_weights(**fields) -> dict:
    cfg = _ct(QuantScheme(bits=8, group_size=-1, weights="fp8"))
    cfg["config_groups"]["group_0"]["weights"].update(fields)
    return cfg


W8A8 = QuantScheme(bits=8, group_size=-1, activations="int8-token-dynamic")
FP8_DYNAMIC = QuantScheme(bits=8, group_size=-1, weights="fp8", activations="fp8-token-dynamic")


@pytest.mark.parametrize("qcfg,needle", [
    ({**_gptq(), "bits": "four"}, "bits='four' is not an integer"),
    ({**_gptq(), "bits": 4.0}, "bits=4.0 is not an integer"),
    ({**_gptq(), "group_size": "32"}, "group_size='32' is not an integer"),
    ({**_gptq(), "sym": "false"}, "sym='false' is not true or false"),
    ({**_gptq(), "sym": 0}, "sym=0 is not true or false"),
    ({**_gptq(), "desc_act": "true"}, "desc_act='true' is not true or false"),
    ({**_gptq(), "static_groups": "no"}, "static_groups='no' is not true or false"),
    ({**_gptq(), "lm_head": "false"}, "lm_head='false' is not true or false"),
    ({**_gptq(), "dynamic": {r"+:.*\.0\.mlp\..*": {"sym": "false"}}}, "sym='false' is not true or false"),
    ({**_awq(), "bits": "4"}, "bits='4' is not an integer"),
    ({**_awq(), "zero_point": "false"}, "zero_point='false' is not true or false"),
    ({**_awq(), "group_size": 32.0}, "group_size=32.0 is not an integer"),
    (_ct_weights(num_bits="4"), "num_bits='4' is not an integer"),
    (_ct_weights(symmetric="false"), "symmetric='false' is not true or false"),
    (_ct_weights(group_size="32"), "group_size='32' is not an integer"),
    (_ct_acts(W8A8, symmetric="true"), "symmetric='true' is not true or false"),
    (_ct_acts(W8A8, num_bits="8"), "num_bits='8' is not an integer"),
    (_fp8_weights(num_bits="8"), "num_bits='8' is not an integer"),
    (_fp8_weights(symmetric="false"), "symmetric='false' is not true or false"),
    (_ct_acts(FP8_DYNAMIC, symmetric="false"), "symmetric='false' is not true or false"),
    ({**_ct(QuantScheme(bits=4, group_size=32)), "kv_cache_scheme": {
        "num_bits": 8, "type": "float", "symmetric": "false", "strategy": "tensor", "dynamic": False}},
     "symmetric='false' is not true or false"),
])
def test_quantization_config_field_of_the_wrong_type_is_refused(qcfg, needle):
    from quantspec.formats.overrides import read_with_overrides

    with pytest.raises(QuantspecError) as e:
        read_with_overrides(copy.deepcopy(qcfg))
    assert needle in e.value.problem and "config.json" in e.value.fix


def test_quantization_configs_of_the_right_types_still_read():
    from quantspec.formats.overrides import read_with_overrides

    assert read_with_overrides(_gptq())[1].scheme == QuantScheme(bits=4, group_size=32, symmetric=False)
    assert read_with_overrides(_awq())[1].scheme == QuantScheme(bits=4, group_size=32, symmetric=False)
    assert read_with_overrides(_ct(W8A8))[1].scheme == W8A8
    assert read_with_overrides(_ct(FP8_DYNAMIC))[1].scheme == FP8_DYNAMIC
    assert read_with_overrides({**_gptq(), "desc_act": None})[1].scheme.act_order is False  # null: unset


def test_checkpoint_with_a_string_sym_is_refused_by_inspect_and_generate(tiny, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", str(tiny), "--method", "rtn", "--bits", "4", "--group-size", "32", "--no-sym",
                 "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["sym"] = "false"
    (out / "config.json").write_text(json.dumps(config))
    (out / "quantspec.checksums.json").unlink()  # checksums are verified first
    assert main(["inspect", str(out)]) == 2
    assert "sym='false' is not true or false" in _one_line_error(capsys)
    assert main(["generate", str(out), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    assert "sym='false' is not true or false" in _one_line_error(capsys)


# --- model config.json ----------------------------------------------------------------------------

def _copy_with_config(tiny: Path, dest: Path, text: str) -> Path:
    shutil.copytree(tiny, dest)
    (dest / "config.json").write_text(text)
    return dest


def test_model_config_with_an_invalid_value_exits_2_naming_the_file(tiny, tmp_path, capsys):
    config = json.loads((tiny / "config.json").read_text())
    bad = _copy_with_config(tiny, tmp_path / "bad", json.dumps({**config, "hidden_size": -5}))
    for streaming in ("--streaming", "--no-streaming"):
        assert main(["quantize", str(bad), "--method", "rtn", "--out", str(tmp_path / "o"), streaming]) == 2
        err = _one_line_error(capsys)
        assert str(bad / "config.json") in err and "hidden size (-5)" in err and "internal" not in err


def test_malformed_model_config_is_a_config_error_not_a_tokenizer_one(tiny, tmp_path, capsys):
    from quantspec.models import load_dense

    bad = _copy_with_config(tiny, tmp_path / "bad", '{"model_type": ')
    with pytest.raises(QuantspecError) as e:
        load_dense(str(bad))
    assert "config.json is not a readable JSON file" in e.value.problem and "tokenizer" not in str(e.value)
    assert main(["quantize", str(bad), "--method", "rtn", "--out", str(tmp_path / "o")]) == 2
    err = _one_line_error(capsys)
    assert "config.json is not a readable JSON file" in err and "tokenizer" not in err


# --- calibration longer than the model's context ----------------------------------------------------

def test_calibration_longer_than_the_context_is_refused_before_calibrating(tiny, tmp_path, capsys):
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"word{i % 37}" for i in range(2000)))  # far fewer than 100000 tokens
    assert main(["quantize", str(tiny), "--method", "gptq", "--calib", str(text), "--calib-samples", "1",
                 "--calib-seqlen", "100000", "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    err = _one_line_error(capsys)
    assert "100000" in err and "context of 512 tokens" in err and "max_position_embeddings" in err
    assert "--calib-seqlen 512" in err
    assert not (tmp_path / "o").exists()


def test_calibration_within_the_context_or_without_a_declared_one_passes(tiny):
    from types import SimpleNamespace

    from quantspec.models.source import check_calibration_seqlen, declared_context

    check_calibration_seqlen(str(tiny), 512)
    check_calibration_seqlen(str(tiny), None)
    assert declared_context(SimpleNamespace(hidden_size=64)) is None
    assert declared_context(SimpleNamespace(n_positions=1024)) == ("n_positions", 1024)


def test_a_default_calibration_length_past_the_context_is_cut_to_it(tmp_path):
    """No calibration seqlen given: the CPU default (512) on a model of 128 learned positions is cut
    to 128, reported and warned about (it crashed in the position embedding before)."""
    import json

    from helpers import calib_text, make_tiny_model

    from quantspec.quant.pipeline import quantize
    from quantspec.quant.recipe import Recipe

    model = make_tiny_model(tmp_path, "gpt2")
    recipe = Recipe.from_dict({"method": "gptq", "scheme": {"bits": 4, "group_size": 32},
                               "calibration": {"data": str(calib_text(tmp_path)), "samples": 2}})
    with pytest.warns(UserWarning, match="past the model's context"):
        quantize(str(model), recipe, tmp_path / "q", progress=False)
    calib = json.loads((tmp_path / "q" / "quant_report.json").read_text())["calibration"]
    assert calib["seqlen"] == 128 and "context (max_position_embeddings 128)" in calib["seqlen_cut"]


def test_the_default_recipe_keeps_its_name_and_output_folder():
    """The default (no recipe, no flags) writes what it always wrote: recipe.yaml's name and the
    default --out are part of the checkpoint a user already has."""
    import argparse
    from pathlib import Path

    from quantspec.cli.quantize import add_parser, recipe_from_args
    from quantspec.quant.pipeline import default_out, resolve_recipe

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    from_cli = recipe_from_args(parser.parse_args(["quantize"]))
    assert resolve_recipe(None).name == from_cli.name == "gptq-w4g128"
    assert default_out("smollm2-135m", from_cli) == Path("quantspec-out/smollm2-135m-gptq-w4g128")
