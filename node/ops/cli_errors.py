"""User mistakes on the command line: one format, one line, exit code 2.

Every mistake a ``dtnode`` command reports, whether argparse finds it (an unknown flag, a value of
the wrong type, a choice not offered) or the settings do (``ConfigError``: an impossible value, a
missing file, a port in use), is one line on stderr::

    dtnode join: error: --inner-steps: must be >= 1, got 0
    dtnode join: error: --codec: must be one of none, fp16, bf16, int8, int4, topk, topk4, got 'int3'
    dtnode join: error: --inner-step: no such flag; did you mean --inner-steps?

the command, then what is at fault (the flag, or the file or environment variable a setting came
from), then what is wrong. Choice lists read the same wherever they come from ("must be one of A,
B, got X"), and a close miss (a typo'd flag, command or choice) is answered with the nearest
candidate (``difflib``).
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

EXIT_USAGE = 2

_FLAG_FIRST = re.compile(r"^(--[a-z][a-z0-9-]*(?:/--[a-z][a-z0-9-]*)?):? ")


def error_line(prog: str, message: str) -> str:
    """``message`` (one mistake) as the line ``PROG: error: WHAT: what is wrong``."""
    return f"{prog}: error: {what_is_wrong(message)}"


def what_is_wrong(message: str) -> str:
    """``message`` on one line as ``WHAT: what is wrong``, argparse's phrasings in this format."""
    text = " ".join(message.split())  # one line, whatever the message held
    text = re.sub(r"^argument ([^:]+): ", r"\1: ", text)  # argparse names "argument --x"
    text = re.sub(
        r"^(\S+): invalid (\w+) value: ", lambda m: f"{m[1]}: must be {_article(m[2])} {m[2]}, got ", text
    )
    return _FLAG_FIRST.sub(r"\1: ", text)  # "--x must be …" -> "--x: must be …"


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def choices_text(choices: Iterable[Any], value: object) -> str:
    """The one way a value outside a fixed set is described, with the nearest choice if one is close."""
    names = [str(choice) for choice in choices]
    close = difflib.get_close_matches(str(value), names, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"must be one of {', '.join(names)}, got {value!r}{hint}"


def unknown_text(extras: Sequence[str], known: Iterable[str], prog: str) -> str:
    """What argparse could not place: the first unknown flag, with the nearest known one."""
    flags = [extra.split("=", 1)[0] for extra in extras if extra.startswith("-")]
    if not flags:
        return f"unexpected argument{'s' if len(extras) > 1 else ''}: {' '.join(extras)} (see {prog} --help)"
    close = difflib.get_close_matches(flags[0], list(known), n=1)
    hint = f"; did you mean {close[0]}?" if close else f" (see {prog} --help)"
    return f"{flags[0]}: no such flag{hint}"


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; a user mistake here is one line (:func:`error_line`) and
    exit code 2.

    Flags are never matched by prefix: ``--inner-step 5`` is an error ("did you mean
    --inner-steps?"), not ``--inner-steps 5``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """As argparse's, but what this parser cannot place is an error here, where its flags are
        known: a subcommand's typo'd flag is answered by the subcommand's parser."""
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            known = [option for action in self._actions for option in action.option_strings]
            self.error(unknown_text(extras, known, self.prog))
        return parsed, extras

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            raise argparse.ArgumentError(action, choices_text(action.choices, value))

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, error_line(self.prog, message) + "\n")
