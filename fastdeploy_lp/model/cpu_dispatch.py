"""Which CPU kernel runs where: each one timed against the Paddle op it replaces, on this machine and model.

The C kernels (`cpu_kernels`) were 1.7x faster than MKL for an 8-row decode step on one AVX-512 CPU
and several times slower on an AVX2-only one, so no kernel is trusted by default: `prepare(model)`
(the runner calls it once the model is loaded, in `FDLP_CPU_KERNELS=auto` mode) times both on the
shapes the engine will run and keeps the faster, per op and row bucket (`cpu_kernels.bucket`):

| op          | buckets                       | measured on                                          |
|-------------|-------------------------------|------------------------------------------------------|
| `linear`    | 1, 2-8, 9-16, 17-32 rows,     | the model's own q/k/v, o, gate/up and down weights,   |
|             | prefill (timed at 1, 8, 16,   | in their format (float32, 16-bit or int8), read in    |
|             | 32, 128)                      | 32 MB sets in turn, cold as in a decode step         |
| `transpose` | decode (8 rows), prefill (64) | a `[2 * intermediate, rows]` product                 |
| `swiglu`    | decode (32 rows), prefill (256)| `[rows, 2 * intermediate]`                          |
| `rotary`    | decode (8 tokens), prefill (256)| layer 0's heads, a paged batch                     |
| `attention` | decode (8 x 1 token over 256), prefill (128 over 128), shorter for a shorter context | layer 0's heads, a paged cache |
| `argmax`    | all (timed at 8 rows: both scale with rows) | `[8, vocab]`                           |
| `widen`     | all (16-bit and int8 weights only) | 8 MB of layer 0's gate/up weight to float32     |

Weights in block formats (GGUF, wint4) have no Paddle op to compare with up to 32 rows: their
linear layers are the kernel's there (`linear` buckets kept without timing). For prefill, `blocks`
times the kernel against tiles of the weight widened for MKL's GEMM (256 rows of x, layer 0's
gate/up weight); the rest is measured as above.

Each decision compares 5 interleaved timings of each side by the mean of their three fastest (noise
only adds time; no single sample decides), and the kernel wins only if it is lower, but for
`linear`, where it wins within `FUSED_LAYER_EDGE` (and the decode buckets of rotary, swiglu and
attention, within `FUSED_OP_EDGE`): the one-call decoder layers (`fused_layer.py`)
run only with the kernel linear, and their saving, which a per-op timing cannot see, is 7-15% of a
batch-1 step on the bench model (every layer in one call; AVX2 build: 11.9 tok/s with every kernel
against 11.1 on an `auto` that had kept MKL's GEMV for one row, within noise of the kernel: at a 5%
edge one calibration in three did so). The choices are cached beside the compiled library, keyed
by the model's shapes, the thread count and `PLAN_VERSION`, so the calibration (0.2-0.6 s) happens once per machine and
model, and they are logged once per process. A calibration during which other processes kept
more than `BUSY_MACHINE` of the CPUs busy is used but not cached: it is measured again at the next start.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import paddle
import paddle.nn.functional as F

from fastdeploy_lp.model import cpu_features, cpu_kernels
from fastdeploy_lp.model.layers import AttentionBatch
from fastdeploy_lp.model.linear import paddle_linear, paddle_widen, widened_linear

logger = logging.getLogger(__name__)

SAMPLES = 5
SET_BYTES = 32 << 20  # weights one linear timing reads; sets are read in turn so none is cache-hot
FUSED_LAYER_EDGE = 0.10  # the linear kernel wins unless Paddle's op is this much faster
# The decode kernels the fused layers chain besides linear (rotary, swiglu, attention) win unless
# Paddle's op is twice as fast: they take microseconds a layer, where timing noise decides, while
# the fused call they enable saves the Python between them, a millisecond and more a step. A
# calibration that kept Paddle's swiglu and rotary for decode (noise on a shared machine) ran
# SmolLM2 at 24 tok/s instead of 92 (30 layers, AVX2 EPYC).
FUSED_OP_EDGE = 1.0
OP_EDGE = {"decode": FUSED_OP_EDGE, "prefill": 0.0}  # per bucket of rotary, swiglu and attention
PLAN_VERSION = 3  # in the cache key: a change of these rules measures again
PREFILL_ROWS = 128  # rows of x the linear layers' prefill bucket is timed at (no fused layers past 32: no edge)
# A plan timed while other processes used more than this share of the CPUs is not cached: a
# package install on one of two cores made Paddle's GEMV look faster than the kernel's, and the
# cached choice then ran float32 batch 1 at 3.6 tok/s instead of 8 for good (AVX2 EPYC).
BUSY_MACHINE = 0.15
_logged: set[str] = set()


def prepare(model, block_size: int, kv_dtype: str = "float32") -> dict[str, bool] | None:
    """Measure (or read back) which kernels beat Paddle for `model` and hand the choice to
    `cpu_kernels` (the attention ops timed on a cache of `kv_dtype`); None when no choice is needed (kernels off, forced on, absent, or not on CPU)."""
    if cpu_kernels.mode() != "auto" or not paddle.get_device().startswith("cpu"):
        return None
    kernels = cpu_kernels.load()
    if kernels is None:
        return None
    signature = _signature(model, block_size, kv_dtype)
    store = kernels.path.with_suffix(".plans.json")
    plans = _read(store)
    plan, where = plans.get(signature), f"cached in {store}"
    if plan is None:
        start, others = time.perf_counter(), _other_processes_load()
        plan = calibrate(kernels, model, block_size, kv_dtype)
        where = f"measured in {time.perf_counter() - start:.2f} s"
        busy = others()
        if busy > BUSY_MACHINE:
            logger.warning("other processes used %.0f%% of the CPUs while the kernels were timed: the choice below "
                           "is used by this process only and measured again at the next start", 100 * busy)
        else:
            _write(store, {**_read(store), signature: plan})
    cpu_kernels.use_plan(plan)
    if signature not in _logged:
        _logged.add(signature)
        logger.info("CPU kernels for %s, %d floats per vector (%s): %s", cpu_features.detect().describe(),
                    kernels.lanes, where, describe(plan))
    return plan


def describe(plan: dict[str, bool]) -> str:
    """`kernel: linear 1, 2-8; swiglu decode | Paddle: linear 17-32` from a plan."""
    def names(won: bool) -> str:
        ops: dict[str, list[str]] = {}
        for key, kernel in plan.items():
            if kernel == won:
                op, bucket = key.split(":")
                ops.setdefault(op, []).append(bucket)
        return "; ".join(f"{op} {', '.join(b)}" for op, b in ops.items()) or "none"
    return f"kernel: {names(True)} | Paddle: {names(False)}"


def calibrate(kernels: cpu_kernels.CpuKernels, model, block_size: int, kv_dtype: str = "float32") -> dict[str, bool]:
    """Time every kernel against its Paddle op on `model`'s shapes: `{"op:bucket": kernel won}`."""
    cfg = model.config
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    plan = {}
    cpu_kernels.use_plan(plan)  # the references run Paddle's ops only
    blocks = mlp.gate_up_weight_layout is not None  # GGUF, wint4: only the kernel multiplies those
    with paddle.no_grad():
        if mlp.gate_up_weight.dtype != paddle.float32 and not blocks:
            # 8 MB of output, past L2: Paddle's cast of a whole 7B gate/up weight would take seconds.
            rows = max(1, (8 << 20) // (4 * mlp.gate_up_weight.shape[1]))
            w = mlp.gate_up_weight[:rows].contiguous()
            scale = None if mlp.gate_up_weight_scale is None else mlp.gate_up_weight_scale[:rows].contiguous()
            plan["widen:all"] = _kernel_wins(lambda: kernels.widen(w, scale), lambda: paddle_widen(w, scale, "float32"))
        width = 2 * mlp.intermediate
        for bucket, rows in (("decode", 8), ("prefill", 64)):
            product = paddle.randn([width, rows])
            plan[f"transpose:{bucket}"] = _kernel_wins(lambda: kernels.transpose(product),
                                                       lambda: product.T.contiguous())
        cpu_kernels.use_plan(plan)  # a linear layer without its kernel widens and transposes as measured
        if blocks:  # prefill: the kernels' own against tiles widened for MKL's GEMM (`linear.widened_linear`)
            x = paddle.randn([256, mlp.gate_up_weight_layout.in_features])
            layout = mlp.gate_up_weight_layout
            plan["blocks:all"] = _kernel_wins(lambda: kernels.linear(x, mlp.gate_up_weight, layout=layout),
                                              lambda: widened_linear(kernels, x, mlp.gate_up_weight, None, layout))
        weights = [] if blocks else _weight_sets(model)
        for rows, name in (*cpu_kernels.LINEAR_BUCKETS, (PREFILL_ROWS, "prefill")):
            if blocks:
                plan[f"linear:{name}"] = True
                continue
            xs = {k: paddle.randn([rows, k]) for k in {w.shape[1] for w, _ in itertools.chain(*weights)}}
            sets = itertools.cycle(weights)  # shared: consecutive timings read different sets
            plan[f"linear:{name}"] = _kernel_wins(
                lambda: [kernels.linear(xs[w.shape[1]], w, None, s) for w, s in next(sets)],
                lambda: [paddle_linear(xs[w.shape[1]], w, None, s) for w, s in next(sets)],
                edge=FUSED_LAYER_EDGE if rows <= cpu_kernels.KERNEL_ROWS else 0.0)
        for bucket, rows in (("decode", 32), ("prefill", 256)):
            gate_up = paddle.randn([rows, width])
            plan[f"swiglu:{bucket}"] = _kernel_wins(lambda: kernels.swiglu(gate_up), lambda: F.swiglu(gate_up),
                                                    edge=OP_EDGE[bucket])
        logits = paddle.randn([8, cfg.vocab_size])
        plan["argmax:all"] = _kernel_wins(lambda: kernels.argmax(logits), lambda: paddle.argmax(logits, axis=-1))
        span = min(256, model.rotary.cos.shape[0])  # positions the model's rotary table holds
        for bucket, seqs, new, length in (("decode", 8, 1, span), ("prefill", 1, span // 2, span // 2)):
            batch, cache = _paged_batch(attn, block_size, seqs, new, length, kv_dtype)
            qkv = paddle.randn([seqs * new, attn.q_size + 2 * attn.kv_size])
            if attn.q_norm is None:  # the rotary kernel has no q/k norm
                plan[f"rotary:{bucket}"] = _kernel_wins(
                    lambda: attn.rotate_and_store_kernel(kernels, qkv, batch, model.rotary, cache),
                    lambda: attn.rotate_and_store(qkv, batch, model.rotary, cache),
                    edge=OP_EDGE[bucket])
            group = batch.groups[0]
            q = paddle.randn([seqs * new, attn.num_heads, attn.head_dim])
            plan[f"attention:{bucket}"] = _kernel_wins(
                lambda: kernels.paged_attention(q, *cache, *group.kernel_inputs[:2], new, group.kernel_inputs[2],
                                                attn.num_kv_heads, block_size, attn.scale),
                lambda: attn.gathered_attention(q, group, *cache), edge=OP_EDGE[bucket])
    return plan


def _kernel_wins(kernel: Callable[[], object], reference: Callable[[], object], edge: float = 0.0) -> bool:
    """Whether `kernel` is faster over SAMPLES interleaved runs of each (after one each to warm up),
    comparing the mean of each one's three fastest runs: noise from other processes only adds
    time, and one lucky run decides nothing. With an `edge`, the kernel also wins when it is at
    most that fraction slower."""
    kernel(), reference()
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(SAMPLES):
        for i, fn in enumerate((kernel, reference)):
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
    return statistics.fmean(sorted(times[0])[:3]) < (1 + edge) * statistics.fmean(sorted(times[1])[:3])


def _weight_sets(model) -> list[list[tuple[paddle.Tensor, paddle.Tensor | None]]]:
    """The decoder layers' linear weights (and int8 scales) in model order, in sets of about SET_BYTES
    of float32 (fewer bytes as held for 16-bit and int8 weights)."""
    sets, current, size = [], [], 0
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for w, scale in ((attn.qkv_weight, attn.qkv_weight_scale), (attn.o_weight, attn.o_weight_scale),
                         (mlp.gate_up_weight, mlp.gate_up_weight_scale), (mlp.down_weight, mlp.down_weight_scale)):
            current.append((w, scale))
            size += w.size * 4  # as float32: what Paddle's path widens to and multiplies
            if size >= SET_BYTES:
                sets.append(current)
                current, size = [], 0
    return sets + [current] if current else sets


def _paged_batch(attn, block_size: int, seqs: int, new: int, length: int, kv_dtype: str = "float32"):
    """A pass of `seqs` sequences adding `new` tokens each, ending at `length`, and a cache (of `kv_dtype`) holding them."""
    per_seq = -(-length // block_size)
    tables = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(seqs)]
    batch = AttentionBatch.paged([(t, length - new, new) for t in tables], block_size, attn.num_kv_heads,
                                 attn.num_heads // attn.num_kv_heads)
    rows = (1 + seqs * per_seq) * attn.num_kv_heads * block_size
    return batch, tuple(paddle.randn([rows, attn.head_dim]).astype(kv_dtype) for _ in "kv")


def _signature(model, block_size: int, kv_dtype: str) -> str:
    cfg, attn = model.config, model.layers[0].self_attn
    shapes = [tuple(w.shape) for w in (attn.qkv_weight, attn.o_weight, model.layers[0].mlp.gate_up_weight,
                                       model.layers[0].mlp.down_weight)]
    formats = sorted({str(layout) for layout in cfg.weight_layouts.values()})
    return json.dumps([PLAN_VERSION, shapes, str(attn.qkv_weight.dtype), formats, cfg.vocab_size, len(model.layers),
                       attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.q_norm is None, block_size, kv_dtype,
                       cpu_kernels.threads()])


def _other_processes_load() -> Callable[[], float]:
    """Start watching the machine; the call returned gives the share of all CPUs that other
    processes kept busy since (from /proc/stat less this process's CPU time; 0 where there is no
    /proc/stat)."""
    def busy_ticks() -> int | None:
        try:
            with open("/proc/stat", encoding="ascii") as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        return sum(fields[:8]) - fields[3] - fields[4]  # user .. steal, less idle and iowait

    hz, cpus = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    start_busy, start_own, start = busy_ticks(), sum(os.times()[:2]), time.perf_counter()

    def share() -> float:
        end_busy = busy_ticks()
        if start_busy is None or end_busy is None:
            return 0.0
        own = (sum(os.times()[:2]) - start_own) * hz
        return max(0.0, end_busy - start_busy - own) / max(1.0, (time.perf_counter() - start) * hz * cpus)

    return share


def _read(store) -> dict[str, dict[str, bool]]:
    try:
        return json.loads(store.read_text())
    except (OSError, ValueError):
        return {}


def _write(store, plans: dict) -> None:
    """Atomically, so concurrent processes (test workers, tensor-parallel ranks) agree on one file."""
    try:
        with tempfile.NamedTemporaryFile("w", dir=store.parent, delete=False) as f:
            json.dump(plans, f)
        os.replace(f.name, store)
    except OSError as e:
        logger.warning("could not cache the CPU kernel choices in %s: %s", store, e)

