"""Every config field is declared once: in its section's dataclass, with its default, range and
help (`fedjax_pfedes.config.fields`), and read from there by every module."""

import dataclasses
import inspect
import pathlib
import re

import pytest

import fedjax_pfedes
from fedjax_pfedes.algorithms import registry
from fedjax_pfedes.config import defaults, fields
from fedjax_pfedes.errors import ConfigError
from fedjax_pfedes.launch import methods

ROOT = pathlib.Path(__file__).resolve().parents[2]


def every_section() -> list[type[fields.Section]]:
    """The core's sections, every registered method's and every registered upload stage's."""
    from fedjax_pfedes.upload import stages

    found = [defaults.TopLevel, *defaults.SECTIONS.values()]
    found += [e.section for e in registry.entries().values() if e.section is not None]
    return found + stages.own_sections()


def test_every_field_of_every_section_is_declared_with_its_help():
    for section in every_section():
        assert fields.undeclared(section) == [], section.__name__
        for row in fields.rows(section):
            assert row.help, f"{row.path} has no help"


def test_no_config_path_is_declared_twice():
    owners: dict[str, str] = {}
    for section in every_section():
        for row in fields.rows(section):
            assert row.path not in owners, (f"{row.path} declared by {owners.get(row.path)} and "
                                            f"{section.__name__}")
            owners[row.path] = section.__name__
    # and the default config holds exactly these, at their declared defaults
    config = fedjax_pfedes.default_config()
    for section in every_section():
        for row in fields.rows(section):
            node = config
            for part in row.path.split(".")[1:]:
                node = node[part]
            assert node == row.default, row.path


def test_a_methods_config_dataclass_inherits_its_section_and_redeclares_nothing():
    """A method's build settings derive from its section (`class FedKDConfig(FedKDSection,
    LocalTrainingConfig)`): a field of the section is the section's declaration, not a second
    default beside it."""
    from fedjax_pfedes.algorithms import fedkd, fedmrl, fedproto, fml, pfedes_paper
    from fedjax_pfedes.algorithms.pfedes import PFedESConfig, PFedESSection

    pairs = [(PFedESConfig, PFedESSection), (fedkd.FedKDConfig, fedkd.FedKDSection),
             (fedmrl.FedMRLConfig, fedmrl.FedMRLSection),
             (fedproto.FedProtoConfig, fedproto.FedProtoSection),
             (fml.FMLConfig, fml.FMLSection),
             (pfedes_paper.PFedESPaperConfig, pfedes_paper.PFedESPaperHyper)]
    for config_cls, section in pairs:
        assert issubclass(config_cls, section)
        own = {f.name: f for f in dataclasses.fields(config_cls)}
        for f in dataclasses.fields(section):
            if f.name in registry.OPTIMIZER_OVERRIDES:
                continue  # the resolved value of config.train's field arrives in its place
            assert own[f.name] is f or own[f.name].metadata == f.metadata, (
                f"{config_cls.__name__}.{f.name} redeclares {section.__name__}.{f.name}")


def _method_modules():
    for entry in registry.entries().values():
        yield entry, inspect.getmodule(entry.build)


def test_no_method_maps_its_sections_fields_by_hand():
    """Its build reads its section as `BuildInputs.section` / `**inputs.own()`, never field by
    field out of the config view (`c.fedprox.mu`, `settings.fedkd.energy_start`)."""
    for entry, module in _method_modules():
        if entry.section is None or not entry.section.SECTION:
            continue
        source = inspect.getsource(module)
        hand = re.findall(rf"\b(?:c|settings|inputs\.settings)\.{entry.section.SECTION}\.\w+",
                          source)
        hand = [h for h in hand if h.rsplit(".", 1)[1] in
                {f.name for f in dataclasses.fields(entry.section)}]
        # a rule across sections may read a field (pfedes_paper's schedule vs the deadline)
        assert len(hand) <= 1, f"{entry.name} maps {hand} by hand"
        assert "fields={" not in source and "FIELDS = {" not in source, entry.name


def _package_dataclasses(package: str):
    import importlib
    import pkgutil

    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (isinstance(obj, type) and dataclasses.is_dataclass(obj)
                    and obj.__module__ == module.__name__):
                yield obj


def test_no_settings_object_repeats_a_sections_field():
    """The upload pipeline's settings hold the built sections (`PipelineConfig.upload`, ...),
    client-level DP's derives from `DPSection`, and no stage or helper dataclass gives a field
    of `config.upload` / `dp` / `secagg` a default of its own: each is declared once, in its
    section."""
    from fedjax_pfedes.upload import privacy, settings

    upload_sections = [defaults.SECTIONS[n] for n in ("upload", "dp", "secagg")]
    names = {f.name for s in upload_sections for f in dataclasses.fields(s)} - {"enabled"}
    assert issubclass(privacy.ClientDPConfig, defaults.SECTIONS["dp"])
    assert not names & {f.name for f in dataclasses.fields(settings.PipelineConfig)}
    for cls in _package_dataclasses("fedjax_pfedes.upload"):
        if any(issubclass(cls, s) for s in upload_sections):
            continue
        for f in dataclasses.fields(cls):
            assert not (f.name in names and f.default is not dataclasses.MISSING), (
                f"{cls.__module__}.{cls.__name__}.{f.name} repeats a section's default")


def test_a_value_out_of_its_declared_range_is_named_when_the_section_is_built():
    config = fedjax_pfedes.default_config()
    config.fedkd.energy_start = 1.5
    with pytest.raises(ConfigError, match=r"config\.fedkd\.energy_start must be in \(0, 1\], "
                                          r"got 1\.5"):
        registry.get("fedkd").read_section(config)
    config.train.plateau_window = 0.0
    with pytest.raises(ConfigError, match=r"config\.train\.plateau_window must be in "
                                          r"\(0, 0\.5\], got 0\.0"):
        defaults.read_section(config, "train")
    config.dp_sgd.clip_norm = -1.0  # checked only while DP-SGD is on
    defaults.read_section(config, "dp_sgd")
    config.dp_sgd.enabled = True
    with pytest.raises(ConfigError, match=r"config\.dp_sgd\.clip_norm must be > 0"):
        defaults.read_section(config, "dp_sgd")


def test_the_config_fields_page_is_generated_from_the_declarations():
    page = (ROOT / "docs" / "guide" / "config_fields.md").read_text()
    assert page == methods.all_fields(), (
        "docs/guide/config_fields.md is stale: python -m launch.methods --all_fields > "
        "docs/guide/config_fields.md")
