"""The modelled step of `ray-zep bench zipccl`: links, codec, overlap (rules in `zipccl.py`).

Units: bytes, seconds, FLOPs. `ratios=None` models NCCL's plain collectives; a
`Ratios` models ZipCCL's zipped ones with those measured ratios.
"""

from __future__ import annotations

from dataclasses import dataclass

from ray_zep.bench.zipccl import Assumptions, DenseModel, MoEModel, Ratios, Setup, check_gpus
from ray_zep.costmodel import codec_rule_bytes_s

BF16_BYTES = 2
FP32_BYTES = 4


@dataclass(frozen=True)
class StepTimes:
    """One modelled step of one GPU, seconds.

    Attributes:
        compute_s: compute of the step (forward + backward).
        collective_s: the collectives the paper's communication figure times (FSDP:
            all-gathers; MoE: all-to-alls), codec time included.
        other_comm_s: the other collectives (FSDP reduce-scatters; MoE gradient all-reduce).
        step_s: the step, overlap applied.
        nic_bytes: bytes of the `collective_s` collectives through one node's NIC.
    """

    compute_s: float
    collective_s: float
    other_comm_s: float
    step_s: float
    nic_bytes: float


def ring_seconds(total_bytes: float, setup: Setup, alpha_s: float) -> float:
    """Ring all-gather or reduce-scatter of a tensor of `total_bytes` (gathered size)."""
    n = setup.gpus
    return (n - 1) * alpha_s + ring_nic_bytes(total_bytes, setup) / setup.testbed.nic_bytes_s


def ring_nic_bytes(total_bytes: float, setup: Setup) -> float:
    """Bytes a ring collective moves through each node's NIC, each way."""
    return (setup.gpus - 1) / setup.gpus * total_bytes


def all_to_all_seconds(bytes_per_gpu: float, setup: Setup, alpha_s: float) -> float:
    """All-to-all in which each GPU sends `bytes_per_gpu`, evenly over all GPUs."""
    return alpha_s + all_to_all_nic_bytes(bytes_per_gpu, setup) / setup.testbed.nic_bytes_s


def all_to_all_nic_bytes(bytes_per_gpu: float, setup: Setup) -> float:
    """Bytes an all-to-all sends through each node's NIC: its GPUs' shares for other nodes."""
    n, g = setup.gpus, setup.testbed.gpus_per_node
    return g * bytes_per_gpu * (n - g) / n


def codec_bytes_s(setup: Setup, ratio: float, spec: Assumptions) -> float:
    """Modelled GPU codec rate (original bytes/s), compress and decompress alike: a share
    of DRAM bandwidth spent reading the original and writing the packed bytes."""
    return codec_rule_bytes_s(setup.testbed.dram_gbytes_s * 1e9, ratio, spec.codec_dram_fraction)


def flops_per_s(setup: Setup, spec: Assumptions) -> float:
    """Achieved FLOP/s of one GPU."""
    return setup.testbed.peak_tflops * 1e12 * spec.mfu


def two_stream_seconds(gathers: list[float], computes: list[float], reduces: list[float]):
    """Seconds until a compute and a communication stream are both idle.

    Unit i's compute waits for gather i; gather i+1 is issued when compute i starts
    (prefetch of one), reduce i when compute i ends; communication runs in issue order.
    """
    comm_free = gathers[0]
    ready, compute_free = [comm_free], 0.0
    for i, compute in enumerate(computes):
        start = max(compute_free, ready[i])
        if i + 1 < len(computes):
            comm_free = max(comm_free, start) + gathers[i + 1]
            ready.append(comm_free)
        compute_free = start + compute
        if reduces[i]:
            comm_free = max(comm_free, compute_free) + reduces[i]
    return max(compute_free, comm_free)


def gather_cost(raw: float, setup: Setup, spec: Assumptions, ratio: float | None):
    """(seconds, NIC bytes) of an all-gather of `raw` BF16 bytes (gathered size), plain or
    zipped, the plain one where zipping is slower.

    Zipped: the packed shards travel the ring after a size exchange (one more ring of
    latencies); each GPU compresses its shard and decompresses the N - 1 others.
    """
    alpha = spec.latency_us * 1e-6
    plain = (ring_seconds(raw, setup, alpha), ring_nic_bytes(raw, setup))
    if ratio is None:
        return plain
    codec = raw / codec_bytes_s(setup, ratio, spec)
    zipped = ring_seconds(raw / ratio, setup, alpha) + (setup.gpus - 1) * alpha + codec
    return min(plain, (zipped, ring_nic_bytes(raw / ratio, setup)))


def all_to_all_zipped(raw: float, setup: Setup, spec: Assumptions, ratio: float | None):
    """(seconds, NIC bytes) of an all-to-all of `raw` BF16 bytes per GPU, plain or zipped
    (each GPU compresses what it sends and decompresses what others send it), the plain
    one where zipping is slower."""
    alpha = spec.latency_us * 1e-6
    plain = (all_to_all_seconds(raw, setup, alpha), all_to_all_nic_bytes(raw, setup))
    if ratio is None:
        return plain
    codec = (raw + raw * (setup.gpus - 1) / setup.gpus) / codec_bytes_s(setup, ratio, spec)
    zipped = all_to_all_seconds(raw / ratio, setup, alpha) + codec
    return min(plain, (zipped, all_to_all_nic_bytes(raw / ratio, setup)))


def reduce_seconds(params: float, setup: Setup, spec: Assumptions, ratio: float | None):
    """Gradient reduce-scatter of `params` elements: the native FP32 ring, or with ZipCCL
    the faster of it and a zipped BF16 all-to-all + local reduce (the adaptive switcher)."""
    alpha = spec.latency_us * 1e-6
    native = ring_seconds(FP32_BYTES * params, setup, alpha)
    if ratio is None:
        return native
    raw = BF16_BYTES * params
    codec = (raw + raw * (setup.gpus - 1) / setup.gpus) / codec_bytes_s(setup, ratio, spec)
    return min(native, all_to_all_seconds(raw / ratio, setup, alpha) + codec)


def fsdp_step(setup: Setup, spec: Assumptions, ratios: Ratios | None) -> StepTimes:
    """FSDP2 step of a dense model (units, gathers and overlap as in `zipccl.py`)."""
    model = setup.model
    assert isinstance(model, DenseModel)
    rate, tokens = flops_per_s(setup, spec), spec.seq_len * spec.micro_batches
    forward = [tokens * f / 3 / rate for f in model.unit_flops_per_token(spec.seq_len)]
    ratio_w = ratios.weights if ratios else None
    ratio_g = ratios.gradients if ratios else None
    params = model.unit_params()
    costs = [gather_cost(BF16_BYTES * p, setup, spec, ratio_w) for p in params]
    gathers = [seconds for seconds, _ in costs]
    back_gathers = [0.0, *reversed(gathers[:-1])]  # norm + output stay gathered
    back_reduces = [reduce_seconds(p, setup, spec, ratio_g) for p in reversed(params)]
    backward = [2 * f for f in reversed(forward)]
    step = two_stream_seconds(gathers, forward, [0.0] * len(params))
    step += two_stream_seconds(back_gathers, backward, back_reduces)
    nic = 2 * sum(nic_bytes for _, nic_bytes in costs) - costs[-1][1]
    return StepTimes(
        compute_s=3 * sum(forward),
        collective_s=sum(gathers) + sum(back_gathers),
        other_comm_s=sum(back_reduces),
        step_s=step,
        nic_bytes=nic,
    )


def moe_step(setup: Setup, spec: Assumptions, ratios: Ratios | None) -> StepTimes:
    """DP + EP step of an MoE model: compute, then all-to-alls and the gradient all-reduce
    on the critical path (Megatron-LM defaults, see `zipccl.py`)."""
    model = setup.model
    assert isinstance(model, MoEModel)
    alpha = spec.latency_us * 1e-6
    tokens = spec.seq_len * spec.micro_batches
    compute = tokens * model.flops_per_token(spec.seq_len) / flops_per_s(setup, spec)
    raw = tokens * model.top_k * model.dim * BF16_BYTES  # one dispatch or combine, per GPU
    per_layer, nic = 0.0, 0.0
    for ratio in (ratios.activations, ratios.gradients) if ratios else (None, None):
        seconds, nic_bytes = all_to_all_zipped(raw, setup, spec, ratio)
        per_layer, nic = per_layer + 2 * seconds, nic + 2 * nic_bytes
    grads = FP32_BYTES * model.replicated_params()
    all_reduce = 2 * ring_seconds(grads, setup, alpha)  # reduce-scatter + all-gather
    collective = model.layers * per_layer
    return StepTimes(compute, collective, all_reduce, compute + collective + all_reduce,
                     model.layers * nic)  # fmt: skip


def model_step(setup: Setup, spec: Assumptions, ratios: Ratios | None) -> StepTimes:
    """The modelled step of a setup, with NCCL (`ratios=None`) or ZipCCL."""
    check_gpus(setup)
    if isinstance(setup.model, DenseModel):
        return fsdp_step(setup, spec, ratios)
    return moe_step(setup, spec, ratios)
