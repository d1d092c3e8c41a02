"""Which modules an adapter_config.json selects, against PEFT's own matcher."""

from __future__ import annotations

import itertools

import pytest

from omnibus.engine.lora.adapters import PROJECTIONS, AdapterError, _module_path, _Selection

CONFIGS = [
    dict(target_modules=["q_proj", "v_proj"]),
    dict(target_modules=["model.layers.0.self_attn.q_proj", "v_proj"]),  # a path, and a name
    dict(target_modules=["self_attn.q_proj", "mlp.up_proj"]),
    dict(target_modules=r".*\.(q|k)_proj"),
    dict(target_modules=r"model\.layers\.1\..*"),
    dict(target_modules="q_proj"),  # a string is a regex, matched against the whole path
    dict(target_modules=list(PROJECTIONS), exclude_modules=["k_proj", "mlp.down_proj"]),
    dict(target_modules=list(PROJECTIONS), exclude_modules=r".*layers\.2\..*"),
    dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[0, 2]),
    dict(target_modules=["q_proj", "down_proj"], layers_to_transform=1),
    dict(target_modules=["q_proj"], layers_to_transform=[1], layers_pattern="layers"),
    dict(target_modules=["q_proj"], layers_to_transform=[1], layers_pattern=["h", "layers"]),
    dict(target_modules=["q_proj"], layers_to_transform=[1], layers_pattern="blocks"),  # no such layers
    dict(target_modules=["model.layers.0.self_attn.q_proj"], layers_to_transform=[1]),  # exact path wins
]


@pytest.mark.parametrize("raw", CONFIGS, ids=str)
def test_selection_is_peft_s(raw):
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    peft_config = LoraConfig(r=2, **raw)
    ours = _Selection.read("a", raw)
    for layer, proj in itertools.product(range(3), PROJECTIONS):
        path = _module_path(layer, proj)
        theirs = check_target_module_exists(peft_config, path)
        expected = bool(theirs) and type(theirs).__name__ != "_ExcludedModule"
        assert ours.selects(path) is expected, path


def test_all_linear_selects_every_projection():
    ours = _Selection.read("a", {"target_modules": "all-linear"})
    assert all(ours.selects(_module_path(0, proj)) for proj in PROJECTIONS)


def test_unchecked_when_the_config_cannot_tell():
    assert _Selection.read("a", {}) is None
    assert _Selection.read("a", {"target_modules": ["q_proj"], "target_parameters": ["v_proj.weight"]}) is None


@pytest.mark.parametrize(("raw", "error"), [
    ({"target_modules": ["q_proj"], "exclude_modules": "("}, "exclude_modules '\\(' is not a valid regex"),
    ({"target_modules": ["q_proj"], "layers_pattern": 3}, "layers_pattern must be"),
    ({"target_modules": ["q_proj"], "layers_to_transform": -1}, "layers_to_transform must be"),
    ({"target_modules": ".*q_proj", "layers_to_transform": [1]}, "cannot be used with a target_modules regex"),
    ({"target_modules": ["q_proj"], "layers_pattern": "layers"}, "layers_pattern needs layers_to_transform"),
])  # fmt: skip
def test_malformed_selection_fields_are_refused(raw, error):
    with pytest.raises(AdapterError, match=error):
        _Selection.read("a", raw)
