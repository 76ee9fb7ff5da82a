"""GGUF files as a model source: what llama.cpp, Ollama and LM Studio users hold on disk.

`--model` may name a `.gguf` file, the first part of a split model (`name-00001-of-00003.gguf`:
the other parts are found beside it), or a directory holding one model's GGUF file(s) and no
`config.json`. The header is parsed here (`read_header`, with the `gguf` package's type names and
block sizes, and held equal to its reader by the tests): the metadata becomes a Hugging Face
`config.json` dictionary (`hf_config`), so `ModelConfig.from_dict` checks a GGUF model exactly as
it checks a safetensors one; tensors are read one at a time with plain reads (not through a
memory map, whose pages would stay resident beside the copies the engine keeps), under their
Hugging Face names.

llama.cpp's converter stores the q and k rows of `llama` models permuted for its interleaved RoPE;
`GGUFModel.hf_rows` undoes that (rows are whole blocks, so quantized rows move as they are).
"""

from __future__ import annotations

import collections
import functools
import glob
import mmap
import os
import re
import struct
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from fastdeploy_lp.block_formats import FORMATS

# GGUF architectures read here: each is also the `model_type` of the transformers config it stands
# for, which `ModelConfig` maps to its class (`model_config.ARCHITECTURE_OF_MODEL_TYPE`).
ARCHITECTURES = ("llama", "qwen2", "qwen3")
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_MAGIC = b"GGUF"

# GGUF tensor names (per layer after `blk.N.`) -> Hugging Face names (after `model.layers.N.`).
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight", "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias", "ffn_down.bias": "mlp.down_proj.bias",
}
_MODEL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.x: RoPE frequency factors, read into the config


class GGUFError(ValueError):
    """A GGUF file this engine cannot serve; the message names what and why."""


def gguf_files(path: str) -> list[str] | None:
    """The GGUF file(s) of the model at `path`, split parts in order; None when `path` is not a GGUF
    source (a Hugging Face directory: it has a `config.json`)."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return None
        found = sorted(glob.glob(os.path.join(path, "*.gguf")))
        firsts = [f for f in found if not _SPLIT.match(os.path.basename(f)) or _SPLIT.match(
            os.path.basename(f)).group("no") == "00001"]
        if not found:
            return None
        if len(firsts) > 1:
            raise GGUFError(f"model: {path!r} holds several GGUF models ({', '.join(map(os.path.basename, firsts))}); "
                            f"name one file")
        path = firsts[0]
    if not (os.path.isfile(path) and _is_gguf(path)):
        return None
    split = _SPLIT.match(os.path.basename(path))
    if split is None:
        return [path]
    count = int(split.group("count"))
    parts = [os.path.join(os.path.dirname(path), f"{split.group('stem')}-{i:05d}-of-{count:05d}.gguf")
             for i in range(1, count + 1)]
    missing = [os.path.basename(p) for p in parts if not os.path.isfile(p)]
    if missing:
        raise GGUFError(f"model: split GGUF {os.path.basename(path)!r} is missing part(s) {', '.join(missing)}")
    return parts


@functools.lru_cache(maxsize=2)
def _open(files: tuple[str, ...]) -> "GGUFModel":
    return GGUFModel(list(files))


def open_model(files: list[str]) -> "GGUFModel":
    """The `GGUFModel` of these files, read once for the config, the tokenizer and the loader."""
    return _open(tuple(files))


# GGUF value types (the spec's numbering): struct formats of the scalars; 8 string, 9 array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def read_header(path: str) -> tuple[dict, list[TensorInfo]]:
    """A GGUF file's metadata (key -> Python value) and tensor infos, parsed from its header.

    Not through `gguf.GGUFReader`, which builds a numpy view per element of every array: 12.7 s
    for a 152k-token vocabulary and its merges (every Llama 3 and Qwen file), 0.4 s here. The type
    names and block sizes are the `gguf` package's; `tests/test_gguf.py` holds the two readers to
    the same fields and tensors."""
    import gguf

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _parse(data, path, gguf)
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
            raise GGUFError(f"model: {os.path.basename(path)!r} is not a readable GGUF file ({e}); a truncated or "
                            f"corrupt download?") from e


def _parse(data, path: str, gguf) -> tuple[dict, list[TensorInfo]]:
    if data[:4] != _MAGIC:
        raise ValueError("no GGUF magic")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} (big-endian or unknown); versions 2 and 3 are read")
    at = 24

    def string() -> str:
        nonlocal at
        (length,) = struct.unpack_from("<Q", data, at)
        text = bytes(data[at + 8:at + 8 + length]).decode("utf-8", errors="replace")
        at += 8 + length
        return text

    def value(kind: int):
        nonlocal at
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if item == _STRING:
                return [string() for _ in range(count)]
            if item == _ARRAY:
                return [value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_SCALARS[item]).newbyteorder("<")
            items = np.frombuffer(data, dtype=dtype, count=count, offset=at)
            at += count * dtype.itemsize
            return items.tolist()
        (scalar,) = struct.unpack_from("<" + _SCALARS[kind], data, at)
        at += struct.calcsize(_SCALARS[kind])
        return scalar

    fields = {}
    for _ in range(kv_count):
        key = string()
        (kind,) = struct.unpack_from("<I", data, at)
        at += 4
        fields[key] = value(kind)
    infos = []
    for _ in range(tensor_count):
        name = string()
        (dims,) = struct.unpack_from("<I", data, at)
        shape = struct.unpack_from(f"<{dims}Q", data, at + 4)
        kind, offset = struct.unpack_from("<IQ", data, at + 4 + 8 * dims)
        at += 4 + 8 * dims + 12
        infos.append((name, shape, kind, offset))
    alignment = int(fields.get("general.alignment", 32))
    return fields, _tensor_infos(infos, -(-at // alignment) * alignment, len(data), path, gguf)


def _tensor_infos(infos: list[tuple], start: int, file_size: int, path: str, gguf) -> list[TensorInfo]:
    """(name, GGML shape, type id, offset) as `TensorInfo`s, in the file of `file_size` bytes whose
    tensor data begins at `start`."""
    tensors = []
    known = {t.value: t for t in gguf.GGMLQuantizationType}
    for name, shape, kind, offset in infos:
        if kind not in known:  # a type newer than the gguf package: refused by the loader, naming the tensor
            tensors.append(TensorInfo(name, f"type {kind}", tuple(int(n) for n in reversed(shape)), path, start + offset, 0))
            continue
        block, block_bytes = gguf.GGML_QUANT_SIZES[known[kind]]
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * block_bytes
        if start + offset + nbytes > file_size:
            raise ValueError(f"tensor {name!r} ends past the end of the file")
        tensors.append(TensorInfo(name, known[kind].name, tuple(int(n) for n in reversed(shape)), path, start + offset,
                                  nbytes))
    return tensors


def _is_gguf(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _MAGIC


@dataclass(frozen=True)
class TensorInfo:
    name: str          # the GGUF name
    type: str          # GGML type name: "Q4_K", "F32", ...
    shape: tuple       # Hugging Face order: (rows, columns) or (length,)
    path: str          # the file (part) holding it
    offset: int        # of its first byte in that file
    nbytes: int


class GGUFModel:
    """One model's GGUF file(s): metadata, tensors, and the Hugging Face view of both."""

    def __init__(self, files: list[str]):
        self.files = files
        self.path = files[0]
        self.fields: dict = {}
        self.tensors: dict[str, TensorInfo] = {}
        for i, path in enumerate(files):
            fields, tensors = read_header(path)
            if i == 0:
                self.fields = fields
            self.tensors.update((t.name, t) for t in tensors)

    def value(self, key: str, default=None):
        """A metadata value as Python (str, number, list), or `default` if the file has no such key."""
        return self.fields.get(key, default)

    @cached_property
    def architecture(self) -> str:
        arch = self.value("general.architecture")
        if arch not in ARCHITECTURES:
            raise GGUFError(f"model: GGUF architecture {arch!r} in {os.path.basename(self.path)!r} is not supported; "
                            f"supported: {', '.join(ARCHITECTURES)} (Llama 3.x, SmolLM2 and Mistral files say llama)")
        return arch

    def arch_value(self, key: str, default=None):
        return self.value(f"{self.architecture}.{key}", default)

    def type_counts(self) -> dict[str, int]:
        """How many tensors the file holds of each type, most first: `{"Q4_1": 210, "F32": 61, ...}`."""
        return dict(collections.Counter(t.type for t in self.tensors.values()).most_common())

    # -- the Hugging Face view ------------------------------------------------------------------
    def hf_config(self) -> dict:
        """The metadata as the `config.json` transformers would write for this model."""
        arch, get = self.architecture, self.arch_value
        hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
        kv_heads = get("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            if len(set(kv_heads)) != 1:
                raise GGUFError(f"model: {arch}.attention.head_count_kv differs between layers ({kv_heads}); "
                                f"one KV head count for every layer is implemented")
            kv_heads = kv_heads[0]
        head_dim = int(get("attention.key_length", hidden // heads))
        if int(get("attention.value_length", head_dim)) != head_dim:
            raise GGUFError(f"model: {arch}.attention.value_length differs from key_length ({head_dim})")
        config = {
            "model_type": arch, "hidden_size": hidden,
            "intermediate_size": int(get("feed_forward_length")), "num_hidden_layers": int(get("block_count")),
            "num_attention_heads": heads, "num_key_value_heads": int(kv_heads), "head_dim": head_dim,
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(get("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(get("context_length", 2048)),
            "vocab_size": self.tensors["token_embd.weight"].shape[0] if "token_embd.weight" in self.tensors
            else int(get("vocab_size", len(self.value("tokenizer.ggml.tokens", [])))),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "eos_token_id": self.eos_token_ids(), "torch_dtype": "float32",
        }
        rope_dims = int(get("rope.dimension_count", head_dim))
        if rope_dims != head_dim:
            config["partial_rotary_factor"] = rope_dims / head_dim  # refused by ModelConfig, naming it
        config["rope_scaling"] = self._rope_scaling()
        if arch == "llama":
            config["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
            config["mlp_bias"] = "blk.0.ffn_gate.bias" in self.tensors
        return config

    def _rope_scaling(self) -> dict | None:
        kind = self.arch_value("rope.scaling.type", "none")
        if ROPE_FREQS in self.tensors:  # Llama 3.x: the file holds the frequency factors it computed
            if kind not in ("none", "linear") and kind is not None:
                raise GGUFError(f"model: RoPE scaling {kind!r} together with rope_freqs is not supported")
            factors = self.read_floats(ROPE_FREQS).tolist()
            return {"rope_type": "freq_factors", "factors": factors}
        if kind in (None, "none"):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self.arch_value("rope.scaling.factor"))}
        return {"rope_type": kind}  # yarn, ...: ModelConfig refuses it, naming the type

    def eos_token_ids(self) -> list[int]:
        """End of sequence, then end of turn and end of message where the file names them."""
        ids = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self.value(f"tokenizer.ggml.{key}")
            if value is not None and int(value) not in ids:
                ids.append(int(value))
        return ids

    def hf_tensors(self) -> dict[str, TensorInfo]:
        """Every tensor the decoder may read, under its Hugging Face name; unknown GGUF names keep
        theirs (the loader refuses them, naming them). The RoPE factors went into the config."""
        out = {}
        for name, info in self.tensors.items():
            if name == ROPE_FREQS:
                continue
            match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
            if match and match.group(2) in _LAYER_TENSORS:
                out[f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}"] = info
            else:
                out[_MODEL_TENSORS.get(name, name)] = info
        return out

    def hf_rows(self, hf_name: str, info: TensorInfo, heads: int, kv_heads: int, axis: int = 0,
                span: tuple[int, int] | None = None) -> np.ndarray:
        """A tensor's stored bytes (`[rows, row bytes]`, or `[bytes]` for a vector) in Hugging Face row
        order: llama.cpp's converter stores the q and k rows of `llama` models permuted for its
        interleaved RoPE (within each head, the two halves interleaved), undone here; quantized
        rows move as they are. With a `span`, only its rows (`axis` 0) or columns (`axis` 1: whole
        blocks) are kept, a tensor-parallel rank's share."""
        data = self.read_bytes(info)
        if self.architecture == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight",
                                                              "k_proj.bias")):
            n = heads if ".q_proj." in hf_name else kv_heads
            shape = data.shape
            data = data.reshape(n, info.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(shape)
        if span is None:
            return data
        start, end = span
        if axis == 0 or data.ndim == 1:
            return data[start:end] if data.ndim == 2 else data.reshape(info.shape[0], -1)[start:end].reshape(-1)
        fmt = FORMATS[info.type]
        if start % fmt.elems or end % fmt.elems:
            raise GGUFError(f"model: tensor {info.name!r} ({info.type}, blocks of {fmt.elems}) cannot be split at "
                            f"column {start if start % fmt.elems else end} for tensor parallelism")
        return np.ascontiguousarray(data[:, start // fmt.elems * fmt.bytes: end // fmt.elems * fmt.bytes])

    # -- reading ----------------------------------------------------------------------------------
    def read_bytes(self, info: TensorInfo) -> np.ndarray:
        """A tensor's bytes as stored, `[rows, row bytes]` (or `[bytes]` for a vector)."""
        data = np.empty(info.nbytes, dtype=np.uint8)
        with open(info.path, "rb") as f:
            f.seek(info.offset)
            if f.readinto(memoryview(data)) != info.nbytes:
                raise GGUFError(f"model: {os.path.basename(info.path)!r} ends inside tensor {info.name!r} "
                                f"(a truncated download?)")
        return data.reshape(info.shape[0], -1) if len(info.shape) == 2 else data

    def read_floats(self, name: str) -> np.ndarray:
        """A float tensor (F32, F16 or BF16) as float32 in its Hugging Face shape."""
        info = self.tensors[name]
        data = self.read_bytes(info).reshape(-1)
        if info.type == "F32":
            return data.view(np.float32).reshape(info.shape)
        if info.type == "F16":
            return data.view(np.float16).astype(np.float32).reshape(info.shape)
        if info.type == "BF16":
            return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(info.shape)
        raise GGUFError(f"model: tensor {name!r} is {info.type}, expected a float type")


def supported_type(name: str) -> bool:
    """Whether the engine multiplies tensors of this GGML type (F32, F16, BF16 and the block formats
    of `block_formats`; W4G128 is this project's own and never in a file)."""
    return name in FORMATS and name != "W4G128"


def as_float32(data: np.ndarray, type_name: str) -> np.ndarray:
    """Rows of a float tensor's bytes (`[rows, row bytes]` or `[bytes]`) as float32 values."""
    flat = np.ascontiguousarray(data).reshape(-1)
    values = {"F32": lambda: flat.view(np.float32), "F16": lambda: flat.view(np.float16).astype(np.float32),
              "BF16": lambda: (flat.view(np.uint16).astype(np.uint32) << 16).view(np.float32)}[type_name]()
    return values.reshape(data.shape[0], -1) if data.ndim == 2 else values
