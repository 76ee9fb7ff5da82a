"""Hugging Face safetensors checkpoints in and out of `DecoderForCausalLM`.

Reads one `model.safetensors` or the shards listed in `model.safetensors.index.json`, in float32,
bfloat16 or float16, keeps linear weights in their `[out, in]` layout (`linear.linear` multiplies
by the transpose), and fuses q/k/v and gate/up. `save_pretrained` does the reverse, so the project's own training script
writes checkpoints that any Hugging Face tool reads.

Loading is strict: the file must hold exactly the tensors the config implies (`expected_tensors`),
in their shapes. A tensor the model would not use, a missing one or a wrong shape is an
`UnsupportedCheckpointError` that names it, never a warning and never a silently different model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re

import numpy as np
import paddle
from safetensors import safe_open

from fastdeploy_lp.block_formats import FLOAT_DTYPES, WeightLayout, wint4_format
from fastdeploy_lp.model_config import ModelConfig, UnsupportedCheckpointError, listing
from fastdeploy_lp.distributed.shard import TensorShard
from fastdeploy_lp.model import cpu_kernels, gpu_weight_only, huge_pages
from fastdeploy_lp.model.decoder import DecoderForCausalLM
from fastdeploy_lp.model.gguf_checkpoint import GGUFCheckpoint
from fastdeploy_lp.model.layers import rope_inverse_frequencies

logger = logging.getLogger(__name__)

_ATTN = "model.layers.{i}.self_attn."
_MLP = "model.layers.{i}.mlp."


def checkpoint_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, s) for s in shards]
    else:
        files = [os.path.join(model_dir, "model.safetensors")]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"model: checkpoint file(s) missing in {model_dir!r}: "
                                f"{', '.join(os.path.basename(m) for m in missing)}")
    return files


_FLOAT_DTYPES = frozenset({"F32", "BF16", "F16"})  # safetensors dtypes that load
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"
# Old checkpoints store the RoPE frequencies as buffers; transformers recomputes them from the config.
_INV_FREQ = re.compile(r"model\.(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq")


def expected_tensors(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder reads for `config`, by Hugging Face name, with its Hugging Face shape
    (`[out, in]` for linear weights). This is the whole contract a checkpoint must meet."""
    h, d, inter, vocab = config.hidden_size, config.head_dim, config.intermediate_size, config.vocab_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes = {_EMBED: (vocab, h), "model.norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        attn, mlp = _ATTN.format(i=i), _MLP.format(i=i)
        shapes.update({attn + "q_proj.weight": (q, h), attn + "k_proj.weight": (kv, h),
                       attn + "v_proj.weight": (kv, h), attn + "o_proj.weight": (h, q)})
        if config.attention_bias:
            shapes.update({attn + "q_proj.bias": (q,), attn + "k_proj.bias": (kv,), attn + "v_proj.bias": (kv,)})
        if config.o_proj_bias:
            shapes[attn + "o_proj.bias"] = (h,)
        if config.qk_norm:
            shapes.update({attn + "q_norm.weight": (d,), attn + "k_norm.weight": (d,)})
        shapes.update({mlp + "gate_proj.weight": (inter, h), mlp + "up_proj.weight": (inter, h),
                       mlp + "down_proj.weight": (h, inter)})
        if config.mlp_bias:
            shapes.update({mlp + "gate_proj.bias": (inter,), mlp + "up_proj.bias": (inter,),
                           mlp + "down_proj.bias": (h,)})
        shapes.update({f"model.layers.{i}.input_layernorm.weight": (h,),
                       f"model.layers.{i}.post_attention_layernorm.weight": (h,)})
    if not config.tie_word_embeddings:
        shapes[_HEAD] = (vocab, h)
    return shapes


class _Checkpoint:
    """Names, shapes and dtypes of every tensor in the checkpoint's files (read from the headers),
    and the tensors themselves on demand."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.aliases: dict[str, str] = {}  # name the model reads -> name in the file (`_tie_head`)
        self.where: dict[str, str] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for path in checkpoint_files(model_dir):
            with safe_open(path, framework="paddle") as f:
                for name in f.keys():
                    if name in self.where:
                        raise UnsupportedCheckpointError(
                            f"model: tensor {name!r} is stored twice in {model_dir!r} "
                            f"({os.path.basename(self.where[name])} and {os.path.basename(path)})")
                    part = f.get_slice(name)
                    self.where[name], self.shapes[name] = path, tuple(part.get_shape())
                    self.dtypes[name] = part.get_dtype()

    def read(self, names) -> dict[str, paddle.Tensor]:
        by_file: dict[str, list[str]] = {}
        for name in names:
            by_file.setdefault(self.where[name], []).append(name)
        out = {}
        for path, group in by_file.items():
            with safe_open(path, framework="paddle") as f:
                for name in group:
                    out[name] = f.get_tensor(name)
        return out

    def take(self, names: tuple[str, ...], split: dict[str, int], shard: TensorShard | None) -> paddle.Tensor:
        """The named tensors (this rank's part of split ones, read through `aliases`), concatenated
        on rows."""
        parts = []
        for name in names:
            stored = self.aliases.get(name, name)
            if name in split:
                axis = split[name]
                parts.append(self.read_part(stored, axis, *shard.part(self.shapes[stored][axis])))
            else:
                parts.append(self.read([stored])[stored])
        return parts[0] if len(parts) == 1 else paddle.concat(parts)

    def read_part(self, name: str, axis: int, start: int, end: int) -> paddle.Tensor:
        """Rows (`axis=0`) or columns (`axis=1`) `[start, end)` of one tensor, reading only those
        bytes of the file (a tensor-parallel rank's shard).

        Through numpy: safetensors' paddle slices crashed Paddle when a column slice was freed
        ("The deleter of the pointer is not found"), and numpy has no bfloat16, so bfloat16 is read
        as its raw 16-bit words and reinterpreted.
        """
        index = (slice(start, end),) if axis == 0 else (slice(None), slice(start, end))
        path = self.where[name]
        if self.dtypes[name] != "BF16":
            with safe_open(path, framework="np") as f:
                return paddle.to_tensor(np.ascontiguousarray(f.get_slice(name)[index]))
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            begin = json.loads(f.read(header_len))[name]["data_offsets"][0]
        words = np.memmap(path, dtype=np.uint16, mode="r", offset=8 + header_len + begin, shape=self.shapes[name])
        return paddle.to_tensor(np.ascontiguousarray(words[index])).view(paddle.bfloat16)


def _tie_head(config: ModelConfig, ckpt: _Checkpoint) -> tuple[ModelConfig, dict[str, str]]:
    """Tied embeddings as transformers loads them. With `tie_word_embeddings` and both matrices in
    the file, equal matrices are tied and different ones are NOT tied (the file's `lm_head.weight`
    becomes an untied head, transformers warns); a file holding only `lm_head.weight` ties the
    embedding to it. Returns the config to build and {name the model reads: name in the file}."""
    if not config.tie_word_embeddings or _HEAD not in ckpt.shapes:
        return config, {}
    if _EMBED not in ckpt.shapes:
        return config, {_EMBED: _HEAD}
    pair = ckpt.read([_EMBED, _HEAD])
    embed, head = pair[_EMBED], pair[_HEAD]
    if embed.shape == head.shape and bool(paddle.equal_all(embed.astype("float32"), head.astype("float32"))):
        return config, {}
    logger.warning("%s: tie_word_embeddings is set but the checkpoint's %s differs from %s; as transformers "
                   "does, they are not tied (set tie_word_embeddings=false to silence this)",
                   config.model, _HEAD, _EMBED)
    return dataclasses.replace(config, tie_word_embeddings=False), {}


def _check(config: ModelConfig, ckpt: _Checkpoint, aliases: dict[str, str]) -> None:
    """Refuse, naming them, tensors the model would not use, tensors it needs that are missing, and
    tensors of the wrong shape or dtype."""
    expected = expected_tensors(config)
    used = {aliases.get(n, n) for n in expected}
    extra = set(ckpt.shapes) - used - ({_HEAD} if config.tie_word_embeddings else set())  # _tie_head: a copy
    extra -= {n for n in extra if _INV_FREQ.fullmatch(n) and _rope_buffer_matches(config, ckpt, n)}
    missing = [n for n in expected if aliases.get(n, n) not in ckpt.shapes]
    wrong_shape = [n for n in expected if n not in missing and ckpt.shapes[aliases.get(n, n)] != expected[n]]
    wrong_dtype = sorted(n for n in used & set(ckpt.shapes) if ckpt.dtypes[n] not in _FLOAT_DTYPES)
    problems = []
    if extra:
        problems.append(f"{len(extra)} tensor(s) the {config.architecture} model does not use (with this "
                        f"config.json): {listing(extra)}")
    if missing:
        problems.append(f"{len(missing)} tensor(s) the model needs are missing: {listing(missing)}")
    if wrong_shape:
        problems.append(f"{len(wrong_shape)} tensor(s) have the wrong shape: " + listing(
            wrong_shape, lambda n: f"{n!r} is {list(ckpt.shapes[aliases.get(n, n)])}, config.json says "
                                   f"{list(expected[n])}"))
    if wrong_dtype:
        problems.append(f"{len(wrong_dtype)} tensor(s) have an unsupported dtype (float32, bfloat16, float16 "
                        f"load): " + listing(wrong_dtype, lambda n: f"{n!r} ({ckpt.dtypes[n]})"))
    if problems:
        raise UnsupportedCheckpointError(f"model: the checkpoint in {config.model!r} does not match its "
                                         f"config.json: " + "; ".join(problems))


def _rope_buffer_matches(config: ModelConfig, ckpt: _Checkpoint, name: str) -> bool:
    """A stored `rotary_emb.inv_freq` is accepted only if it equals what the config gives."""
    if ckpt.dtypes[name] not in _FLOAT_DTYPES:
        return False
    stored = ckpt.read([name])[name].astype("float32").numpy()
    ours = rope_inverse_frequencies(config).numpy()
    return stored.shape == ours.shape and bool(np.allclose(stored, ours, rtol=1e-2, atol=0))


def sharded_axes(config: ModelConfig) -> dict[str, int]:
    """The tensors tensor parallelism splits, by Hugging Face name, and the axis of their `[out, in]`
    layout it splits: rows of the column-parallel q/k/v and gate/up projections (and their biases)
    and of the vocabulary-parallel embedding and LM head; columns of the row-parallel o_proj and
    down_proj. Every other tensor (norms, o/down biases) is replicated."""
    axes = {_EMBED: 0} if config.tie_word_embeddings else {_EMBED: 0, _HEAD: 0}
    for i in range(config.num_hidden_layers):
        attn, mlp = _ATTN.format(i=i), _MLP.format(i=i)
        axes.update({attn + f"{x}_proj.weight": 0 for x in "qkv"})
        axes.update({mlp + "gate_proj.weight": 0, mlp + "up_proj.weight": 0})
        axes.update({attn + "o_proj.weight": 1, mlp + "down_proj.weight": 1})
        if config.attention_bias:
            axes.update({attn + f"{x}_proj.bias": 0 for x in "qkv"})
        if config.mlp_bias:
            axes.update({mlp + "gate_proj.bias": 0, mlp + "up_proj.bias": 0})
    return axes


def load_model(config: ModelConfig, max_positions: int | None = None,
               shard: TensorShard | None = None) -> DecoderForCausalLM:
    """Build the decoder in `config.dtype` on the current Paddle device and load its weights.

    The checkpoint must hold exactly the tensors `expected_tensors(config)` lists, in their shapes
    (besides what transformers also accepts: a duplicate `lm_head.weight` of a tied embedding and
    RoPE frequency buffers that agree with the config); anything else is an
    `UnsupportedCheckpointError` naming the tensors. A GGUF file (`gguf_file`) meets the same
    contract under the Hugging Face names, its weights kept in their stored blocks. With a `shard`
    (one tensor-parallel rank) the same whole-checkpoint check runs, then only the rank's rows or
    columns of the split tensors (`sharded_axes`) are read from the files.
    """
    split = {} if shard is None else sharded_axes(config)
    if config.file_format == "gguf":
        ckpt = GGUFCheckpoint(config)
        ckpt.check(expected_tensors(config))
    else:
        ckpt = _Checkpoint(config.model)
        config, ckpt.aliases = _tie_head(config, ckpt)
        _check(config, ckpt, ckpt.aliases)
    sources = _sources(config)
    config = dataclasses.replace(config, weight_layouts=_weight_layouts(config, ckpt, sources, split, shard))
    if config.weight_layouts and not paddle.get_device().startswith("cpu"):
        raise UnsupportedCheckpointError(f"model: {_held_as(config)} weights run on CPU only (no GPU kernels for "
                                         f"block formats yet); use --device cpu")
    paddle.set_default_dtype(config.dtype)
    try:
        model = DecoderForCausalLM(config, max_positions, shard)
    finally:
        paddle.set_default_dtype("float32")
    model.eval()
    on_huge_pages = huge_pages.pack(list(model.parameters()))  # before the writes below
    params = model.state_dict()
    if set(params) != set(sources) | {n + "_scale" for n in sources if n + "_scale" in params}:
        raise RuntimeError(f"model: loader and decoder disagree on {sorted(set(params) ^ set(sources))}")
    for name, names in sources.items():  # one tensor at a time: peak memory stays near the model's own
        layout = config.weight_layouts.get(name)
        if config.file_format == "gguf":  # as the file stores it: blocks, or float values in the dtype
            params[name].set_value(ckpt.take(names, layout, split, shard, params[name].dtype))
        else:
            _fill(params, name, ckpt.take(names, split, shard), layout)
    huge_pages.release_freed()
    logger.info("weights: %s%s, %.2f GB held%s", _held_as(config), _quantized_part(config, model),
                weight_bytes(model) / 1e9, f" ({on_huge_pages / 1e9:.2f} GB on 2 MiB pages)" if on_huge_pages else "")
    return model


def _fill(params: dict[str, paddle.Tensor], name: str, value: paddle.Tensor, layout) -> None:
    """Write a checkpoint tensor into the decoder parameter `name`, in the form the parameter holds."""
    if isinstance(layout, WeightLayout):  # wint4: this rank's rows in 4-bit (Q8_0 for the vocabulary)
        params[name].set_value(quantize_blocks(value, layout))
        return
    if list(params[name].shape) != list(value.shape):
        raise RuntimeError(f"model: {name} is {list(value.shape)}, the decoder has {list(params[name].shape)}")
    if name + "_scale" in params:  # after `take`: a rank quantizes its own shard, scales and all
        value, scale = _quantized(value, params[name + "_scale"])
        params[name + "_scale"].set_value(scale)
        params[name].set_value(value)
    else:
        params[name].set_value(value.astype(params[name].dtype))


def _weight_layouts(config: ModelConfig, ckpt, sources: dict[str, tuple[str, ...]], split: dict[str, int],
                    shard: TensorShard | None) -> dict[str, WeightLayout | str]:
    """How each 2-D weight is held where it is not `config.weight_dtype`: a GGUF file's in the
    types the file stores (`WeightLayout` when any part is a block format, else the float dtype),
    wint4's in 4-bit blocks (the vocabulary matrices in Q8_0). The shapes are this rank's."""
    if config.file_format != "gguf" and config.quantization != "wint4":
        return {}
    expected = expected_tensors(config)
    vocabulary = {"embed_tokens.weight", "lm_head"}
    layouts = {}
    for param, names in sources.items():
        if len(expected[names[0]]) != 2:
            continue
        parts, columns = [], expected[names[0]][1]
        for name in names:
            rows = expected[name][0]
            if name in split:
                start, end = shard.part(expected[name][split[name]])
                rows, columns = (end - start, columns) if split[name] == 0 else (rows, end - start)
            if config.file_format == "gguf":
                parts.append((ckpt.type_of(name), rows))
            else:
                parts.append(("Q8_0" if param in vocabulary else wint4_format(config.wint4_group), rows))
        if any(name not in FLOAT_DTYPES for name, _ in parts):
            try:
                layouts[param] = WeightLayout.of(parts, columns)
            except ValueError as e:  # a row-parallel split inside a block
                raise UnsupportedCheckpointError(
                    f"tensor_parallel_size: {shard.size if shard else 1} gives each rank {columns} columns of "
                    f"{names[0]!r}: {e}; use a size that splits at block boundaries") from e
        else:
            kinds = {FLOAT_DTYPES[name] for name, _ in parts}
            layouts[param] = kinds.pop() if len(kinds) == 1 else "float32"
    return layouts


def _held_as(config: ModelConfig) -> str:
    if config.file_format == "gguf":
        return "GGUF " + ", ".join(f"{kind} x{count}" for kind, count in config.tensor_types.items())
    return config.weight_dtype


def _quantized(weight: paddle.Tensor, scale: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    """`weight` `[out, in]` as int8 and its scale, for the device the model's `scale` is on."""
    if scale.place.is_gpu_place():
        return gpu_weight_only.quantize(weight, scale.dtype)
    return quantize_rows(weight)


def quantize_blocks(weight: paddle.Tensor, layout: WeightLayout) -> paddle.Tensor:
    """`weight` `[out, in]` in the one block format of `layout` (wint4), as its bytes."""
    (name, _), = layout.parts
    return cpu_kernels.required(f"wint4 ({name})").quantize_blocks(weight, name)


def _quantized_part(config: ModelConfig, model: DecoderForCausalLM) -> str:
    if config.quantization in (None, "gguf"):
        return ""
    if config.quantization == "wint4":
        return f", wint4 (linear layers in {wint4_format(config.wint4_group)}, embedding and LM head in Q8_0)"
    if model.embed_tokens.weight_scale is None:  # GPU: see gpu_weight_only
        return f", {config.quantization} (linear layers; embedding and LM head in {config.weight_dtype})"
    return f", {config.quantization} (linear layers, embedding, LM head)"


def _sources(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Each decoder parameter (but int8 scales) and the checkpoint tensors it is made of, in order:
    q/k/v and gate/up are fused by stacking rows."""
    sources = {"embed_tokens.weight": (_EMBED,), "norm.weight": ("model.norm.weight",)}
    for i in range(config.num_hidden_layers):
        attn, mlp, p = _ATTN.format(i=i), _MLP.format(i=i), f"layers.{i}."
        sources[p + "self_attn.qkv_weight"] = tuple(attn + f"{x}_proj.weight" for x in "qkv")
        if config.attention_bias:
            sources[p + "self_attn.qkv_bias"] = tuple(attn + f"{x}_proj.bias" for x in "qkv")
        sources[p + "self_attn.o_weight"] = (attn + "o_proj.weight",)
        if config.o_proj_bias:
            sources[p + "self_attn.o_bias"] = (attn + "o_proj.bias",)
        if config.qk_norm:
            sources[p + "self_attn.q_norm.weight"] = (attn + "q_norm.weight",)
            sources[p + "self_attn.k_norm.weight"] = (attn + "k_norm.weight",)
        sources[p + "mlp.gate_up_weight"] = (mlp + "gate_proj.weight", mlp + "up_proj.weight")
        sources[p + "mlp.down_weight"] = (mlp + "down_proj.weight",)
        if config.mlp_bias:
            sources[p + "mlp.gate_up_bias"] = (mlp + "gate_proj.bias", mlp + "up_proj.bias")
            sources[p + "mlp.down_bias"] = (mlp + "down_proj.bias",)
        sources[p + "input_layernorm.weight"] = (f"model.layers.{i}.input_layernorm.weight",)
        sources[p + "post_attention_layernorm.weight"] = (f"model.layers.{i}.post_attention_layernorm.weight",)
    if not config.tie_word_embeddings:
        sources["lm_head"] = (_HEAD,)
    return sources


def quantize_rows(weight: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    """Symmetric int8 per output row (`wint8`): `weight ~= q * scale[:, None]`, q in [-127, 127],
    rounded half away from zero. In the CPU kernels when they are built (a 7B model in seconds, no
    float32 temporaries); the same arithmetic in Paddle's ops otherwise."""
    kernels = cpu_kernels.load() if weight.place.is_cpu_place() else None
    return paddle_quantize_rows(weight) if kernels is None else kernels.quantize_rows(weight)


def paddle_quantize_rows(weight: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor]:
    """`quantize_rows` in Paddle's ops."""
    w = weight.astype("float32")
    scale = w.abs().max(axis=1) / 127.0
    scale = paddle.where(scale > 0, scale, paddle.ones_like(scale))  # an all-zero row stays zero
    return paddle.round(w / scale.unsqueeze(1)).clip(-127, 127).astype("int8"), scale


def weight_bytes(model: DecoderForCausalLM) -> int:
    """Bytes of every parameter the model holds (weights, scales, norms, biases)."""
    return sum(p.size * p.element_size() for p in model.parameters())


def hf_state_dict(model: DecoderForCausalLM) -> dict[str, np.ndarray]:
    """The model's weights under Hugging Face names and layouts, as float32 numpy arrays."""
    if model.shard is not None:
        raise ValueError("model: a tensor-parallel shard holds part of the weights; save an unsharded model")
    cfg = model.config
    state = _float_state(model.state_dict(), cfg.weight_layouts)
    out = {"model.embed_tokens.weight": state["embed_tokens.weight"], "model.norm.weight": state["norm.weight"]}
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        attn, mlp, p = _ATTN.format(i=i), _MLP.format(i=i), f"layers.{i}."
        wq, wk, wv = np.split(state[p + "self_attn.qkv_weight"], [q, q + kv])
        for name, w in zip("qkv", (wq, wk, wv)):
            out[attn + f"{name}_proj.weight"] = w
        if cfg.attention_bias:
            for name, b in zip("qkv", np.split(state[p + "self_attn.qkv_bias"], [q, q + kv])):
                out[attn + f"{name}_proj.bias"] = b
        out[attn + "o_proj.weight"] = state[p + "self_attn.o_weight"]
        if cfg.o_proj_bias:
            out[attn + "o_proj.bias"] = state[p + "self_attn.o_bias"]
        if cfg.qk_norm:
            out[attn + "q_norm.weight"] = state[p + "self_attn.q_norm.weight"]
            out[attn + "k_norm.weight"] = state[p + "self_attn.k_norm.weight"]
        gate, up = np.split(state[p + "mlp.gate_up_weight"], 2)
        out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = gate, up
        out[mlp + "down_proj.weight"] = state[p + "mlp.down_weight"]
        if cfg.mlp_bias:
            out[mlp + "gate_proj.bias"], out[mlp + "up_proj.bias"] = np.split(state[p + "mlp.gate_up_bias"], 2)
            out[mlp + "down_proj.bias"] = state[p + "mlp.down_bias"]
        out[f"model.layers.{i}.input_layernorm.weight"] = state[p + "input_layernorm.weight"]
        out[f"model.layers.{i}.post_attention_layernorm.weight"] = state[p + "post_attention_layernorm.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = state["lm_head"]
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def _float_state(params: dict[str, paddle.Tensor], layouts: dict) -> dict[str, np.ndarray]:
    """Every parameter but the int8 scales as float32 numpy, int8 weights as the values they stand
    for: row-major int8 times its row scale on CPU, `gpu_weight_only.dequantize` on GPU; block
    formats (GGUF, wint4) dequantized as `gguf.quants` does."""
    scales = {name: scale for name, scale in params.items() if name.removesuffix("_scale") in params.keys() - {name}}
    weights = {name.removesuffix("_scale"): (params[name.removesuffix("_scale")], scale) for name, scale in scales.items()}
    blocks = {name: layout for name, layout in layouts.items() if isinstance(layout, WeightLayout)}
    state = {k: v.astype("float32").numpy() for k, v in params.items()
             if k not in scales and k not in weights and k not in blocks}
    for name, layout in blocks.items():
        state[name] = cpu_kernels.required(layout.describe()).dequantize(params[name], layout).numpy()
    for name, (weight, scale) in weights.items():
        if weight.place.is_gpu_place():
            state[name] = gpu_weight_only.dequantize(weight, scale).astype("float32").numpy()
        else:
            state[name] = weight.astype("float32").numpy() * scale.numpy()[:, None]
    return state


def save_pretrained(model: DecoderForCausalLM, out_dir: str) -> None:
    """Write `model.safetensors` (float32) in the Hugging Face layout."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(hf_state_dict(model), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
