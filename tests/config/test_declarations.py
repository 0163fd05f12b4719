"""Every config field is declared once: in its section's dataclass, with its default, range and
help (`fedjax_pfedes.config.fields`), and read from there by every module."""

import ast
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


def literal_defaults(source: str, names: set[str]) -> list[str]:
    """The fields named in `names` to which a dataclass (a class decorated with
    `dataclasses.dataclass`, not a `Section`) in `source` gives a literal default of its own,
    as `Class.field`: a second declaration of a section's default (one read from the
    declaration, `lr_local: float = TrainSection.lr_local`, is not)."""
    found = []
    for cls in ast.walk(ast.parse(source)):
        if not (isinstance(cls, ast.ClassDef) and any(
                "dataclass" in ast.unparse(d) for d in cls.decorator_list)):
            continue
        if any(ast.unparse(b).endswith(("Section", "Hyper")) for b in cls.bases):
            continue  # a section, or a section's declared base (pfedes_paper's)
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                    and stmt.target.id in names and stmt.value is not None):
                continue
            value = stmt.value
            if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("field"):
                value = next((k.value for k in value.keywords if k.arg == "default"), None)
            if value is not None and _is_literal(value):
                found.append(f"{cls.name}.{stmt.target.id}")
    return found


def _is_literal(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, ast.UnaryOp):
        return _is_literal(node.operand)
    if isinstance(node, ast.Tuple):
        return bool(node.elts) and all(_is_literal(e) for e in node.elts)
    return False


# Fields named like a config field that are something else: a command line's own flags and a
# method's capability.
NOT_CONFIG_FIELDS = {
    "fedjax_pfedes/algorithms/pfedes/pretraining.py: PretrainSettings.batch_size",  # its flag
    "fedjax_pfedes/algorithms/registry.py: AlgorithmEntry.proxy_init",  # can it start from one
    "fedjax_pfedes/studies/gradient_inversion.py: AttackConfig.clip_norm",  # launch.leakage's
    "fedjax_pfedes/studies/gradient_inversion.py: AttackConfig.noise_multiplier",
}


def test_no_settings_object_repeats_a_sections_default():
    """An object built from a section (the upload pipeline's settings, client-level DP's,
    the local training's, the data loaders' options, the system model's, ...) holds the built
    section or reads each default from its declaration: no dataclass in the package gives a
    config field's name a literal default of its own. `PipelineConfig` holds the sections
    themselves and client-level DP's settings derive from `DPSection`."""
    from fedjax_pfedes.upload import privacy, settings

    names = {f.name for s in every_section() for f in dataclasses.fields(s)}
    names -= {"name", "enabled"}  # flax modules' `name`; an `enabled` switch is no default
    found = []
    for path in sorted((ROOT / "fedjax_pfedes").rglob("*.py")):
        found += [f"{path.relative_to(ROOT)}: {hit}"
                  for hit in literal_defaults(path.read_text(), names)]
    assert [f for f in found if f not in NOT_CONFIG_FIELDS] == []
    assert issubclass(privacy.ClientDPConfig, defaults.SECTIONS["dp"])
    upload = {f.name for n in ("upload", "dp", "secagg")
              for f in dataclasses.fields(defaults.SECTIONS[n])} - {"enabled"}
    assert not upload & {f.name for f in dataclasses.fields(settings.PipelineConfig)}
    # the loaders' options are `config.data`'s fields, read by name (`engine.build.load_options`)
    from fedjax_pfedes.data.sources import LoadOptions
    assert {f.name for f in dataclasses.fields(LoadOptions)} - {"seed"} <= {
        f.name for f in dataclasses.fields(defaults.SECTIONS["data"])}


def test_the_repeat_check_sees_a_literal_default():
    source = ("@dataclasses.dataclass\nclass Opts:\n    lr_local: float = 0.05\n"
              "    batch_size: int = TrainSection.batch_size\n"
              "    seed: int = dataclasses.field(default=0)\n")
    assert literal_defaults(source, {"lr_local", "batch_size", "seed"}) == [
        "Opts.lr_local", "Opts.seed"]


# A number any value of which means something: no range to declare.
UNBOUNDED_NUMBERS = {"config.attack.value"}  # a constant, a scale (a negative flips), a std


def test_every_number_declares_its_range():
    """A numeric field's static range sits in its declaration (shown by `launch.methods
    --all_fields`, checked when the section is built); a module's `check` adds only rules across
    fields or against the data."""
    missing = [row.path for section in every_section() for row in fields.rows(section)
               if isinstance(row.default, (int, float)) and not isinstance(row.default, bool)
               and not row.wanted and row.path not in UNBOUNDED_NUMBERS]
    assert missing == []


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
