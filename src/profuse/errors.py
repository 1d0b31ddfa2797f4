"""Errors the command line turns into one clear line and exit status 2."""


class UsageError(ValueError):
    """Bad input from the user: a size, a device, a missing optional dependency.

    The message is one sentence that says what is wrong and, where it can, what to do.
    """
