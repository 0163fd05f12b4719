"""The algorithm registry: a method owns its config fields and sees only its view of the config."""

import collections
import dataclasses

import pytest
from fl_helpers import SPEC

import fedjax_pfedes
from fedjax_pfedes.algorithms import registry
from fedjax_pfedes.engine import sections
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError


def _register_mine(seen: list):
    """A user's method: FedAvg's programs under another name, with one field of its own."""
    fedavg = registry.get("fedavg")

    def build(inputs):
        seen.append(inputs.settings)
        return dataclasses.replace(fedavg.build(inputs), name="mine")

    def check(settings):
        if not 0 <= settings.mine.weight <= 1:
            raise ValueError(f"config.mine.weight must be in [0, 1], got {settings.mine.weight}")

    return registry.register(registry.AlgorithmEntry(
        "mine", build, aggregation="per_cohort", check=check,
        fields={"mine.weight": 0.25}, reads=("proxy_dim", "train.rounds")))


def test_a_method_brings_its_fields_and_sees_only_what_it_declared():
    seen = []
    _register_mine(seen)
    try:
        config = fedjax_pfedes.default_config()
        assert config.mine.weight == 0.25  # joined into the defaults by its registration
        config.algorithm = "mine"
        config.clients.architectures = "mlp_small"
        config.mine.weight = 0.5
        validate_config(config)
        sections.build_algorithm(config, 3, SPEC, 1, collections.Counter({"mlp_small": 2}))
        view = seen[-1]
        assert view.mine.weight == 0.5 and view.proxy_dim == config.proxy_dim
        assert view.train.rounds == config.train.rounds and view.algorithm == "mine"
        assert set(view.train.keys()) == {"rounds"}  # only the declared field of the section
        with pytest.raises((AttributeError, KeyError)):
            _ = view.lam  # pFedES's field: not declared, not visible
        with pytest.raises((AttributeError, TypeError)):
            view.mine.weight = 1.0  # read-only
        config.mine.weight = 2.0
        with pytest.raises(ConfigError, match=r"config\.mine\.weight must be in \[0, 1\]"):
            validate_config(config)
    finally:
        registry._ENTRIES.pop("mine", None)
    assert "mine" not in fedjax_pfedes.default_config()


def test_two_methods_may_not_declare_one_field_with_two_defaults():
    fedprox = registry.get("fedprox")
    twin = dataclasses.replace(fedprox, name="fedprox_twin", fields={"fedprox.mu": 0.5})
    with pytest.raises(ValueError, match=r"AlgorithmEntry\('fedprox_twin'\): field "
                                         r"'config\.fedprox\.mu' is declared by 'fedprox' too, "
                                         r"with default 0\.01 \(here 0\.5\)"):
        registry.register(twin)  # refused when registered, naming both
    assert "fedprox_twin" not in registry.entries()
    registry._ENTRIES["fedprox_twin"] = twin  # past the registration check: still caught
    try:
        with pytest.raises(ValueError, match=r"config\.fedprox\.mu: declared by 'fedprox' with "
                                             r"default 0\.01 and by 'fedprox_twin' with 0\.5"):
            fedjax_pfedes.default_config()
    finally:
        registry._ENTRIES.pop("fedprox_twin", None)


def test_a_declared_read_the_config_lacks_is_named():
    entry = dataclasses.replace(registry.get("fedavg"), name="reads_nothing_there",
                                reads=("train.no_such_field",))
    registry.register(entry)
    try:
        config = fedjax_pfedes.default_config()
        config.algorithm = "reads_nothing_there"
        with pytest.raises(ValueError, match=r"config\.train\.no_such_field: "
                                             r"'reads_nothing_there' reads it"):
            sections.method_settings(config)
    finally:
        registry._ENTRIES.pop("reads_nothing_there", None)
