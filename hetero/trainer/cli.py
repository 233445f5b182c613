"""The command-line face of Config: one flag per field (--help, make help and the docs' flag table come from the
fields' metadata), and the parser class every hetero command uses for one-line errors.

    python -m hetero.trainer.cli [--markdown]    # the flag table: plain for make help, markdown for docs/cli.md
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import fields

from .config import Config, _flag, shown


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _int(text: str) -> int:
    """A whole number in ASCII digits (int() also takes '٣'); Config bounds its range (type_problem: int64, then
    each field's own), and a text past int()'s 4,300-digit limit is refused here without conversion."""
    if len(text) > 1000 or not re.fullmatch(r"[+-]?[0-9]+", text.strip()):
        raise argparse.ArgumentTypeError(f"invalid int value: {shown(text)}")
    return int(text)


def _float(text: str) -> float:
    if len(text) > 100:  # float() takes 400 digits and says inf: a typo, not a number anyone means
        raise argparse.ArgumentTypeError(f"invalid float value: {shown(text)}")
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {shown(text)}") from None


class CliParser(argparse.ArgumentParser):
    """argparse with the project's bad-input convention: one line `hetero: error: ...` and exit status 2."""

    def error(self, message: str):  # not a usage dump
        self.exit(2, f"hetero: error: {message} (see --help)\n")


def _shown(value) -> str:
    """A default as it is typed on the command line."""
    return str(value).lower() if isinstance(value, bool) else ('""' if value == "" else str(value))


def flag_help(name: str) -> str:
    """One field's help line: its meaning, choices and default (the text of --help, make help and docs/cli.md)."""
    f = next(f for f in fields(Config) if f.name == name)
    choices = f.metadata.get("choices") or (("true", "false") if str(f.type) == "bool" else ())
    return f"{f.metadata.get('help', '')} (" + (f"choices: {', '.join(choices)}; " if choices else "") + \
        f"default: {_shown(f.default)})"


def build_parser(prog: str = "python -m hetero.trainer") -> argparse.ArgumentParser:
    """One flag per Config field; booleans take an optional true/false so Make can pass `--overwrite $(OVERWRITE)`."""
    p = CliParser(prog=prog, allow_abbrev=False, description="Heterogeneity-aware DDP training (run under torchrun). "
                  "Every flag --foo-bar is also the Make variable FOO_BAR= and the notebook parameter foo_bar.")
    for f in fields(Config):
        kind = {"int": _int, "float": _float, "str": str, "bool": _bool}[str(f.type)]
        # the help text is escaped for argparse's %-formatting; choices are checked by Config (one-line errors)
        text = flag_help(f.name).replace("%", "%%")
        if kind is _bool:
            p.add_argument(f"--{_flag(f.name)}", type=_bool, nargs="?", const=True, default=f.default,
                           metavar="BOOL", help=text)
        else:
            p.add_argument(f"--{_flag(f.name)}", type=kind, default=f.default, metavar=f.name.upper(), help=text)
    return p


def _md(text: str) -> str:
    """Plain text as a Markdown table cell: <class> is not a tag, * not emphasis, | not a column."""
    return text.replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*").replace("|", "/")


def flag_table(markdown: bool = False) -> str:
    """Every field as Make variable, flag and help line: plain text for make help, a table for docs/cli.md."""
    rows = [(f.name.upper(), f"--{_flag(f.name)}", flag_help(f.name)) for f in fields(Config)]
    if markdown:
        return "\n".join(["| Make variable | flag | meaning (choices; default) |", "|---|---|---|",
                          *(f"| `{v}` | `{fl}` | {_md(h)} |" for v, fl, h in rows)])
    width = max(len(v) for v, _, _ in rows) + 2
    return "\n".join(f"  {v:<{width}}{h}" for v, _, h in rows)


_UNSET = object()


def parse_args(argv: list[str] | None = None) -> tuple[Config, argparse.Namespace]:
    """The Config of a command line; ns.given names the fields whose flags were on it (resume checks them)."""
    p = build_parser()
    p.add_argument("--check", action="store_true",
                   help="validate the configuration (and fetch the data) without training; WORLD_SIZE sets the world")
    # argparse fills in a default only where the namespace lacks the attribute: a marker there survives exactly
    # for the flags not given
    ns = p.parse_args(argv, argparse.Namespace(**{f.name: _UNSET for f in fields(Config)}))
    ns.given = {f.name for f in fields(Config) if getattr(ns, f.name) is not _UNSET}
    for f in fields(Config):
        if f.name not in ns.given:
            setattr(ns, f.name, f.default)
    cfg = Config(**{f.name: getattr(ns, f.name) for f in fields(Config)})
    return cfg, ns


if __name__ == "__main__":  # make help (plain) and docs/cli.md's flag table (--markdown)
    print(flag_table(markdown="--markdown" in sys.argv[1:]))
