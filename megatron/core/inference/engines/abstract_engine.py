"""`AbstractEngine`: what every inference engine offers."""
import abc


class AbstractEngine(abc.ABC):
    """An engine turns prompts into completed requests."""

    @abc.abstractmethod
    def generate(self, *args, **kwargs):
        """Generate for the given prompts or requests."""


__all__ = ["AbstractEngine"]
