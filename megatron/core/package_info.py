"""Version information for the `megatron.core` library (Megatron Core 0.13.1's fields).

The version is the Megatron Core release whose surface this library reproduces, so code that checks
`megatron.core.package_info.__version__` takes its 0.13.1 branches; the descriptive fields name this project.
"""

MAJOR = 0
MINOR = 13
PATCH = 1
PRE_RELEASE = ""

VERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)
"""(major, minor, patch, pre-release tag)."""

__shortversion__ = ".".join(map(str, VERSION[:3]))
__version__ = __shortversion__ + "".join(VERSION[3:])
__package_name__ = "megatron_core"
__contact_names__ = "megatron-lite developers"
__contact_emails__ = ""
__homepage__ = ""
__repository_url__ = ""
__download_url__ = ""
__description__ = "Megatron Core compatible library on plain PyTorch"
__license__ = "Apache-2.0"
__keywords__ = "deep learning, machine learning, gpu, NLP, NLU, language, transformer, pytorch, torch, megatron"
