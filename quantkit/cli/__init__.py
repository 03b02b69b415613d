"""The ``quantkit`` command: thin.  Parse arguments, call the library, print, map errors to exit codes.

Each command group lives in its own module of this package (``quantkit.cli.<name>``) and is attached to
:func:`main` in :data:`COMMAND_MODULES`, listed explicitly.

Exit codes, the same for every command (errors map through :data:`ERROR_TABLE`, first match wins):

====  ==========================================================================================================
0     success
1     a check ran and failed: ``validate`` found a difference, ``swapset status --record`` a missing sidecar,
      ``compare`` a regression by a blocker rule of its release gate (:mod:`quantkit.scoring.compare`),
      ``transport assemble``/``fetch`` bytes that differ from their manifest (a corrupt, truncated or reordered part),
      ``parity`` an engine output that diverges from the reference (:mod:`quantkit.scoring.parity`)
2     the input cannot be used: a missing, unreadable, truncated or malformed file (GGUF, safetensors, config.json,
      recipe, imatrix, fixture, sidecar, score table, compare policy or baseline), inputs that do not belong
      together (an imatrix of another model, a resume of other inputs, a fixture of another checkpoint), an output
      that exists, a bad option value
3     not available here: a capability quantkit does not implement, or an optional dependency that is not
      installed (the message gives the ``pip install`` line)
130   interrupted (Ctrl-C); ``convert`` keeps the partial output and its journal for ``--resume``
141   the output pipe was closed (``quantkit recipes | head``): no message
====  ==========================================================================================================

An error prints one line, ``error: <file or tensor or field>: <what was expected and found>``, never a Python
exception name or traceback; an unexpected exception prints ``error: internal error: ...`` (exit 2).  Set
``QUANTKIT_DEBUG=1`` to see the traceback.
"""
from __future__ import annotations

import os
import sys

import click

from ..io import jsontext
from .. import __version__
from ..errors import (CorruptDataError, FixtureError, FormatError, MissingDependencyError, OutputExistsError, QuantkitError,
                      RecipeError, SourceError, UnsupportedError, ValidationError)

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UNAVAILABLE = 3
EXIT_INTERRUPTED = 130     # 128 + SIGINT, as shells report it
EXIT_BROKEN_PIPE = 141     # 128 + SIGPIPE

# One table: exception type -> (exit code, hint).  First match wins, so subclasses come first.
ERROR_TABLE: list[tuple[type[BaseException], int, str]] = [
    (OutputExistsError, EXIT_BAD_INPUT, "pass --force to overwrite"),
    (MissingDependencyError, EXIT_UNAVAILABLE, ""),
    (CorruptDataError, EXIT_CHECK_FAILED, ""),
    (UnsupportedError, EXIT_UNAVAILABLE, ""),
    (ValidationError, EXIT_BAD_INPUT, ""),
    (FormatError, EXIT_BAD_INPUT, ""),
    (SourceError, EXIT_BAD_INPUT, ""),
    (RecipeError, EXIT_BAD_INPUT, ""),
    (FixtureError, EXIT_BAD_INPUT, ""),
    (QuantkitError, EXIT_BAD_INPUT, ""),
    (ImportError, EXIT_UNAVAILABLE, ""),
    (OSError, EXIT_BAD_INPUT, ""),
    (UnicodeDecodeError, EXIT_BAD_INPUT, ""),
    (MemoryError, EXIT_BAD_INPUT, "the input asks for more memory than is available"),
]


def _exit_for(exc: BaseException) -> tuple[int, str]:
    for kind, code, hint in ERROR_TABLE:
        if isinstance(exc, kind):
            return code, hint
    return EXIT_BAD_INPUT, ""


def error_line(exc: BaseException) -> str:
    """The one line printed for ``exc`` (without ``error: `` and the hint): what and where, no exception class."""
    if isinstance(exc, QuantkitError):
        text = str(exc)
    elif isinstance(exc, ImportError):
        from ..extras import RUNTIME_MODULES, runtime_message

        root = (exc.name or "").split(".")[0]
        text = (runtime_message("this command") if root in RUNTIME_MODULES
                else f"a required module is not installed: {exc.name or exc}")
    elif isinstance(exc, OSError) and exc.strerror:
        where = ": ".join(str(f) for f in (exc.filename, exc.filename2) if f is not None)
        text = f"{where}: {exc.strerror}" if where else exc.strerror
    elif isinstance(exc, UnicodeDecodeError):
        text = f"input is not UTF-8 text ({exc.reason} at byte {exc.start})"
    elif isinstance(exc, MemoryError):
        text = "out of memory"
    else:
        text = f"internal error: {exc or type(exc).__name__} (QUANTKIT_DEBUG=1 shows the traceback; please report it)"
    return " ".join(text.split())


def one_output(option: os.PathLike | None, argument: os.PathLike | None) -> os.PathLike:
    """The output named by ``-o`` or by the positional argument (older scripts), exactly once."""
    if option is not None and argument is not None and option != argument:
        raise click.BadParameter(f"two outputs given ({argument} and -o {option})", param_hint="-o/--output")
    if option is None and argument is None:
        raise click.BadParameter("name the output with -o/--output", param_hint="-o/--output")
    return option if option is not None else argument


def _quiet_stdout() -> None:
    """After the reader of stdout went away: no further write or the final flush may raise."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):   # not a real file (tests capture output in memory)
        pass


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            result = super().invoke(ctx)
            sys.stdout.flush()   # a closed pipe shows here, not at interpreter exit
            return result
        except click.UsageError as exc:   # one line, as every other error (click adds usage and a blank line)
            where = exc.ctx.command_path if exc.ctx is not None else ctx.command_path
            click.echo(f"error: {' '.join(exc.format_message().split())} (see {where} --help)", err=True)
            sys.exit(exc.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except BrokenPipeError:
            _quiet_stdout()
            sys.exit(EXIT_BROKEN_PIPE)
        except Exception as exc:  # noqa: BLE001 - the one place errors become exit codes
            if os.environ.get("QUANTKIT_DEBUG"):
                raise
            code, hint = _exit_for(exc)
            click.echo(f"error: {error_line(exc)}" + (f" ({hint})" if hint else ""), err=True)
            sys.exit(code)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="quantkit")
def main():
    """quantkit: convert, validate and score quantized MoE model artifacts."""


@main.command()
@click.argument("path", type=click.Path(exists=True, dir_okay=True))
@click.option("--json", "as_json", is_flag=True, help="print the report as JSON")
@click.option("--all", "show_all", is_flag=True, help="list every tensor (default: summarize long tables)")
def inspect(path, as_json, show_all):
    """Show what is inside a GGUF file or a safetensors checkpoint."""
    from ..inspect import describe, render

    report = describe(path)
    if as_json:
        click.echo(jsontext.dumps(report, indent=1, default=str))
    else:
        click.echo(render(report, show_all=show_all))


# Modules that define extra commands, each exporting ``COMMANDS`` (a list of click commands or groups).
COMMAND_MODULES: tuple[str, ...] = ("recipes", "convert", "validate", "imatrix", "swapset", "score", "demo",
                                    "redialect", "transport", "generate", "parity")


def _attach_commands() -> None:
    import importlib

    for module_name in COMMAND_MODULES:
        for command in importlib.import_module(f"{__name__}.{module_name}").COMMANDS:
            main.add_command(command)


_attach_commands()


def run() -> None:
    """The ``quantkit`` command: :data:`main`, then, once torch is loaded, an exit without the interpreter's
    teardown of torch and transformers (about a second, as long as some commands' work on the bundled example).
    By then every output is written, renamed and closed, and no worker is left: only stdout and stderr need a
    flush."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    if "torch" not in sys.modules:
        sys.exit(code)
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # the reader went away: nothing more to show
            pass
    os._exit(code or 0)


if __name__ == "__main__":
    run()
