"""`ray-zep bench scale-replay` with the planner's work model counting SHARE of what
`exposed_exchange` says pieces hide (0: the exchanges whole, as before the pieces; 0.81:
less the contention of 1.19 the simulator plays beside them; 1: the code's own).

Usage: python work_model_hidden_share.py SHARE bench scale-replay RECORD [overrides] --out DIR
"""
import sys
import numpy as np
import ray_zep.partition.work as work
import ray_zep.partition.guest_kernel as gk
from ray_zep.costmodel import BACKWARD_LINEAR_FACTOR
from ray_zep.cli import main
SHARE = float(sys.argv[1])
def exposed(forward, backward, projections, pieces):
    if pieces <= 1:
        return forward, backward
    hidden = (1.0 - 1.0 / pieces) * SHARE
    back = projections * BACKWARD_LINEAR_FACTOR
    return (forward - np.minimum(forward, projections) * hidden, backward - np.minimum(backward, back) * hidden)
work.exposed_exchange = exposed
orig = gk.costs_of
def costs_of(model):
    v = orig(model); v[gk.HIDDEN] *= SHARE; return v
gk.costs_of = costs_of
import ray_zep.partition.usp_guests as ug
if hasattr(ug, "costs_of"): ug.costs_of = costs_of
try:
    main(sys.argv[2:])
except SystemExit:
    pass
