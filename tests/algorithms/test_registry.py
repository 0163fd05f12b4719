"""The algorithm registry: a method owns its config fields and sees only its view of the config."""

import collections
import dataclasses

import pytest
from fl_helpers import SPEC

import fedjax_pfedes
from fedjax_pfedes.algorithms import registry
from fedjax_pfedes.config import fields
from fedjax_pfedes.engine import sections
from fedjax_pfedes.engine.validate import validate_config
from fedjax_pfedes.errors import ConfigError


def _register_mine(seen: list):
    """A user's method: FedAvg's programs under another name, with one field of its own."""
    fedavg = registry.get("fedavg")

    def build(inputs):
        seen.append(inputs)
        return fedavg.build(inputs)  # name and aggregation: the entry's

    return registry.register(registry.AlgorithmEntry(
        "mine", build, aggregation="per_cohort", section=MineSection,
        reads=("proxy_dim", "train.rounds")))


@dataclasses.dataclass(frozen=True)
class MineSection(fields.Section):
    """`config.mine`: a user's section, each field declared once."""

    SECTION = "mine"
    weight: float = fields.param(0.25, "the weight of my term", fields.between(0, 1, "[]"))


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
        built = sections.build_algorithm(config, 3, SPEC, 1,
                                         collections.Counter({"mlp_small": 2}))
        assert (built.name, built.aggregation) == ("mine", "per_cohort")  # declared once
        view = seen[-1].settings
        assert seen[-1].section == MineSection(weight=0.5)  # built from the config, checked
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


@dataclasses.dataclass(frozen=True)
class TwinSection(fields.Section):
    """Top-level fields, as pFedES's: one named as pFedES's, at another default."""

    SECTION = ""
    lam: float = fields.param(0.9, "a twin's weight")


def test_two_methods_may_not_declare_one_field_with_two_defaults():
    twin = dataclasses.replace(registry.get("fedavg"), name="pfedes_twin", section=TwinSection)
    with pytest.raises(ValueError, match=r"AlgorithmEntry\('pfedes_twin'\): field "
                                         r"'config\.lam' is declared by 'pfedes' too, "
                                         r"with default 0\.5 \(here 0\.9\)"):
        registry.register(twin)  # refused when registered, naming both
    assert "pfedes_twin" not in registry.entries()
    registry._ENTRIES["pfedes_twin"] = twin  # past the registration check: still caught
    try:
        with pytest.raises(ValueError, match=r"config\.lam: declared by 'pfedes' with "
                                             r"default 0\.5 and by 'pfedes_twin' with 0\.9"):
            fedjax_pfedes.default_config()
    finally:
        registry._ENTRIES.pop("pfedes_twin", None)


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
