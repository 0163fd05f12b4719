"""How a config field is declared: once, with its default, its range and its help.

Every config section, the core's (`config/defaults.py`) and each method's (its module), is one
frozen dataclass deriving from `Section`, whose fields are made with `param`:

    @dataclasses.dataclass(frozen=True)
    class FedProxSection(Section):
        SECTION: ClassVar[str] = "fedprox"
        mu: float = param(0.01, "proximal weight mu/2 ||w - w_global||^2 (0 = FedAvg)",
                          at_least(0))

From that one declaration come the default config (`defaults_of`), the range check (building
the dataclass with `**config.section` runs it, a ValueError naming the field), the listing of
`launch.methods --fields` and the documentation's tables (`rows`). A rule that reads several
fields at once is the section's `check` method.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

from fedjax_pfedes.errors import ConfigError

_RANGE, _HELP = "fedjax_pfedes.range", "fedjax_pfedes.help"


@dataclasses.dataclass(frozen=True)
class Range:
    """A field's allowed values: `test(value)` is True inside, `wanted` says it in words.

    Attributes:
      test: value -> bool.
      wanted: the range as an error message ends it ("> 0", "in [0, 1)").
      if_enabled: checked only when the section's `enabled` field is True.
    """

    test: Callable[[Any], bool]
    wanted: str
    if_enabled: bool = False

    def when_enabled(self) -> Range:
        """The same range, checked only while the section is enabled."""
        return dataclasses.replace(self, if_enabled=True)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def above(low: float, note: str = "") -> Range:
    """The range value > low.

    Args:
      low: the bound, excluded.
      note: words after the range in an error message (" (0 = off)").

    Returns:
      The `Range`.
    """
    return Range(lambda v: v > low, f"> {low:g}{note}")


def at_least(low: float, note: str = "", integer: bool = False) -> Range:
    """The range value >= low.

    Args:
      low: the bound, included.
      note: words after the range in an error message (" (0 = all)").
      integer: the value must also be an integer.

    Returns:
      The `Range`.
    """
    if integer:
        return Range(lambda v: _is_int(v) and v >= low, f"an integer >= {low:g}{note}")
    return Range(lambda v: v >= low, f">= {low:g}{note}")


def between(low: float, high: float, closed: str = "()") -> Range:
    """The range between two bounds.

    Args:
      low: the lower bound.
      high: the upper bound.
      closed: which ends are included: '()', '[)', '(]' or '[]'.

    Returns:
      The `Range`.
    """
    lo_in, hi_in = closed[0] == "[", closed[1] == "]"

    def test(v):
        return ((v >= low if lo_in else v > low) and (v <= high if hi_in else v < high))
    return Range(test, f"in {closed[0]}{low:g}, {high:g}{closed[1]}")


def one_of(*choices: str) -> Range:
    """The range of named choices.

    Args:
      *choices: the values allowed.

    Returns:
      The `Range`.
    """
    return Range(lambda v: v in choices, f"one of {list(choices)}")


def param(default: Any, help: str, range: Range | None = None) -> Any:  # noqa: A002
    """A config field: its default, its help line and its range, declared once.

    Args:
      default: the default value (an immutable one: a number, a string, a bool, a tuple).
      help: what the field means, one or two sentences.
      range: the values it may take (None: any of its type).

    Returns:
      A `dataclasses.field` carrying them.
    """
    return dataclasses.field(default=default, metadata={_HELP: help, _RANGE: range})


class Section:
    """Base of every config section: the fields' ranges checked when it is built.

    `SECTION` is the section's place in the config ('train'; 'fedprox'; '' for fields at the
    top level, as pFedES's `lam`). A subclass with rules across fields overrides `check`.
    """

    SECTION: ClassVar[str] = ""

    def __post_init__(self):
        check_ranges(self)
        self.check()

    def check(self) -> None:
        """Rules that read several fields at once (ValueError naming a field)."""


def config_path(section: Section | type[Section], field: str) -> str:
    """`config.<path>.<field>` of one field (`config.<field>` at the top level)."""
    return f"config.{section.SECTION}.{field}" if section.SECTION else f"config.{field}"


def check_ranges(section: Section) -> None:
    """ConfigError (a ValueError) naming the first field of `section` outside its range."""
    enabled = getattr(section, "enabled", True)
    for f in dataclasses.fields(section):
        rule = f.metadata.get(_RANGE)
        if rule is None or (rule.if_enabled and not enabled):
            continue
        value = getattr(section, f.name)
        if hasattr(value, "aval"):
            continue  # a JAX value (a vectorized sweep's traced member axis): checked per member
        try:
            ok = rule.test(value)
        except TypeError:
            ok = False
        if not ok:
            raise ConfigError(f"{config_path(section, f.name)} must be {rule.wanted}, got "
                              f"{value!r}")


def defaults_of(cls: type[Section]) -> dict[str, Any]:
    """{field: default} of a section class."""
    return {f.name: f.default for f in dataclasses.fields(cls)}


def build(cls: type[Section], values: dict[str, Any]) -> Section:
    """The section built from a config's values, with the fields it does not have refused.

    Args:
      cls: the section's class.
      values: the section's values (`config.<path>.to_dict()`).

    Returns:
      The built section; ConfigError (a ValueError) naming the field for an unknown field or a
      value out of range.
    """
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        where = f"config.{cls.SECTION}" if cls.SECTION else "config"
        raise ConfigError(f"{where}.{unknown[0]}: not a field of {where} (a typo, or a field "
                          f"that moved?); its fields: {sorted(known)}")
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class FieldRow:
    """One field as the listings and the docs show it."""

    path: str
    default: Any
    wanted: str
    help: str


def rows(cls: type[Section]) -> list[FieldRow]:
    """Every field of a section with its default, range and help, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        rule = f.metadata.get(_RANGE)
        wanted = "" if rule is None else rule.wanted + (" (when enabled)" if rule.if_enabled
                                                         else "")
        out.append(FieldRow(config_path(cls, f.name), f.default, wanted, f.metadata.get(_HELP,
                                                                                        "")))
    return out


def undeclared(cls: type[Section]) -> list[str]:
    """The fields of a section made without `param` (no help): what the declaration test
    refuses."""
    return [f.name for f in dataclasses.fields(cls) if _HELP not in f.metadata]
