"""Enumerated values of config keys (the schema is `ray_zep.config`).

Each enum's members are the words a YAML file or a `key=value` override may use.
"""

from __future__ import annotations

from enum import Enum


class ZonePolicy(Enum):
    """How the Zeppelin partitioner chooses zone thresholds and split degrees (and what
    `whole` packing and `hybrid_dp` balance under `work`)."""

    COST = "cost"
    """From the cost model: split only where the transfer hides behind compute."""
    CAPACITY = "capacity"
    """As the paper's Algorithms 1 and 2: from token capacities alone."""
    WORK = "work"
    """Every rank the same modelled work (linear + attention seconds, exposed ring
    transfers); token counts differ up to L (ray_zep.partition.balance)."""


class DkvWire(Enum):
    """The dtype ring dK/dV accumulators travel in between ring members (backward)."""

    FLOAT32 = "float32"
    """float32, as they are summed: the sum over the ring is the one-device sum up to
    float32 rounding."""
    COMPUTE = "compute"
    """The K/V dtype (bf16 in bf16 runs), as TransformerEngine sends them: half the dK/dV
    bytes, each partial sum rounded to it once per hop (identical in fp32 runs)."""
    OWNER = "owner"
    """Each ring step's dK/dV goes straight to the position that owns those K/V, in the
    dtype the kernel returned it (the K/V dtype), and the owner sums them in float32: the
    float32 ring's sums (a step's block gives each key row one kernel output, which its
    dtype holds exactly) at the K/V dtype's bytes, and no sum waits for the previous
    member's. For the items whose members send as their ring hops do, each through its
    own links (`QueueItem.owner_dkv`: inside one node, or Ulysses groups); rings across
    nodes pass float32 accumulators as `FLOAT32` does."""


class RemapPolicy(Enum):
    """When the remapping layer runs on a batch (with `parallel.remap`)."""

    WHEN_FASTER = "when_faster"
    """Only when the cost model says balancing the linear modules saves more time
    than the transfers cost (ray_zep.remap.policy)."""
    ALWAYS = "always"
    """On every batch."""


class Packing(Enum):
    """How documents are admitted into a global batch."""

    BUDGET = "budget"
    """Add documents while the batch holds at most nodes x GPUs x L tokens."""
    RANK = "rank"
    """First-fit into one bin of L tokens per rank; a document never spans ranks."""


class Overlong(Enum):
    """What to do with a document longer than the longest sequence a batch takes."""

    SPLIT = "split"
    DROP = "drop"
    ERROR = "error"


class ResumeMode(Enum):
    AUTO = "auto"
    """Resume from the newest complete checkpoint in `train.out_dir` if there is one."""
    NEVER = "never"
    """Start from scratch; refuse to run if `train.out_dir` holds checkpoints."""


class Device(Enum):
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class Precision(Enum):
    AUTO = "auto"
    """fp32 on CPU, bf16 autocast on GPU."""
    FP32 = "fp32"
    BF16 = "bf16"


class ActivationCheckpointing(Enum):
    """Which activations of a transformer block backward recomputes instead of keeping."""

    NONE = "none"
    """Keep every activation."""
    FULL = "full"
    """Keep only each block's input; backward runs the block's forward again."""
    SELECTIVE = "selective"
    """Keep the attention outputs, recompute the feed-forward (MLP or MoE) part."""
    LINEARS = "linears"
    """Keep each block's input and what the attention kernel keeps (its q, k, v, output
    and log-sum-exp); backward recomputes the norms, projections and feed-forward, never
    the attention nor its transfers."""

    def on_block(
        self, index: int, blocks: int, rest: ActivationCheckpointing | None = None
    ) -> ActivationCheckpointing:
        """The mode of block `index` when it applies to the first `blocks` blocks
        (`train.checkpoint_blocks`; 0: every block); the others run `rest`
        (`train.checkpoint_rest`; none: they keep every activation)."""
        applies = not blocks or index < blocks
        return self if applies else (rest or ActivationCheckpointing.NONE)


BENEATH_SELECTIVE = (ActivationCheckpointing.LINEARS, ActivationCheckpointing.FULL)
"""The modes whose first blocks `train.checkpoint_rest=selective` may follow: those that
keep less than `selective` does."""


class FsdpUnit(Enum):
    """What one FSDP2 unit gathers at a time (`parallel.fsdp_unit`)."""

    BLOCK = "block"
    """A transformer block: one all-gather and one reduce-scatter per block and pass,
    and a block's unsharded parameters and gradients held together in its backward."""
    LINEAR = "linear"
    """Each projection of a dense block (q, k, v, o and the three SwiGLU matrices)
    apart, the block's norms in a unit of their own, as ZeRO-3 gathers per module:
    seven times the collectives, a seventh of the transient. MoE blocks stay one
    unit (FoldMoE calls their attention once per micro-batch). A checkpointed region
    recomputed in backward gathers all of its projections at once."""


class Compression(Enum):
    """When collectives move losslessly compressed bytes (ZipCCL)."""

    OFF = "off"
    AUTO = "auto"
    """Per call, whichever of the plain and the zipped path the switcher, profiled
    at start-up, models faster (ray_zep.collectives.switcher)."""
    ALWAYS = "always"
    """Every call that can go zipped does."""


class CompressionStream(Enum):
    """The traffic `comm.compression` may compress, by name (`comm.compression_streams`).

    A stream that only moves bytes (all-gather, all-to-all, point-to-point) is
    bit-identical with compression on or off. A stream that sums sums in float32
    in rank order when zipped, so it differs from the backend's sum by rounding.
    """

    GRADIENTS = "gradients"
    """The data-parallel gradient all-reduce (replicated weights): a sum."""
    KV = "kv"
    """Ring K/V and dK/dV transfers of the attention engine: moves, bit-identical."""
    ROUTED_KV = "routed_kv"
    """Ring K/V and dK/dV that `parallel.routing` sends through proxy ranks, coded
    once at the source per piece and decoded at the destination: moves, bit-identical."""
    FSDP_ALL_GATHER = "fsdp_all_gather"
    """FSDP2's parameter all-gathers, forward and backward: moves, bit-identical."""
    FSDP_REDUCE_SCATTER = "fsdp_reduce_scatter"
    """FSDP2's gradient reduce-scatter inside the shard group: a sum."""
    EXPERT_ALL_TO_ALL = "expert_all_to_all"
    """MoE dispatch and combine over the EP group, forward and backward: moves,
    bit-identical (the switcher also picks the all-to-all design)."""
    ULYSSES_ALL_TO_ALL = "ulysses_all_to_all"
    """The Ulysses head exchange of `ulysses` and `usp` (Q, K, V rows for head slices,
    outputs and gradients back), forward and backward: moves, bit-identical."""
    REMAP_ALL_TO_ALL = "remap_all_to_all"
    """The remapping layer's rows between the linear and the attention layout
    (`parallel.remap`), forward and backward: moves, bit-identical."""
    WEIGHT_SHARDS = "weight_shards"
    """`tawpipe` / `ring_relay`: weight shards on their way to the devices that borrow
    them, in the compute dtype: moves, bit-identical."""
    SHARD_GRADIENTS = "shard_gradients"
    """`tawpipe` / `ring_relay`: the gradient sums on their way to the shards' owners, in
    the compute dtype: a sum, coded again at every hop. The ring adds in the same
    order either way (bit-identical); TawPipe's group sums add in chain order."""


COMPRESSION_STREAMS = tuple(s.value for s in CompressionStream)


class MoEDispatch(Enum):
    """How tokens reach their experts under expert parallelism."""

    AUTO = "auto"
    """padded when a capacity factor is set, varlen when dropless."""
    PADDED = "padded"
    """Every expert gets exactly `capacity` slots (fixed sizes, no host sync)."""
    VARLEN = "varlen"
    """Only kept choices move; counts are exchanged first."""


class MoEPipeline(Enum):
    """How an MoE block overlaps its all-to-alls with computation (FoldMoE)."""

    NONE = "none"
    """No overlap: attention, dispatch, experts, combine in turn."""
    MOE_ONLY = "moe_only"
    """Token micro-batches inside the MoE layer only (Tutel-style)."""
    AAAM = "aaam"
    """Attention-MoE pipeline, all attention slices before any expert computation."""
    ONE_A_ONE_M = "1a1m"
    """Attention-MoE pipeline interleaving one attention slice and one expert micro-batch."""
