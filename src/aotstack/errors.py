"""Every error aotstack raises derives from :class:`AotstackError`."""

from __future__ import annotations

from typing import Any


class AotstackError(Exception):
    """Base of every error raised by aotstack."""


class ExportError(AotstackError):
    """A method could not be exported: it does not exist or ``torch.export`` refused it."""


class UnsupportedModelError(ExportError):
    """A model cannot be exported for the task asked: an unknown task, or an architecture export cannot trace."""


class ModelFolderError(AotstackError):
    """A model folder lacks a file an export needs, or asks to run code of its own; the message names it."""


class GenerationError(AotstackError):
    """Generation was asked for something it cannot do: a bad sampling setting, a prompt the cache cannot hold."""


class AudioFileError(AotstackError):
    """An audio file cannot be read (not a WAV, a compressed or float WAV, no samples) or written; the message names
    it."""


class QuantizationError(AotstackError):
    """A model cannot be quantized as asked: an unknown scheme, a group size that does not fit a layer, no torchao."""


class LoweringError(AotstackError):
    """A partition could not be lowered: bad partition, bad compile spec, failed compile."""


class CompileSpecError(LoweringError, ValueError):
    """A compile spec has a value its backend does not accept; the message names the spec."""


class MissingFallbackKernelsError(LoweringError):
    """A backend would need fallback kernels its target's runtime lacks (raised in strict mode).

    ``kernels`` maps each missing kernel, as an op name like ``aten.median.default``, to the
    nodes that need it; ``method`` names the method once it is known.
    """

    def __init__(self, backend_id: str, kernels: dict[str, list[str]], method: str | None = None) -> None:
        self.backend_id = backend_id
        self.kernels = {kernel: sorted(nodes) for kernel, nodes in sorted(kernels.items())}
        self.method = method
        super().__init__(self.message())

    def message(self) -> str:
        where = f"method {self.method!r}" if self.method else "the graph"
        listed = "; ".join(
            f"{kernel} (for {', '.join(nodes)})" if nodes else kernel for kernel, nodes in self.kernels.items()
        )
        return (
            f"{where} needs {len(self.kernels)} fallback kernel(s) that {self.backend_id}'s runtime lacks: "
            f"{listed}. Without strict=True these ops are left to plain ATen; the 'fallback_kernels' "
            "compile spec lists the kernels a target has"
        )

    def __reduce__(self) -> tuple[type, tuple[str, dict[str, list[str]], str | None]]:
        # Rebuilt from its fields, so it crosses from a compile worker process intact.
        return (type(self), (self.backend_id, self.kernels, self.method))

    def in_method(self, method: str) -> MissingFallbackKernelsError:
        return MissingFallbackKernelsError(self.backend_id, self.kernels, method)


class EngineCrashError(LoweringError):
    """An engine's process ended without a result: a signal (SIGSEGV, SIGFPE, SIGABRT), killed, or an exit.

    Lowering runs the engines' compiles, and auto-lowering the timing of each plan, in child
    processes, so a crash in an engine's native code ends only the child; the message names the
    engine, what it was doing and the signal. ``signal`` is the signal's name (``"SIGFPE"``), None
    where the child exited without one.
    """

    def __init__(self, message: str, signal: str | None = None) -> None:
        super().__init__(message)
        self.signal = signal

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:
        return (type(self), (str(self), self.signal))


class CheckError(LoweringError):
    """A lowered program's answers differ from eager PyTorch's past the tolerance.

    ``result`` (a ``CheckResult``) holds every difference measured; ``lowered`` is the lowered
    program, so it can still be inspected or saved.
    """

    def __init__(self, message: str, result: Any = None, lowered: Any = None) -> None:
        super().__init__(message)
        self.result = result
        self.lowered = lowered


class BackendNotFoundError(AotstackError):
    """No backend is registered under the id a delegate asks for."""


class DelegateInitError(AotstackError):
    """A delegate's engine could not be set up on this machine (a missing provider, a model it rejects)."""


class PackageError(AotstackError):
    """A file is not an aotstack package, is truncated, or holds a blob whose hash does not match."""


class SaveError(AotstackError, OSError):
    """A package could not be written where asked: its folder is missing or not writable, or the disk is full."""


class CustomOpError(AotstackError):
    """A file calls custom ops this process cannot run: not registered here, or not allowed in the plan.

    ``missing`` names the ops to register (by importing their module) before loading;
    ``not_allowed`` the ops a plan step calls, which ``load(..., allow_ops=[...])`` must name.
    """

    def __init__(self, message: str, missing: list[str] | None = None, not_allowed: list[str] | None = None) -> None:
        super().__init__(message)
        self.missing = list(missing or [])
        self.not_allowed = list(not_allowed or [])

    def __reduce__(self) -> tuple[type, tuple[str, list[str], list[str]]]:
        return (type(self), (str(self), self.missing, self.not_allowed))


class SignatureError(PackageError):
    """A package is unsigned, signed by a key that is not trusted, or its signature does not verify."""


class InputError(AotstackError, TypeError):
    """A method was called with the wrong number, dtype or shape of arguments."""


class RunError(AotstackError, RuntimeError):
    """A step of a loaded method failed while it ran; the message names the step or delegate."""


class MethodNotFoundError(AotstackError, AttributeError):
    """A method that the program does not have was asked for."""


def caused_by(error: BaseException, kind: type[BaseException]) -> bool:
    """Whether ``error``, or an exception it was raised from or while handling (torch and Inductor wrap what they
    catch), is a ``kind``."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, kind):
            return True
        seen = seen.__cause__ or seen.__context__
    return False
