"""Errors the command line turns into one clear line and exit status 2."""


class UsageError(ValueError):
    """Bad input from the user: a size, a device, a missing optional dependency.

    The message is one sentence that says what is wrong and, where it can, what to do.
    """


class UnsupportedModel(UsageError):
    """A model profuse cannot fuse exactly (an unknown layout, an offset norm, a non-SiLU MLP,
    a model already fused). Raised before anything is changed: the model is left as it was.
    The message is one line: the model, what is off, and why it matters."""
