"""Every quantkit error, in one module.

One root, :class:`QuantkitError`; each subclass also inherits the builtin it refines so callers that catch
``ValueError`` or ``EOFError`` keep working.  Errors carry the fields that locate the problem (path, tensor,
offset, field) and their message says what was being read, what was expected and what was found.
The CLI maps these types to one-line messages and exit codes (see ``quantkit.cli``).
"""
from __future__ import annotations

from pathlib import Path


class QuantkitError(Exception):
    """Root of every error quantkit raises on purpose."""

    def __init__(self, message: str, *, path: str | Path | None = None, tensor: str | None = None,
                 offset: int | None = None, field: str | None = None):
        self.path = str(path) if path is not None else None
        self.tensor = tensor
        self.offset = offset
        self.field = field
        self.detail = message
        super().__init__(self._render(message))

    def _render(self, message: str) -> str:
        where = []
        if self.path is not None:
            where.append(self.path)
        if self.tensor is not None:
            where.append(f"tensor {self.tensor!r}")
        if self.offset is not None:
            where.append(f"offset {self.offset}")
        if self.field is not None:
            where.append(f"field {self.field!r}")
        return f"{': '.join(where)}: {message}" if where else message


class SourceError(QuantkitError, ValueError):
    """A source checkpoint (safetensors, config, index) is missing, inconsistent or malformed."""


class MissingSourceError(SourceError, FileNotFoundError):
    """A file, shard or tensor that the source refers to does not exist."""


class FormatError(QuantkitError, ValueError):
    """A container or numeric format was violated (bad header, bad type id, bad block)."""


class TruncatedFileError(FormatError, EOFError):
    """A file ended before the structure it declares."""


class UnsupportedError(QuantkitError, NotImplementedError):
    """A valid request quantkit does not implement (an encoder for a type, an architecture)."""


class SupportError(UnsupportedError):
    """``convert --support KIND`` of a checkpoint that holds no such drafter, or whose map cannot write it
    (field ``support``).  ``validate`` of a support file re-planned from such a source reads it as a source that is
    not the drafter's checkpoint (the file records that quantkit made its kind from its own checkpoint)."""


class EncodeError(QuantkitError, ValueError):
    """Input to an encoder is unusable: NaN/Inf, bad imatrix, row length not a multiple of the block."""


class RecipeError(QuantkitError, ValueError):
    """A recipe is malformed or does not resolve to one type per tensor."""


class ValidationError(QuantkitError, ValueError):
    """Inputs that are each readable do not belong together: an imatrix of another model, a journal or resume
    state of other inputs, a sidecar of another checkpoint.  (A validation *report* that finds differences is
    not an exception: ``quantkit validate`` prints it and exits 1.)"""


class FixtureError(QuantkitError, ValueError):
    """A scoring fixture is incomplete, inconsistent or belongs to another checkpoint."""


class OutputExistsError(QuantkitError, FileExistsError):
    """The output file exists and overwriting was not requested."""


class MissingDependencyError(QuantkitError, ImportError):
    """An optional dependency a command needs is not installed; the message gives the command that installs it."""


class StateError(QuantkitError, RuntimeError):
    """An object was used out of order (e.g. a writer asked for payloads before its header was written)."""


class OutputPathError(QuantkitError, ValueError):
    """An output path cannot be used: it is (or links to) an input, it is a directory, or it is not writable."""


class ConcurrentWriteError(QuantkitError, RuntimeError):
    """Another process holds the output's lock, or renamed, replaced or removed a partial output in use."""


class OutOfSpaceError(QuantkitError, OSError):
    """The filesystem of an output is full (ENOSPC) or its quota is exhausted (EDQUOT)."""


class CorruptDataError(QuantkitError, ValueError):
    """Bytes differ from the size or SHA-256 recorded for them (a transport part or a download that is corrupt,
    truncated, or in another part's place): a check that ran and failed, exit code 1."""


class ClusterError(QuantkitError, RuntimeError):
    """A Ray cluster cannot be reached or started, or lost a worker more often than a task may be retried."""
