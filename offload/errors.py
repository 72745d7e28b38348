"""Exceptions raised by `offload`.

All of them derive from `OffloadError` (a `RuntimeError`), so a training loop can tell
a misuse of the library apart from an error of the model itself. docs/errors.md lists the
bad inputs and what each gets.
"""


class OffloadError(RuntimeError):
    """Misuse of the offloading API or a state in which offloading cannot be correct."""


class OffloadTypeError(OffloadError, TypeError):
    """An argument of the wrong type: a group name that is not a string, a chunk id that is
    not an int, a schedule given as a string."""


class OffloadValueError(OffloadError, ValueError):
    """An argument of the right type and a wrong value: a negative chunk id, a schedule that
    is not one, an ``attach`` mapping whose groups would nest in themselves."""


class UnknownModuleError(OffloadValueError):
    """A module name that the model does not have (a typo in the config or the flag)."""


class SavedTensorModifiedError(OffloadError):
    """A tensor saved for backward was changed in place before backward used it.

    Autograd raises the same error without offloading; with saved-tensor hooks it no longer
    checks, so the engine does.
    """
