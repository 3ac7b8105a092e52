"""The exception types fastwan raises for a user's mistake.

Rule: an error whose cause is the caller's input, files or environment (a bad argument, a checkpoint that does
not fit, an output path that cannot be written, a backend that cannot run here) is a :class:`UserError`, and its
message names the value, the rule and the fix. The CLI prints a user error as one line and exits 2; any other
exception is a bug and keeps its traceback. Each concrete class also derives from the builtin a Python caller
would catch (``ValueError``, ``FileNotFoundError``, ...), so ``except ValueError`` keeps working. A check that
knows which request field it refuses says so (``field=``); callers read the field from it, never from the message.
Every check a request goes through before any compute (its fields' rules and the checkpoint's, at ``resolve``) sets
it; an error about a combination of fields names the field its message names first (the value it refuses), except
that a rule about a field the caller did not give (``image= / last_image=`` with only a last image) names the one
given.
"""
from __future__ import annotations

import argparse
import sys

USER_ERROR_EXIT = 2  # the exit code of a command that stops on a user error
INTERRUPT_EXIT = 130  # the exit code of a command stopped by Ctrl-C (128 + SIGINT, as a shell reports it)


class UserError(Exception):
    """Base of every error caused by the caller's input, files or environment. ``field``: the request field the
    error is about when the check that raises knows it (a server names it as the error's ``param``), else None."""

    def __init__(self, *args, field: str | None = None):
        super().__init__(*args)
        self.field = field


class InvalidArgument(UserError, ValueError):
    """An argument's value breaks a rule (range, form, combination)."""


class InvalidArgumentType(UserError, TypeError):
    """An argument has the wrong type."""


class CheckpointError(UserError, ValueError):
    """A checkpoint's files or metadata do not describe a model fastwan can load."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder the call names or needs does not exist (a model folder, a checkpoint component, a shard)."""


class OutputPathError(UserError, OSError):
    """The requested output destination cannot be written (raised before any compute)."""


class OutputExistsError(OutputPathError, FileExistsError):
    """The output file exists and overwriting was not asked for."""


class VideoWriteError(OutputPathError):
    """The video encoder failed or wrote nothing (after compute); the destination was left unchanged."""


def report_interrupt(who: str = "") -> int:
    """Say on one stderr line that the command was stopped by Ctrl-C (``who``: e.g. 'rank 1: ') -> its exit
    code, :data:`INTERRUPT_EXIT`."""
    print(f"fastwan: {who}interrupted", file=sys.stderr)
    return INTERRUPT_EXIT


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (a multi-line message's lines joined with '; ')."""
    lines = [ln.strip() for ln in str(exc).splitlines()]
    lines = [ln[2:].strip() if ln.startswith("- ") else ln for ln in lines]  # a "- " bullet, not "--flag" or "-1"
    out = ""
    for ln in filter(None, lines):
        out += ln if not out else (" " if out.endswith(":") else "; ") + ln
    return out or type(exc).__name__


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are user errors: one line on stderr, ``fastwan: error: <message> (see '<prog>
    --help')``, exit code 2, no usage dump. Every fastwan command's errors start alike, whatever its program name
    (``fastwan env``, ``python -m fastwan.profiler``, an example's script)."""

    label = "fastwan"

    def error(self, message: str):
        print(f"{self.label}: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
