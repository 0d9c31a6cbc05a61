"""The exceptions kernel_pytorch raises; each names what went wrong and what to do."""

from __future__ import annotations

__all__ = ["KernelPytorchError", "ConfigError", "HardwareUnavailableError", "PassError", "UnknownPassError", "first_line"]


class KernelPytorchError(Exception):
    """Base class of the errors this library raises on purpose."""


class ConfigError(KernelPytorchError, ValueError):
    """An option of a config (``OptimizeConfig``, or one inside it) has a value it does not take.

    One line per wrong option, naming the option, the value given and what it takes; raised in place of
    pydantic's ``ValidationError``, which lists one entry per member of a Union in pydantic's type names.
    """

    def __init__(self, *problems: str):
        self.problems = problems
        super().__init__("\n".join(problems))


class HardwareUnavailableError(KernelPytorchError, RuntimeError):
    """A device was asked for (config ``device=`` or ``KERNEL_PYTORCH_DEVICE``) but its probe failed."""


class PassError(KernelPytorchError, RuntimeError):
    """A graph or module pass raised; the message names the pass and the graph it ran on."""

    def __init__(self, pass_name: str, where: str, cause: BaseException):
        self.pass_name = pass_name
        self.where = where
        super().__init__(f"pass '{pass_name}' failed on {where}: {type(cause).__name__}: {cause}")


class UnknownPassError(KernelPytorchError, KeyError):
    """A pass name in the config is not registered."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def first_line(error: BaseException) -> str:
    """``Type: first line of the message``: CUDA and Dynamo errors append pages of advice to theirs."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else 'no message'}"
