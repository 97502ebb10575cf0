"""Memory per rank, modeled, and the BucketSize C it leaves (`scheduling.bucket_size: auto`); docs/memory.md.

    peak(T) = static + runtime + max over phases (fixed + per_token * T)     one micro-batch of T tokens
    C       = max T with peak(T) <= M - safety
            = min over phases floor((M - safety - static - runtime - fixed) / per_token)

    M        device memory of a rank: hardware.profile's device_memory_bytes (CPU workers share the host's:
             divided by the workers on one node)
    static   bytes per rank at train.zero_stage, over W ranks (the smallest worker count of an elastic run,
             where each rank holds the most), for P parameters of which T train (all, or the LoRA
             adapters), e = bytes per element of model.dtype:
               weights     P*e at stages 1-2; stage 3: P*e/W + the parameters under the persistence
                           threshold whole (norms and biases) + what is gathered at once: the largest
                           module's weights (a layer, or the V x h embedding) and the prefetch bucket
               gradients   stage 1: T*4 (fp32 accumulation of the whole model); stages 2-3: T*4/W (this
                           rank's fp32 partition) + two reduce buckets in model.dtype
               optimizer   T*12/W: AdamW's m and v and the fp32 master weights, partitioned (stage >= 1)
    runtime  hardware.profile's runtime_memory_bytes: what a micro-batch holds beyond everything modeled
             here (measured: the profile's comment says where)
    phases   app/profiling/activation/phases.py: the end of the forward while the loss runs (what the
             forward keeps per token + the loss's chunk temporaries and head gradient) and the backward of
             the layer where most is live (what the layers below keep + one recomputed layer + its
             backward's gradients); per token from the model's shapes, for the kernel set the run uses
             (`kernels`: torch | liger | compiled) and the checkpointing setting
    safety   SAFETY_FRACTION of M: the headroom kept free of every modeled term
    load     the peak while the model is built and its checkpoint read, before the first step (`load_peak`):
               stage 3 (workers/sharded.py) device P*e/W + the largest module whole (built, or gathered
                       for the random init: the gated MLP's 3*h*I, the attention's projections or the V x h
                       embedding); host: the checkpoint tensor being read, mapped (V x h at most)
               stages 1-2: device P*e, every rank's whole copy; host P*e per rank (from_pretrained and
                       random init build it in host memory before it moves), x ranks per node
             it fits when the device part leaves the safety margin free (the host part is reported only)

`loss` and `activation_per_token` of MemoryTerms are the fixed and per-token bytes of the phase that holds
the most at the run's C (the loss's chunk temporaries, or the LM head's gradient during the backward).
Every number is a model (`plan` says so); tests/test_memory_model.py measures the per-token terms.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from app.config import ConfigError, SkrullConfig
from app.profiling.activation import Checkpointing, PassMemory, Phase, kernel_set, model_shape, pass_memory
from app.profiling.hardware import load_hardware_profile, model_dims
from scheduling import CostModel, HardwareProfile, bucket_size_from_memory
from workers.presets import is_tiny_preset

SAFETY_FRACTION = 0.10
"""Share of the device memory kept free of the modeled terms (the headroom)."""
REDUCE_BUCKET_ELEMENTS = {True: 5e7, False: 5e5}
"""app/model/deepspeed_config.py's reduce and stage-3 prefetch buckets (on GPU, on CPU), in elements."""
LORA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder's linear layers that model.lora.target_modules (all-linear: every one) can adapt."""
GB = 1e9


@dataclass(frozen=True, slots=True)
class MemoryTerms:
    """Bytes per rank (the module docstring's terms), the C they leave and the peak at the run's C."""

    zero_stage: int
    workers: int
    device: float
    weights: float
    gradients: float
    optimizer: float
    runtime: float
    safety: float
    recompute: str
    """The checkpointing setting modeled: off | every layer | every n-th layer, with ` + offload`."""
    kernels: str
    """The kernel set modeled: torch | liger | compiled."""
    activations: PassMemory
    bucket: int | None = None
    """The run's C when scheduling.bucket_size is set (None: auto, the derived C)."""
    load: LoadPeak | None = None
    """The peak while the model is built and loaded (load_peak)."""

    @property
    def static(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def budget(self) -> float:
        """What the phases may take: M - safety - static - runtime."""
        return self.device - self.safety - self.static - self.runtime

    @property
    def tokens(self) -> int:
        """C derived from memory; 0 when nothing is left for activations."""
        try:
            return min(bucket_size_from_memory(device_memory_bytes=self.budget, static_memory_bytes=p.fixed,
                                               activation_bytes_per_token=p.per_token)
                       for p in self.activations.phases)
        except ValueError:
            return 0

    @property
    def at_tokens(self) -> int:
        """The C the peak is evaluated at: the run's (set), or the derived one (auto)."""
        return self.tokens if self.bucket is None else self.bucket

    @property
    def phase(self) -> Phase:
        """The phase holding the most at the run's C."""
        return self.activations.phase_at(self.at_tokens)

    @property
    def loss(self) -> float:
        """The peak phase's fixed bytes: the loss's chunk temporaries and head gradient, or (backward) the LM
        head's gradient."""
        return self.phase.fixed

    @property
    def activation_per_token(self) -> float:
        return self.phase.per_token

    @property
    def peak_bytes(self) -> float:
        """The predicted peak at the run's C (safety excluded: it is what stays free)."""
        return self.peak_at(self.at_tokens)

    def peak_at(self, tokens: int) -> float:
        """The predicted peak of a micro-batch of `tokens` tokens."""
        return self.static + self.runtime + self.activations.peak(tokens)

    @property
    def headroom(self) -> float:
        return self.device - self.peak_bytes

    @property
    def fits(self) -> bool:
        """The peak at the run's C leaves at least the safety margin free."""
        return self.at_tokens >= 1 and self.headroom >= self.safety

    @property
    def load_fits(self) -> bool:
        """The build-and-load peak leaves the safety margin of the device free."""
        return self.load is None or self.load.device <= self.device - self.safety

    def as_json(self) -> dict[str, object]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                  if f.name not in ("activations", "load")}
        load = None if self.load is None else {**dataclasses.asdict(self.load), "fits": self.load_fits}
        return {**fields, "load": load, "static": self.static, "loss": self.loss,
                "activation_per_token": self.activation_per_token, "tokens": self.tokens,
                "at_tokens": self.at_tokens, "peak_bytes": self.peak_bytes,
                "activation_bytes": self.activation_per_token * self.at_tokens, "headroom": self.headroom,
                "kept_per_token": self.activations.kept_per_token, "peak_phase": self.phase.name,
                "phases": [p.as_json() for p in self.activations.phases]}

    def line(self) -> str:
        """Why C is what it is, in one line."""
        gb = (f"{self.device / GB:.1f} GB device - {self.static / GB:.1f} GB weights, gradients and "
              f"optimizer at ZeRO-{self.zero_stage} over {self.workers} ranks - {self.loss / GB:.1f} GB "
              f"loss - {self.runtime / GB:.1f} GB runtime - {self.safety / GB:.1f} GB safety "
              f"({SAFETY_FRACTION:.0%})")
        return (f"({gb}) / {self.activation_per_token / 1e3:.1f} KB per token (recompute: {self.recompute}, "
                f"kernels: {self.kernels})")


@dataclass(frozen=True, slots=True)
class LoadPeak:
    """Bytes one rank holds while its model is built and the checkpoint read (module docstring: load)."""

    device: float
    host: float
    host_per_node: float
    """`host` times the ranks on one node."""


def load_peak(config: SkrullConfig, cost: CostModel, *, stage: int, workers: int, element: int,
              ranks_per_node: int) -> LoadPeak:
    """The module docstring's `load` term."""
    params, h, vocab = float(cost.params), cost.hidden_size, cost.vocab
    if stage < 3:
        whole = params * element
        return LoadPeak(device=whole, host=whole, host_per_node=whole * ranks_per_node)
    attention = 2 * h * h + 2 * h * cost.kv_hidden_size
    largest = max(3 * h * cost.mlp_size, attention, vocab * h) * element
    reads = not (config.model.random_init or is_tiny_preset(config.model.name_or_path))
    host = vocab * h * element if reads else 0.0
    return LoadPeak(device=params * element / workers + largest, host=host,
                    host_per_node=host * ranks_per_node)


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


def kernel_set_of(config: SkrullConfig) -> str:
    """The kernel set whose memory the run's workers hold: model.kernels resolved as the workers resolve it
    (workers/kernels resolve_kernels; torch-free here), its layers counted as compiled under train.compile
    (what the compiler's partitioner saves): `compiled` for the torch set, `compiled_liger_loss` for
    liger_loss. auto is liger on GPU workers when liger-kernel is installed and the model's family is one
    it covers (liger_loss under train.compile: the compiler fuses the layers itself), torch otherwise. A
    family that cannot be read offline counts as torch, whose kernels keep more (the safe side)."""
    chosen = _resolved_kernels(config)
    if not config.train.compile or chosen == "liger":
        return chosen
    return {"torch": "compiled", "liger_loss": "compiled_liger_loss"}[chosen]


def _resolved_kernels(config: SkrullConfig) -> str:
    """model.kernels as the workers resolve it: torch | liger | liger_loss (auto under train.compile)."""
    import importlib.util

    from app.model.support import model_config_dict
    from workers.presets import LIGER_FAMILIES, TINY_MODEL_TYPES

    chosen = config.model.kernels
    if chosen != "auto":
        return chosen
    if config.resources.gpus_per_worker <= 0:
        return "torch"
    family = TINY_MODEL_TYPES.get(config.model.name_or_path) or (
        model_config_dict(config.model) or {}).get("model_type")
    if importlib.util.find_spec("liger_kernel") is None or family not in LIGER_FAMILIES:
        return "torch"
    return "liger_loss" if config.train.compile else "liger"


def configured_checkpointing(config: SkrullConfig, offload: bool | None = None) -> Checkpointing:
    """The train section's setting (offload: None = train.activation_offload; True on a setting without
    recompute means every layer offloaded). train.activation_checkpointing=auto must be resolved first."""
    train = config.train
    if train.activation_checkpointing == "auto":
        raise ConfigError("train.activation_checkpointing=auto is resolved before the memory of one setting "
                          "is modeled (app/profiling/budget.py resolve_bucket_size)")
    offload = train.activation_offload if offload is None else offload
    every = train.activation_checkpointing_every if train.activation_checkpointing else (1 if offload else 0)
    return Checkpointing(every=every, offload=offload)


def memory_terms(config: SkrullConfig, *, zero_stage: int | None = None, offload: bool | None = None,
                 profile: HardwareProfile | None = None, kernels: str | None = None,
                 checkpointing: Checkpointing | None = None) -> MemoryTerms:
    """The module docstring's terms for `config` (zero_stage / offload / profile / checkpointing / kernels:
    None = the config's; `kernels`: torch | liger | compiled)."""
    kernels = kernels or kernel_set_of(config)
    profile = profile or load_hardware_profile(config.hardware.profile)
    dims = model_dims(config.model, config.data.tokenizer)
    cost = CostModel.from_model_dims(hidden_size=dims.hidden_size, kv_hidden_size=dims.kv_hidden_size,
                                     num_layers=dims.num_layers, profile=profile,
                                     num_params=dims.num_params, formula="model",
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
    setting = checkpointing or configured_checkpointing(config, offload)
    activations = pass_memory(model_shape(config), kernel_set(kernels), setting,
                              config.train.loss_chunk_tokens)
    size = config.scheduling.bucket_size
    load = load_peak(config, cost, stage=stage, workers=workers, element=element,
                     ranks_per_node=min(workers, profile.gpus_per_node) if on_gpu else workers)
    return MemoryTerms(zero_stage=stage, workers=workers, device=device, weights=weights, gradients=gradients,
                       optimizer=trainable * 12 / workers, runtime=profile.runtime_memory_bytes,
                       safety=SAFETY_FRACTION * device, recompute=setting.name, kernels=kernels,
                       activations=activations, bucket=None if size == "auto" else int(size), load=load)


def memory_table(config: SkrullConfig, *, kernels: str | None = None) -> dict[str, MemoryTerms]:
    """memory_terms at ZeRO-2 and ZeRO-3, each without and with activation offload (`plan`)."""
    return {f"zero{stage}{'_offload' if offload else ''}":
            memory_terms(config, zero_stage=stage, offload=offload, kernels=kernels)
            for stage in (2, 3) for offload in (False, True)}


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    rows = [header, *rows]
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if c else cell.ljust(w) for c, (cell, w) in enumerate(zip(r, widths,
                                                                                             strict=True)))
             for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def format_memory_table(table: dict[str, MemoryTerms]) -> str:
    """The table `plan` prints (GB per rank, modeled): each setting's terms, the C it leaves and its peak."""
    header = ("setting", "weights", "grads", "optimizer", "loss", "static", "KB/token", "C tokens", "peak GB",
              "load GB", "load host GB/node")
    return _table(header, [
        (f"ZeRO-{t.zero_stage}, recompute {t.recompute}", f"{t.weights / GB:.1f}", f"{t.gradients / GB:.1f}",
         f"{t.optimizer / GB:.1f}", f"{t.loss / GB:.1f}", f"{t.static / GB:.1f}",
         f"{t.activation_per_token / 1e3:.1f}", f"{t.tokens:,}" if t.tokens else "does not fit",
         f"{t.peak_bytes / GB:.1f}", _load_cell(t), f"{t.load.host_per_node / GB:.1f}" if t.load else "-")
        for t in table.values()])


def _load_cell(terms: MemoryTerms) -> str:
    if terms.load is None:
        return "-"
    return f"{terms.load.device / GB:.1f}" + ("" if terms.load_fits else " (does not fit)")


def format_terms(terms: MemoryTerms) -> str:
    """One setting's memory per rank by term at the run's C (`plan`): why C is what it is."""
    rows = [("weights", terms.weights), ("gradients", terms.gradients), ("optimizer", terms.optimizer),
            (f"loss ({terms.phase.name} phase)", terms.loss),
            (f"activations at C = {terms.at_tokens:,} ({terms.activation_per_token / 1e3:.1f} KB/token)",
             terms.activation_per_token * terms.at_tokens),
            ("runtime (hardware.profile)", terms.runtime), ("peak", terms.peak_bytes),
            *([("load: build + checkpoint read (before step 1)", terms.load.device),
               ("load: host memory per rank", terms.load.host)] if terms.load else []),
            (f"headroom (>= {SAFETY_FRACTION:.0%} safety kept free)", terms.headroom),
            ("device", terms.device)]
    return _table(("term", "GB"), [(name, f"{value / GB:.2f}") for name, value in rows])
