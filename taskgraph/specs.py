"""Validated descriptions of what is simulated: model, hardware, workload, policy, scenario.

Units: sizes in bytes unless a field name says ``_gb`` (10^9 bytes); bandwidths in GB/s
(10^9 bytes per second); compute in TFLOPS (10^12 FLOP/s); times in seconds unless ``_us``/``_ms``.
Every hardware figure is a datasheet peak plus an achieved-efficiency factor, so a profile says
both what the part is sold as and what it delivers (`tg calibrate` measures the latter).
"""

from __future__ import annotations

import math
import re
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from taskgraph import formats, placement
from taskgraph.dag.schedules import RESOURCES
from taskgraph.errors import TgError
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
#: The share of an expert cache's misses ECP's predictor fetches right where a scenario does not
#: say (policy.prefetch): 0.788, FATE's (arXiv 2502.12224, on Qwen1.5-MoE and DeepSeekMoE) for
#: the predictor ECP models, the next layer's router applied to this layer's router input, its
#: top k fetched. Another model's figure: no source read gives Mixtral's (docs/experts.md);
#: `tg execute --schedule ECP` measures it on a checkpoint (experts.prefetch.covered), which
#: `tg validate` feeds back.
PREFETCH_PUBLISHED = 0.788


def _number(annotation: Any) -> bool:
    """Whether a field holds a number (int, float, an optional one, a literal of numbers)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _number(args[0])
    if origin in (typing.Union, types.UnionType):
        given = [a for a in args if a is not type(None)]
        return bool(given) and all(_number(a) for a in given)
    if origin is Literal:
        return all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in args)
    return annotation in (int, float)


def _numbers_in(annotation: Any) -> bool:
    """Whether a field holds a list or tuple of numbers."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_numbers_in(a) for a in args if a is not type(None))
    return origin in (list, tuple) and bool(args) and _number(args[0])


#: YAML 1.1's forms of a number that YAML 1.2 and the scenario loader read as text (010 was 8,
#: 1_6 was 16, 1:0 was 60).
_YAML11_NUMBER = re.compile(r"[-+]?(0[0-7_]+|\d[\d_]*_[\d_]*|\d+(:[0-5]?\d)+|0b[01_]+|0x[\da-fA-F_]+)"
                            r"(\.\d*)?")


def _integer(annotation: Any) -> bool:
    """Whether a number field (_number) takes whole numbers only."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _integer(args[0])
    if origin in (typing.Union, types.UnionType, list, tuple):
        return all(_integer(a) for a in args if a not in (type(None), Ellipsis))
    if origin is Literal:
        return all(isinstance(a, int) for a in args)
    return annotation is int


def _not_a_number(name: str, value: Any, integer: bool) -> str:
    what = "an integer" if integer else "a number"
    if isinstance(value, bool):
        return f"{name} must be {what}, not {str(value).lower()}"
    hint = ""
    if _YAML11_NUMBER.fullmatch(value.strip()):
        hint = (" (YAML 1.1's octal, binary, hexadecimal, underscore and sexagesimal forms are "
                "not read as numbers: write it in decimal)")
    else:
        try:
            float(value)
            hint = " (a number in quotes is text: write it bare)"
        except ValueError:
            pass
    return f"{name} must be {what}, not the text {value[:40]!r}{hint}"


class Numbers(BaseModel):
    """A model whose numbers are numbers: true/false or text where a number belongs is refused
    naming the field (pydantic would read true as 1 and '8' as 8), as are lists of numbers
    holding either. One rule for every file tg reads (scenarios, --set, measurement files)."""

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_numbers(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            field = cls.model_fields.get(name)
            if field is None:
                continue
            integer = _integer(field.annotation)
            if _number(field.annotation) and isinstance(value, (bool, str)):
                raise ValueError(_not_a_number(name, value, integer))
            if _numbers_in(field.annotation) and isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    if isinstance(item, (bool, str)):
                        raise ValueError(_not_a_number(f"{name}[{i}]", item, integer))
        return data


class Spec(Numbers):
    """A section of a scenario: unknown keys refused, immutable, no NaN or infinity, numbers
    numbers (:class:`Numbers`)."""

    model_config = _STRICT


#: The classes of tensor whose storage a model states (ModelSpec.precision), besides the KV cache.
TENSOR_CLASSES = ("attention", "router", "experts", "shared", "dense", "embedding", "head")

#: Layer structures tg knows, by Hugging Face model_type: each implies what its shapes do not
#: say (norms, biases, activation details; docs/models.md). The executor computes those
#: exec/loading.py's EXECUTED names.
ARCHITECTURES = ("mixtral", "dbrx", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3",
                 "olmoe", "phimoe", "gpt_oss", "glm4_moe")


class PrecisionSpec(Spec):
    """How a model's tensors are stored, class by class: a format name (q4_k, q8_0, mxfp4,
    fp8-block128, int4-g128, bf16, ...: :mod:`taskgraph.formats`) or bits per weight, block
    scales included; and the KV cache's. Unset: the model's dtype (dtype_bytes)."""

    attention: str | float | None = None     # Q, K, V and O projections (MLA's too)
    router: str | float | None = None
    experts: str | float | None = None       # the routed experts
    shared: str | float | None = None        # the shared experts
    dense: str | float | None = None         # the FFN of dense layers
    embedding: str | float | None = None
    head: str | float | None = None          # the LM head
    kv_cache: str | float | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _a_format(cls, value: object) -> object:
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError("must be a format name (such as q4_k, mxfp4 or bf16) or bits per "
                             "weight")
        try:
            formats.bits(value)
        except TgError as err:
            raise ValueError(str(err)) from None
        return value


class ModelSpec(Spec):
    """A decoder-only MoE transformer (SPEC 3.1), with what the MoEs offloaded today add to
    Mixtral's shape: dense layers, shared experts, fine-grained experts with their own size,
    grouped sigmoid routing, multi-head latent attention, sliding-window layers, and tensors
    stored at 4 to 8 bits (docs/models.md)."""

    name: str = "custom"
    h: int = Positive
    h_i: int = Positive          # a routed expert's intermediate size
    # The deepest MoEs have 61-94 layers; a graph's tasks grow with L, and a million layers
    # would be built for hours before anything could refuse them.
    L: int = Field(gt=0, le=1000)
    n_q: int = Positive
    n_kv: int = Positive
    E: int = Positive
    k: int = Positive
    V: int = Positive
    # Bytes of an element as the model computes (activations), and of every weight whose
    # precision says nothing else.
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
    # YaRN's own parameters, as config.json gives them (factor, original_max_position_embeddings,
    # beta_fast, beta_slow, truncate, attention_factor, mscale, mscale_all_dim; and the model's
    # max_position_embeddings): the executor computes the frequencies transformers does
    rope_yarn: dict[str, float | bool | None] | None = None
    # LongRoPE's (Phi-3.5-MoE's): short_factor (one divisor per frequency), short_mscale (what
    # multiplies cos and sin), original_max_position_embeddings (past it the long factors
    # apply, which the executor refuses), as config.json gives them
    rope_longrope: dict[str, float | list[float]] | None = None
    # RoPE rotates pairs of neighbouring dimensions (DeepSeek's), not the two halves (Llama's)
    rope_interleave: bool = False
    # RoPE rotates this fraction of each head's dimensions, the first ones (GLM-4.5's
    # partial_rotary_factor, 0.5); the rest pass unrotated.
    rope_partial: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    rms_norm_eps: float = Field(default=1e-5, gt=0, allow_inf_nan=False)
    # The LM head reuses the token embedding (one matrix, counted once).
    tie_word_embeddings: bool = False
    # Attention sees only the last `sliding_window` tokens (None: every token) in the layers
    # `sliding_layers` lists (None: every layer); gpt-oss alternates sliding and full layers.
    sliding_window: int | None = Field(default=None, gt=0)
    sliding_layers: tuple[int, ...] | None = None
    hidden_act: str = "silu"             # the experts' gate activation (SwiGLU: silu)
    # Which layer structure the weights follow (ARCHITECTURES).
    architecture: Literal[ARCHITECTURES] = "mixtral"
    # Layers whose FFN is one dense SwiGLU MLP of intermediate size h_dense: no router, no
    # experts (DeepSeek's first_k_dense_replace, Qwen's mlp_only_layers).
    dense_layers: tuple[int, ...] = ()
    h_dense: int | None = Field(default=None, gt=0)
    # Experts every token runs besides its k routed ones, each a SwiGLU MLP of h_shared
    # (DeepSeek's n_shared_experts; Qwen2-MoE's one, whose output a sigmoid gate scales).
    shared_experts: int = Field(default=0, ge=0, le=64)
    h_shared: int | None = Field(default=None, gt=0)
    shared_gate: bool = False
    # The router: a softmax over the experts' logits (Mixtral, Qwen, OLMoE, gpt-oss) or a
    # sigmoid score with a bias (DeepSeek-V3); whether the k gates are renormalised to sum to
    # 1; experts in `expert_groups` groups of which a token takes its k from the best
    # `topk_groups`; the gates' scale.
    router: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True
    expert_groups: int = Field(default=1, gt=0)
    topk_groups: int = Field(default=1, gt=0)
    routed_scaling: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    # Attention: grouped-query ("gqa") or multi-head latent attention ("mla", DeepSeek-V2/V3),
    # whose KV cache holds a kv_lora_rank latent and a qk_rope_head_dim key part per token.
    attention: Literal["gqa", "mla"] = "gqa"
    q_lora_rank: int | None = Field(default=None, gt=0)      # None: Q projected directly
    kv_lora_rank: int | None = Field(default=None, gt=0)
    qk_nope_head_dim: int | None = Field(default=None, gt=0)
    qk_rope_head_dim: int | None = Field(default=None, gt=0)
    v_head_dim: int | None = Field(default=None, gt=0)
    # How decode computes MLA: absorbed, the up-projections folded into the query and the
    # output so each head attends over the cached latent (llama.cpp, vLLM, kTransformers), or
    # decompressed, every cached latent projected to each head's key and value at every step
    # (transformers, and tg's own executor: `tg validate` prices it so).
    mla_absorbed: bool = True
    # A learned sink logit per head takes part in each softmax (gpt-oss).
    attention_sinks: bool = False
    # The Q, K and V projections add a bias (attention_bias: Phi-3.5-MoE's, whose O projection
    # adds one too, and GLM-4.5's), and so does the LM head (Phi-3.5-MoE's lm_head_bias).
    # Qwen2-MoE's and gpt-oss's biases go with their architecture.
    attention_bias: bool = False
    lm_head_bias: bool = False
    # Each head's Q and K are RMS-normed before RoPE (GLM-4.5's use_qk_norm; Qwen3-MoE's and
    # OLMoE's norms go with their architecture).
    qk_norm: bool = False
    # Phi-3.5-MoE's SparseMixer router drops, for each of its two picks, the experts whose
    # logit is more than 2 x this below the best (relatively): its router_jitter_noise, which
    # it uses so at inference too.
    sparsemixer_eps: float = Field(default=0.01, ge=0, allow_inf_nan=False)
    # How each class of tensor and the KV cache are stored.
    precision: PrecisionSpec = Field(default_factory=PrecisionSpec)

    @field_validator("dtype_bytes", mode="before")
    @classmethod
    def _whole_bytes(cls, value: object) -> object:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{value} is not whole bytes: dtype_bytes is the size of an element "
                             "the model computes in; weights stored in fewer bits are "
                             "model.precision.<class> (experts, attention, ...: a format such "
                             "as q4_k or mxfp4, or bits per weight)")
        return value

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
        if self.architecture == "phimoe" and self.k != 2:
            raise ValueError(f"k = {self.k}: a phimoe layer's SparseMixer router picks 2 "
                             "experts per token, whatever else its config says")
        yarn = self.rope_yarn or {}
        for name in ("factor", "original_max_position_embeddings", "max_position_embeddings"):
            value = yarn.get(name)
            if value is not None and not (isinstance(value, (int, float))
                                          and not isinstance(value, bool)
                                          and 0 < value < float("inf")):
                raise ValueError(f"rope_yarn.{name} must be a number above 0, not {value}")
        # Layers past L are the model's beyond the first L that run (--set model.L=2 on a
        # 61-layer model): kept, and counted nowhere.
        for name in ("dense_layers", "sliding_layers"):
            layers = getattr(self, name) or ()
            if any(i < 0 for i in layers) or len(set(layers)) != len(layers):
                raise ValueError(f"{name} must list distinct layer numbers from 0, not "
                                 f"{list(layers)}")
        if self.dense_layers and self.h_dense is None:
            raise ValueError(f"dense_layers lists {len(self.dense_layers)} layers but h_dense, "
                             "their FFN's intermediate size, is not given")
        if self.moe_layers == 0:
            raise ValueError(f"every one of the L = {self.L} layers is dense (dense_layers): "
                             "that is no MoE")
        if self.shared_experts and self.h_shared is None:
            raise ValueError(f"shared_experts = {self.shared_experts} but h_shared, their "
                             "intermediate size, is not given")
        if self.sliding_layers is not None and self.sliding_window is None:
            raise ValueError("sliding_layers is given but sliding_window is not")
        if self.E % self.expert_groups or self.topk_groups > self.expert_groups:
            raise ValueError(f"E = {self.E} experts in expert_groups = {self.expert_groups} "
                             f"groups of which topk_groups = {self.topk_groups} are taken: the "
                             "groups must divide E and number at least topk_groups")
        mla = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.attention == "mla":
            missing = [f for f in mla if getattr(self, f) is None]
            if missing:
                raise ValueError(f"attention: mla needs {', '.join(missing)}")
        elif any(getattr(self, f) is not None for f in (*mla, "q_lora_rank")):
            raise ValueError("kv_lora_rank, q_lora_rank and the qk/v head dims describe "
                             "attention: mla, not gqa")
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

    # --- which layer is which ---------------------------------------------------------------

    @property
    def moe_layers(self) -> int:
        """Layers with a router and experts."""
        return self.L - self.dense_count

    @property
    def dense_count(self) -> int:
        """Dense layers among the L."""
        return sum(1 for i in self.dense_layers if i < self.L)

    def is_dense(self, layer: int) -> bool:
        return layer in self.dense_layers

    def window(self, layer: int) -> int | None:
        """The tokens a layer's attention sees at most (None: all of them)."""
        if self.sliding_window is None or (self.sliding_layers is not None
                                           and layer not in self.sliding_layers):
            return None
        return self.sliding_window

    # --- attention, as its kernels see it --------------------------------------------------
    # MLA in decode absorbed (llama.cpp, vLLM and kTransformers: each head attends over the
    # cached latent and rope part) or decompressed (mla_absorbed False: over keys and values
    # projected from every cached latent).

    @property
    def qk_norm_whole(self) -> bool:
        """Q and K are RMS-normed over every head at once (OLMoE's q_norm and k_norm), not
        head by head: under tensor parallelism no GPU's heads alone can compute the norm."""
        return self.architecture == "olmoe"

    @property
    def q_width(self) -> int:
        """Elements of one token's queries as attention reads them."""
        if self.attention == "mla":
            return self.n_q * ((self.kv_lora_rank if self.mla_absorbed
                                else self.qk_nope_head_dim) + self.qk_rope_head_dim)
        return self.q_dim

    @property
    def attn_out_width(self) -> int:
        """Elements of one token's attention output (before the O projection)."""
        if self.attention == "mla":
            return self.n_q * (self.kv_lora_rank if self.mla_absorbed else self.v_head_dim)
        return self.q_dim

    @property
    def decompressed_width(self) -> int:
        """Elements of the keys and values decode makes of one cached token (MLA decompressed:
        every head's key, its shared rope part repeated, and value; 0 otherwise)."""
        if self.attention != "mla" or self.mla_absorbed:
            return 0
        return self.n_q * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)

    @property
    def decompress_params(self) -> int:
        """The up-projection decode applies to every cached token (MLA decompressed; else 0)."""
        if self.attention != "mla" or self.mla_absorbed:
            return 0
        return self.kv_lora_rank * self.n_q * (self.qk_nope_head_dim + self.v_head_dim)

    @property
    def kv_width(self) -> int:
        """Elements of one token's K and V in one layer's cache."""
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.h_kv

    @property
    def kv_split(self) -> int:
        """The most ways tensor parallelism splits the KV cache: by KV head (GQA); MLA's latent,
        which every query head reads, is held whole by every GPU (vLLM, SGLang). GPUs past
        this each hold a copy of their heads' part."""
        return 1 if self.attention == "mla" else self.n_kv

    def kv_copies(self, gpus: int) -> float:
        """How many times `gpus` GPUs in tensor parallel hold the KV cache over them all."""
        return gpus / min(gpus, self.kv_split)

    @property
    def prefill_pair_flops(self) -> int:
        """FLOPs of one (query, key) pair of prompt attention (scores and values; MLA's keys
        and values decompressed, as prefill runs it)."""
        if self.attention == "mla":
            return 2 * self.n_q * (self.qk_nope_head_dim + self.qk_rope_head_dim
                                   + self.v_head_dim)
        return 4 * self.q_dim

    # --- parameters, per layer ---------------------------------------------------------------

    @property
    def qkv_params(self) -> int:
        """Everything a layer computes Q, K and V with (MLA: the Q path, the KV down-projection
        and the key half of the up-projection, absorbed into the query)."""
        if self.attention != "mla":
            return self.h * (self.q_dim + 2 * self.h_kv)
        qk = self.n_q * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        q = (self.h * self.q_lora_rank + self.q_lora_rank * qk if self.q_lora_rank
             else self.h * qk)
        kv_down = self.h * (self.kv_lora_rank + self.qk_rope_head_dim)
        return q + kv_down + self.kv_lora_rank * self.n_q * self.qk_nope_head_dim

    @property
    def o_params(self) -> int:
        """The O projection (MLA: and the value half of the up-projection)."""
        if self.attention != "mla":
            return self.q_dim * self.h
        v = self.n_q * self.v_head_dim
        return self.kv_lora_rank * v + v * self.h

    @property
    def expert_params(self) -> int:
        """One routed SwiGLU expert: w1, w3 (up) and w2 (down)."""
        return 3 * self.h * self.h_i

    @property
    def shared_params(self) -> int:
        """A layer's shared experts (and their gate)."""
        if not self.shared_experts:
            return 0
        return self.shared_experts * 3 * self.h * self.h_shared + self.h * self.shared_gate

    @property
    def dense_params(self) -> int:
        """A dense layer's FFN."""
        return 3 * self.h * self.h_dense if self.dense_layers else 0

    # --- bytes, as stored ----------------------------------------------------------------------

    def bits(self, tensor_class: str) -> float:
        """Bits per weight (or per cache element) of a class of tensor, as stored."""
        fmt = getattr(self.precision, tensor_class)
        return 8.0 * self.dtype_bytes if fmt is None else formats.bits(fmt)

    def _stored(self, params: int, tensor_class: str) -> float:
        if getattr(self.precision, tensor_class) is None:
            return self.dtype_bytes * params
        return params * self.bits(tensor_class) / 8

    # Per-layer weight sections, in the order they lie in a layer's weight buffer. Only the
    # streamed tail of a layer is paged, so the order decides which tasks wait for which pages.
    @property
    def qkv_bytes(self) -> float:
        return self._stored(self.qkv_params, "attention")

    @property
    def o_bytes(self) -> float:
        return self._stored(self.o_params, "attention")

    @property
    def value_up_bytes(self) -> float:
        """MLA's value half of the up-projection (the first part of o_params), stored."""
        return self._stored(self.kv_lora_rank * self.n_q * self.v_head_dim, "attention")

    @property
    def router_bytes(self) -> float:
        return self._stored(self.h * self.E, "router")

    @property
    def shared_bytes(self) -> float:
        return self._stored(self.shared_params, "shared")

    @property
    def expert_bytes(self) -> float:
        """One routed SwiGLU expert: w1, w3 (up) and w2 (down)."""
        return self._stored(self.expert_params, "experts")

    @property
    def dense_bytes(self) -> float:
        return self._stored(self.dense_params, "dense")

    @property
    def layer_bytes(self) -> float:
        """An MoE layer: attention, router, shared and routed experts."""
        return (self.qkv_bytes + self.o_bytes + self.router_bytes + self.shared_bytes
                + self.E * self.expert_bytes)

    @property
    def dense_layer_bytes(self) -> float:
        return self.qkv_bytes + self.o_bytes + self.dense_bytes

    @property
    def latent_projection_params(self) -> int:
        """MLA's projections down to the Q and KV latents (none without MLA)."""
        if self.attention != "mla":
            return 0
        return self.h * (self.kv_lora_rank + self.qk_rope_head_dim + (self.q_lora_rank or 0))

    def whole_on_every_gpu_bytes(self, dense: bool) -> float:
        """A layer's weights that each GPU's shard holds whole under tensor parallelism, not
        split: MLA's latent projections, which all its heads read, and an MoE layer's router
        and shared experts' gate."""
        latent = self._stored(self.latent_projection_params, "attention")
        if dense:
            return latent
        return latent + self.router_bytes + self._stored(self.h * self.shared_gate, "shared")

    @property
    def layers_bytes(self) -> float:
        """Every layer's weights."""
        return self.moe_layers * self.layer_bytes + self.dense_count * self.dense_layer_bytes

    @property
    def head_bytes(self) -> float:
        """The LM head (the embedding, if tied)."""
        return self._stored(self.V * self.h, "embedding" if self.tie_word_embeddings else "head")

    @property
    def embed_bytes(self) -> float:
        """Token embedding plus LM head (one matrix if tied), kept on the GPU."""
        if self.tie_word_embeddings:
            return self.head_bytes
        return self._stored(self.V * self.h, "embedding") + self.head_bytes

    @property
    def model_bytes(self) -> float:
        return self.layers_bytes + self.embed_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token in one layer (MLA: its latent and rope key)."""
        return self._stored(self.kv_width, "kv_cache")

    @property
    def params(self) -> dict[str, int]:
        """Parameters in all, and those a token's forward pass multiplies by (its FLOPs are
        twice these): every layer's attention, router, shared and dense FFN, its k routed
        experts of each MoE layer, and the LM head; the embedding is a lookup. (Model cards
        count "active" parameters with or without the embedding and the head.)"""
        attention = self.L * (self.qkv_params + self.o_params)
        moe = self.moe_layers * (self.h * self.E + self.shared_params)
        dense = self.dense_count * self.dense_params
        matrices = self.V * self.h * (1 if self.tie_word_embeddings else 2)
        routed = self.moe_layers * self.expert_params
        return {"total": attention + moe + dense + matrices + routed * self.E,
                "active": attention + moe + dense + self.V * self.h + routed * self.k}

    def size(self) -> dict[str, Any]:
        """What a user checks against the model card: parameters (in all and used a token),
        GB and bits per weight of each class of tensor as stored, and the KV cache one token
        adds over all layers (while a sliding-window layer holds fewer than its window)."""
        bits = {"attention": self.bits("attention"), "router": self.bits("router"),
                "experts": self.bits("experts"), "shared": self.bits("shared"),
                "dense": self.bits("dense"),
                "embedding + head": self.bits("embedding") if self.tie_word_embeddings
                else (self.bits("embedding") + self.bits("head")) / 2}
        classes = self.bytes_by_class()
        return {"params": self.params, "gb": round(self.model_bytes / 1e9, 3),
                "classes": {c: {"gb": round(b / 1e9, 3), "bits": round(bits[c], 4)}
                            for c, b in classes.items()},
                "kv_kb_per_token": round(self.L * self.kv_bytes_per_token / 1e3, 3)}

    def bytes_by_class(self) -> dict[str, float]:
        """The whole model's bytes per class of tensor, as stored."""
        dense = self.dense_count
        out = {"attention": self.L * (self.qkv_bytes + self.o_bytes),
               "router": self.moe_layers * self.router_bytes,
               "experts": self.moe_layers * self.E * self.expert_bytes,
               "shared": self.moe_layers * self.shared_bytes,
               "dense": dense * self.dense_bytes,
               "embedding + head": self.embed_bytes}
        return {k: v for k, v in out.items() if v}


class GPUSpec(Spec):
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


class CPUSpec(Spec):
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


class LinkSpec(Spec):
    """The CPU-GPU link of one GPU. The two directions run in parallel; transfers in one
    direction share it and run one after another."""

    h2d_gbps: float = Figure
    d2h_gbps: float = Figure
    h2d_eff: float = Efficiency
    d2h_eff: float = Efficiency
    latency_us: float = Field(default=10.0, ge=0.0, le=1e9, allow_inf_nan=False)
    # Achieved CPU->GPU rate from pageable (unpinned) memory, which the driver stages through
    # its own pinned buffer; None: as fast as pinned.
    pageable_h2d_gbps: float | None = Field(default=None, ge=1e-6, le=1e9, allow_inf_nan=False)


class InterconnectSpec(Spec):
    """What carries the GPUs' collectives (tensor parallelism's all-reduces): NVLink, or PCIe
    peer-to-peer through a switch or the host bridge. `gbps` is the rate one GPU sends at in a
    ring collective (nccl-tests' "bus bandwidth"); each step of a ring pays `latency_us`."""

    name: str = "interconnect"
    gbps: float = Figure
    eff: float = Efficiency
    latency_us: float = Field(default=10.0, ge=0.0, le=1e9, allow_inf_nan=False)
    # No peer-to-peer between the GPUs: what they send each other is written to host memory and
    # read back, drawing on what the host shares (hardware.shared) on its way.
    through_host: bool = False


class SharedSpec(Spec):
    """What the GPUs of one host share beyond its cores. A figure left out is not shared: each
    GPU's link, and each process's host work, runs at its own rate whatever the others do.

    Shared bandwidth is divided among the tasks drawing on it in proportion to what each would
    draw alone (:mod:`taskgraph.sim.contention`)."""

    # The bandwidth the GPUs' links reach together, per direction: the CPU's PCIe lanes or the
    # switch the GPUs sit behind (achieved GB/s).
    pcie_gbps: float | None = Field(default=None, ge=1e-6, le=1e9, allow_inf_nan=False)
    # Host memory bandwidth (achieved GB/s, bytes read plus written, as STREAM counts them) that
    # every link's DMA, every copy into pinned memory (which reads and writes each byte) and the
    # host's own tasks (CPU attention, CPU experts) draw on together.
    memory_gbps: float | None = Field(default=None, ge=1e-6, le=1e9, allow_inf_nan=False)


class InterferenceSpec(Spec):
    """Tasks slowing down the tasks they overlap on other resources: cores, memory bandwidth and
    caches that two streams share.

    ``slowdown[victim][aggressor] = a``: a task on resource `victim` takes ``duration x (1 + sum
    of a x f)``, where f is the fraction of its run during which resource `aggressor` is busy. On
    the CPU backend every stream is a thread on the same few cores and memory, so everything
    slows everything; on a real machine CPU attention competes with pinned memcpy and DMA for
    host memory. `tg calibrate` fits the factors from the executor's own tasks."""

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


class KindEffect(Spec):
    """How one system's software does on one task kind, relative to what the machine's own
    kernels and copies reach (the hardware profile's achieved rates)."""

    flops_eff: float = Field(default=1.0, gt=0.0, le=1.0)   # share of the achieved FLOP rate
    bytes_eff: float = Field(default=1.0, gt=0.0, le=1.0)   # share of the achieved bandwidth
    overhead_us: float = Field(default=0.0, ge=0.0, le=1e6, allow_inf_nan=False)   # per task
    # Skinny matrix products (an MoE expert seeing a few tokens) stream their weights at a
    # fraction I / (I + intensity_half) of the bandwidth, I = the task's FLOPs per byte (about
    # the tokens per expert for fp16 weights); 0: no such loss.
    intensity_half: float = Field(default=0.0, ge=0.0, le=1e4, allow_inf_nan=False)
    # The rate its kernel unpacks routed-expert weights stored below 16 bits at (G weights/s),
    # a time added to the task's reading of them: a kernel that dequantizes into temporaries
    # before its product pays it (tg's own executor: `tg calibrate` measures it). None: unpacked
    # in registers as the weights stream (llama.cpp's quantized dot products; what that
    # arithmetic costs them is `serial`).
    dequant_gweights: float | None = Field(default=None, gt=0.0, le=1e6, allow_inf_nan=False)
    # Its arithmetic and its reads add up (seconds = bytes / bandwidth + FLOPs / FLOP rate)
    # instead of the one hiding under the other (the roofline's larger of the two): a kernel
    # that unpacks each block and multiplies between its loads, as llama.cpp's CPU kernels
    # measure (taskgraph.presets, "llama.cpp").
    serial: bool = False
    # For the experts of a task that see more than one token each, the kind runs another
    # kernel, whose rates (flops_eff, bytes_eff, serial) the fields set here are, over the
    # ones above; the task's fixed cost and unpacking stay the kind's. An expert product's
    # only (CPUFFN, GPUFFN): PyTorch's 16-bit product on a CPU without 16-bit arithmetic
    # streams one token's weights (a matrix-vector product) but converts and packs them for
    # two or more, then multiplies (taskgraph.presets, "fiddler"). None: one kernel at every
    # count.
    several_tokens: KindEffect | None = None

    @field_validator("several_tokens")
    @classmethod
    def _kernel_rates_only(cls, value: KindEffect | None) -> KindEffect | None:
        if value is not None:
            for name in ("overhead_us", "intensity_half", "dequant_gweights", "several_tokens"):
                if getattr(value, name) != KindEffect.model_fields[name].default:
                    raise ValueError(
                        f"{name}: several_tokens gives another kernel's rates (flops_eff, "
                        "bytes_eff, serial); the task's fixed cost, unpacking and skinniness "
                        "are the kind's own, set beside several_tokens")
        return value


#: The kinds whose work is routed experts' products alone, so that FLOPs per byte count the
#: tokens each expert sees (KindEffect.several_tokens).
EXPERT_PRODUCTS = ("CPUFFN", "GPUFFN")


class ImplementationSpec(Spec):
    """What one system's software achieves on a machine (an *implementation profile*): kernel
    efficiency per task kind, fixed costs per task (launches, Python), and whether weights
    cross from pinned or pageable memory. A machine profile says what the hardware can do;
    this says how much of it a given system gets. Each schedule names the one it stands for by
    default (S1: MoE-Lightning, S3/S4: FlexGen); ``implementation:`` in a scenario swaps it."""

    name: str
    title: str = ""
    kinds: dict[str, KindEffect] = Field(default_factory=dict)
    # Where it runs a process per GPU on one host they share, what its kinds reach there, in
    # place of `kinds`' entry for the same kind: a mechanism of the shared host (ZeRO-3
    # gathering every GPU's parameters through host memory) must not price a one-GPU run.
    several_gpus_kinds: dict[str, KindEffect] = Field(default_factory=dict)
    # Weights cross CPU->GPU from pageable memory (the driver stages them) at
    # hardware.link.pageable_h2d_gbps instead of the pinned rate.
    pageable_weights: bool = False
    # Its KV cache sits in pageable host memory, so the GPU-attention schedules' copies of it
    # to the GPU (D4) cross at hardware.link.pageable_h2d_gbps too.
    pageable_kv_cache: bool = False
    # Its expert cache swaps on a miss: the expert evicted to make room is copied back to host
    # memory after the chosen one crosses in, on the same CUDA stream, so a miss is a copy each
    # way, one after the other (Mixtral-offloading's ExpertCache._swap). False: host memory
    # keeps every expert and an evicted one is dropped (MoE-Infinity, tg's own executor).
    expert_swaps: bool = False
    # On several GPUs the system runs one process per GPU, and each runs its host work (its
    # shard's CPU attention, its copies into pinned memory) with this many threads: torchrun
    # sets OMP_NUM_THREADS=1 for every process it starts unless told otherwise. None: the
    # host's cores shared evenly among the processes. A process never gets more than its
    # share of the cores, however many threads it starts.
    rank_threads: float | None = Field(default=None, gt=0, le=1e4, allow_inf_nan=False)
    # The same for its one process on one GPU, where the system fixes it (Fiddler's generate()
    # calls torch.set_num_threads(16)); None: every core of the host. Several GPUs read
    # `rank_threads` alone.
    threads: float | None = Field(default=None, gt=0, le=1e4, allow_inf_nan=False)
    sources: list[str] = Field(default_factory=list)
    # Where the figures come from: `tg fit` writes the data, date and error here.
    fitted: str | None = None

    @field_validator("kinds", "several_gpus_kinds")
    @classmethod
    def _known_kinds(cls, value: dict[str, KindEffect]) -> dict[str, KindEffect]:
        for kind, effect in value.items():
            if kind not in KINDS:
                raise ValueError(f"unknown task kind '{kind}' (known: {', '.join(KINDS)})")
            if effect.several_tokens and kind not in EXPERT_PRODUCTS:
                raise ValueError(
                    f"{kind}.several_tokens: only an expert product's kernel depends on the "
                    f"tokens each expert sees ({', '.join(EXPERT_PRODUCTS)}); {kind}'s "
                    "work is not counted in experts")
        return value


class HardwareSpec(Spec):
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
    # `hardware: local`: which figures came from presets, not from this machine (each run
    # prints it; None: not this machine).
    assumed: str | None = None
    # Which figures `tg fit` fitted to published end-to-end measurements, on what data, when,
    # and how well (None: none).
    fitted: str | None = None
    # Per task kind, measured by `tg calibrate` from the executor's own tasks: a fixed cost (µs)
    # and an effective bandwidth for the bytes the task moves (GB/s), replacing its resource's.
    # On small shapes these, not the datasheet roofs, decide how long a task takes.
    task_overhead_us: dict[str, float] = Field(default_factory=dict)
    task_gbps: dict[str, float] = Field(default_factory=dict)
    # Per task kind that computes routed experts, the rate the executor dequantizes experts
    # stored below 16 bits at (G weights/s), measured by `tg calibrate` on a Q4_0 run; in place
    # of the implementation's KindEffect.dequant_gweights.
    task_dequant_gweights: dict[str, float] = Field(default_factory=dict)
    # Per task kind that computes or copies routed experts, what each expert a task touches
    # adds beyond its bytes (µs): its own operators, launched expert by expert. Measured by
    # `tg calibrate` from the same runs with experts four times as many and a quarter the size.
    task_expert_us: dict[str, float] = Field(default_factory=dict)
    # How long after a task ends a task on another stream waiting for it can start (an event's
    # latency, a thread waking up). `tg calibrate` measures it.
    handoff_us: float = Field(default=0.0, ge=0.0, le=1e9, allow_inf_nan=False)
    # Tasks slowed down by what overlaps them on other resources (None: not modelled).
    interference: InterferenceSpec | None = None

    @field_validator("task_overhead_us", "task_gbps", "task_dequant_gweights", "task_expert_us")
    @classmethod
    def _known_kinds(cls, value: dict[str, float], info) -> dict[str, float]:
        for kind, x in value.items():
            if not math.isfinite(x):
                raise ValueError(f"{kind}: {x} is not a finite number")
            if kind not in KINDS:
                raise ValueError(f"unknown task kind '{kind}' (known: {', '.join(KINDS)})")
            if x < 0 or (x == 0 and info.field_name != "task_overhead_us"):
                raise ValueError(f"{kind}: {x} must be {'positive' if x == 0 else 'non-negative'}")
            if x > 1e9:                 # as every other figure: 1e308 overflows the clock
                raise ValueError(f"{kind}: {x} must be at most 1e9")
        return value


class LengthsSpec(Spec):
    """A generated request list (:func:`taskgraph.serving.requests.generate_requests`): `count` requests
    whose prompt and generation lengths have the given means and maxima."""

    count: int = Field(gt=0, le=MAX_REQUESTS)
    prompt_mean: float = Field(gt=0, le=10_000_000)
    prompt_max: int = Field(gt=0, le=10_000_000)
    gen_mean: float = Field(gt=0, le=10_000_000)
    gen_max: int = Field(gt=0, le=10_000_000)
    seed: int = Field(default=0, ge=0, le=2**32 - 1)      # NumPy's seeds are non-negative

    @model_validator(mode="after")
    def _means_below_maxima(self) -> "LengthsSpec":
        for what in ("prompt", "gen"):
            mean, top = getattr(self, f"{what}_mean"), getattr(self, f"{what}_max")
            if mean > top:
                raise ValueError(f"{what}_mean = {mean:g} is above {what}_max = {top}")
        return self


class RoutingSpec(Spec):
    """Which experts tokens route to (taskgraph.dag.routing): ``uniform`` (any k of E alike),
    ``skewed`` (in proportion to ``popularity``, one weight per expert, or to rank^-``zipf``),
    or ``trace`` (a file of a real run's router decisions, `tg execute --record-routing`).
    ``seed`` draws the synthetic steps an expert cache is replayed on."""

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


class WorkloadSpec(Spec):
    """Offline batch decoding. With ``padded`` every prompt counts as ``max_prompt_len`` tokens
    (FlexGen's padding); otherwise prompts count at their mean length, as variable-length batching
    packs them. A workload given as requests (``requests``: a file; ``lengths``: generated) has
    its lengths filled in from the list by the scenario loader: the mean prompt, the longest
    prompt, and the mean generation length (the longest when padded, as FlexGen generates one
    length for all)."""

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


class PolicySpec(Spec):
    """(N, mu, A_g, F_g, r_w, r_c) of SPEC 3.5."""

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
    # EP's experts placed otherwise than experts_gpu on every layer (taskgraph.placement), at
    # most one of: a budget over all MoE layers, the most popular (layer, expert) pairs first
    # (Fiddler); llama.cpp's --n-cpu-moe N (the experts of layers 0..N-1 on the CPU, the
    # others' on the GPU); llama.cpp's -ot PATTERN=BUFFER list.
    experts_total: int | None = Field(default=None, ge=0, le=1_000_000)
    cpu_moe: int | None = Field(default=None, ge=0, le=100_000)
    override_tensor: tuple[str, ...] | None = Field(default=None, min_length=1, max_length=1000)
    eviction: Literal["lru", "popular"] = "lru"
    # ECP: the share of a layer's cache misses a predictor fetches right one layer ahead;
    # unset, the published figure for ECP's predictor (PREFETCH_PUBLISHED).
    prefetch: float | None = Field(default=None, ge=0.0, le=1.0)

    @property
    def prefetch_right(self) -> float:
        """The share of ECP's misses its predictor fetched right: policy.prefetch, or the
        published figure where the scenario does not say."""
        return PREFETCH_PUBLISHED if self.prefetch is None else self.prefetch

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

    @field_validator("override_tensor", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        # as llama.cpp's -ot takes it: PATTERN=BUFFER pairs separated by commas
        return value.split(",") if isinstance(value, str) else value

    @model_validator(mode="after")
    def _one_placement(self) -> "PolicySpec":
        given = [f for f in ("experts_total", "cpu_moe", "override_tensor")
                 if getattr(self, f) is not None]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} each place the experts; give one")
        if given and self.experts_gpu:
            raise ValueError(f"experts_gpu = {self.experts_gpu} places experts on every layer "
                             f"and {given[0]} places them otherwise; give one")
        if self.override_tensor is not None:
            placement.parse_overrides(self.override_tensor, "override_tensor")
        return self

    @property
    def n_micro(self) -> int:
        return self.N // self.mu


class Expect(Spec):
    """What `tg compare --check` enforces (a CI gate on simulated performance)."""

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


class ObjectiveSpec(Spec):
    """What `tg search` and `policy: auto` look for: the most tokens per second (the paper's
    question) or the lowest per-token latency (a chat's), among the policies whose every
    sequence gets a token within `max_token_ms` and its first within `max_ttft_s`, at the batch
    size `batch` where one is given (None: any)."""

    optimize: Literal["throughput", "latency"] = "throughput"
    max_token_ms: float | None = Field(default=None, gt=0, le=1e9, allow_inf_nan=False)
    max_ttft_s: float | None = Field(default=None, gt=0, le=1e9, allow_inf_nan=False)
    batch: int | None = Field(default=None, gt=0, le=1_000_000)

    def met_by(self, token_latency_ms: float, ttft_s: float) -> bool:
        return ((self.max_token_ms is None or token_latency_ms <= self.max_token_ms)
                and (self.max_ttft_s is None or ttft_s <= self.max_ttft_s))

    def limits(self) -> str:
        """The limits in words ("" where there are none)."""
        parts = ([f"per-token latency <= {self.max_token_ms:g} ms"] if self.max_token_ms else []) \
            + ([f"first token <= {self.max_ttft_s:g} s"] if self.max_ttft_s else [])
        return " and ".join(parts)


class Scenario(Spec):
    name: str
    model: ModelSpec
    hardware: HardwareSpec
    workload: WorkloadSpec
    policy: PolicySpec
    schedule: str = "S1"
    # None: each schedule's own (Schedule.implementation).
    implementation: ImplementationSpec | None = None
    expect: Expect | None = None
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec)
    # `policy: auto` in the file: the policy is a placeholder until a search replaces it.
    _policy_auto: bool = PrivateAttr(default=False)
    # Policy fields the user gave explicitly: field -> (where, e.g. "--set policy.A_g=0", and
    # whether it binds every schedule (a --set) or only the file's own schedule (the file)).
    _pins: dict[str, tuple[str, bool]] = PrivateAttr(default_factory=dict)
    # The request list of `workload.requests` or `workload.lengths` (None: mean lengths only).
    _requests: list | None = PrivateAttr(default=None)
    # The router decisions of `workload.routing.trace` (taskgraph.dag.routing.RoutingTrace).
    _routing_trace: object = PrivateAttr(default=None)
    # The experts each layer keeps on the GPU where fixed, an array per layer; None: the
    # routing's most popular (taskgraph.dag.routing.Routing.held, .popular).
    _experts_kept: object = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _experts_fit_the_model(self) -> "Scenario":
        E, routing = self.model.E, self.workload.routing
        if routing.popularity is not None and len(routing.popularity) != E:
            raise ValueError(f"workload.routing.popularity has {len(routing.popularity)} "
                             f"weights; the model has E = {E} experts, one weight each")
        p, m = self.policy, self.model
        if p.experts_gpu > E:
            raise ValueError(f"policy.experts_gpu = {p.experts_gpu} exceeds the "
                             f"model's E = {E} experts per layer")
        if p.experts_total is not None and p.experts_total > E * m.moe_layers:
            raise ValueError(f"policy.experts_total = {p.experts_total} exceeds the model's "
                             f"{E * m.moe_layers} experts ({m.moe_layers} MoE layers of {E})")
        if p.cpu_moe is not None and p.cpu_moe > m.L:
            raise ValueError(f"policy.cpu_moe = {p.cpu_moe} layers exceeds the model's "
                             f"L = {m.L} layers")
        if p.override_tensor is not None:
            placement.cpu_layers_of_overrides(p.override_tensor, m)
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
