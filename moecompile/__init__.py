"""moecompile: a compiler for Mixture-of-Experts training.

A dense PyTorch model goes in; passes over a ``torch.fx`` graph turn its FFNs into
routed experts; a training step comes out::

    import moecompile as mc
    result = mc.convert(model, mc.Plan.from_dict({"experts": {"num_experts": 8, "top_k": 2}}), (ids,))
    print(result.report())
"""

# core: what passes build on
from .errors import DistributedError, KernelError, MoecompileError, PassError, PlanError, TraceError
from .meta import Role
from .pass_manager import Options, PassContext, PassSpec, register_pass, register_verifier, registered_passes
from .plan import Plan
from .frontend import trace
from . import distributed  # World, init, world_from_plan, expert_shards, reduce_gradients
from .distributed import ExpertShard, World
from .memory import measure_memory

# driver: built on the passes
from .memory_estimate import MemoryEstimate, estimate_memory
from .convert import ConversionResult, convert
from .diff import diff
from . import visualize  # the package is callable: mc.visualize(result, "graph.html")
from .train_step import StepMetrics, TrainStep, build_train_step
from .adamw import AdamW
from .export_hf import export_hf
from .planner import plan_for

__all__ = [
    "ConversionResult", "DistributedError", "KernelError", "MoecompileError", "Options", "PassContext",
    "PassError", "PassSpec", "Plan", "PlanError", "Role", "TraceError", "convert", "diff", "register_pass",
    "register_verifier", "registered_passes", "trace", "visualize",
]
__all__ += ["StepMetrics", "TrainStep", "build_train_step", "export_hf", "AdamW"]
__all__ += ["MemoryEstimate", "estimate_memory", "measure_memory"]
__all__ += ["ExpertShard", "World", "distributed"]
__all__ += ["plan_for"]
__version__ = "0.1.0"
