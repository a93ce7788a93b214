"""Plan and simulate rows of `bench scale` at a given L and K/V room, one batch each
(seed 0, the planning checkpointing), and print step / bound.
usage: python fill_rows.py GPUS:DATA:MODEL:L:KV ...   (KV: model or 0)
env: FILL=1 budget-packed at 4k / L (what `bench scale` now sets); EXTRA="key=value ..."
     config overrides (e.g. parallel.prefetch_after_attention=false parallel.prefetch_depth=1);
     FWD=x the USP forward share the planner checks (default 1/3); DIAG=1 the slowest ranks."""
import sys, os, math, time, dataclasses
import numpy as np
from ray_zep.partition import work as W
if "FWD" in os.environ:
    W.FORWARD_SHARE = float(os.environ["FWD"])
    import ray_zep.partition.usp_grid as UG, ray_zep.partition.guest_kernel as GK, ray_zep.partition.usp_guests as UGS
    import ray_zep.partition.wide_guests as WG
    for m in (UG, GK, UGS, WG):
        if hasattr(m, "FORWARD_SHARE"): m.FORWARD_SHARE = W.FORWARD_SHARE
from ray_zep.bench import scale as S
from ray_zep.bench.scale_play import simulated_step
from ray_zep.config import load_config
from ray_zep.topology import build_topology
from ray_zep.sim.hardware import Hardware
from ray_zep.sim.bound import step_bound
rows = [r.split(":") for r in sys.argv[1:]]
out = []
for gpus, dist, model, L, kv in rows:
    gpus, L = int(gpus), int(L)
    room = [] if kv == "model" else [f"parallel.ring_kv_room_mb={kv}"]
    config = load_config(None, ["topology.preset=cluster_a", f"topology.nodes={gpus // 8}", f"model.preset={model}",
        f"train.tokens_per_rank={L}", "parallel.weights=fsdp", *room, *[x for x in os.environ.get("EXTRA", "").split() if x]])
    hardware = Hardware.preset(build_topology(config.topology))
    config = S.variant_config(config, "zeppelin", L)
    if os.environ.get("FILL"):
        from ray_zep.options import Packing
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_fill=4096 / L, packing=Packing.BUDGET))
    run = S.RunModel.create(config, hardware)
    run = dataclasses.replace(run, config=S._planning_checkpointing(config, hardware, run))
    lengths = S.batch_lengths(dist, 4096 * gpus, 0)
    sched = S.scheduler_of(S.VARIANTS["zeppelin"])
    plans, micro, remap, secs = S.plan_batch_timed(sched, lengths, run, 1)
    step = simulated_step(lengths, run, plans, micro, remap, False)
    b = step_bound(np.asarray(lengths), run)
    lv = [t.factor for t in plans[0].levels if t.outcome.value == "kept"]
    print(f"{gpus} {dist} {model} L={L} kv={kv}: step {step.step_seconds:.4f} /bound {step.step_seconds / b.seconds:.4f} level {lv}", flush=True)


    if os.environ.get("DIAG"):
        from ray_zep.sim.events import Lane
        plan = plans[0]
        for name, tl in (("fwd", step.forward), ("bwd", step.backward)):
            tasks = tl.graph.tasks
            ranks = len({t.rank for t in tasks})
            busy = np.array([tl.busy(r, Lane.COMPUTE) for r in range(ranks)])
            end = np.zeros(ranks)
            for i, t in enumerate(tasks):
                if t.lane is Lane.COMPUTE: end[t.rank] = max(end[t.rank], tl.end[i])
            print("  ", name, "makespan %.4f busiest compute %.4f mean %.4f; last end rank %d (busy %.4f)" % (tl.makespan, busy.max(), busy.mean(), end.argmax(), busy[end.argmax()]))
            r = int(end.argmax())
            items = [(p.seq, p.length, len(p.ranks), p.ulysses, p.exchange.name) for p in plan.placements if r in p.ranks]
            print("      items", items[:6], "nodes", sorted({q // 8 for p in plan.placements if r in p.ranks for q in p.ranks})[:8])
