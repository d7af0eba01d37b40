"""Built-in passes; importing this package registers them with the pass manager."""

from . import find_ffn, upcycle  # noqa: F401
