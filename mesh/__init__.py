"""The 4D device mesh (dp, pp, cp, tp), its validation, and the logical->mesh axis rules."""
from mesh.errors import ConfigError
from mesh.mesh import AXES, CP, DP, PP, TP, MeshConfig, make_mesh, mesh_summary
from mesh.rules import RULES, constrain, logical_to_spec, param_rules
from mesh.validate import validate_batch, validate_model

__all__ = [
    "AXES", "CP", "DP", "PP", "TP", "ConfigError", "MeshConfig", "make_mesh", "mesh_summary",
    "RULES", "constrain", "logical_to_spec", "param_rules", "validate_batch", "validate_model",
]
