"""Exceptions raised by shmps.

Every error is a :class:`shmps.Error` and also a subclass of the matching builtin, so
``except KeyError`` or ``except ValueError`` keep working.  Each carries a ``hint``
saying what to do; ``str(err)`` is the message followed by the hint.

C functions return ``0`` or a negative ``SHMPS_E_*`` code (positive values are errnos);
:func:`shmps._native.check` maps a code to the class here, specific codes first.
"""
from __future__ import annotations


class Error(Exception):
    """Base class of every shmps error."""

    hint: str = ""

    def __init__(self, message: str, hint: str | None = None) -> None:
        self.message = message
        if hint is not None:
            self.hint = hint
        super().__init__(message)

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def told(self, hint: str | None) -> str:
        """``str(self)`` for a reader outside Python (a command line, an HTTP client):
        InvalidArgument's default hint points at a docstring that reader does not have,
        so ``hint`` (None: no hint) takes its place; any other hint stays."""
        if self.hint != InvalidArgument.hint:
            return str(self)
        return f"{self.message} ({hint})" if hint else self.message


class InvalidArgument(Error, ValueError):
    """An argument is malformed (bad name, bad option, non-finite gradient, ...)."""

    hint = "check the argument against the docstring"


class SchemaError(InvalidArgument):
    """Shape, dtype, kind or optimizer does not match the tensor (or the request)."""

    hint = "pass the same shape/dtype/optimizer as the tensor's creator, or use a new name"


class OutOfRange(InvalidArgument, IndexError):
    """A row index is negative or not below the row count."""

    hint = "rows must be integers in [0, nrows); negative indexing is not supported"


class NonFinite(InvalidArgument):
    """A gradient holds NaN or Inf and the tensor does not allow it."""

    hint = "fix the gradient, or create the tensor with allow_nonfinite=True"


class NotFound(Error, KeyError):
    """No store, tensor or file by that name."""

    hint = "check the name with store.tensors() or `shmps-tool ls`"

    def __str__(self) -> str:  # KeyError would repr() the message
        return Error.__str__(self)


class CapacityError(Error, RuntimeError):
    """A table (or a fixed area of a segment) is full; nothing was changed."""

    hint = "create the table with a larger capacity, or evict cold rows with table.evict()"


class CorruptSegment(Error, ValueError):
    """A shared-memory segment is not a valid shmps segment of this layout version."""

    # (`shmps-tool gc` alone skips a store whose manifest it cannot read, and destroy()
    # needs a store that attaches: the hint said "`shmps-tool gc` or store.destroy()")
    hint = ("the segment was not written by this shmps version or is damaged; remove the "
            "store once no process uses it: store.destroy(), or `shmps-tool gc --corrupt` "
            "where its manifest is the damaged segment")


class CorruptFile(Error, ValueError):
    """A matrix file set or checkpoint is malformed; the message names file and position."""

    hint = "rewrite the file set, or pass --rowcnt-dtype/--colidx-dtype/--value-dtype/--cols"


class Timeout(Error, TimeoutError):
    """A bounded wait ran out (creation, lock, clock, flush)."""

    hint = "a peer may be stuck (SIGSTOP?) or overloaded; retry or raise the timeout"


class Busy(Timeout):
    """A call that must not wait found what it needs held by another process, and
    changed nothing (internal: a bridge's apply to an aggregated tensor while a worker
    pushes a round, which the bridge answers BUSY and its sender sends again)."""

    hint = "try again shortly"


class Closed(Error, ValueError):
    """The store or tensor was closed in this process."""

    hint = "attach again with shmps.attach(name)"


class PushesLost(Error, RuntimeError):
    """``store.flush()``: pushes it waited for were taken by a bridge process that ended
    before their owner acknowledged them (SIGKILL, a crash), or by a drain that failed
    part way (a corrupt outbox shard), or refused for good by their owner (a batch it
    cannot apply: the bridge logs why): they may or may not have been applied, and
    nobody can resend them."""

    hint = ("the parameters may lack these pushes: restore a checkpoint, or accept the "
            "loss and go on (later flushes are not affected)")


__all__ = [
    "Error", "InvalidArgument", "SchemaError", "OutOfRange", "NonFinite", "NotFound",
    "CapacityError", "CorruptSegment", "CorruptFile", "Timeout", "Closed", "PushesLost",
]
