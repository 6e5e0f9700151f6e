"""autobatch: the largest per-device batch that trains, and a plan that reaches your global batch.

Public names are re-exported here; see ``__all__``.
"""

from __future__ import annotations

from .errors import AutobatchError, ConfigError, MinimumBatchError, MissingDependencyError, NoBatchFitsError
from .oom import is_oom_error
from .units import format_bytes, parse_bytes

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "AutobatchError",
    "ConfigError",
    "MinimumBatchError",
    "MissingDependencyError",
    "NoBatchFitsError",
    "is_oom_error",
    "format_bytes",
    "parse_bytes",
]
