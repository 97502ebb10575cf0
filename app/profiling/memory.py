"""Memory per rank, modeled, and the BucketSize C it leaves (`scheduling.bucket_size: auto`).

    C = floor((M - S - loss - safety) / alpha)       tokens one rank may hold in a micro-batch

    M        device memory of a rank: hardware.profile's device_memory_bytes (CPU workers share the host's:
             divided by the workers on one node)
    S        static bytes per rank at train.zero_stage, over W ranks (the smallest worker count of an
             elastic run, where each rank holds the most), for P parameters of which T train (all, or the
             LoRA adapters), e = bytes per element of model.dtype:
               weights     P*e at stages 1-2; stage 3: P*e/W + the parameters under the persistence
                           threshold whole (norms and biases) + what is gathered at once: the largest
                           module's weights (a layer, or the V x h embedding) and the prefetch bucket
               gradients   stage 1: T*4 (fp32 accumulation of the whole model); stages 2-3: T*4/W (this
                           rank's fp32 partition) + two reduce buckets in model.dtype
               optimizer   T*12/W: AdamW's m and v and the fp32 master weights, partitioned (stage >= 1)
    loss     the chunked loss (workers/loss.py): one chunk's fp32 logits and one [C, V] temporary of
             the same size (logsumexp's; the gradient is made in the logits' storage), loss_chunk_tokens x
             V x 8, and the fp32 LM-head gradient it accumulates, V x h x 4; chunks never overlap
    safety   SAFETY_FRACTION of M: allocator fragmentation, the CUDA context, NCCL buffers and kernel
             workspaces, which no term above counts
    alpha    activation bytes per token of the checkpointing setting, from the hardware profile's
             a = activation_bytes_per_hidden (a layer that keeps its activations) and
             k = checkpoint_bytes_per_hidden (a recomputed layer's saved input), both measured by
             `profile`, with c = ceil(L / n) recomputed layers (train.activation_checkpointing_every = n):
               nothing recomputed    a * L * h
               recompute             (a * (L - c) + k * c + a) * h     (+ a: the one layer being recomputed)
               recompute + offload   (a * (L - c) + a) * h             (the saved inputs are in host memory)

Every number is a model of what DeepSpeed and the step allocate, not a measurement (`plan` says so);
scheduling/cost.py `bucket_size_from_memory` is the division.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from app.config import ConfigError, SkrullConfig
from app.profiling.hardware import load_hardware_profile, model_dims
from scheduling import CostModel, HardwareProfile, bucket_size_from_memory

SAFETY_FRACTION = 0.10
"""Share of the device memory kept free of the modeled terms (the module docstring says what it covers)."""
REDUCE_BUCKET_ELEMENTS = {True: 5e7, False: 5e5}
"""app/model/deepspeed_config.py's reduce and stage-3 prefetch buckets (on GPU, on CPU), in elements."""
LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder's linear layers that model.lora.target_modules (all-linear: every one) can adapt."""
GB = 1e9


@dataclass(frozen=True, slots=True)
class MemoryTerms:
    """Bytes per rank (the module docstring's terms) and the C they leave."""

    zero_stage: int
    workers: int
    device: float
    weights: float
    gradients: float
    optimizer: float
    loss: float
    safety: float
    activation_per_token: float
    recompute: str
    """What alpha assumes: none | every layer | every n-th layer, with `+ offload`."""

    @property
    def static(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def tokens(self) -> int:
        """C; 0 when nothing is left for activations."""
        try:
            return bucket_size_from_memory(device_memory_bytes=self.device,
                                           static_memory_bytes=self.static + self.loss,
                                           activation_bytes_per_token=self.activation_per_token,
                                           safety_bytes=self.safety)
        except ValueError:
            return 0

    def as_json(self) -> dict[str, float | int | str]:
        return {**dataclasses.asdict(self), "static": self.static, "tokens": self.tokens}

    def line(self) -> str:
        """Why C is what it is, in one line."""
        gb = (f"{self.device / GB:.1f} GB device - {self.static / GB:.1f} GB weights, gradients and "
              f"optimizer at ZeRO-{self.zero_stage} over {self.workers} ranks - {self.loss / GB:.1f} GB "
              f"loss - {self.safety / GB:.1f} GB safety ({SAFETY_FRACTION:.0%})")
        return f"({gb}) / {self.activation_per_token / 1e3:.1f} KB per token (recompute: {self.recompute})"


@dataclass(frozen=True, slots=True)
class BucketBudget:
    """The BucketSize a run uses and where it came from."""

    tokens: int
    source: str
    """config (scheduling.bucket_size set) | memory (auto: derived here)."""
    terms: MemoryTerms | None = None
    """The terms C was derived from (source memory)."""

    def line(self) -> str:
        if self.terms is None:
            return f"BucketSize C = {self.tokens:,} tokens per rank (scheduling.bucket_size)"
        return f"BucketSize C = {self.tokens:,} tokens per rank (scheduling.bucket_size=auto, modeled): " \
               f"{self.terms.line()}"


def trainable_params(config: SkrullConfig, cost: CostModel) -> float:
    """T: every parameter, or with model.lora.r > 0 the adapters' r x (in + out) per adapted linear."""
    lora = config.model.lora
    if not lora.r:
        return float(cost.params)
    h, kv, inter = cost.hidden_size, cost.kv_hidden_size, cost.mlp_size
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    names = LORA_LINEARS if lora.target_modules == "all-linear" else (
        [lora.target_modules] if isinstance(lora.target_modules, str) else lora.target_modules)
    return float(lora.r * cost.num_layers * sum(sum(shapes[n]) for n in names if n in shapes))


def activation_bytes_per_token(config: SkrullConfig, profile: HardwareProfile, cost: CostModel, *,
                               offload: bool | None = None) -> tuple[float, str]:
    """alpha of the config's checkpointing setting (offload: None = train.activation_offload), and what
    it assumes."""
    train, h, layers = config.train, cost.hidden_size, cost.num_layers
    full, kept = profile.activation_bytes_per_hidden, profile.checkpoint_bytes_per_hidden
    offload = train.activation_offload if offload is None else offload
    if not train.activation_checkpointing and not offload:
        return full * layers * h, "none"
    every = train.activation_checkpointing_every
    recomputed = math.ceil(layers / every)
    saved = 0.0 if offload else kept * recomputed
    what = "every layer" if every == 1 else f"every {every}th layer"
    return (full * (layers - recomputed) + saved + full) * h, what + (" + offload" if offload else "")


def memory_terms(config: SkrullConfig, *, zero_stage: int | None = None, offload: bool | None = None,
                 profile: HardwareProfile | None = None) -> MemoryTerms:
    """The module docstring's terms for `config` (zero_stage / offload / profile: None = the config's;
    `profile` measures one)."""
    profile = profile or load_hardware_profile(config.hardware.profile)
    dims = model_dims(config.model, config.data.tokenizer)
    cost = CostModel.from_model_dims(hidden_size=dims.hidden_size, kv_hidden_size=dims.kv_hidden_size,
                                     num_layers=dims.num_layers, profile=profile,
                                     num_params=config.model.num_params, formula="model",
                                     intermediate_size=dims.intermediate_size, vocab_size=dims.vocab_size)
    stage = config.train.zero_stage if zero_stage is None else zero_stage
    on_gpu = config.resources.gpus_per_worker > 0
    workers = config.parallel.worker_range[0]
    element = 2 if config.model.dtype == "bf16" else 4
    params, trainable = float(cost.params), trainable_params(config, cost)
    h, layers, vocab = cost.hidden_size, cost.num_layers, cost.vocab
    bucket = REDUCE_BUCKET_ELEMENTS[on_gpu]
    if stage < 3:
        weights = params * element
    else:
        # 2 norms and the Q/K/V biases per layer, the final norm: each under persistence_threshold(h)
        persistent = layers * (3 * h + 2 * cost.kv_hidden_size) + h
        largest = max((params - 2 * vocab * h) / layers, vocab * h)
        weights = (params / workers + persistent + largest + bucket) * element
    gradients = trainable * 4 if stage == 1 else trainable * 4 / workers + 2 * bucket * element
    device = profile.device_memory_bytes / (1 if on_gpu else min(workers, profile.gpus_per_node))
    alpha, recompute = activation_bytes_per_token(config, profile, cost, offload=offload)
    loss = config.train.loss_chunk_tokens * vocab * 8 + vocab * h * 4
    return MemoryTerms(zero_stage=stage, workers=workers, device=device, weights=weights,
                       gradients=gradients, optimizer=trainable * 12 / workers, loss=loss,
                       safety=SAFETY_FRACTION * device, activation_per_token=alpha, recompute=recompute)


def bucket_budget(config: SkrullConfig) -> BucketBudget:
    """scheduling.bucket_size as set, or (auto) the C of memory_terms; auto with nothing left for
    activations is a ConfigError naming the knobs."""
    size = config.scheduling.bucket_size
    if size != "auto":
        return BucketBudget(tokens=int(size), source="config")
    terms = memory_terms(config)
    if terms.tokens < 1:
        raise ConfigError(
            f"scheduling.bucket_size=auto: nothing is left for activations on a rank "
            f"{terms.line()}: set train.zero_stage=3, model.lora.r, train.activation_checkpointing, more "
            "parallel.num_workers, or scheduling.bucket_size by hand")
    return BucketBudget(tokens=terms.tokens, source="memory", terms=terms)


def resolve_bucket_size(config: SkrullConfig) -> tuple[SkrullConfig, BucketBudget]:
    """The config with scheduling.bucket_size an int (auto replaced by the derived C), and its budget."""
    budget = bucket_budget(config)
    if config.scheduling.bucket_size == budget.tokens:
        return config, budget
    scheduling = dataclasses.replace(config.scheduling, bucket_size=budget.tokens)
    return dataclasses.replace(config, scheduling=scheduling), budget


def memory_table(config: SkrullConfig) -> dict[str, MemoryTerms]:
    """memory_terms at ZeRO-2 and ZeRO-3, each without and with activation offload (`plan`)."""
    return {f"zero{stage}{'_offload' if offload else ''}": memory_terms(config, zero_stage=stage,
                                                                        offload=offload)
            for stage in (2, 3) for offload in (False, True)}


def format_memory_table(table: dict[str, MemoryTerms]) -> str:
    """The table `plan` prints (GB per rank, modeled)."""
    header = ("setting", "weights", "grads", "optimizer", "loss", "static", "KB/token", "C tokens")
    rows = [header]
    for t in table.values():
        rows.append((f"ZeRO-{t.zero_stage}, recompute {t.recompute}", f"{t.weights / GB:.1f}",
                     f"{t.gradients / GB:.1f}", f"{t.optimizer / GB:.1f}", f"{t.loss / GB:.1f}",
                     f"{t.static / GB:.1f}", f"{t.activation_per_token / 1e3:.1f}",
                     f"{t.tokens:,}" if t.tokens else "does not fit"))
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(r, widths,
                                                                                             strict=True)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
