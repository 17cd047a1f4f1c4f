"""The 4D device mesh (dp, pp, cp, tp; dp split into replicas x ep), its validation, and the logical->mesh axis rules."""
from mesh.errors import ConfigError
from mesh.mesh import AXES, CP, DATA, DP, EP, PP, TP, MeshConfig, make_mesh, mesh_summary
from mesh.rules import RULES, constrain, logical_to_spec, param_rules
from mesh.validate import validate_batch, validate_model

__all__ = [
    "AXES", "CP", "DATA", "DP", "EP", "PP", "TP", "ConfigError", "MeshConfig", "make_mesh", "mesh_summary",
    "RULES", "constrain", "logical_to_spec", "param_rules", "validate_batch", "validate_model",
]
