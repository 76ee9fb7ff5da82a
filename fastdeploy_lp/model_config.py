"""What a checkpoint says: `ModelConfig`, read from a Hugging Face `config.json` the way
transformers reads it, and the dtype and quantization names the engine accepts."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from fastdeploy_lp import gguf_file

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}


def default_model_path() -> str:
    """The model trained by this project and shipped inside the package."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "default_model")


def normalize_dtype(dtype: str) -> str:
    key = str(dtype).replace("paddle.", "").replace("torch.", "").lower()
    if key not in _DTYPES:
        raise ValueError(f"dtype: unsupported value {dtype!r}; use one of float32, bfloat16, float16")
    return _DTYPES[key]


QUANTIZATIONS = ("wint8", "wint4")


def normalize_quantization(quantization: str | None) -> str | None:
    """None (weights as `dtype` says), `wint8` or `wint4` (int8 / 4-bit weight-only, FastDeploy's names)."""
    key = None if quantization is None else str(quantization).strip().lower()
    if key in (None, "", "none"):
        return None
    if key not in QUANTIZATIONS:
        raise ValueError(f"quantization: unsupported value {quantization!r}; use wint8, wint4 or none")
    return key


class UnsupportedCheckpointError(ValueError):
    """A checkpoint asks for something the decoder does not implement: a config switch or value, a
    tensor it would not use, a missing tensor or one of the wrong shape. The message names it."""


_SHOWN = 8  # names listed per kind of problem before "... and N more"


def listing(names, describe=repr) -> str:
    """`names`, sorted and described, for an `UnsupportedCheckpointError`: at most eight of them."""
    names = sorted(names)
    more = f" ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(describe(n) for n in names[:_SHOWN]) + more


# transformers' ACT2FN names that `fastdeploy_lp.model.activations` implements (`prelu` and `xielu`
# carry learned weights no supported architecture stores, so they are not among them).
HIDDEN_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_python", "gelu_new", "gelu_fast", "gelu_accurate",
                      "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_10", "quick_gelu", "relu", "relu2", "relu6",
                      "leaky_relu", "sigmoid", "tanh", "mish", "laplace", "linear")

# RoPE types and the keys each one reads (transformers' ROPE_INIT_FUNCTIONS has more: dynamic,
# yarn, longrope, ... which are refused).
ROPE_TYPES = {"default": (), "linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
              # A GGUF file of a Llama 3.x model: the per-frequency divisors llama.cpp's converter computed.
              "freq_factors": ("factors",)}

# Defaults of the transformers config classes, used when config.json leaves a key out.
_ARCH_DEFAULTS = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048, "num_key_value_heads": None, "head_dim": None},
    "MistralForCausalLM": {"max_position_embeddings": 4096 * 32, "num_key_value_heads": 8, "head_dim": None,
                           "sliding_window": 4096},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": None},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "head_dim": 128},
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class ModelConfig:
    """The fields of a Hugging Face `config.json` that the Llama-family decoder needs.

    `from_dict` reads each architecture the way its transformers class does (which switches exist,
    their defaults) and refuses, with `UnsupportedCheckpointError` naming it, any switch or value
    the decoder does not implement.
    """

    model: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections have a bias (Llama/Qwen3 `attention_bias`; always on Qwen2)
    qk_norm: bool
    checkpoint_dtype: str
    eos_token_ids: list[int]
    sliding_window: int | None = None  # set when some layer attends through a window of this size
    o_proj_bias: bool = False  # o_proj has a bias (Llama/Qwen3 `attention_bias`; never on Qwen2/Mistral)
    mlp_bias: bool = False  # gate/up/down projections have a bias (Llama `mlp_bias`)
    hidden_act: str = "silu"  # the gate activation, one of HIDDEN_ACTIVATIONS
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"  # the dtype the engine computes in (set by FDConfig)
    # How linear weights and the embedding are held (set by FDConfig): on CPU a bfloat16/float16
    # checkpoint stays 2 bytes a weight while the engine computes in float32.
    weight_dtype: str = "float32"
    quantization: str | None = None  # "wint8": linear weights int8 with a float32 scale per output row
    wint4_group: int = 128  # weights per scale under quantization "wint4" (32: GGML's Q4_0)
    file_format: str = "safetensors"  # or "gguf" (`fastdeploy_lp.gguf_file`)
    tensor_types: dict[str, int] = field(default_factory=dict)  # GGUF: tensors of each stored type
    # How each weight the loader fills is held, by decoder parameter name, where it is not
    # `weight_dtype`: a dtype name, or a `block_formats.WeightLayout` (GGUF blocks, wint4). Set by
    # the loader as it builds the model.
    weight_layouts: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        """The config of a Hugging Face directory (`config.json`) or of a GGUF file (its metadata)."""
        files = gguf_file.gguf_files(model_dir)
        if files is not None:
            return cls.from_gguf(gguf_file.open_model(files))
        path = os.path.join(model_dir, "config.json")
        if os.path.isfile(model_dir):
            raise FileNotFoundError(f"model: {model_dir!r} is neither a GGUF file nor a checkpoint directory")
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"model: {model_dir!r} is not a directory or a GGUF file")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model: no config.json in {model_dir!r}")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        return cls.from_dict(cfg, model_dir)

    @classmethod
    def from_gguf(cls, model: "gguf_file.GGUFModel") -> "ModelConfig":
        """A GGUF file's config: its metadata read as the `config.json` it stands for, so the same
        checks apply; float32 compute, the weights kept in the file's types."""
        config = cls.from_dict(model.hf_config(), model.path)
        sampling = {key: model.value(f"general.sampling.{name}") for key, name in
                    (("temperature", "temp"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"))}
        return dataclasses.replace(config, file_format="gguf", tensor_types=model.type_counts(),
                                   generation_defaults={k: v for k, v in sampling.items() if v is not None})

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], model_dir: str = "") -> "ModelConfig":
        arch = _read_architecture(cfg, model_dir)
        where = f"{arch} config in {model_dir or 'config'}"

        def refuse(switch: str, why: str):
            raise UnsupportedCheckpointError(f"model: unsupported config switch {switch} in the {where}: {why}")

        defaults = _ARCH_DEFAULTS[arch]
        if cfg.get("quantization_config"):
            method = (cfg["quantization_config"] or {}).get("quant_method", "?")
            refuse(f"quantization_config (quant_method {method!r})", "only float32/bfloat16/float16 weights load")

        theta, scaling = _read_rope(cfg, refuse)

        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act not in HIDDEN_ACTIVATIONS:
            refuse(f"hidden_act={hidden_act!r}", f"the activations implemented are {', '.join(HIDDEN_ACTIVATIONS)}")

        qkv_bias, o_bias, mlp_bias = _read_biases(cfg, arch, refuse)

        hidden = int(cfg["hidden_size"])
        layers = int(cfg["num_hidden_layers"])
        heads, kv_heads, head_dim = _read_heads(cfg, defaults, hidden, refuse)
        gen = _read_generation_config(model_dir)

        return cls(
            model=model_dir,
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or defaults["max_position_embeddings"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            o_proj_bias=o_bias,
            mlp_bias=mlp_bias,
            hidden_act=hidden_act,
            qk_norm=arch == "Qwen3ForCausalLM",
            checkpoint_dtype=normalize_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            eos_token_ids=_read_eos_ids(cfg, gen),
            sliding_window=_read_sliding_window(cfg, arch, layers, refuse),
            generation_defaults={k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p",
                                                     "repetition_penalty") if k in gen},
        )


# `model_type` of the supported architectures, read where a config lists no `architectures`
# (configs written by hand or by converters, as transformers itself reads them).
ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                              "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def _read_architecture(cfg: dict[str, Any], model_dir: str) -> str:
    """The first of the config's `architectures` that the decoder implements; without any listed,
    the one its `model_type` names."""
    archs = cfg.get("architectures") or []
    if not archs and cfg.get("model_type") in ARCHITECTURE_OF_MODEL_TYPE:
        return ARCHITECTURE_OF_MODEL_TYPE[cfg["model_type"]]
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"model: unsupported architecture {archs or cfg.get('model_type')!r} in "
            f"{model_dir or 'config'}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def _read_heads(cfg: dict[str, Any], defaults: dict[str, Any], hidden: int, refuse) -> tuple[int, int, int]:
    """(attention heads, key/value heads, head dimension), with the architecture's defaults."""
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads", defaults["num_key_value_heads"]) or heads)
    if heads % kv_heads:
        refuse(f"num_key_value_heads={kv_heads}", f"it must divide num_attention_heads={heads}")
    head_dim = int(cfg.get("head_dim", defaults["head_dim"]) or hidden // heads)
    return heads, kv_heads, head_dim


def _read_eos_ids(cfg: dict[str, Any], generation_config: dict[str, Any]) -> list[int]:
    """Every end-of-sequence id: config.json's `eos_token_id` (one or a list), then
    generation_config.json's that are not among them."""
    eos = cfg.get("eos_token_id")
    eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
    gen_eos = generation_config.get("eos_token_id")
    for e in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
        if e is not None and int(e) not in eos_ids:
            eos_ids.append(int(e))
    return eos_ids


def _read_rope(cfg: dict[str, Any], refuse) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling from either config style: `rope_theta` + `rope_scaling`
    (transformers < 5) or one `rope_parameters` dict (transformers >= 5)."""
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        refuse(f"rope_parameters={rope!r}", "one RoPE for every layer is implemented, not per-layer-type RoPE")
    rope = dict(rope)
    theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or rope)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_TYPES:
        refuse(f"rope scaling type {kind!r}", f"the RoPE types implemented are {', '.join(ROPE_TYPES)}")
    partial = scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        refuse(f"partial_rotary_factor={partial!r}", "RoPE rotates the whole head dimension here")
    missing = [k for k in ROPE_TYPES[kind] if scaling.get(k) is None]
    if missing:
        refuse(f"rope scaling type {kind!r}", f"it needs {', '.join(missing)}, which the config does not give")
    if kind == "default":
        return theta, None
    scaling["rope_type"] = kind
    return theta, scaling


def _read_biases(cfg: dict[str, Any], arch: str, refuse) -> tuple[bool, bool, bool]:
    """Which projections carry a bias (q/k/v, o, MLP), as each transformers class builds them."""
    attention_bias, mlp_bias = cfg.get("attention_bias"), cfg.get("mlp_bias")
    if arch == "Qwen2ForCausalLM":  # q/k/v always biased, o never; no config switch
        if attention_bias is not None and not attention_bias:
            refuse("attention_bias=false", "Qwen2ForCausalLM always has q/k/v biases")
        qkv_bias, o_bias = True, False
    elif arch == "MistralForCausalLM":  # no biases at all
        if attention_bias:
            refuse("attention_bias=true", "MistralForCausalLM has no attention biases (LlamaForCausalLM has)")
        qkv_bias = o_bias = False
    else:  # Llama, Qwen3: q/k/v and o together
        qkv_bias = o_bias = bool(attention_bias)
    if mlp_bias and arch != "LlamaForCausalLM":
        refuse("mlp_bias=true", f"{arch} has no MLP biases (LlamaForCausalLM has)")
    return qkv_bias, o_bias, bool(mlp_bias)


def _read_sliding_window(cfg: dict[str, Any], arch: str, layers: int, refuse) -> int | None:
    """The attention window if any layer uses one, as transformers decides it per architecture:
    Mistral windows every layer (`sliding_window`, default 4096); Qwen2/Qwen3 only with
    `use_sliding_window`, on the layers `layer_types` (or `max_window_layers`) marks; Llama never."""
    if arch == "LlamaForCausalLM":
        return None
    if arch == "MistralForCausalLM":
        window = cfg.get("sliding_window", _ARCH_DEFAULTS[arch]["sliding_window"])
    else:
        window = cfg.get("sliding_window", 4096) if cfg.get("use_sliding_window", False) else None
        types = cfg.get("layer_types")
        if types is not None:
            unknown = sorted({t for t in types if t not in _LAYER_TYPES}, key=str)
            if unknown or len(types) != layers:
                refuse(f"layer_types={types!r}",
                       f"expected {layers} entries, each one of {', '.join(_LAYER_TYPES)}")
        else:
            first = int(cfg.get("max_window_layers", 28))
            types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(layers)]
        if "sliding_attention" not in types:
            window = None
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        refuse(f"sliding_window={window!r}", "it must be a positive integer or null")
    return window


def _read_generation_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "generation_config.json") if model_dir else ""
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    return {}
