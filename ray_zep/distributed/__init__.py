"""The ground floor of every distributed call: groups, meshes, waits and placement.

Every process group and DeviceMesh a run uses is built here, once, from the
topology (`Comm.create` for the world group, `Comm.with_groups` for the rest);
the rest of the package asks the Comm for them instead of creating its own.
"""

from ray_zep.distributed.comm import Comm
from ray_zep.distributed.group import Group
from ray_zep.distributed.groups import GroupNeeds, MeshShape, RankGroups

__all__ = ["Comm", "Group", "GroupNeeds", "MeshShape", "RankGroups"]
