"""Model configuration: one dataclass mirroring HF ``config.json`` keys.

Every reader (HF folder, GGUF, ``.eif``) produces an HF-style config dict and hands it
to :meth:`ModelConfig.from_hf_dict`; unknown keys are dropped, inconsistent values
raise. Architecture differences are switches here, filled per family from
:mod:`edgeinfer.models.families`, never copies of the forward pass.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .families import BY_ARCHITECTURE, BY_MODEL_TYPE, activation


class ConfigError(ValueError):
    """A config value is missing, unknown or inconsistent."""


class UnsupportedConfigError(ConfigError):
    """A valid config value that edgeinfer does not implement (architecture, RoPE
    scaling)."""


#: Largest size accepted for any dimension (kernels index with int32).
MAX_DIM = 2**31 - 1
#: Most layers accepted (the largest released decoders have under 200).
MAX_LAYERS = 65536
#: RoPE scaling types :mod:`edgeinfer.models.rope` implements.
ROPE_SCALING_TYPES = ("linear", "llama3", "longrope")
LAYER_TYPES = ("sliding_attention", "full_attention")
#: Sizes every config needs, with their largest accepted value.
_REQUIRED_SIZES = {"vocab_size": MAX_DIM, "hidden_size": MAX_DIM, "intermediate_size": MAX_DIM,
                   "num_hidden_layers": MAX_LAYERS, "num_attention_heads": MAX_DIM}


#: model_type values the runtime implements, mapped to their architecture family.
SUPPORTED_MODEL_TYPES = {mt: f.name for mt, f in BY_MODEL_TYPE.items()}


@dataclass
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer.

    Attributes mirror HF names. Derived fields are filled in ``__post_init__``.
    ``eos_token_ids`` is the union of every EOS id the checkpoint declares.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    # --- switches used by non-llama families (gemma3) ---------------------------
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + w)
    qk_norm: bool = False
    embed_scale: float = 1.0  # embeddings multiplied by this (gemma: sqrt(hidden), rounded)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # "sliding_attention" / "full_attention" per layer
    rope_local_base_freq: float | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    sandwich_norms: bool = False  # post-attention / post-ffw norms (gemma)

    # derived
    arch: str = ""

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedConfigError(
                f"unknown architecture {self.model_type!r}; edgeinfer supports "
                f"{sorted(SUPPORTED_MODEL_TYPES)}"
            )
        self.arch = SUPPORTED_MODEL_TYPES[self.model_type]
        _check_values(self)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size {self.hidden_size} is not divisible by num_attention_heads "
                    f"{self.num_attention_heads} and no head_dim is given"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads} (GQA needs whole groups)"
            )
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ConfigError(
                f"head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} "
                f"gives {self.rotary_dim} rotary dimensions; RoPE needs a positive even number"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        try:
            activation(self.hidden_act)
        except ValueError as e:
            raise ConfigError(f"hidden_act: {e}") from None
        if self.bos_token_id is not None and self.bos_token_id >= self.vocab_size:
            raise ConfigError(f"bos_token_id {self.bos_token_id} is not below vocab_size "
                              f"{self.vocab_size}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            self.pad_token_id = None  # e.g. -1 in old Llama configs: no padding token
        self._check_longrope()

    def _check_longrope(self) -> None:
        rs = self.rope_scaling
        if not isinstance(rs, dict) or rs.get("rope_type", rs.get("type")) != "longrope":
            return
        half = self.rotary_dim // 2
        for key in ("short_factor", "long_factor"):
            f = rs.get(key)
            if not (isinstance(f, list) and len(f) == half and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool)
                    and math.isfinite(x) and x > 0 for x in f)):
                raise ConfigError(f"rope_scaling.{key} must be a list of {half} positive numbers "
                                  f"(rotary dims / 2) for longrope")
        orig = rs.get("original_max_position_embeddings")
        if orig is not None and (isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0):
            raise ConfigError(f"rope_scaling.original_max_position_embeddings must be a positive "
                              f"integer, got {orig!r}")

    # ---- derived quantities ---------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        """Query heads per KV head (GQA group size): head h reads KV head h // q_per_kv."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def activation(self) -> str:
        """The backends' GLU activation, "silu" or "gelu_tanh" (from ``hidden_act``)."""
        return activation(self.hidden_act)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attn_scale(self) -> float:
        d = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return 1.0 / math.sqrt(d)

    def layer_window(self, layer: int) -> int | None:
        """Sliding-window size of a layer (query i sees keys i-W+1..i), or None (global)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def layer_rope_theta(self, layer: int) -> float:
        if self.rope_local_base_freq is not None and self.layer_window(layer) is not None:
            return self.rope_local_base_freq
        return self.rope_theta

    def kv_bytes_per_token_f32(self) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 4

    def param_count(self) -> int:
        """Parameters of the weights (tied head counted once)."""
        d, f, l = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        hq, hkv, hd = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = d * hq * hd * 2 + d * hkv * hd * 2
        mlp = 3 * d * f
        emb = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return l * (attn + mlp + 2 * d) + emb + d

    # ---- (de)serialization ---------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], extra_eos: list[int] | None = None) -> "ModelConfig":
        """Build from an HF ``config.json`` dict (transformers 4 or 5 style).

        Accepts both the classic ``rope_theta`` / ``rope_scaling`` keys and the
        transformers-5 ``rope_parameters`` dict. ``eos_token_id`` may be an int or a
        list; ``extra_eos`` (from generation_config / tokenizer) is merged in.

        Raises:
            ConfigError: a missing key, a value of the wrong type or out of range, or
                inconsistent sizes (see :func:`_check_values`); sizes are checked before
                a family fixup builds anything per layer.
            UnsupportedConfigError: unknown ``model_type`` or RoPE scaling.
        """
        if not isinstance(d, dict):
            raise ConfigError(f"the config is a {type(d).__name__}, not a JSON object")
        d = dict(d)
        if "text_config" in d and "hidden_size" not in d:  # multimodal wrappers
            tc = d["text_config"]
            if not isinstance(tc, dict):
                raise ConfigError("text_config must be a JSON object")
            d = {**tc, "model_type": tc.get("model_type", d.get("model_type"))}
        mt = d.get("model_type")
        if mt is None:
            archs = d.get("architectures") or []
            if not isinstance(archs, list):
                raise ConfigError(f"architectures must be a list of class names, got {archs!r}")
            mt = next((BY_ARCHITECTURE[a] for a in archs
                       if isinstance(a, str) and a in BY_ARCHITECTURE), None)
            if mt is None:
                raise UnsupportedConfigError(
                    f"config has no model_type and no known architectures ({archs})")
        if not isinstance(mt, str):
            raise ConfigError(f"model_type must be a string, got {mt!r}")
        for key, hi in _REQUIRED_SIZES.items():
            if key not in d:
                raise ConfigError(f"required key {key!r} is missing")
            v = d[key]
            if not (_is_int(v) or isinstance(v, float) and v.is_integer()) or not 1 <= v <= hi:
                raise ConfigError(f"{key} must be an integer in 1..{hi}, got {v!r}")
        fam = BY_MODEL_TYPE.get(mt)
        if fam is not None:  # what the family's HF config class implies for absent keys
            d = {**fam.defaults, **d}
        kw: dict[str, Any] = {"model_type": mt}
        names = {f.name for f in dataclasses.fields(cls)}
        for k, v in d.items():
            if k in names and k not in ("eos_token_ids", "arch", "model_type"):
                kw[k] = v
        rp = d.get("rope_parameters")
        if rp is not None and not isinstance(rp, dict):
            raise ConfigError(f"rope_parameters must be a JSON object, got {rp!r}")
        if isinstance(rp, dict):
            # transformers 5: {"rope_type": "default", "rope_theta": 1e4, ...}; gemma3 nests
            # per layer type: {"full_attention": {...}, "sliding_attention": {...}}.
            if "full_attention" in rp or "sliding_attention" in rp:
                full = rp.get("full_attention", {})
                local = rp.get("sliding_attention", {})
                if not isinstance(full, dict) or not isinstance(local, dict):
                    raise ConfigError("rope_parameters.full_attention / sliding_attention must "
                                      "be JSON objects")
                if "rope_theta" in full:
                    kw["rope_theta"] = full["rope_theta"]
                if "rope_theta" in local:
                    kw["rope_local_base_freq"] = local["rope_theta"]
                rp = full
            elif "rope_theta" in rp:
                kw["rope_theta"] = rp["rope_theta"]
            if rp.get("rope_type", "default") not in ("default", None):
                kw["rope_scaling"] = dict(rp)
            if "partial_rotary_factor" in rp:
                kw["partial_rotary_factor"] = rp["partial_rotary_factor"]
        rs = kw.get("rope_scaling")
        if isinstance(rs, dict) and rs.get("rope_type", rs.get("type")) in ("default", None):
            kw["rope_scaling"] = None
        eos = d.get("eos_token_id")
        eos_list = [eos] if eos is None or isinstance(eos, int) else eos
        if not isinstance(eos_list, list):
            raise ConfigError(f"eos_token_id must be an integer or a list of integers, got {eos!r}")
        eos_list = [e for e in eos_list if e is not None]
        for e in extra_eos or []:
            if e is not None and e not in eos_list:
                eos_list.append(e)
        kw["eos_token_ids"] = eos_list
        if "tie_word_embeddings" not in d:
            kw["tie_word_embeddings"] = True  # PretrainedConfig's default; families override it
        act = d.get("hidden_activation") or d.get("hidden_act")
        if act:
            kw["hidden_act"] = act
        if fam is not None and fam.hf_fixup is not None:
            try:
                fam.hf_fixup(d, kw)
            except (TypeError, ValueError, ArithmeticError) as e:
                raise ConfigError(f"{mt} config: {e}") from None
        return cls(**kw)

    def to_hf_dict(self) -> dict[str, Any]:
        """HF-style dict that :meth:`from_hf_dict` reads back to an equal config."""
        out = dataclasses.asdict(self)
        out.pop("arch")
        out["eos_token_id"] = out.pop("eos_token_ids")
        # keys HF configs hold outside the fields (families' fixups read them back)
        out["use_sliding_window"] = self.sliding_window is not None
        rs = self.rope_scaling
        if isinstance(rs, dict) and "original_max_position_embeddings" in rs:
            out["original_max_position_embeddings"] = rs["original_max_position_embeddings"]
        return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_field(cfg: ModelConfig, name: str, lo: int, hi: int = MAX_DIM, optional: bool = False) -> None:
    v = getattr(cfg, name)
    if v is None and optional:
        return
    if isinstance(v, float) and v.is_integer():  # 2048.0 in some configs
        v = int(v)
        setattr(cfg, name, v)
    if not _is_int(v) or not lo <= v <= hi:
        raise ConfigError(f"{name} must be an integer in {lo}..{hi}, got {v!r}")


def _float_field(cfg: ModelConfig, name: str, *, optional: bool = False,
                 upper: float | None = None) -> None:
    """A positive finite number (at most ``upper``)."""
    v = getattr(cfg, name)
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{name} must be a finite number, got {v!r}")
    if v <= 0:
        raise ConfigError(f"{name} must be positive, got {v!r}")
    if upper is not None and v > upper:
        raise ConfigError(f"{name} must be at most {upper}, got {v!r}")
    setattr(cfg, name, float(v))


def _check_rope_scaling(cfg: ModelConfig) -> None:
    rs = cfg.rope_scaling
    if rs is None:
        return
    if not isinstance(rs, dict):
        raise ConfigError(f"rope_scaling must be a JSON object or null, got {rs!r}")
    kind = rs.get("rope_type", rs.get("type"))
    if kind in ("default", None):
        cfg.rope_scaling = None
        return

    def scalar(v: Any) -> bool:
        return v is None or isinstance(v, (str, int, float))

    if not all(isinstance(k, str) and (scalar(v) or isinstance(v, list) and all(
            isinstance(x, (int, float)) for x in v)) for k, v in rs.items()):
        raise ConfigError("rope_scaling values must be numbers, strings or lists of numbers")
    if kind not in ROPE_SCALING_TYPES:
        raise UnsupportedConfigError(f"rope scaling {kind!r} is not supported (supported: "
                                     f"{', '.join(ROPE_SCALING_TYPES)})")

    def num(key: str, default: float | None = None) -> float | None:
        v = rs.get(key, default)
        if v is None and default is None and kind == "longrope":
            return None  # optional for longrope (derived from the context lengths)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"rope_scaling.{key} must be a positive finite number, got {v!r}")
        return float(v)

    num("factor")
    if kind == "longrope":
        num("attention_factor")
    if kind == "llama3":
        low, high = num("low_freq_factor", 1.0), num("high_freq_factor", 4.0)
        if high <= low:
            raise ConfigError(f"rope_scaling.high_freq_factor {high} must exceed low_freq_factor "
                              f"{low} (llama3 RoPE divides by their difference)")
        num("original_max_position_embeddings", 8192)


def _check_values(cfg: ModelConfig) -> None:
    """Types and ranges of every field, before any size is used (raises ConfigError)."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                 "max_position_embeddings"):
        _int_field(cfg, name, 1)
    _int_field(cfg, "num_hidden_layers", 1, MAX_LAYERS)
    _int_field(cfg, "num_key_value_heads", 1, optional=True)
    _int_field(cfg, "head_dim", 1, optional=True)
    _int_field(cfg, "sliding_window", 1, optional=True)
    for name in ("bos_token_id", "pad_token_id"):
        _int_field(cfg, name, -MAX_DIM, optional=True)
    if cfg.bos_token_id is not None and cfg.bos_token_id < 0:
        raise ConfigError(f"bos_token_id must be a token id (>= 0), got {cfg.bos_token_id}")
    _float_field(cfg, "rms_norm_eps", upper=1.0)
    _float_field(cfg, "rope_theta")
    _float_field(cfg, "rope_local_base_freq", optional=True)
    _float_field(cfg, "partial_rotary_factor", upper=1.0)
    _float_field(cfg, "embed_scale")
    _float_field(cfg, "query_pre_attn_scalar", optional=True)
    _float_field(cfg, "final_logit_softcapping", optional=True)
    _float_field(cfg, "attn_logit_softcapping", optional=True)
    for name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_unit_offset",
                 "qk_norm", "sandwich_norms"):
        if not isinstance(getattr(cfg, name), bool):
            raise ConfigError(f"{name} must be true or false, got {getattr(cfg, name)!r}")
    if cfg.mlp_bias:
        raise UnsupportedConfigError("mlp_bias=true (MLP biases) is not supported")
    if not isinstance(cfg.eos_token_ids, list) or not all(_is_int(i) and i >= 0
                                                          for i in cfg.eos_token_ids):
        raise ConfigError(f"eos_token_id must be token ids (integers >= 0), got "
                          f"{cfg.eos_token_ids!r}")
    if cfg.layer_types is not None and (not isinstance(cfg.layer_types, list) or not all(
            isinstance(t, str) and t in LAYER_TYPES for t in cfg.layer_types)):
        raise UnsupportedConfigError(f"layer_types must list {' / '.join(LAYER_TYPES)} per layer")
    _check_rope_scaling(cfg)
