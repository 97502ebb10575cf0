"""Skrull's cost model (docs/design.md §2): FLOPs, KV volume, compute/communication time, memory.

Forward FLOPs of one sequence of S tokens, l of them label tokens (h = hidden, h_kv = KV hidden,
I = MLP intermediate size, V = vocabulary, L = layers); `formula` picks one (scheduling.cost_formula):

  paper  FLOPs(S)    = L * (20*h^2*S + 4*h*h_kv*S + 4*h*S^2)
         the paper's per-layer count: a GPT-style MLP of 4h (16h^2), Q and O (4h^2), K and V (4h*h_kv),
         attention scores and values counted as a full S x S matrix; no LM head.
  model  FLOPs(S, l) = L * (4*h^2*S + 4*h*h_kv*S + 6*h*I*S + 2*h*S*(S+1)) + 2*h*V*l
         the model's own matrices: Q and O (h x h), K and V (h x h_kv: GQA), a gated MLP of three h x I
         matrices (gate, up, down), causal attention (query i sees i+1 keys, for QK^T and for AV: the
         flash kernels on GPU and CPU skip the masked blocks), and the LM head on the label tokens only
         (the chunked loss, workers/loss.py, computes logits only there). Without label counts every
         token is taken as a label (the upper bound). Softmax, norms and the cross-entropy's own
         arithmetic are O(S*h) or O(l*V) element-wise work, left out as in every FLOP count.
    FLOPs(S, N) = FLOPs(S) / N                             (balanced causal shard: rank r holds chunks
                                                            r and 2N-1-r of 2N, so work is equal per rank)
    Volume(S)   = 2 * S * h_kv * bytes                     (K and V; x num_layers here)

Times (a HardwareProfile holds the rates; see configs/hardware/*.yaml for the source of every number):

    T_comp(F)   = F * train_flops_factor / (peak_flops * mfu)       the per-micro-batch constant b of the
                                                                    paper's a*F + b is charged once per
                                                                    micro-batch by `micro_batch_time`
    b(W)        = launch + grad_reduce_passes * (W-1)/W * P * grad_bytes_per_param / B_coll(W)
                  ZeRO-2 reduces the gradients inside *every* micro-batch's backward over the W = DP x CP
                  ranks (P parameters), with one all_reduce per bucket in DeepSpeed 0.19 (two ring
                  passes; a reduce-scatter would be one), each rank keeping its partition.
                  B_coll(W) = NVLink inside one node; across nodes NCCL runs one ring per
                  rail, so a node's gpus_per_node NICs carry it in parallel:
                  min(NVLink, gpus_per_node * NIC). So b grows with the model: ~10 ms for 0.5B, ~96 ms
                  for 7B on 32 H100s (configs/hardware/h100.yaml). It is charged in full (no overlap with
                  the backward), the pessimistic end of DeepSpeed's overlap_comm.
    T_comm(V,N) = comm_passes * L * (N-1) * max(latency, offset + V/(L*N) / bandwidth)
                  a ring of N-1 steps per layer, each moving one rank's 1/N of the layer's K/V, timed
                  by the paper's two-regime T_comm: a fixed latency below a size threshold, a line
                  a_c*V + b_c above it (a_c = 1/bandwidth, b_c = offset; offset 0 is the pure
                  max(latency, bytes/bandwidth) of an ideal link). bandwidth, latency and offset are the
                  intra-node ones while the CP group fits one node, the inter-node ones otherwise.
    ring(d,g,V) = comm_passes * L * (d-1) * max(latency, offset + V/(L*d) / bandwidth)
                  per-sequence CP degrees (docs/design.md §13, SubgroupClock): the ring of an aligned
                  subgroup g of d ranks, on the intra-node links iff its world ranks sit on one node
                  (subgroup_crosses_node; CP ranks are contiguous world ranks); d = N is T_comm above.

Memory: activations are linear in tokens, so a rank's budget is a token count
    C = (device memory - static memory - safety) / alpha,  alpha = activation bytes per token
(`bucket_size_from_memory`); app/profiling/memory.py derives the terms from the model's shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

QWEN_VOCAB_SIZE = 151936
"""Qwen2/2.5 embedding rows (config.json vocab_size): CostModel.params' estimate when vocab_size is unset."""

COST_FORMULAS = ("paper", "model")
CostFormula = Literal["paper", "model"]


RETIRED_PROFILE_KEYS = ("activation_bytes_per_hidden", "checkpoint_bytes_per_hidden")
"""Keys of profiles written before activation memory was derived from the model's shapes
(app/profiling/activation/): still read, ignored."""

TIME = {"scales_as": "time"}
RATE = {"scales_as": "rate"}
"""Field metadata of HardwareProfile: a time (seconds) or a rate (work per second). Running k times slower
multiplies every TIME field by k and divides every RATE field by k, which multiplies every modeled time by
k and changes no plan (`profile --steps` scales a fitted profile this way, app/profiling/steps.py).
peak_flops is left unmarked: T_comp divides by peak_flops * mfu, and mfu carries the fitted speed."""


@dataclass(frozen=True, slots=True)
class RingLink:
    """The links one ring step crosses: the paper's two-regime T_comm, the one place it is written.

        step_s(bytes) = max(latency_s, offset_s + bytes / bandwidth)
    """

    latency_s: float
    offset_s: float
    bandwidth: float

    def step_s(self, nbytes: float) -> float:
        return max(self.latency_s, self.offset_s + nbytes / self.bandwidth)


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareProfile:
    """Rates of one accelerator type. Defaults are the H100 numbers of configs/hardware/h100.yaml."""

    name: str = "h100"
    peak_flops: float = 989e12
    """Dense peak FLOP/s at the training precision."""
    mfu: float = dataclasses.field(default=0.45, metadata=RATE)
    """Model-FLOPs utilization assumed for long packed micro-batches."""
    train_flops_factor: float = 3.0
    """Forward + backward FLOPs over forward FLOPs."""
    micro_batch_launch_s: float = dataclasses.field(default=0.004, metadata=TIME)
    """Fixed launch/dispatch cost of one micro-batch's forward+backward (the model-independent part of b)."""
    grad_bytes_per_param: float = 2.0
    """Bytes of one gradient element in the ZeRO-2 reduction (bf16)."""
    grad_reduce_passes: float = 2.0
    """Ring passes of the per-micro-batch gradient reduction: 2 for the all_reduce DeepSpeed 0.19's ZeRO-2
    issues per bucket (1 would be a reduce-scatter)."""
    intra_node_bandwidth: float = dataclasses.field(default=360e9, metadata=RATE)
    """Bytes/s one rank can send to a peer inside a node."""
    inter_node_bandwidth: float = dataclasses.field(default=40e9, metadata=RATE)
    """Bytes/s one rank can send to a peer in another node."""
    intra_node_latency_s: float = dataclasses.field(default=15e-6, metadata=TIME)
    """A ring step's time below the size threshold (the paper's fixed T_comm regime), inside a node."""
    inter_node_latency_s: float = dataclasses.field(default=30e-6, metadata=TIME)
    intra_node_comm_offset_s: float = dataclasses.field(default=0.0, metadata=TIME)
    """b_c of the paper's T_comm = a_c*V + b_c above the threshold, inside a node (0: the line through
    the origin). gloo on 2 shared cores grows smoothly, not like an ideal link (docs/benchmarks.md)."""
    inter_node_comm_offset_s: float = dataclasses.field(default=0.0, metadata=TIME)
    gpus_per_node: int = 8
    bytes_per_element: int = 2
    comm_passes: float = 3.0
    """Ring traffic of forward+backward in units of the forward K/V traffic (fwd K,V; bwd K,V + dK,dV)."""
    device_memory_bytes: float = 80e9
    runtime_memory_bytes: float = 2.5e9
    """Device memory a training micro-batch holds beyond what app/profiling/memory.py models from the model's
    shapes (kernel workspaces, blocks the CUDA caching allocator keeps for other streams, ...): measured
    peak minus the modeled terms (`profile`; h100.yaml says where its value comes from); 0: none."""
    ring_overlap: float = 1.0
    """Share of min(ring time, local compute) the ring's transfers hide behind local compute: 1 = fully
    (DACP's premise, separate CUDA streams), 0 = serialized (measured by `python -m app profile`)."""
    grad_reduce_bandwidth: float = dataclasses.field(default=0.0, metadata=RATE)
    """Bytes/s of the ZeRO-2 gradient collective inside one node (measured); 0: intra_node_bandwidth."""
    optimizer_s_per_param: float = dataclasses.field(default=0.0, metadata=TIME)
    """Seconds of the optimizer step per parameter a rank updates (ZeRO-2: P / W each, plus the parameter
    all-gather); 0: not modeled. Charged once per step, outside the plan's micro-batches."""
    ring_sequence_step_s: float = dataclasses.field(default=0.0, metadata=TIME)
    """Seconds one sharded sequence costs each rank of its ring per ring step (d per layer over d ranks:
    the block attention calls and log-sum-exp merges of its chunks, forward and backward), beyond its FLOPs
    and bytes; 0: not modeled. Fitted from measured micro-batches (scheduling/refit.py)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            # 0 is a measured value for these (no launch cost beyond the gradient reduction, a ring that
            # never overlaps, ...), not a missing one.
            if f.name in ("intra_node_comm_offset_s", "inter_node_comm_offset_s"):
                # b_c may be negative (a line steeper than through the origin); latency floors the step
                if not np.isfinite(value):
                    raise ValueError(f"hardware profile {self.name!r}: {f.name} must be finite: {value!r}")
            elif f.name in ("ring_overlap", "grad_reduce_bandwidth", "optimizer_s_per_param",
                            "micro_batch_launch_s", "ring_sequence_step_s", "runtime_memory_bytes"):
                ok = 0.0 <= value <= 1.0 if f.name == "ring_overlap" else value >= 0
                if not ok:
                    raise ValueError(f"hardware profile {self.name!r}: {f.name} out of range: {value!r}")
            elif f.name != "name" and not value > 0:
                raise ValueError(f"hardware profile {self.name!r}: {f.name} must be > 0, got {value!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        """Build from a mapping (a parsed YAML profile); unknown keys are errors naming the key."""
        names = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k not in RETIRED_PROFILE_KEYS}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(
                f"hardware profile: unknown key(s) {unknown}; valid keys: {', '.join(sorted(names))}"
            )
        kwargs = {k: (str(v) if k == "name" else float(v)) for k, v in data.items()}
        for int_key in ("gpus_per_node", "bytes_per_element"):
            if int_key in kwargs:
                kwargs[int_key] = int(kwargs[int_key])
        return cls(**kwargs)

    def collective_bandwidth(self, world: int) -> float:
        """Bus bandwidth of a ring collective over `world` ranks (NVLink, or every rail's NIC at once)."""
        inside = self.grad_reduce_bandwidth or self.intra_node_bandwidth
        if world <= self.gpus_per_node:
            return inside
        return min(inside, self.gpus_per_node * self.inter_node_bandwidth)

    def ring_link(self, *, across_nodes: bool) -> RingLink:
        """The links of a ring inside one node (NVLink) or across nodes (the NICs)."""
        if across_nodes:
            return RingLink(self.inter_node_latency_s, self.inter_node_comm_offset_s,
                            self.inter_node_bandwidth)
        return RingLink(self.intra_node_latency_s, self.intra_node_comm_offset_s, self.intra_node_bandwidth)

    def ring_step_s(self, nbytes: float, cp_size: int) -> float:
        """One ring step moving `nbytes` over `cp_size` ranks (inside a node if one node holds them)."""
        return self.ring_link(across_nodes=cp_size > self.gpus_per_node).step_s(nbytes)


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """FLOPs, bytes and modeled seconds for one model on one hardware profile."""

    hidden_size: int
    kv_hidden_size: int
    num_layers: int
    profile: HardwareProfile = dataclasses.field(default_factory=HardwareProfile)
    num_params: int = 0
    """Trainable parameters (whose gradients ZeRO-2 reduces every micro-batch); 0: `params` estimates."""
    formula: CostFormula = "paper"
    """Which FLOP count (module docstring): the paper's, or the model's own matrices."""
    intermediate_size: int = 0
    """MLP width I of the model formula (0: 4h, the paper's MLP)."""
    vocab_size: int = 0
    """Vocabulary V of the model formula's LM head (0: Qwen2.5's 151936)."""

    def __post_init__(self) -> None:
        for knob, value in (("model.hidden_size", self.hidden_size),
                            ("model.kv_hidden_size", self.kv_hidden_size),
                            ("model.num_layers", self.num_layers)):
            if value < 1:
                raise ValueError(f"cost model needs {knob} >= 1, got {value}")
        for knob, value in (("model.num_params", self.num_params),
                            ("model.intermediate_size", self.intermediate_size),
                            ("model.vocab_size", self.vocab_size)):
            if value < 0:
                raise ValueError(f"cost model needs {knob} >= 0, got {value}")
        if self.formula not in COST_FORMULAS:
            raise ValueError(f"scheduling.cost_formula={self.formula!r} is not one of: "
                             f"{', '.join(COST_FORMULAS)}")

    @classmethod
    def from_model_dims(cls, *, hidden_size: int, kv_hidden_size: int, num_layers: int,
                        profile: HardwareProfile | None = None, num_params: int = 0,
                        formula: CostFormula = "paper", intermediate_size: int = 0,
                        vocab_size: int = 0) -> CostModel:
        return cls(hidden_size=int(hidden_size), kv_hidden_size=int(kv_hidden_size),
                   num_layers=int(num_layers), profile=profile or HardwareProfile(),
                   num_params=int(num_params), formula=formula, intermediate_size=int(intermediate_size),
                   vocab_size=int(vocab_size))

    @property
    def mlp_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    @property
    def vocab(self) -> int:
        return self.vocab_size or QWEN_VOCAB_SIZE

    @property
    def params(self) -> int:
        """num_params, or an estimate from the dimensions (untied input and output embeddings).

        paper: 12*h^2*L + 2*V*h, the classic GPT count (4h^2 attention + 8h^2 MLP), which misses Qwen's
        wider MLP and GQA (Qwen2.5-0.5B: 494M true vs 504M estimated, 7B: 7.62B vs 5.41B).
        model: (2*h^2 + 2*h*h_kv + 3*h*I) * L + 2*V*h, the model's own matrices (biases and norms left out).
        """
        if self.num_params:
            return self.num_params
        h, layers, embeddings = self.hidden_size, self.num_layers, 2 * self.vocab * self.hidden_size
        if self.formula == "paper":
            return 12 * h * h * layers + embeddings
        per_layer = 2 * h * h + 2 * h * self.kv_hidden_size + 3 * h * self.mlp_size
        return per_layer * layers + embeddings

    def micro_batch_overhead_s(self, world: int = 1) -> float:
        """b: launch cost + the ZeRO-2 gradient reduce-scatter over `world` = DP x CP ranks."""
        p = self.profile
        launch = p.micro_batch_launch_s
        if world <= 1:
            return launch
        volume = p.grad_reduce_passes * (world - 1) / world * self.params * p.grad_bytes_per_param
        return launch + volume / p.collective_bandwidth(world)

    def optimizer_step_s(self, world: int = 1) -> float:
        """The once-per-step optimizer time: every rank updates its 1/world share of the parameters."""
        return self.profile.optimizer_s_per_param * self.params / max(world, 1)

    # ------------------------------------------------------------------------------------------ FLOPs
    def flops(self, length: Any, labels: Any = None) -> Any:
        """Forward FLOPs of whole sequences over all layers (module docstring; elementwise on arrays).

        `labels`: label tokens per sequence (the model formula's LM head); None: every token.
        """
        terms = self.flop_terms(length, labels)
        return terms["linear"] + terms["attention"] + terms["lm_head"]

    def flop_terms(self, length: Any, labels: Any = None, *, causal: bool = True) -> dict[str, Any]:
        """The forward FLOPs by term: `linear` (projections and MLP), `attention`, `lm_head`.

        causal=False counts the attention as a full S x S product (what a FLOP counter that ignores the
        mask reports); the planner always uses the causal count.
        """
        h, hkv, layers = self.hidden_size, self.kv_hidden_size, self.num_layers
        s = np.asarray(length, dtype=np.float64) if not np.isscalar(length) else float(length)
        if self.formula == "paper":
            return {"linear": layers * (20 * h * h + 4 * h * hkv) * s, "attention": layers * 4 * h * s * s,
                    "lm_head": 0.0 * s}
        label_tokens = s if labels is None else (
            np.asarray(labels, dtype=np.float64) if not np.isscalar(labels) else float(labels))
        attention = 2 * h * s * (s + 1) if causal else 4 * h * s * s
        return {"linear": layers * (4 * h * h + 4 * h * hkv + 6 * h * self.mlp_size) * s,
                "attention": layers * attention, "lm_head": 2 * h * self.vocab * label_tokens}

    def chunk_flop_terms(self, length: int, start: int, stop: int,
                         labels: float | None = None) -> dict[str, float]:
        """flop_terms of tokens [start, stop) of a sequence of `length` tokens (`labels` label tokens; None:
        every token), whose queries also attend to the `start` keys before them (a dependent chunk).

        Linear and attention terms are differences of the whole-prefix counts, F(stop) - F(start): the
        causal attention of the chunk's queries over [0, stop) is its c*start + c(c+1)/2 query-key pairs
        under the model formula (the paper formula's full-square count telescopes the same way), so a
        later chunk costs more and the chunks of a sequence sum to the sequence's own FLOPs. The LM head
        takes the chunk's share of the label tokens (labels * c / length: the plan knows counts, not where
        the labels sit).
        """
        upper, lower = self.flop_terms(float(stop)), self.flop_terms(float(start))
        share = (float(length) if labels is None else float(labels)) * (stop - start) / max(length, 1)
        return {"linear": upper["linear"] - lower["linear"],
                "attention": upper["attention"] - lower["attention"],
                "lm_head": self.flop_terms(float(stop - start), share)["lm_head"]}

    def sequence_flops(self, lengths: Sequence[int], labels: Sequence[int] | None = None) -> list[float]:
        """flops() of every sequence of a batch, as a list the planners index by sequence."""
        lens = np.asarray(lengths, dtype=np.float64)
        return np.asarray(self.flops(lens, None if labels is None else np.asarray(labels)),
                          dtype=np.float64).tolist()

    def shard_flops(self, length: float, cp_size: int) -> float:
        """Per-rank forward FLOPs of a sequence cut into balanced causal shards over `cp_size` ranks."""
        return self.flops(length) / cp_size

    def kv_bytes(self, length: float) -> float:
        """Volume(S): K and V bytes of a sequence over all layers."""
        return 2.0 * length * self.kv_hidden_size * self.profile.bytes_per_element * self.num_layers

    # ------------------------------------------------------------------------------------------ time
    def t_comp(self, flops: float) -> float:
        p = self.profile
        return flops * p.train_flops_factor / (p.peak_flops * p.mfu)

    def t_forward(self, flops: float) -> float:
        """One extra forward of `flops` FLOPs (a recomputed chunk's): t_comp without the backward."""
        p = self.profile
        return flops / (p.peak_flops * p.mfu)

    def overlapped(self, comm_s: float, local_s: float) -> float:
        """Ring and local compute run together: max(comm, local) when the profile's ring_overlap is 1,
        their sum when 0, in between comm + local - ring_overlap * min(comm, local)."""
        return comm_s + local_s - self.profile.ring_overlap * min(comm_s, local_s)

    def t_comm(self, volume: float, cp_size: int) -> float:
        """Ring time of forward+backward for `volume` K/V bytes sharded over `cp_size` ranks."""
        if cp_size <= 1 or volume <= 0:
            return 0.0
        per_step = volume / (self.num_layers * cp_size)
        steps = self.num_layers * (cp_size - 1)
        return self.profile.comm_passes * steps * self.profile.ring_step_s(per_step, cp_size)

    def sharded_sequence_s(self, degree: int) -> float:
        """What one sequence sharded over `degree` ranks costs each of them beyond its FLOPs and bytes:
        ring_sequence_step_s per ring step, `degree` steps per layer (0 for a local sequence)."""
        if degree <= 1:
            return 0.0
        return self.profile.ring_sequence_step_s * self.num_layers * degree

    def clock(self, cp_size: int, world: int = 1) -> Clock:
        """t_comp / t_comm / overlapped / b for one CP size, with the constants hoisted (the planner's
        inner loops call them thousands of times per batch)."""
        return Clock(self, cp_size, world)

    def micro_batch_time(self, local_flops: Sequence[float], dist_flops: float, volume: float, *,
                         world: int = 1, num_distributed: int = 0) -> float:
        """DACP overlap formula: max_j [max(T_comm(V), T_comp(Local_j)) + T_comp(Dist)] + b(world)
        (max: with ring_overlap = 1; `overlapped` in general), plus each distributed sequence's
        sharded_sequence_s(N).

        `local_flops[j]` is rank j's local FLOPs, `dist_flops` the per-rank FLOPs of the distributed
        shards (equal on every rank), `volume` the distributed sequences' total K/V bytes, `world` the
        DP x CP ranks the gradients are reduced over, `num_distributed` how many sequences are sharded.
        """
        n = len(local_flops)
        comm = self.t_comm(volume, n)
        worst_local = max(local_flops) if n else 0.0
        overhead = self.micro_batch_overhead_s(world)
        return (self.overlapped(comm, self.t_comp(worst_local)) + self.t_comp(dist_flops) + overhead
                + num_distributed * self.sharded_sequence_s(n))


class Clock:
    """CostModel's time formulas for one CP size N and one world W, constants hoisted out of the calls.

    Every method performs the same floating-point operations in the same order as the CostModel method
    it names, so the results are bit for bit equal (the planners compare times with tight tolerances,
    and equal plans need equal comparisons):

        comp(F)                = F * train_flops_factor / (peak_flops * mfu)            = t_comp(F)
        comm(V)                = comm_passes * L*(N-1) * max(latency, offset + V/(L*N)/B) = t_comm(V, N)
        overlapped(c, l)       = c + l - ring_overlap * min(c, l)
        time(Lmax, D, V, k)    = overlapped(comm(V), comp(Lmax)) + comp(D) + k * seq_s  (the DACP objective,
                                 k distributed sequences)
        objective(c, Lmax, D, k) = time() given c = comm(V)
        overhead               = micro_batch_overhead_s(W)                              (b)
        seq_s                  = sharded_sequence_s(N)
    """

    __slots__ = ("cp_size", "overhead", "seq_s", "_comm_scale", "_denom", "_factor", "_link", "_overlap",
                 "_per_step")

    def __init__(self, cost: CostModel, cp_size: int, world: int = 1) -> None:
        p = cost.profile
        self.cp_size = cp_size
        self.overhead = cost.micro_batch_overhead_s(world)
        self._factor, self._denom = p.train_flops_factor, p.peak_flops * p.mfu
        self._overlap = p.ring_overlap
        self._per_step = cost.num_layers * cp_size
        self._comm_scale = p.comm_passes * (cost.num_layers * (cp_size - 1))
        self._link = p.ring_link(across_nodes=cp_size > p.gpus_per_node)
        self.seq_s = cost.sharded_sequence_s(cp_size)

    @property
    def factor(self) -> float:
        """train_flops_factor (comp(F) = F * factor / denom)."""
        return self._factor

    @property
    def denom(self) -> float:
        """peak_flops * mfu."""
        return self._denom

    @property
    def overlap(self) -> float:
        """ring_overlap (overlapped(c, l) = c + l - overlap * min(c, l))."""
        return self._overlap

    def comp(self, flops: float) -> float:
        return flops * self._factor / self._denom

    def comm(self, volume: float) -> float:
        if self.cp_size <= 1 or volume <= 0:
            return 0.0
        return self._comm_scale * self._link.step_s(volume / self._per_step)

    def overlapped(self, comm_s: float, local_s: float) -> float:
        return comm_s + local_s - self._overlap * min(comm_s, local_s)

    def time(self, max_local: float, dist: float, volume: float, num_dist: int = 0) -> float:
        """max_j [overlapped(T_comm(V), T_comp(Local_j))] + T_comp(Dist) + num_dist * seq_s, given
        max_j Local_j (without b)."""
        return self.objective(self.comm(volume), max_local, dist, num_dist)

    def objective(self, comm_s: float, max_local: float, dist: float, num_dist: int = 0) -> float:
        """time() with T_comm(V) already computed (the local search keeps it while V does not change)."""
        local = max_local * self._factor / self._denom
        return (comm_s + local - self._overlap * min(comm_s, local) + dist * self._factor / self._denom
                + num_dist * self.seq_s)


def subgroup_crosses_node(gpus_per_node: int, cp_size: int, degree: int, group: int, cp_group: int) -> bool:
    """Whether aligned CP subgroup [group*degree, (group+1)*degree) of CP group `cp_group` spans two nodes.

    CP ranks are contiguous world ranks (CP group k holds world ranks [k*N, (k+1)*N), nodes hold
    gpus_per_node consecutive ranks), so the subgroup's world ranks are [k*N + g*d, k*N + (g+1)*d) and it
    crosses a node boundary iff its first and last rank sit on different nodes.
    """
    first = cp_group * cp_size + group * degree
    return first // gpus_per_node != (first + degree - 1) // gpus_per_node


class SubgroupClock:
    """Ring times of every aligned CP subgroup of one CP group (per-sequence CP degrees, design §13).

    A degree-d ring (1 < d < N) over subgroup g moves, per layer, d-1 steps of V/(L*d) bytes each, on the
    intra-node links when the subgroup's world ranks sit on one node and the inter-node links otherwise
    (subgroup_crosses_node):

        ring(d, g, V) = comm_passes * L*(d-1) * max(latency, offset + V/(L*d) / bandwidth)

    Degree N is the whole-group ring, `base.comm(V)` (Clock), bit for bit: the whole CP group keeps its
    rule (intra-node iff N <= gpus_per_node), so a two-level plan models the same under either clock.
    `base` also carries comp / overlapped / overhead for the micro-batch's world.
    """

    __slots__ = ("base", "cp_size", "seq_s", "_kinds", "_rings")

    def __init__(self, cost: CostModel, cp_size: int, world: int = 1, cp_group: int = 0) -> None:
        p = cost.profile
        self.base = Clock(cost, cp_size, world)
        self.cp_size = cp_size
        self.seq_s = {degree: cost.sharded_sequence_s(degree) for degree in range(1, cp_size + 1)}
        """sharded_sequence_s(d) per degree d (0 at d = 1)."""
        self._rings: dict[tuple[int, int], tuple[float, float, RingLink]] = {}
        self._kinds: dict[int, tuple[int, ...]] = {}  # per degree: the first group of each link kind
        degree = 2
        while degree < cp_size:
            if cp_size % degree == 0:
                kinds: dict[bool, int] = {}
                for group in range(cp_size // degree):
                    across = subgroup_crosses_node(p.gpus_per_node, cp_size, degree, group, cp_group)
                    kinds.setdefault(across, group)
                    self._rings[degree, group] = (
                        p.comm_passes * (cost.num_layers * (degree - 1)), float(cost.num_layers * degree),
                        p.ring_link(across_nodes=across))
                self._kinds[degree] = tuple(kinds.values())
            degree *= 2

    def ring(self, degree: int, group: int, volume: float) -> float:
        """Seconds of the ring of `volume` K/V bytes over subgroup `group` of `degree` ranks (0: empty)."""
        if degree >= self.cp_size:
            return self.base.comm(volume)
        if degree <= 1 or volume <= 0:
            return 0.0
        scale, per_step, link = self._rings[degree, group]
        return scale * link.step_s(volume / per_step)

    def ring_floor(self, degree: int, volume: float) -> float:
        """The fastest ring of `volume` bytes over any aligned subgroup of `degree` ranks (a lower bound)."""
        if degree >= self.cp_size:
            return self.base.comm(volume)
        if degree <= 1 or volume <= 0:
            return 0.0
        # the subgroups of one degree differ only in their links: one group of each kind is enough
        return min(self.ring(degree, group, volume) for group in self._kinds[degree])


def ring_lower_bound(cost: CostModel, volume: float, degree: int, cp_size: int) -> float:
    """A lower bound of the ring time of `volume` bytes over any degree-`degree` subgroup of any CP group.

    Degree N is t_comm(volume, N) exactly (the whole group's rule); 1 < d < N takes the cheaper of the
    intra- and inter-node links unless d > gpus_per_node (then the subgroup must cross a node)."""
    if degree >= cp_size:
        return cost.t_comm(volume, cp_size)
    if degree <= 1 or volume <= 0:
        return 0.0
    p = cost.profile
    per_step = volume / (cost.num_layers * degree)
    steps = p.comm_passes * (cost.num_layers * (degree - 1))
    inter = steps * p.ring_link(across_nodes=True).step_s(per_step)
    if degree > p.gpus_per_node:
        return inter
    return min(steps * p.ring_link(across_nodes=False).step_s(per_step), inter)


def bucket_size_from_memory(*, device_memory_bytes: float, static_memory_bytes: float,
                            activation_bytes_per_token: float, safety_bytes: float = 0.0) -> int:
    """C = floor((device - static - safety) / alpha); an error if nothing is left for activations."""
    free = device_memory_bytes - static_memory_bytes - safety_bytes
    if free <= 0 or activation_bytes_per_token <= 0:
        raise ValueError(
            f"no memory left for activations ({free:.3g} bytes): lower the static memory (ZeRO stage, "
            "optimizer) or set scheduling.bucket_size by hand"
        )
    return int(free // activation_bytes_per_token)
