"""The error a bad input raises: one line naming the value and the fix, said once by the launching process.

It lives below every module that raises it (the config's checks, the cache directory's, the data's), so that none
of them imports another for it; `pipetune.config` re-exports it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the value and the fix."""
