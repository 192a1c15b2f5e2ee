"""The command line's argument parser class: argparse that suggests the closest sub-command,
choice or option on a typo, and a walk over every (nested) sub-command for ``--help`` checks."""

from __future__ import annotations

import argparse
from typing import Iterator

from megatron_rl.config.overrides import closest_name


class Parser(argparse.ArgumentParser):
    """:class:`argparse.ArgumentParser` whose "invalid choice" errors (sub-commands, ``choices``)
    end with ``did you mean ...?``. Sub-parsers are of this class too (argparse's default)."""

    def _check_value(self, action: argparse.Action, value) -> None:
        try:
            super()._check_value(action, value)
        except argparse.ArgumentError as exc:
            hint = closest_name(value, [str(c) for c in action.choices or ()])
            if not hint:
                raise
            raise argparse.ArgumentError(action, f"{exc.message}{hint}") from None


def subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
                ) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """``(("convert", "hf-to-megatron"), parser)`` for every sub-command, nested ones included
    (the root parser itself first, with ``()``)."""
    yield path, parser
    for action in parser._actions:  # noqa: SLF001 - argparse keeps sub-parsers only here
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            for name, sub in action.choices.items():
                yield from subcommands(sub, (*path, name))


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace
                  ) -> argparse.ArgumentParser:
    """The (nested) sub-command parser ``args`` were parsed by."""
    for action in parser._actions:  # noqa: SLF001
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            name = getattr(args, action.dest, None)
            if name in action.choices:
                return chosen_parser(action.choices[name], args)
    return parser


def unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """``unrecognized arguments: --chek; did you mean '--check'?`` (the closest option of
    ``parser`` for each unknown ``--flag``)."""
    options = [o for a in parser._actions for o in a.option_strings]  # noqa: SLF001
    hints = [closest_name(x.split("=", 1)[0], options).removeprefix("; ")
             for x in extra if x.startswith("-")]
    hints = [h for h in hints if h]
    return f"unrecognized arguments: {' '.join(extra)}" + (f"; {'; '.join(hints)}" if hints
                                                           else "")
