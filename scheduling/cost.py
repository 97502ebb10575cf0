"""Skrull's cost model (docs/design.md §2): FLOPs, KV volume, compute/communication time, memory.

Per Transformer layer, for one packed sequence of S tokens (h = hidden, h_kv = KV hidden):

    FLOPs(S)    = 20*h^2*S + 4*h*h_kv*S + 4*h*S^2          (forward; x num_layers here)
    FLOPs(S, N) = FLOPs(S) / N                             (balanced causal shard: rank r holds chunks
                                                            r and 2N-1-r of 2N, so work is equal per rank)
    Volume(S)   = 2 * S * h_kv * bytes                     (K and V; x num_layers here)

Times (a HardwareProfile holds the rates; see configs/hardware/*.yaml for the source of every number):

    T_comp(F)   = F * train_flops_factor / (peak_flops * mfu)       the per-micro-batch constant b of the
                                                                    paper's a*F + b is charged once per
                                                                    micro-batch by `micro_batch_time`
    b(W)        = launch + grad_reduce_passes * (W-1)/W * P * grad_bytes_per_param / B_coll(W)
                  ZeRO-2 reduce-scatters the gradients inside *every* micro-batch's backward over the
                  W = DP x CP ranks (P parameters; one ring pass for a reduce-scatter, two for an
                  all-reduce). B_coll(W) = NVLink inside one node; across nodes NCCL runs one ring per
                  rail, so a node's gpus_per_node NICs carry it in parallel:
                  min(NVLink, gpus_per_node * NIC). So b grows with the model: ~7 ms for 0.5B, ~50 ms
                  for 7B on 32 H100s (configs/hardware/h100.yaml). It is charged in full (no overlap with
                  the backward), the pessimistic end of DeepSpeed's overlap_comm.
    T_comm(V,N) = comm_passes * L * (N-1) * max(latency, V/(L*N) / bandwidth)
                  a ring of N-1 steps per layer, each moving one rank's 1/N of the layer's K/V: a fixed
                  latency below latency*bandwidth bytes, linear above (the paper's two-regime T_comm).
                  bandwidth is NVLink while the CP group fits one node, the NIC otherwise.

Memory: activations are linear in tokens, so a rank's budget is a token count
    C = (device memory - static memory - safety) / alpha,  alpha = activation bytes per token
with alpha = 34 * h bytes per layer for bf16 with selective recomputation (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", Table 2, t = 1).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

QWEN_VOCAB_SIZE = 151936
"""Qwen2/2.5 embedding rows (config.json vocab_size), used only by CostModel.params' estimate."""


@dataclass(frozen=True, slots=True, kw_only=True)
class HardwareProfile:
    """Rates of one accelerator type. Defaults are the H100 numbers of configs/hardware/h100.yaml."""

    name: str = "h100"
    peak_flops: float = 989e12
    """Dense peak FLOP/s at the training precision."""
    mfu: float = 0.45
    """Model-FLOPs utilization assumed for long packed micro-batches."""
    train_flops_factor: float = 3.0
    """Forward + backward FLOPs over forward FLOPs."""
    micro_batch_launch_s: float = 0.004
    """Fixed launch/dispatch cost of one micro-batch's forward+backward (the model-independent part of b)."""
    grad_bytes_per_param: float = 2.0
    """Bytes of one gradient element in the ZeRO-2 reduction (bf16)."""
    grad_reduce_passes: float = 1.0
    """Ring passes of the per-micro-batch gradient reduction: 1 reduce-scatter (ZeRO-2), 2 all-reduce."""
    intra_node_bandwidth: float = 360e9
    """Bytes/s one rank can send to a peer inside a node."""
    inter_node_bandwidth: float = 40e9
    """Bytes/s one rank can send to a peer in another node."""
    intra_node_latency_s: float = 15e-6
    inter_node_latency_s: float = 30e-6
    gpus_per_node: int = 8
    bytes_per_element: int = 2
    comm_passes: float = 3.0
    """Ring traffic of forward+backward in units of the forward K/V traffic (fwd K,V; bwd K,V + dK,dV)."""
    device_memory_bytes: float = 80e9
    activation_bytes_per_hidden: float = 34.0
    """Activation bytes per token per layer per hidden unit (34 with selective recompute, bf16)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name != "name" and not value > 0:
                raise ValueError(f"hardware profile {self.name!r}: {f.name} must be > 0, got {value!r}")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        """Build from a mapping (a parsed YAML profile); unknown keys are errors naming the key."""
        names = {f.name for f in dataclasses.fields(cls)}
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
        if world <= self.gpus_per_node:
            return self.intra_node_bandwidth
        return min(self.intra_node_bandwidth, self.gpus_per_node * self.inter_node_bandwidth)

    def link(self, cp_size: int) -> tuple[float, float]:
        """(latency_s, bandwidth) of a ring over `cp_size` ranks: NVLink if one node holds it."""
        if cp_size <= self.gpus_per_node:
            return self.intra_node_latency_s, self.intra_node_bandwidth
        return self.inter_node_latency_s, self.inter_node_bandwidth


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """FLOPs, bytes and modeled seconds for one model on one hardware profile."""

    hidden_size: int
    kv_hidden_size: int
    num_layers: int
    profile: HardwareProfile = dataclasses.field(default_factory=HardwareProfile)
    num_params: int = 0
    """Trainable parameters (whose gradients ZeRO-2 reduces every micro-batch); 0: `estimated_params`."""

    def __post_init__(self) -> None:
        for knob, value in (("model.hidden_size", self.hidden_size),
                            ("model.kv_hidden_size", self.kv_hidden_size),
                            ("model.num_layers", self.num_layers)):
            if value < 1:
                raise ValueError(f"cost model needs {knob} >= 1, got {value}")
        if self.num_params < 0:
            raise ValueError(f"cost model needs model.num_params >= 0, got {self.num_params}")

    @classmethod
    def from_model_dims(cls, *, hidden_size: int, kv_hidden_size: int, num_layers: int,
                        profile: HardwareProfile | None = None, num_params: int = 0) -> CostModel:
        return cls(hidden_size=int(hidden_size), kv_hidden_size=int(kv_hidden_size),
                   num_layers=int(num_layers), profile=profile or HardwareProfile(),
                   num_params=int(num_params))

    @property
    def params(self) -> int:
        """num_params, or the estimate 12*h^2*L + 2*V*h with Qwen2.5's vocabulary V = 151936.

        12*h^2 per layer is the classic GPT count (4h^2 attention + 8h^2 MLP); Qwen's wider MLP and GQA
        make the true count differ (Qwen2.5-0.5B: 494M true vs 504M estimated, 7B: 7.62B vs 5.41B), so
        configs should state model.num_params; 2*V*h counts untied input and output embeddings.
        """
        if self.num_params:
            return self.num_params
        h = self.hidden_size
        return 12 * h * h * self.num_layers + 2 * QWEN_VOCAB_SIZE * h

    def micro_batch_overhead_s(self, world: int = 1) -> float:
        """b: launch cost + the ZeRO-2 gradient reduce-scatter over `world` = DP x CP ranks."""
        p = self.profile
        launch = p.micro_batch_launch_s
        if world <= 1:
            return launch
        volume = p.grad_reduce_passes * (world - 1) / world * self.params * p.grad_bytes_per_param
        return launch + volume / p.collective_bandwidth(world)

    # ------------------------------------------------------------------------------------------ FLOPs
    def flops(self, length: float) -> float:
        """Forward FLOPs of one whole sequence over all layers (works elementwise on numpy arrays)."""
        h, hkv = self.hidden_size, self.kv_hidden_size
        return self.num_layers * (20 * h * h * length + 4 * h * hkv * length + 4 * h * length * length)

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

    def t_comm(self, volume: float, cp_size: int) -> float:
        """Ring time of forward+backward for `volume` K/V bytes sharded over `cp_size` ranks."""
        if cp_size <= 1 or volume <= 0:
            return 0.0
        latency, bandwidth = self.profile.link(cp_size)
        per_step = volume / (self.num_layers * cp_size)
        steps = self.num_layers * (cp_size - 1)
        return self.profile.comm_passes * steps * max(latency, per_step / bandwidth)

    def micro_batch_time(self, local_flops: Sequence[float], dist_flops: float, volume: float, *,
                         world: int = 1) -> float:
        """DACP overlap formula: max_j [max(T_comm(V), T_comp(Local_j)) + T_comp(Dist)] + b(world).

        `local_flops[j]` is rank j's local FLOPs, `dist_flops` the per-rank FLOPs of the distributed
        shards (equal on every rank), `volume` the distributed sequences' total K/V bytes, `world` the
        DP x CP ranks the gradients are reduced over.
        """
        comm = self.t_comm(volume, len(local_flops))
        worst_local = max(local_flops) if len(local_flops) else 0.0
        overhead = self.micro_batch_overhead_s(world)
        return max(comm, self.t_comp(worst_local)) + self.t_comp(dist_flops) + overhead


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
