"""The error every validation failure raises, on every rank alike."""


class StateDictError(ValueError, RuntimeError):
    """A state dict, or options, that cannot be loaded as given.

    It is a ``ValueError`` (bad input) and a ``RuntimeError`` (what torch
    raises for missing or unexpected keys), so existing handlers of either
    keep working. Nothing has been changed when it is raised.
    """
