"""Every error aotstack raises derives from :class:`AotstackError`."""

from __future__ import annotations


class AotstackError(Exception):
    """Base of every error raised by aotstack."""


class ExportError(AotstackError):
    """A method could not be exported: it does not exist or ``torch.export`` refused it."""


class LoweringError(AotstackError):
    """A partition could not be lowered: bad partition, bad compile spec, failed compile."""


class BackendNotFoundError(AotstackError):
    """No backend is registered under the id a delegate asks for."""


class DelegateInitError(AotstackError):
    """A delegate's engine could not be set up on this machine (a missing provider, a model it rejects)."""


class PackageError(AotstackError):
    """A file is not an aotstack package, is truncated, or holds a blob whose hash does not match."""


class InputError(AotstackError, TypeError):
    """A method was called with the wrong number, dtype or shape of arguments."""


class MethodNotFoundError(AotstackError, AttributeError):
    """A method that the program does not have was asked for."""
