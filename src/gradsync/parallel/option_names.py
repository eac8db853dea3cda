"""How the library's checks name an option: keyword arguments for library callers, flags for the CLI.

A check shared by the library and ``gradsync train`` takes a spelling: the
library's classes pass :data:`KEYWORDS` (the default), the CLI's validation
:data:`FLAGS`, so that each caller reads the names it typed.

>>> KEYWORDS.name("outer_lr"), KEYWORDS.setting("outer_fragments", 3)
('outer_lr', 'outer_fragments=3')
>>> FLAGS.name("outer_lr"), FLAGS.setting("outer_fragments", 3), FLAGS.setting("outer_compression", "int4")
('--outer-lr', '--outer-fragments 3', "--outer-compression 'int4'")
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Spelling:
    """Names of options in error messages: the keyword argument (``flags`` False) or ``--the-flag``."""

    flags: bool = False

    def name(self, option: str) -> str:
        """``option`` (a keyword argument's name, e.g. ``outer_lr``) as the caller typed it."""
        return "--" + option.replace("_", "-") if self.flags else option

    def setting(self, option: str, value: object) -> str:
        """The option with its value: ``outer_lr=0.5`` or ``--outer-lr 0.5`` (strings quoted)."""
        return f"{self.name(option)} {value!r}" if self.flags else f"{option}={value!r}"


KEYWORDS = Spelling(flags=False)
FLAGS = Spelling(flags=True)
