"""The ``quantkit`` command: thin.  Parse arguments, call the library, print, map errors to exit codes.

Each command group lives in its own module of this package (``quantkit.cli.<name>``) and is attached to
:func:`main` in :data:`COMMAND_MODULES`, listed explicitly.

Exit codes: 0 success; 1 a check failed (validation found a difference); 2 unreadable or malformed input, or a
usage error; 3 a requested capability is not implemented.  Library errors print as one line; set
``QUANTKIT_DEBUG=1`` to see the traceback.
"""
from __future__ import annotations

import json
import os
import sys

import click

from .. import __version__
from ..errors import (FixtureError, FormatError, OutputExistsError, QuantkitError, RecipeError, SourceError,
                     UnsupportedError, ValidationError)

# One table: exception type -> (exit code, hint).  First match wins, so subclasses come first.
ERROR_TABLE: list[tuple[type[BaseException], int, str]] = [
    (OutputExistsError, 2, "pass --force to overwrite"),
    (ValidationError, 1, ""),
    (FormatError, 2, ""),
    (SourceError, 2, ""),
    (RecipeError, 2, ""),
    (FixtureError, 2, ""),
    (UnsupportedError, 3, ""),
    (QuantkitError, 2, ""),
    (FileNotFoundError, 2, ""),
    (PermissionError, 2, ""),
    (IsADirectoryError, 2, ""),
    (OSError, 2, ""),
    (MemoryError, 2, "the input asks for more memory than is available"),
]


def _exit_for(exc: BaseException) -> tuple[int, str]:
    for kind, code, hint in ERROR_TABLE:
        if isinstance(exc, kind):
            return code, hint
    return 2, ""


class _Group(click.Group):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.Abort, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - the one place errors become exit codes
            if os.environ.get("QUANTKIT_DEBUG"):
                raise
            code, hint = _exit_for(exc)
            message = " ".join(str(exc).split()) or type(exc).__name__
            if not isinstance(exc, QuantkitError):
                message = f"{type(exc).__name__}: {message}"
            click.echo(f"error: {message}" + (f" ({hint})" if hint else ""), err=True)
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
        click.echo(json.dumps(report, indent=1, default=str))
    else:
        click.echo(render(report, show_all=show_all))


# Modules that define extra commands, each exporting ``COMMANDS`` (a list of click commands or groups).
COMMAND_MODULES: tuple[str, ...] = ("recipes", "convert", "validate", "imatrix", "swapset", "score", "demo",
                                    "redialect")


def _attach_commands() -> None:
    import importlib

    for module_name in COMMAND_MODULES:
        for command in importlib.import_module(f"{__name__}.{module_name}").COMMANDS:
            main.add_command(command)


_attach_commands()

if __name__ == "__main__":
    main()
