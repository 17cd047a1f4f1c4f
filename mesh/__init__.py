"""The 4D device mesh (dp, pp, cp, tp; dp split into ZeRO groups' copies x replicas x ep), its validation, and the
logical->mesh axis rules."""
from mesh.errors import ConfigError
from mesh.mesh import AXES, CP, DATA, DP, EP, PP, RP, TP, ZERO, MeshConfig, make_mesh, mesh_summary
from mesh.rules import RULES, constrain, logical_to_spec, param_rules
from mesh.validate import validate_batch, validate_model

__all__ = [
    "AXES", "CP", "DATA", "DP", "EP", "PP", "RP", "TP", "ZERO", "ConfigError", "MeshConfig", "make_mesh",
    "mesh_summary",
    "RULES", "constrain", "logical_to_spec", "param_rules", "validate_batch", "validate_model",
]
