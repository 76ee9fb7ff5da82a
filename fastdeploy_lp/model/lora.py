"""LoRA adapters in Hugging Face PEFT format, applied per row on top of the base model's linears.

An adapter is a directory with `adapter_config.json` (`r`, `lora_alpha`, `use_rslora`,
`target_modules`) and `adapter_model.safetensors` (keys such as
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, A `[r, in]`, B `[out, r]`).
Each targeted projection gets `y = base(x) + scaling * (x @ A^T) @ B^T`, `scaling = lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`), PEFT's rule.

The model holds q/k/v and gate/up fused (`layers.py`), so an adapter's projections are fused the
same way when it loads: the A matrices of q, k and v stacked `[r_q + r_k + r_v, in]`, their B
matrices transposed and scaled side by side in one `[r, q + 2 kv]`, each segment reading its own
columns of `x @ A^T`. A pass runs the base linear over all its rows once, whatever the weight
format, then each row's adapter update: on CPU in the C kernels (`fdlp_lora_update`, inside the
fused decoder-layer call as between Paddle ops), each adapter's A and B read once for all its rows,
the segmented form of Punica / S-LoRA; elsewhere with Paddle ops per adapter (gather its rows, two
matmuls, scatter-add). Rows without an adapter cost nothing, and a pass without any adapter never
enters this module (`active()` is None).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import paddle

from fastdeploy_lp.config import LoRAConfig
from fastdeploy_lp.distributed.shard import TensorShard
from fastdeploy_lp.model_config import ModelConfig
from fastdeploy_lp.model import cpu_kernels
from fastdeploy_lp.model.cpu_kernels.structs import LoRAInputs, lora_table

LORA_NAME = "lora_name"  # `SamplingParams.extra` key: the name of the adapter a request runs with
LORA_ADAPTER = "lora_adapter"  # and the `LoRAAdapter` itself, set by the engine when the request is queued

# PEFT module name -> (the fused weight here, its segment: q, k, v of qkv; gate, up of gate_up)
TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
           "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
PANEL = 16  # B^T is held in panels of this many outputs (layer.h's LORA_PANEL), as the C kernels read it
LINEARS = ("qkv", "o", "gate_up", "down")  # a layer's linears, in the C kernels' order (layer.h)
COLUMN_PARALLEL = ("qkv", "gate_up")  # under tensor parallelism split by output rows; o and down by input columns
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest`: the adapter a request runs with (`LLM.generate(..., lora_request=...)`).
    `lora_int_id` is accepted for vLLM's signature; the adapter is known by its name."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass
class LoRAAdapter:
    """One loaded adapter, in `--lora-dtype`: per (layer, fused weight) its stacked A `[a_rows, in]`,
    scaled B^T in panels `[ceil(out / PANEL), rank, PANEL]` and per output segment the first column
    of `x @ A^T` it reads (-1: not targeted); `outs` each fused weight's output segments (this
    rank's, under tensor parallelism)."""

    name: str
    path: str
    rank: int
    layers: int
    outs: dict[str, list[int]]
    weights: dict[tuple[int, str], tuple[paddle.Tensor, paddle.Tensor, tuple[int, ...]]] = field(default_factory=dict)
    _table: object = None  # the weights as the C kernels read them, built at first use

    def kernel_table(self):
        """`lora_table` of the adapter's updates, 4 per layer in layer.h's order."""
        if self._table is None:
            self._table = lora_table([self.weights.get((layer, fused)) for layer in range(self.layers)
                                      for fused in LINEARS])
        return self._table


def fused_shapes(config: ModelConfig) -> tuple[int, dict[str, tuple[int, list[int]]]]:
    """The decoder's layer count and, per fused weight, its input size and output segments (unsharded)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return config.num_hidden_layers, {"qkv": (hidden, [q, kv, kv]), "o": (q, [hidden]),
                                      "gate_up": (hidden, [inter, inter]), "down": (inter, [hidden])}


def read_adapter(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """`adapter_config.json` and the tensors of `adapter_model.safetensors` as float32 (PEFT's `.bin`: refused)."""
    config_file, weights_file = (os.path.join(path, f) for f in ("adapter_config.json", "adapter_model.safetensors"))
    for f in (config_file, weights_file):
        if not os.path.isfile(f):
            raise ValueError(f"lora_path: {path!r} has no {os.path.basename(f)} (a PEFT adapter directory)")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except ValueError as e:
        raise ValueError(f"lora_path: {config_file!r} is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"lora_path: {config_file!r} is not a JSON object")
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(weights_file, framework="paddle") as f:  # numpy has no bfloat16; PEFT often saves it
            return config, {k: f.get_tensor(k).astype("float32").numpy() for k in f.keys()}
    except SafetensorError as e:
        raise ValueError(f"lora_path: {weights_file!r} is not a safetensors file: {e}") from None


def load_adapter(name: str, path: str, model_config: ModelConfig, shard: TensorShard | None, max_rank: int,
                 dtype: str) -> LoRAAdapter:
    """Read and check a PEFT adapter against the model of `model_config`, held in `dtype`; a `ValueError`
    names the field that does not fit (`r`, `target_modules`, a tensor's shape). With a `shard`
    (tensor parallelism), this rank's part, split as its layers are: B's rows of its q/k/v heads and
    MLP columns; A's columns of its o_proj and down_proj inputs, whose partial updates the layers'
    all-reduce sums with theirs (B (x_1 A_1^T + x_2 A_2^T) is the whole update)."""
    config, tensors = read_adapter(path)
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"r: adapter {name!r} has rank {rank!r}, must be a positive integer")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ValueError(f"lora_alpha: adapter {name!r} has lora_alpha {alpha!r}, must be a finite number")
    if rank > max_rank:
        raise ValueError(f"r: adapter {name!r} has rank {rank}, more than max_lora_rank={max_rank}")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"rank_pattern: adapter {name!r} uses per-module ranks, not supported")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    if not all(isinstance(t, str) for t in targets):
        raise ValueError(f"target_modules: adapter {name!r} has target_modules {targets!r}, must be names")
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown:
        raise ValueError(f"target_modules: adapter {name!r} targets {', '.join(unknown)}, which this model does not "
                         f"have as LoRA targets (supported: {', '.join(TARGETS)})")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    layers, shapes = fused_shapes(model_config)
    pieces: dict[tuple[int, str], dict[int, dict[str, np.ndarray]]] = {}
    for key, value in tensors.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in TARGETS:
            raise ValueError(f"target_modules: adapter {name!r} has tensor {key!r}, not a LoRA weight of "
                             f"{', '.join(TARGETS)}")
        layer = int(m.group(1))
        if layer >= layers:
            raise ValueError(f"target_modules: adapter {name!r} has {key!r}, but the base model has {layers} layers")
        if not np.isfinite(value).all():
            raise ValueError(f"lora_{m.group(4)}: adapter {name!r} {key!r} holds NaN or infinite values")
        fused, segment = TARGETS[m.group(3)]
        pieces.setdefault((layer, fused), {}).setdefault(segment, {})[m.group(4)] = value
    ranks = 1 if shard is None else shard.size
    outs = {fused: [n // ranks for n in segment_outs] if fused in COLUMN_PARALLEL else segment_outs
            for fused, (_, segment_outs) in shapes.items()}
    adapter = LoRAAdapter(name, path, rank, layers, outs)
    for (layer, fused), segments in pieces.items():
        a, bt, columns = _fuse(name, layer, fused, segments, shapes[fused], rank, scaling, shard)
        adapter.weights[(layer, fused)] = (paddle.to_tensor(a).astype(dtype), paddle.to_tensor(bt).astype(dtype),
                                           columns)
    if not adapter.weights:
        raise ValueError(f"target_modules: adapter {name!r} holds no LoRA weights")
    return adapter


def _fuse(name: str, layer: int, fused: str, segments: dict, shape: tuple[int, list[int]], rank: int,
          scaling: float, shard: TensorShard | None) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    in_features, outs = shape
    ranks = 1 if shard is None else shard.size
    offsets = np.cumsum([0] + [n // ranks if fused in COLUMN_PARALLEL else n for n in outs])
    a_rows, bt, columns = [], np.zeros((rank, offsets[-1]), dtype=np.float32), [-1] * len(outs)
    for k, (segment, ab) in enumerate(sorted(segments.items())):
        module = next(m for m, t in TARGETS.items() if t == (fused, segment))
        where = f"adapter {name!r} layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"target_modules: {where} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.shape != (rank, in_features):
            raise ValueError(f"lora_A: {where} is {list(a.shape)}, the base layer needs [{rank}, {in_features}] (r, in)")
        if b.shape != (outs[segment], rank):
            raise ValueError(f"lora_B: {where} is {list(b.shape)}, the base layer needs [{outs[segment]}, {rank}] "
                             "(out, r)")
        if shard is not None and fused in COLUMN_PARALLEL:
            b = b[slice(*shard.part(outs[segment]))]
        elif shard is not None:
            a = a[:, slice(*shard.part(in_features))]
        a_rows.append(a)
        bt[:, offsets[segment]:offsets[segment + 1]] = scaling * b.T
        columns[segment] = k * rank
    panels = np.pad(bt, ((0, 0), (0, -offsets[-1] % PANEL))).reshape(rank, -1, PANEL).transpose(1, 0, 2)
    return np.concatenate(a_rows), np.ascontiguousarray(panels), tuple(columns)


def unpanel(bt: paddle.Tensor, out: int) -> paddle.Tensor:
    """B^T `[rank, out]` from its panels `[ceil(out / PANEL), rank, PANEL]`."""
    return bt.transpose([1, 0, 2]).reshape([bt.shape[1], -1])[:, :out]


class LoRAManager:
    """The adapters an engine serves, by name (`--lora-modules`, `LLM.generate(lora_request=...)`).

    Every name loaded stays known with its path; past `max_cpu_loras` adapters in memory the least
    recently used one leaves it, and is read again from its path when a request names it. A queued
    request holds its adapter (`LORA_ADAPTER`), so neither eviction nor `unload` touches requests
    already queued, and the step loop never reads a file. Safe to call from any thread: files are
    read outside the lock."""

    def __init__(self, model_config: ModelConfig, lora_config: LoRAConfig, shard: TensorShard | None = None):
        self.model_config, self.shard = model_config, shard
        self.max_lora_rank, self.max_cpu_loras, self.dtype = (lora_config.max_lora_rank, lora_config.max_cpu_loras,
                                                              lora_config.dtype)
        self.paths: dict[str, str] = {}
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()

    def load(self, name: str, path: str) -> LoRAAdapter:
        """Load (or return, when the same path is loaded under `name`) an adapter. Two loads of one
        name racing from two paths: the first to finish reading wins, the other is refused."""
        with self._lock:
            have = self.paths.get(name)
        if have is not None:
            self._check_same_path(name, have, path)
            return self.get(name)
        adapter = self._read(name, path)
        with self._lock:  # the name may have been taken while the files were read
            have = self.paths.get(name)
            if have is not None:
                self._check_same_path(name, have, path)
            self.paths[name] = have or path
            return self._keep(adapter)

    @staticmethod
    def _check_same_path(name: str, have: str, path: str) -> None:
        if os.path.abspath(have) != os.path.abspath(path):
            raise ValueError(f"lora_name: {name!r} is loaded from {have!r}, not {path!r}")

    def unload(self, name: str) -> None:
        with self._lock:
            if name not in self.paths:
                raise ValueError(f"lora_name: adapter {name!r} is not loaded")
            del self.paths[name]
            self.adapters.pop(name, None)

    def names(self) -> dict[str, str]:
        """Every adapter served, name -> path (in memory or not)."""
        with self._lock:
            return dict(self.paths)

    def get(self, name: str) -> LoRAAdapter:
        """The adapter `name`, most recently used now (read again from its path if it was evicted)."""
        with self._lock:
            adapter, path = self.adapters.get(name), self.paths.get(name)
            if adapter is not None:
                self.adapters.move_to_end(name)
                return adapter
        if path is None:
            raise ValueError(f"model: LoRA adapter {name!r} is not loaded (loaded: {', '.join(self.paths) or 'none'})")
        adapter = self._read(name, path)
        with self._lock:
            return self._keep(adapter) if self.paths.get(name) == path else adapter

    def resolve(self, name: str, path: str) -> LoRAAdapter:
        """The adapter `name` read from `path`, whatever was loaded under that name before: a
        tensor-parallel rank's view of the driver's adapters (`TensorParallelRunner`), which it
        follows pass by pass."""
        with self._lock:
            stale = self.paths.get(name) not in (None, path)
        if stale:
            self.unload(name)
        return self.load(name, path)

    def _read(self, name: str, path: str) -> LoRAAdapter:
        return load_adapter(name, path, self.model_config, self.shard, self.max_lora_rank, self.dtype)

    def _keep(self, adapter: LoRAAdapter) -> LoRAAdapter:
        self.adapters[adapter.name] = adapter
        while self.max_cpu_loras is not None and len(self.adapters) > self.max_cpu_loras:
            self.adapters.popitem(last=False)  # requests holding it keep their own reference
        return adapter


@dataclass
class LoRAPass:
    """The adapters of the pass running now: `groups` [(adapter, its row indices, None: every row)],
    and `row_owner` (each row's index in `groups`, -1: the base)."""

    groups: list[tuple[LoRAAdapter, paddle.Tensor | None]]
    row_owner: np.ndarray
    _kernel_inputs: object = None

    def kernel_inputs(self) -> LoRAInputs:
        """The pass's adapters as the C kernels take them, built once per pass."""
        if self._kernel_inputs is None:
            self._kernel_inputs = LoRAInputs.of([a.kernel_table() for a, _ in self.groups], self.row_owner)
        return self._kernel_inputs


class _ThreadState(threading.local):
    """Per thread (engines of one process may step on threads of their own): the pass running now."""

    active: LoRAPass | None = None


_state = _ThreadState()


def active() -> LoRAPass | None:
    return _state.active


@contextlib.contextmanager
def rows_of_pass(row_adapters: list[LoRAAdapter | None]):
    """Within the block, the model's linears add each row's adapter (`row_adapters[i]` for row i of
    the pass, None: the base). Without any adapter the pass is untouched."""
    groups: dict[int, tuple[LoRAAdapter, list[int]]] = {}
    owner = np.full(len(row_adapters), -1, dtype=np.int64)
    for i, adapter in enumerate(row_adapters):
        if adapter is not None:
            owner[i] = list(groups).index(id(adapter)) if id(adapter) in groups else len(groups)
            groups.setdefault(id(adapter), (adapter, []))[1].append(i)
    before = _state.active
    _state.active = LoRAPass([(a, None if len(rows) == len(row_adapters) else paddle.to_tensor(rows, dtype="int64"))
                        for a, rows in groups.values()], owner) if groups else None
    try:
        yield
    finally:
        _state.active = before


def add(layer: int, fused: str, x: paddle.Tensor, out: paddle.Tensor) -> paddle.Tensor:
    """`out` (the base linear's output over `x`) plus each row's adapter update. On CPU the C
    kernels add it in place, as the fused decoder-layer call does (the same values whichever path
    a pass takes); elsewhere Paddle ops per adapter."""
    lora_pass = _state.active
    if (x.place.is_cpu_place() and x.dtype == out.dtype == paddle.float32 and out.is_contiguous()
            and (kernels := cpu_kernels.load()) is not None):
        outs = lora_pass.groups[0][0].outs[fused]
        kernels.lora_update(lora_pass.kernel_inputs(), 4 * layer + LINEARS.index(fused), x, out, outs)
        return out
    x32 = x if x.dtype == paddle.float32 else x.astype("float32")
    for adapter, rows in lora_pass.groups:
        if (layer, fused) not in adapter.weights:
            continue
        a, panels, columns = adapter.weights[(layer, fused)]
        a, bt = a.astype("float32"), unpanel(panels, sum(adapter.outs[fused])).astype("float32")
        xs = x32 if rows is None else paddle.index_select(x32, rows)
        shrunk, parts, start = paddle.matmul(xs, a, transpose_y=True), [], 0
        for width, column in zip(adapter.outs[fused], columns):
            parts.append(paddle.zeros([xs.shape[0], width], dtype="float32") if column < 0 else
                         paddle.matmul(shrunk[:, column:column + adapter.rank], bt[:, start:start + width]))
            start += width
        update = paddle.concat(parts, axis=1) if len(parts) > 1 else parts[0]
        if update.dtype != out.dtype:
            update = update.astype(out.dtype)
        out = out + update if rows is None else paddle.index_add(out, rows, 0, update)
    return out
