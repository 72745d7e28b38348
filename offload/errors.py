"""Exceptions raised by `offload`.

All of them derive from `OffloadError` (a `RuntimeError`), so a training loop can tell
a misuse of the library apart from an error of the model itself.
"""


class OffloadError(RuntimeError):
    """Misuse of the offloading API or a state in which offloading cannot be correct."""


class UnknownModuleError(OffloadError, ValueError):
    """A module name that the model does not have (a typo in the config or the flag)."""


class SavedTensorModifiedError(OffloadError):
    """A tensor saved for backward was changed in place before backward used it.

    Autograd raises the same error without offloading; with saved-tensor hooks it no longer
    checks, so the engine does.
    """
