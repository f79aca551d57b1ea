"""Version information for the `megatron.core` library."""

MAJOR = 0
MINOR = 13
PATCH = 1

__version__ = f"{MAJOR}.{MINOR}.{PATCH}"
__package_name__ = "megatron_core"
__description__ = "Megatron Core compatible library on plain PyTorch"
