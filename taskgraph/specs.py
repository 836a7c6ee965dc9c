"""Validated descriptions of what is simulated: model, hardware, workload, policy, scenario.

Units: sizes in bytes unless a field name says ``_gb`` (10^9 bytes); bandwidths in GB/s
(10^9 bytes per second); compute in TFLOPS (10^12 FLOP/s); times in seconds unless ``_us``/``_ms``.
Every hardware figure is a datasheet peak plus an achieved-efficiency factor, so a profile says
both what the part is sold as and what it delivers (`tg calibrate` measures the latter).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from taskgraph.dag.schedules import RESOURCES
from taskgraph.kinds import KINDS

# No NaN or infinity anywhere: every figure must be a number a run can use.
_STRICT = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

Positive = Field(gt=0)
Efficiency = Field(gt=0.0, le=1.0)
#: A machine's figure (GB, GB/s, TFLOPS): within what any machine has, since outside it the
#: arithmetic over- or underflows (1e-320 TFLOPS gave an infinite prefill and NaN figures with
#: exit 0; 1e308 GB/s a division by zero).
Figure = Field(ge=1e-6, le=1e9, allow_inf_nan=False)

# Sizes beyond any real run, refused up front: past them the run's own structures, not its
# figures, take the time and memory (each bound names the field in the error).
#: GPUs of one host (HGX-2 has 16); the streams and tasks of a run grow with each.
MAX_GPUS = 16
#: Micro-batches in one batch (policy.N / policy.mu): a batch's task graph links every
#: micro-batch's buffer use to the others', so its dependencies grow with the square of this
#: (256: 9,000 tasks, 270,000 dependencies a decode step on tiny; 1,024 took 6 GB). The search
#: considers at most 64; published policies use up to 92.
MAX_MICRO_BATCHES = 256
#: Requests in a request list, read or generated: the queue benchmark's scale.
MAX_REQUESTS = 1_000_000


class ModelSpec(BaseModel):
    """A decoder-only MoE transformer (SPEC 3.1)."""

    model_config = _STRICT

    name: str = "custom"
    h: int = Positive
    h_i: int = Positive
    L: int = Positive
    n_q: int = Positive
    n_kv: int = Positive
    E: int = Positive
    k: int = Positive
    V: int = Positive
    dtype_bytes: int = Field(default=2, gt=0)
    # What the weights are stored as (a checkpoint's torch_dtype); None: fp32 for 4-byte
    # weights, bf16 (CPU) or fp16 (CUDA) for 2-byte ones. It must agree with dtype_bytes.
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    # Fields that change what the model computes but not how much work it is (read from a
    # checkpoint's config.json; the defaults are Mixtral 8x7B's).
    head_dim: int | None = Field(default=None, gt=0)      # None: h / n_q
    rope_theta: float = Field(default=1e6, gt=0, allow_inf_nan=False)
    rope_type: str = "default"           # HF rope_type; the executor computes default, linear
    rope_scaling_factor: float = Field(default=1.0, gt=0, allow_inf_nan=False)   # linear
    rms_norm_eps: float = Field(default=1e-5, gt=0, allow_inf_nan=False)
    # The LM head reuses the token embedding (one matrix, counted once).
    tie_word_embeddings: bool = False
    # Attention sees only the last `sliding_window` tokens (None: every token).
    sliding_window: int | None = Field(default=None, gt=0)
    hidden_act: str = "silu"             # the experts' gate activation (SwiGLU: silu)
    # Which layer structure the weights follow; the executor computes "mixtral" only.
    architecture: Literal["mixtral", "dbrx"] = "mixtral"

    @model_validator(mode="after")
    def _shapes(self) -> "ModelSpec":
        if self.head_dim is None and self.h % self.n_q:
            raise ValueError(f"h = {self.h} is not a multiple of n_q = {self.n_q}")
        if self.dtype is not None and _DTYPE_BYTES[self.dtype] != self.dtype_bytes:
            raise ValueError(f"dtype {self.dtype} has {_DTYPE_BYTES[self.dtype]}-byte elements "
                             f"but dtype_bytes = {self.dtype_bytes}")
        if self.n_q % self.n_kv:
            raise ValueError(f"n_q = {self.n_q} is not a multiple of n_kv = {self.n_kv}")
        if self.k > self.E:
            raise ValueError(f"k = {self.k} experts per token exceeds E = {self.E} experts")
        return self

    @property
    def d(self) -> int:
        """Head dimension."""
        return self.head_dim or self.h // self.n_q

    @property
    def q_dim(self) -> int:
        """Width of Q (and of the attention output): n_q heads of d, usually h."""
        return self.n_q * self.d

    @property
    def h_kv(self) -> int:
        """Width of K (and of V): n_kv heads of d."""
        return self.n_kv * self.d

    # Per-layer weight sections, in the order they lie in a layer's weight buffer. Only the
    # streamed tail of a layer is paged, so the order decides which tasks wait for which pages.
    @property
    def qkv_bytes(self) -> int:
        return self.dtype_bytes * self.h * (self.q_dim + 2 * self.h_kv)

    @property
    def o_bytes(self) -> int:
        return self.dtype_bytes * self.q_dim * self.h

    @property
    def router_bytes(self) -> int:
        return self.dtype_bytes * self.h * self.E

    @property
    def expert_bytes(self) -> int:
        """One SwiGLU expert: w1, w3 (up) and w2 (down)."""
        return self.dtype_bytes * 3 * self.h * self.h_i

    @property
    def layer_bytes(self) -> int:
        return self.qkv_bytes + self.o_bytes + self.router_bytes + self.E * self.expert_bytes

    @property
    def embed_bytes(self) -> int:
        """Token embedding plus LM head (one matrix if tied), kept on the GPU."""
        return (1 if self.tie_word_embeddings else 2) * self.dtype_bytes * self.V * self.h

    @property
    def model_bytes(self) -> int:
        return self.L * self.layer_bytes + self.embed_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in one layer."""
        return 2 * self.dtype_bytes * self.h_kv



class GPUSpec(BaseModel):
    model_config = _STRICT

    name: str
    count: int = Field(default=1, gt=0, le=MAX_GPUS)
    memory_gb: float = Figure
    # Planning headroom: the search keeps within memory_gb x usable_fraction (MoE-Lightning's
    # optimizer keeps GPU use <= 0.86). An explicit policy may use up to memory_gb - reserve_gb
    # (the CUDA context and library workspaces), with a warning above the headroom.
    usable_fraction: float = Field(default=0.86, gt=0.0, le=1.0)
    reserve_gb: float = Field(default=0.5, ge=0.0, le=1e9, allow_inf_nan=False)
    mem_gbps: float = Figure
    tflops: float = Figure
    flops_eff: float = Efficiency
    mem_eff: float = Efficiency
    task_overhead_us: float = Field(default=10.0, ge=0.0, le=1e9, allow_inf_nan=False)


class CPUSpec(BaseModel):
    model_config = _STRICT

    name: str
    cores: int = Positive
    memory_gb: float = Figure
    # As for the GPU: the search plans within usable_fraction (0.8, as MoE-Lightning's
    # optimizer); an explicit policy may use all but reserve_gb (the OS and the process itself).
    usable_fraction: float = Field(default=0.8, gt=0.0, le=1.0)
    reserve_gb: float = Field(default=8.0, ge=0.0, le=1e9, allow_inf_nan=False)
    mem_gbps: float = Figure
    tflops: float = Figure
    flops_eff: float = Efficiency
    mem_eff: float = Efficiency
    # What the host's copies into pinned memory reach, one process with all its threads.
    memcpy_gbps: float = Figure
    # Memory bandwidth one core drives on its own (GB/s, bytes read plus written). A process
    # with few threads gets no more than its threads' worth: its host tasks' memory traffic at
    # threads x this, its copies at half that (a copy reads and writes every byte). None: no
    # per-core limit (a process reaches the host's rates whatever its threads).
    core_gbps: float | None = Field(default=None, ge=1e-6, le=1e9, allow_inf_nan=False)
    task_overhead_us: float = Field(default=20.0, ge=0.0, le=1e9, allow_inf_nan=False)


class LinkSpec(BaseModel):
    """The CPU-GPU link of one GPU. The two directions run in parallel; transfers in one
    direction share it and run one after another."""

    model_config = _STRICT

    h2d_gbps: float = Figure
    d2h_gbps: float = Figure
    h2d_eff: float = Efficiency
    d2h_eff: float = Efficiency
    latency_us: float = Field(default=10.0, ge=0.0, le=1e9, allow_inf_nan=False)
    # Achieved CPU->GPU rate from pageable (unpinned) memory, which the driver stages through
    # its own pinned buffer; None: as fast as pinned.
    pageable_h2d_gbps: float | None = Field(default=None, ge=1e-6, le=1e9, allow_inf_nan=False)


class InterconnectSpec(BaseModel):
    """What carries the GPUs' collectives (tensor parallelism's all-reduces): NVLink, or PCIe
    peer-to-peer through a switch or the host bridge. `gbps` is the rate one GPU sends at in a
    ring collective (nccl-tests' "bus bandwidth"); each step of a ring pays `latency_us`."""

    model_config = _STRICT

    name: str = "interconnect"
    gbps: float = Figure
    eff: float = Efficiency
    latency_us: float = Field(default=10.0, ge=0.0, le=1e9, allow_inf_nan=False)
    # No peer-to-peer between the GPUs: what they send each other is written to host memory and
    # read back, drawing on what the host shares (hardware.shared) on its way.
    through_host: bool = False


class SharedSpec(BaseModel):
    """What the GPUs of one host share beyond its cores. A figure left out is not shared: each
    GPU's link, and each process's host work, runs at its own rate whatever the others do.

    Shared bandwidth is divided among the tasks drawing on it in proportion to what each would
    draw alone (:mod:`taskgraph.sim.contention`)."""

    model_config = _STRICT

    # The bandwidth the GPUs' links reach together, per direction: the CPU's PCIe lanes or the
    # switch the GPUs sit behind (achieved GB/s).
    pcie_gbps: float | None = Field(default=None, ge=1e-6, le=1e9, allow_inf_nan=False)
    # Host memory bandwidth (achieved GB/s, bytes read plus written, as STREAM counts them) that
    # every link's DMA, every copy into pinned memory (which reads and writes each byte) and the
    # host's own tasks (CPU attention, CPU experts) draw on together.
    memory_gbps: float | None = Field(default=None, ge=1e-6, le=1e9, allow_inf_nan=False)


class InterferenceSpec(BaseModel):
    """Tasks slowing down the tasks they overlap on other resources: cores, memory bandwidth and
    caches that two streams share.

    ``slowdown[victim][aggressor] = a``: a task on resource `victim` takes ``duration x (1 + sum
    of a x f)``, where f is the fraction of its run during which resource `aggressor` is busy. On
    the CPU backend every stream is a thread on the same few cores and memory, so everything
    slows everything; on a real machine CPU attention competes with pinned memcpy and DMA for
    host memory. `tg calibrate` fits the factors from the executor's own tasks."""

    model_config = _STRICT

    slowdown: dict[str, dict[str, float]]

    @field_validator("slowdown")
    @classmethod
    def _resources(cls, value: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        for victim, by in value.items():
            for name in (victim, *by):
                if name not in RESOURCES:
                    raise ValueError(f"unknown resource '{name}' (known: {', '.join(RESOURCES)})")
            for name, x in by.items():
                if name == victim:
                    raise ValueError(f"'{victim}' cannot slow itself down (its tasks run one at "
                                     "a time)")
                if x < 0:
                    raise ValueError(f"slowdown of '{victim}' by '{name}' is {x}; it must be >= 0")
        return value


class KindEffect(BaseModel):
    """How one system's software does on one task kind, relative to what the machine's own
    kernels and copies reach (the hardware profile's achieved rates)."""

    model_config = _STRICT

    flops_eff: float = Field(default=1.0, gt=0.0, le=1.0)   # share of the achieved FLOP rate
    bytes_eff: float = Field(default=1.0, gt=0.0, le=1.0)   # share of the achieved bandwidth
    overhead_us: float = Field(default=0.0, ge=0.0, le=1e6, allow_inf_nan=False)   # per task
    # Skinny matrix products (an MoE expert seeing a few tokens) stream their weights at a
    # fraction I / (I + intensity_half) of the bandwidth, I = the task's FLOPs per byte (about
    # the tokens per expert for fp16 weights); 0: no such loss.
    intensity_half: float = Field(default=0.0, ge=0.0, le=1e4, allow_inf_nan=False)


class ImplementationSpec(BaseModel):
    """What one system's software achieves on a machine (an *implementation profile*): kernel
    efficiency per task kind, fixed costs per task (launches, Python), and whether weights
    cross from pinned or pageable memory. A machine profile says what the hardware can do;
    this says how much of it a given system gets. Each schedule names the one it stands for by
    default (S1: MoE-Lightning, S3/S4: FlexGen); ``implementation:`` in a scenario swaps it."""

    model_config = _STRICT

    name: str
    title: str = ""
    kinds: dict[str, KindEffect] = Field(default_factory=dict)
    # Weights cross CPU->GPU from pageable memory (the driver stages them) at
    # hardware.link.pageable_h2d_gbps instead of the pinned rate.
    pageable_weights: bool = False
    # On several GPUs the system runs one process per GPU, and each runs its host work (its
    # shard's CPU attention, its copies into pinned memory) with this many threads: torchrun
    # sets OMP_NUM_THREADS=1 for every process it starts unless told otherwise. None: the
    # host's cores shared evenly among the processes. A process never gets more than its
    # share of the cores, however many threads it starts.
    rank_threads: float | None = Field(default=None, gt=0, le=1e4, allow_inf_nan=False)
    sources: list[str] = Field(default_factory=list)
    # Where the figures come from: `tg fit` writes the data, date and error here.
    fitted: str | None = None

    @field_validator("kinds")
    @classmethod
    def _known_kinds(cls, value: dict[str, KindEffect]) -> dict[str, KindEffect]:
        for kind in value:
            if kind not in KINDS:
                raise ValueError(f"unknown task kind '{kind}' (known: {', '.join(KINDS)})")
        return value


class HardwareSpec(BaseModel):
    model_config = _STRICT

    name: str = "custom"
    gpu: GPUSpec
    cpu: CPUSpec
    link: LinkSpec
    # Between the GPUs of a multi-GPU machine (None: the GPUs' collectives cross their PCIe
    # links, at the link's GPU->CPU rate).
    interconnect: InterconnectSpec | None = None
    # What the GPUs' links and the host's tasks share (nothing, unless given).
    shared: SharedSpec = Field(default_factory=SharedSpec)
    # Where and when `tg calibrate` measured this profile (None: datasheet figures).
    calibrated: str | None = None
    # Which figures `tg fit` fitted to published end-to-end measurements, on what data, when,
    # and how well (None: none).
    fitted: str | None = None
    # Per task kind, measured by `tg calibrate` from the executor's own tasks: a fixed cost (µs)
    # and an effective bandwidth for the bytes the task moves (GB/s), replacing its resource's.
    # On small shapes these, not the datasheet roofs, decide how long a task takes.
    task_overhead_us: dict[str, float] = Field(default_factory=dict)
    task_gbps: dict[str, float] = Field(default_factory=dict)
    # How long after a task ends a task on another stream waiting for it can start (an event's
    # latency, a thread waking up). `tg calibrate` measures it.
    handoff_us: float = Field(default=0.0, ge=0.0)
    # Tasks slowed down by what overlaps them on other resources (None: not modelled).
    interference: InterferenceSpec | None = None

    @field_validator("task_overhead_us", "task_gbps")
    @classmethod
    def _known_kinds(cls, value: dict[str, float], info) -> dict[str, float]:
        for kind, x in value.items():
            if not math.isfinite(x):
                raise ValueError(f"{kind}: {x} is not a finite number")
            if kind not in KINDS:
                raise ValueError(f"unknown task kind '{kind}' (known: {', '.join(KINDS)})")
            if x < 0 or (x == 0 and info.field_name == "task_gbps"):
                raise ValueError(f"{kind}: {x} must be {'positive' if x == 0 else 'non-negative'}")
        return value


class LengthsSpec(BaseModel):
    """A generated request list (:func:`taskgraph.serving.requests.generate_requests`): `count` requests
    whose prompt and generation lengths have the given means and maxima."""

    model_config = _STRICT

    count: int = Field(gt=0, le=MAX_REQUESTS)
    prompt_mean: float = Field(gt=0, le=10_000_000)
    prompt_max: int = Field(gt=0, le=10_000_000)
    gen_mean: float = Field(gt=0, le=10_000_000)
    gen_max: int = Field(gt=0, le=10_000_000)
    seed: int = 0

    @model_validator(mode="after")
    def _means_below_maxima(self) -> "LengthsSpec":
        for what in ("prompt", "gen"):
            mean, top = getattr(self, f"{what}_mean"), getattr(self, f"{what}_max")
            if mean > top:
                raise ValueError(f"{what}_mean = {mean:g} is above {what}_max = {top}")
        return self


class RoutingSpec(BaseModel):
    """Which experts tokens route to (taskgraph.dag.routing): ``uniform`` (any k of E alike),
    ``skewed`` (in proportion to ``popularity``, one weight per expert, or to rank^-``zipf``),
    or ``trace`` (a file of a real run's router decisions, `tg execute --record-routing`).
    ``seed`` draws the synthetic steps an expert cache is replayed on."""

    model_config = _STRICT

    kind: Literal["uniform", "skewed", "trace"] = "uniform"
    popularity: list[float] | None = Field(default=None, min_length=1, max_length=4096)
    zipf: float | None = Field(default=None, gt=0.0, le=10.0)
    trace: str | None = None
    seed: int = Field(default=0, ge=0, le=2**32 - 1)

    @field_validator("popularity")
    @classmethod
    def _positive(cls, weights: list[float] | None) -> list[float] | None:
        if weights is not None and not all(0 < w <= 1e9 for w in weights):
            raise ValueError("every popularity weight must be positive (at most 1e9)")
        return weights

    @model_validator(mode="after")
    def _one_source(self) -> "RoutingSpec":
        given = [f for f in ("popularity", "zipf", "trace") if getattr(self, f) is not None]
        wants = {"uniform": [], "trace": ["trace"]}.get(self.kind)
        if wants is None:
            if len(given) != 1 or given[0] == "trace":
                raise ValueError("skewed routing needs one of popularity (a weight per expert) "
                                 "or zipf (an exponent)")
        elif given != wants:
            extra = sorted(set(given) - set(wants))
            raise ValueError(f"{self.kind} routing takes no {', '.join(extra)}" if extra else
                             f"{self.kind} routing needs {', '.join(wants)} (a file)")
        return self


class WorkloadSpec(BaseModel):
    """Offline batch decoding. With ``padded`` every prompt counts as ``max_prompt_len`` tokens
    (FlexGen's padding); otherwise prompts count at their mean length, as variable-length batching
    packs them. A workload given as requests (``requests``: a file; ``lengths``: generated) has
    its lengths filled in from the list by the scenario loader: the mean prompt, the longest
    prompt, and the mean generation length (the longest when padded, as FlexGen generates one
    length for all)."""

    model_config = _STRICT

    prompt_len: int = Field(gt=0, le=10_000_000)
    max_prompt_len: int | None = Field(default=None, gt=0, le=10_000_000)
    gen_len: int = Field(gt=0, le=10_000_000)
    padded: bool = False
    requests: str | None = None
    lengths: LengthsSpec | None = None
    # One continuous batch: a finished request's slot goes to the next in the queue, its prompt
    # prefilled within the next decode step (MoE-Lens). Needs a request list, unpadded.
    refill: bool = False
    routing: RoutingSpec = RoutingSpec()

    @field_validator("routing", mode="before")
    @classmethod
    def _routing_kind(cls, value):
        return {"kind": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _max(self) -> "WorkloadSpec":
        if self.max_prompt_len is not None and self.max_prompt_len < self.prompt_len:
            raise ValueError(
                f"max_prompt_len = {self.max_prompt_len} is below prompt_len = {self.prompt_len}"
            )
        if self.refill and self.padded:
            raise ValueError("refill runs requests unpadded (each at its own length); padded "
                             "batches (FlexGen) run one fixed batch at a time")
        if self.refill and self.requests is None and self.lengths is None:
            raise ValueError("refill needs a request list: give workload.requests (a file) or "
                             "workload.lengths (generated)")
        return self

    @property
    def context_prompt(self) -> int:
        """Prompt tokens each sequence holds in the KV cache."""
        if self.padded:
            return self.max_prompt_len or self.prompt_len
        return self.prompt_len


class PolicySpec(BaseModel):
    """(N, mu, A_g, F_g, r_w, r_c) of SPEC 3.5."""

    model_config = _STRICT

    N: int = Field(gt=0, le=1_000_000_000)
    mu: int = Field(gt=0, le=1_000_000_000)
    A_g: Literal[0, 1] = 0
    F_g: Literal[0, 1] = 1
    r_w: float = Field(default=0.0, ge=0.0, le=1.0)   # default: every weight streamed
    r_c: float = Field(default=0.0, ge=0.0, le=1.0)   # default: the whole KV cache on the CPU
    # Expert-level schedules (EP, EC): experts of each layer held on the GPU, a fixed set of the
    # most popular (EP) or a cache (EC) that keeps the most recently used (lru) or the most
    # popular (popular).
    experts_gpu: int = Field(default=0, ge=0, le=4096)
    eviction: Literal["lru", "popular"] = "lru"
    # ECP: the share of a layer's cache misses a predictor fetches right one layer ahead.
    prefetch: float = Field(default=0.0, ge=0.0, le=1.0)

    @field_validator("mu")
    @classmethod
    def _mu_divides_n(cls, mu: int, info) -> int:
        n = info.data.get("N")
        if n is not None:
            if mu > n:
                raise ValueError(f"mu = {mu} exceeds N = {n}: a micro-batch cannot exceed the batch")
            if n % mu:
                raise ValueError(f"N = {n} is not a multiple of mu = {mu}")
            if n // mu > MAX_MICRO_BATCHES:
                raise ValueError(f"N / mu = {n // mu:,} micro-batches; tg runs at most "
                                 f"{MAX_MICRO_BATCHES} in a batch (raise mu or lower N)")
        return mu

    @property
    def n_micro(self) -> int:
        return self.N // self.mu


class Expect(BaseModel):
    """What `tg compare --check` enforces (a CI gate on simulated performance)."""

    model_config = _STRICT

    beats: dict[str, list[str]] = Field(default_factory=dict)
    min_efficiency: dict[str, float] = Field(default_factory=dict)
    max_decode_layer_ms: dict[str, float] = Field(default_factory=dict)
    min_throughput_tok_s: dict[str, float] = Field(default_factory=dict)

    def schedules(self) -> list[str]:
        names: list[str] = []
        for winner, losers in self.beats.items():
            names += [winner, *losers]
        for table in (self.min_efficiency, self.max_decode_layer_ms, self.min_throughput_tok_s):
            names += list(table)
        return list(dict.fromkeys(names))


class Scenario(BaseModel):
    model_config = _STRICT

    name: str
    model: ModelSpec
    hardware: HardwareSpec
    workload: WorkloadSpec
    policy: PolicySpec
    schedule: str = "S1"
    # None: each schedule's own (Schedule.implementation).
    implementation: ImplementationSpec | None = None
    expect: Expect | None = None
    # `policy: auto` in the file: the policy is a placeholder until a search replaces it.
    _policy_auto: bool = PrivateAttr(default=False)
    # Policy fields the user gave explicitly: field -> (where, e.g. "--set policy.A_g=0", and
    # whether it binds every schedule (a --set) or only the file's own schedule (the file)).
    _pins: dict[str, tuple[str, bool]] = PrivateAttr(default_factory=dict)
    # The request list of `workload.requests` or `workload.lengths` (None: mean lengths only).
    _requests: list | None = PrivateAttr(default=None)
    # The router decisions of `workload.routing.trace` (taskgraph.dag.routing.RoutingTrace).
    _routing_trace: object = PrivateAttr(default=None)
    # The experts each layer keeps on the GPU where fixed, an (L, experts_gpu) array; None: the
    # routing's most popular (taskgraph.dag.routing.Routing.popular).
    _experts_kept: object = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _experts_fit_the_model(self) -> "Scenario":
        E, routing = self.model.E, self.workload.routing
        if routing.popularity is not None and len(routing.popularity) != E:
            raise ValueError(f"workload.routing.popularity has {len(routing.popularity)} "
                             f"weights; the model has E = {E} experts, one weight each")
        if self.policy.experts_gpu > E:
            raise ValueError(f"policy.experts_gpu = {self.policy.experts_gpu} exceeds the "
                             f"model's E = {E} experts per layer")
        return self

    @property
    def routing_trace(self):
        """The recorded router decisions `workload.routing.trace` names (None otherwise)."""
        return self._routing_trace

    @property
    def experts_kept(self):
        """The experts each layer keeps on the GPU where that set is fixed (EP; EC evicting by
        popularity), where pinned: `tg validate` pins those the executed run kept, which its
        scenario's routing chose, when it simulates the run on its own routing trace. None: the
        routing's most popular."""
        return self._experts_kept

    @property
    def requests(self) -> list | None:
        """The workload's requests (:class:`taskgraph.serving.requests.Request`), if it lists them."""
        return self._requests

    @property
    def policy_auto(self) -> bool:
        return self._policy_auto

    @property
    def decode_steps(self) -> int:
        return self.workload.gen_len
