"""Settings that scenario tests pin, so that the figures their docstrings quote hold."""

WHOLE_EXCHANGES = "parallel.ulysses_chunks=1"
"""USP head exchanges whole, as the planner costed them and the simulator played them when
these scenarios' figures were taken (`parallel.ulysses_chunks` runs them in 8 pieces by
default, which changes the levels the work policy keeps and the plans it makes)."""


def zeppelin_case(gpus: int, model: str, capacity: int, *overrides: str):
    """`bench scale`'s zeppelin on `gpus` GPUs of cluster A under FSDP, L = `capacity`,
    no K/V room, as that row runs: (config, topology, model shape)."""
    from ray_zep.config import load_config
    from ray_zep.sim.compare import variant_config
    from ray_zep.sim.hardware import Hardware
    from ray_zep.sim.step import RunModel
    from ray_zep.topology import build_topology

    config = load_config(None, ["topology.preset=cluster_a", f"topology.nodes={gpus // 8}",
                                f"model.preset={model}", "parallel.weights=fsdp",
                                f"train.tokens_per_rank={capacity}",
                                "parallel.ring_kv_room_mb=0", *overrides])  # fmt: skip
    config = variant_config(config, "zeppelin", capacity)
    topology = build_topology(config.topology)
    return config, topology, RunModel.create(config, Hardware.preset(topology)).shape
