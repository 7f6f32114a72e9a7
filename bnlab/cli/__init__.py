"""The ``bnlab`` command line: parse, validate, call the library, print.

Each command lives in its own module ``bnlab/cli/_cmd_<name>.py`` exposing
``add_parser(subparsers)``; the parser's ``func`` default is called with the
parsed arguments and returns the process exit code.  Modules are discovered
here, so adding a command touches no other file.  No computation lives in the
CLI: every command calls a public function of the library.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from bnlab import __version__
    from bnlab.cli._common import BnlabParser

    parser = BnlabParser(
        prog="bnlab",
        description="Batch normalization theory, simulation and experiments.",
    )
    parser.add_argument("--version", action="version", version=f"bnlab {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    package = importlib.import_module(__name__)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_cmd_"):
            importlib.import_module(f"{__name__}.{info.name}").add_parser(sub)
    _remember_parsers(sub)
    return parser


def _remember_parsers(sub: argparse._SubParsersAction) -> None:
    """Each (sub)command's parser as the default ``_parser`` of its namespace: errors found after parsing
    (an unknown option, a value the library refuses) print that command's usage, not bnlab's.  A command
    without a description gets its one-line help as one."""
    helps = {a.dest: a.help for a in sub._choices_actions}
    for name, p in sub.choices.items():
        p.set_defaults(_parser=p)
        if not p.description and helps.get(name):  # `bnlab X --help` says what X does
            p.description = helps[name][0].upper() + helps[name][1:] + "."
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                _remember_parsers(action)


def _warning_printer(command: str):
    """Warnings as one line naming the command (not Python's ``path:line: Category: text`` + source line)."""

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"bnlab {command}: warning: {message}", file=file or sys.stderr)

    return show


def main(argv: list[str] | None = None) -> int:
    import warnings

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    command_parser = getattr(args, "_parser", parser)
    if unknown:
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    previous = warnings.showwarning
    warnings.showwarning = _warning_printer(args.command)
    try:
        from bnlab.cli._common import apply_threads

        apply_threads(args)  # --threads of the long-running commands, checked and applied before any work
        return int(args.func(args) or 0)
    except ValueError as exc:
        # Bad input is reported as a usage error of the command, with the library's message.
        command_parser.print_usage(sys.stderr)
        command_parser.exit(2, f"bnlab {args.command}: error: {exc}\n")
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        # Sizes are checked against --max-memory-gb before allocating; this is the last line of defence.
        print(f"bnlab {args.command}: error: out of memory; use smaller sizes", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # `bnlab ... | head` closed the pipe: not an error of ours. Point stdout at devnull so the
        # interpreter's final flush does not raise again.
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:
        # A file-system or network failure is the environment's, not a bug: say what failed, no traceback.
        what = f"{exc.strerror} ({exc.filename})" if exc.strerror and exc.filename else str(exc)
        print(f"bnlab {args.command}: error: {what}", file=sys.stderr)
        return 1
    finally:
        warnings.showwarning = previous


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
