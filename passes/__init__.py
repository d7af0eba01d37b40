"""Built-in passes; importing this package registers them with the pass manager."""

from . import find_ffn, import_moe, upcycle  # noqa: F401
from . import fp8, recompute  # noqa: F401
from . import expert_parallel  # noqa: F401
from . import overlap  # noqa: F401
