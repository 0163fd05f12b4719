"""Upload stages (`upload/stages.py`): the chain the config describes, registering a stage, a
stage's own config fields.
"""


import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fl_helpers import pipeline_config, upload_cohort

from fedjax_pfedes.upload import privacy
from fedjax_pfedes.upload.pipeline import UploadPipeline


def test_the_chain_follows_the_config_and_a_new_stage_is_one_class():
    from fedjax_pfedes.upload import stages
    from fedjax_pfedes.upload.pipeline import build_stages

    def names(cfg):
        return [s.name for s in build_stages(cfg, 1.0)]

    checks = ["finite_check", "compression", "norm_outlier_check"]
    assert names(pipeline_config()) == checks + ["weighting"]
    assert names(pipeline_config(aggregator="median")) == checks + ["weighting",
                                                                    "robust_aggregation"]
    dp = privacy.ClientDPConfig(clip_norm=1.0, noise_multiplier=1.0)
    assert names(pipeline_config(dp=dp, weighting="uniform")) == checks + [
        "clip", "weighting", "dp_noisy_mean"]
    assert names(pipeline_config(secagg=True, dp=dp, weighting="uniform")) == checks + [
        "clip", "weighting", "secure_aggregation"]

    class AddOne(stages.UploadStage):  # a new client-side transform
        name, transforms = "add_one", True

        def client(self, delta, memory, key, info):
            return jax.tree.map(lambda d: d + 1.0, delta), memory, info

    cfg = pipeline_config(norm_outlier_factor=0.0)
    chain = build_stages(cfg, 0.0)
    chain.insert(1, AddOne())
    pipe = UploadPipeline(cfg, "shared", "test", 10, 4, 4, 5, stages_override=chain)
    template = {"w": jnp.array([1.0, 2.0])}
    ups = {"w": jnp.array([[1.0, 2.0], [3.0, 2.0]])}
    groups, _, _ = pipe.process(0, {"a": upload_cohort(ups, template, [1, 3])}, {"a": {}},
                                {"a": 2}, jax.random.key(0))
    np.testing.assert_allclose(groups["a"][0]["w"], [[2.0, 3.0], [4.0, 3.0]])


def test_a_registered_stage_joins_the_chain_at_its_position():
    from fedjax_pfedes.upload import stages
    from fedjax_pfedes.upload.pipeline import build_stages

    @dataclasses.dataclass
    class Shift(stages.UploadStage):  # a client-side transform, on when topk_fraction < 1
        amount: float = 1.0
        name, transforms, position = "shift_test", True, 25

        @classmethod
        def from_config(cls, cfg, noise_multiplier):
            return cls(0.5) if cfg.upload.topk_fraction < 1 else None

        def client(self, delta, memory, key, info):
            return jax.tree.map(lambda d: d + self.amount, delta), memory, info

    stages.register_stage(Shift)
    try:
        names = [s.name for s in build_stages(pipeline_config(), 0.0)]
        assert "shift_test" not in names
        cfg = pipeline_config(topk_fraction=0.5)
        names = [s.name for s in build_stages(cfg, 0.0)]
        assert names == ["finite_check", "compression", "shift_test", "norm_outlier_check",
                         "weighting"]

        class Twin(stages.UploadStage):
            name = "shift_test"

        with pytest.raises(ValueError, match="'shift_test' is registered twice"):
            stages.register_stage(Twin)
    finally:
        stages.STAGES.remove(Shift)


def test_a_stage_owns_its_config_fields():
    """A stage's own section joins the default config, reaches its `from_config` through the
    pipeline's settings at the run's values, and its declared range refuses a bad value by
    name: a new stage is its class, its section, its registration and its test, no edit
    elsewhere."""
    import fedjax_pfedes
    from fedjax_pfedes.engine.sections import pipeline_config
    from fedjax_pfedes.engine.validate import validate_config
    from fedjax_pfedes.errors import ConfigError
    from fedjax_pfedes.upload import stages
    from fedjax_pfedes.upload.pipeline import build_stages

    @dataclasses.dataclass(frozen=True)
    class ShiftSection(fedjax_pfedes.Section):
        SECTION: ClassVar[str] = "shift_owned"
        amount: float = fedjax_pfedes.param(0.0, "added to every update",
                                            fedjax_pfedes.at_least(0))

    @dataclasses.dataclass
    class Shift(stages.UploadStage):  # adds a constant to every update, on when amount != 0
        amount: float = 0.0
        name, transforms, position = "shift_owned", True, 25
        section = ShiftSection

        @classmethod
        def from_config(cls, cfg, noise_multiplier):
            amount = cfg.section(ShiftSection).amount
            return cls(amount) if amount != 0 else None

        def client(self, delta, memory, key, info):
            return jax.tree.map(lambda d: d + self.amount, delta), memory, info

    stages.register_stage(Shift)
    try:
        config = fedjax_pfedes.default_config()
        assert config.shift_owned.amount == 0.0
        assert "shift_owned" not in [s.name for s in build_stages(pipeline_config(config), 0.0)]
        config.shift_owned.amount = 0.25
        chain = build_stages(pipeline_config(config), 0.0)
        names = [s.name for s in chain]
        assert names[names.index("compression") + 1] == "shift_owned"  # position 25
        assert chain[names.index("shift_owned")].amount == 0.25
        validate_config(config)
        config.shift_owned.amount = -1.0
        with pytest.raises(ConfigError, match=r"config\.shift_owned\.amount must be >= 0"):
            validate_config(config)
    finally:
        stages.STAGES.remove(Shift)
    assert "shift_owned" not in fedjax_pfedes.default_config()


def test_the_registry_builds_the_chain_the_config_describes():
    """Against the chain written out by hand: checks, compression, norm, clip under DP,
    weighting, then at most one aggregator (secure sum, else DP noisy mean, else robust)."""
    from fedjax_pfedes.upload.pipeline import build_stages

    dp = privacy.ClientDPConfig(clip_norm=1.0, noise_multiplier=1.0)
    for use_dp in (False, True):
        for secagg in (False, True):
            for aggregator in ("mean", "median", "trimmed_mean"):
                cfg = pipeline_config(dp=dp if use_dp else None, secagg=secagg,
                                      aggregator=aggregator)
                expected = ["finite_check", "compression", "norm_outlier_check"]
                expected += ["clip"] if use_dp else []
                expected += ["weighting"]
                if secagg:
                    expected += ["secure_aggregation"]
                elif use_dp:
                    expected += ["dp_noisy_mean"]
                elif aggregator != "mean":
                    expected += ["robust_aggregation"]
                assert [s.name for s in build_stages(cfg, 1.0)] == expected, cfg
