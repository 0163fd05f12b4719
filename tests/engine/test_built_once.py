"""A run validates its config once and builds each config section once."""

import collections

import pytest
from fl_helpers import tiny_config

import fedjax_pfedes
from fedjax_pfedes.config import fields
from fedjax_pfedes.config.defaults import SECTIONS
from fedjax_pfedes.engine import validate


@pytest.mark.slow
def test_a_run_validates_once_and_builds_each_section_once(tmp_path, monkeypatch):
    built = collections.Counter()
    checks = fields.check_ranges

    def counting(section):
        built[type(section).__name__] += 1
        checks(section)

    validations = []
    real = validate._validate
    monkeypatch.setattr(fields, "check_ranges", counting)
    monkeypatch.setattr(validate, "_validate", lambda c: validations.append(1) or real(c))
    config = tiny_config(rounds=1)
    fedjax_pfedes.run(config, str(tmp_path), progress=False)
    assert len(validations) == 1
    # Every core section and the method's, once; `config.distributed` is read once more where
    # the run starts, before validation (it must join the other processes before anything
    # touches a JAX backend).
    sections = {"TopLevel", "PFedESSection", *(c.__name__ for c in SECTIONS.values())}
    once = {name: built[name] for name in sections - {"DistributedSection"}}
    assert set(once.values()) == {1}, dict(built)
    assert built["DistributedSection"] == 2
    # the method's build settings derive from its section: built once more, as the build
    assert built["PFedESConfig"] == 1
