"""Expected failures, each with its own exit code, and the command line's one-line report of them.

A user's mistake (a missing file, a full disk, a broken checkpoint) is not a bug: the command
line says in one line which file is at fault and what is wrong with it, and exits with a code
that tells the kinds apart. Only an unexpected error (a bug) prints a traceback, and only with
`--debug` or VACPACK_DEBUG=1.
"""

from __future__ import annotations

import errno
import os
import sys
import traceback
from collections.abc import Callable
from enum import IntEnum
from pathlib import Path

DEBUG_ENV = "VACPACK_DEBUG"


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1  # an unexpected error: a bug (--debug prints its traceback)
    USAGE = 2  # a bad flag or option value (argparse's own code too)
    FILE_NOT_FOUND = 3  # an input, an output's directory, a model directory
    PERMISSION_DENIED = 4  # no permission, or a read-only filesystem
    NO_SPACE = 5  # disk full, quota exceeded, or the file size limit reached
    IO_ERROR = 6  # any other error reading or writing a file
    OUTPUT_EXISTS = 7  # the output file holds something other than this input's results
    MODEL_NOT_FOUND = 8  # neither a local checkpoint nor found on the Hugging Face hub
    INVALID_CONFIG = 9  # config.json unreadable, invalid, or naming an unsupported model
    CORRUPT_WEIGHTS = 10  # a weights file that is not valid safetensors (truncated, damaged)
    WEIGHTS_MISMATCH = 11  # weights whose names or shapes disagree with config.json
    TOKENIZER_ERROR = 12  # tokenizer files missing or unusable
    INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)


class RequestFieldError(ValueError):
    """A request the engine refuses for one of its fields (an API error's `param`), found only
    where the model is known, such as a token id past its vocabulary."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


_ERRNO_EXIT_CODES = {
    errno.ENOENT: ExitCode.FILE_NOT_FOUND,
    errno.ENOTDIR: ExitCode.FILE_NOT_FOUND,
    errno.EACCES: ExitCode.PERMISSION_DENIED,
    errno.EPERM: ExitCode.PERMISSION_DENIED,
    errno.EROFS: ExitCode.PERMISSION_DENIED,
    errno.ENOSPC: ExitCode.NO_SPACE,
    errno.EDQUOT: ExitCode.NO_SPACE,
    errno.EFBIG: ExitCode.NO_SPACE,
}


class VacpackError(Exception):
    """An expected failure. Its message names the file (or value) at fault and the problem."""

    exit_code: ExitCode = ExitCode.INTERNAL


class FileAccessError(VacpackError):
    """Reading or writing a file failed (not found, no permission, disk full, ...)."""

    def __init__(self, action: str, path: str | os.PathLike[str], error: OSError) -> None:
        self.path = Path(path)
        self.errno = error.errno
        reason = error.strerror or str(error)
        super().__init__(f"cannot {action} {str(path)!r}: {reason}")
        self.exit_code = exit_code_for_errno(error.errno)


class OutputExistsError(VacpackError):
    """The output file exists and is not an earlier run's results for the same input."""

    exit_code = ExitCode.OUTPUT_EXISTS

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path = Path(path)
        super().__init__(
            f"output file {str(path)!r} exists and is not an earlier run's output for this input "
            f"({reason}); it was left untouched. Choose another output file, or pass --overwrite "
            "to replace it"
        )


# The checkpoint errors are ValueErrors too: "bad model argument" is what callers of the Python
# API have caught all along.
class ModelNotFoundError(VacpackError, ValueError):
    exit_code = ExitCode.MODEL_NOT_FOUND


class InvalidConfigError(VacpackError, ValueError):
    exit_code = ExitCode.INVALID_CONFIG


class CorruptWeightsError(VacpackError, ValueError):
    exit_code = ExitCode.CORRUPT_WEIGHTS


class WeightsMismatchError(VacpackError, ValueError):
    exit_code = ExitCode.WEIGHTS_MISMATCH


class TokenizerLoadError(VacpackError, ValueError):
    """A tokenizer could not be loaded; the message names the model id or path."""

    exit_code = ExitCode.TOKENIZER_ERROR


class TokenizerNotFoundError(TokenizerLoadError):
    """The name is neither a local model directory nor a Hub repo available here."""


def exit_code_for_errno(number: int | None) -> ExitCode:
    return _ERRNO_EXIT_CODES.get(number or 0, ExitCode.IO_ERROR)


def debug_requested(argv: list[str]) -> bool:
    return "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def describe(error: BaseException) -> tuple[ExitCode, str]:
    """The exit code for an error and its one-line message."""
    if isinstance(error, VacpackError):
        code, message = error.exit_code, str(error)
    elif isinstance(error, OSError):
        code = exit_code_for_errno(error.errno)
        where = f"{error.filename!r}: " if error.filename else ""
        message = f"{where}{error.strerror or error}"
    elif isinstance(error, ValueError):
        code, message = ExitCode.USAGE, str(error)
    else:
        code = ExitCode.INTERNAL
        message = (
            f"internal error: {type(error).__name__}: {error} (rerun with --debug or "
            f"{DEBUG_ENV}=1 for the traceback)"
        )
    return code, " ".join(message.split())  # one line, whatever the library wrote


def run_reporting_errors(command: str, run: Callable[[], int], debug: bool) -> int:
    """Runs a command; an error becomes one line on stderr and its exit code."""
    try:
        return run()
    except KeyboardInterrupt:
        print(f"vacpack {command}: interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except Exception as error:
        if debug:
            traceback.print_exc()
        code, message = describe(error)
        print(f"vacpack {command}: error: {message}", file=sys.stderr)
        return code
