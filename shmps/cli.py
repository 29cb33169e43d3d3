"""``shmps-tool``: one verb per function, errors as one line on stderr, exit 2.

Verbs live beside the code they inspect: file verbs in :mod:`shmps.cli_files`,
store verbs in :mod:`shmps.cli_store`, the bridge's member list in
:mod:`shmps.cli_bridge`.  Each of those modules has
``register(subparsers)`` adding its parsers with ``set_defaults(func=verb)``;
a verb takes the parsed namespace and returns an exit status.
"""
from __future__ import annotations

import argparse
import codecs
import os
import sys
from typing import Sequence

from .errors import Error

PROG = "shmps-tool"
#: set (to anything but empty) to see the traceback of an internal error
TRACEBACK_ENV = "SHMPS_TOOL_TRACEBACK"


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as ``shmps-tool: error: ...`` with exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        # argparse (before Python 3.13) takes a value such as '-1:' for an option, so
        # `--rows -1:` ends here instead of at --rows's own "no negative indexing" check
        if message == "argument --rows: expected one argument":
            message += (" (--rows takes A:B, A:, :B or A, with rows >= 0: no negative "
                        "indexing; a value that starts with '-' must be attached: --rows=V)")
        elif not message.endswith(")"):
            message += f" (see {self.prog} --help)"
        raise _UsageError(message)


class _UsageError(Exception):
    pass


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Inspect and manage shmps stores and binary matrix files.",
        epilog="examples:\n  shmps-tool ls\n  shmps-tool dump data/X --format summary\n"
               "  shmps-tool checkpoint model ckpt/\n  shmps-tool gc --dry-run",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=_Parser)
    sub.required = True
    from . import cli_bridge, cli_files, cli_store

    cli_store.register(sub)
    cli_files.register(sub)
    cli_bridge.register(sub)
    return parser


def fail(message: str) -> int:
    """Print ``shmps-tool: error: <message>`` (one line) and return exit status 2."""
    line = " ".join(str(message).split())
    print(f"{PROG}: error: {line}", file=sys.stderr)
    return 2


#: the error handler of stdout (see _escape_unencodable)
STDOUT_ERRORS = "shmps-escape"


def _escape_unencodable(exc: UnicodeError) -> tuple[str, int]:
    """What stdout's encoding cannot hold, escaped instead of failing the verb after its
    work is done: a file name's undecodable bytes as they were (surrogateescape: a path
    given as ``$'\\xff.npy'``, printed in a UTF-8 locale whose stdout is strict),
    anything else as a backslash escape (a lone surrogate in a .meta's JSON,
    ``"\\ud800"``, or in a bridge's answer)."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    try:
        return codecs.lookup_error("surrogateescape")(exc)
    except UnicodeEncodeError:
        return codecs.backslashreplace_errors(exc)


codecs.register_error(STDOUT_ERRORS, _escape_unencodable)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``shmps-tool``; returns the exit status."""
    args = None
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:   # (not a StringIO of a test's redirect_stdout)
        reconfigure(errors=STDOUT_ERRORS)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except _UsageError as exc:
        return fail(str(exc))
    except Error as exc:
        return fail(exc.told(f"see {PROG} {getattr(args, 'verb', None) or ''} --help"
                             .replace("  ", " ")))
    except KeyboardInterrupt:
        return fail("interrupted")
    except BrokenPipeError:
        return 0
    except OSError as exc:
        return fail(f"{exc.filename + ': ' if exc.filename else ''}{exc.strerror or exc}")
    except MemoryError:
        return fail("out of memory (the input may declare sizes larger than it holds: check "
                    "it with `shmps-tool check`; or limit the output with --rows/--head)")
    except Exception as exc:
        # Not a shmps error: input that should have been refused with one, or a bug.
        # One line all the same (exit 1 tells it from a refused input); the traceback
        # is one environment variable away.
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"{PROG}: error: internal error: {type(exc).__name__}: "
              f"{' '.join(str(exc).split())} (this is a bug in {PROG}: please report it "
              f"with the command line; {TRACEBACK_ENV}=1 shows the traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
