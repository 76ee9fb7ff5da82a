"""Configuration: what the checkpoint says (`ModelConfig`) and how the engine runs it (`FDConfig`).

`FDConfig` is what every `LogitsProcessor` receives, as in FastDeploy: processors read
`fd_config.model_config.vocab_size`, `.dtype`, `fd_config.device` and so on.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

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


@dataclass
class ModelConfig:
    """The fields of a Hugging Face `config.json` that the Llama-family decoder needs."""

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
    attention_bias: bool
    qk_norm: bool
    checkpoint_dtype: str
    eos_token_ids: list[int]
    bos_token_id: int | None
    pad_token_id: int | None
    sliding_window: int | None = None
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"  # the dtype the engine computes in (set by FDConfig)

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"model: {model_dir!r} is not a directory")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model: no config.json in {model_dir!r}")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        return cls.from_dict(cfg, model_dir)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], model_dir: str = "") -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"model: unsupported architecture {archs or cfg.get('model_type')!r} in "
                f"{model_dir or 'config'}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")

        # Two config styles exist on the Hub: `rope_theta` + `rope_scaling` (transformers < 5)
        # and a single `rope_parameters` dict (transformers >= 5).
        rope = dict(cfg.get("rope_parameters") or {})
        theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "llama3", "linear"):
                raise ValueError(f"model: unsupported rope scaling type {kind!r} (default, linear, llama3)")
            scaling["rope_type"] = kind

        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        gen = _read_generation_config(model_dir)
        gen_eos = gen.get("eos_token_id")
        for e in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if e is not None and int(e) not in eos_ids:
                eos_ids.append(int(e))

        return cls(
            model=model_dir,
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            checkpoint_dtype=normalize_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
            eos_token_ids=eos_ids,
            sliding_window=int(cfg["sliding_window"]) if cfg.get("sliding_window") and (
                cfg.get("use_sliding_window", True)) else None,
            bos_token_id=cfg.get("bos_token_id"),
            pad_token_id=cfg.get("pad_token_id"),
            generation_defaults={k: gen[k] for k in ("temperature", "top_p", "top_k", "min_p",
                                                     "repetition_penalty") if k in gen},
        )


def _read_generation_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "generation_config.json") if model_dir else ""
    if path and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    return {}


def default_device() -> str:
    import paddle

    return "gpu" if paddle.device.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0 else "cpu"


@dataclass
class FDConfig:
    """Everything the engine and the logits processors need to know about one deployment."""

    model_config: ModelConfig
    max_num_seqs: int = 8
    max_model_len: int = 2048
    device: str = "cpu"
    logits_processors: list[str] = field(default_factory=list)
    guided_decoding_backend: str = "llguidance"
    fast_forward: bool = True  # append tokens processors declare certain in one pass (share_inputs docs)
    cpu_threads: int | None = None  # threads for CPU math; None: every core this process may use
    tool_functions: dict[str, Any] = field(default_factory=dict)  # for ToolExecutionLogitsProcessor
    custom_guided_decoding_backends: dict[str, Any] = field(default_factory=dict)  # name -> CustomBackend
    tokenizer: Any = None  # the engine's `Tokenizer`, set when the engine starts

    @classmethod
    def create(cls, model: str | None = None, *, max_num_seqs: int = 8, max_model_len: int | None = None,
               device: str | None = None, dtype: str | None = None,
               logits_processors: list[str] | None = None,
               guided_decoding_backend: str = "llguidance", fast_forward: bool = True) -> "FDConfig":
        model_config = ModelConfig.from_pretrained(model or default_model_path())
        device = device or default_device()
        if dtype in (None, "auto"):
            dtype = model_config.checkpoint_dtype
        dtype = normalize_dtype(dtype)
        if device.startswith("cpu") and dtype != "float32":
            # Paddle's CPU matmul has no bfloat16/float16 kernels: compute in float32 there.
            logger.info("dtype %s is not supported for CPU matmul; computing in float32", dtype)
            dtype = "float32"
        model_config.dtype = dtype
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be a positive integer, got {max_num_seqs!r}")
        limit = model_config.max_position_embeddings
        max_model_len = max_model_len or min(limit, 4096)
        window = model_config.sliding_window
        if window is not None and max_model_len > window:
            # Every layer attends to the whole context here; capping the length keeps that exact.
            logger.warning("the checkpoint uses sliding-window attention (%d); max_model_len %d is capped to it",
                           window, max_model_len)
            max_model_len = window
        if not isinstance(max_model_len, int) or not 1 < max_model_len <= limit:
            raise ValueError(f"max_model_len: must be an integer in 2..{limit} (the model's "
                             f"max_position_embeddings), got {max_model_len!r}")
        return cls(model_config=model_config, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                   device=device, logits_processors=list(logits_processors or []),
                   guided_decoding_backend=guided_decoding_backend, fast_forward=fast_forward)
