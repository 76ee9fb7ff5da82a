"""The sampler's stages: penalties, min_tokens, temperature, min_p, top-k/top-p and the draw.

Each is a method over `StepRows` (every row at once, on the logits' device); `engine/stages.py`
says in which order they run, between and after the logits processors. The only host transfer is
the drawn ids (and the logprobs of requests that ask for them). The `Sampler` also keeps the state
the penalties need across steps: each slot's output token counts and prompt membership.

Seeded sampling depends on nothing but the request. The random numbers behind a row's draw are a
function of the request's seed and the position of the token being drawn (`seeded_uniforms`,
SplitMix64), and the draw is a Gumbel-max over the row's own probabilities after the row's own
temperature, min_p, top-k and top-p (`_two_level_gumbel_max`: the noise goes with token ids and
nothing is sorted by probability). So a neighbour's top-k, top-p or min_p cannot shift it
(they change only their own rows), a request preempted and resumed continues the same random
stream (its position is its output length, which it keeps), and forced tokens take positions
without drawing (fast-forward on or off gives the same text). A request without a seed gets a
random one. The numbers (~2 sqrt(vocab) per row) are made for the whole batch in one vectorised
pass on the host, where the seeds and positions are, and uploaded once.

What the sampler cannot promise is bit-identical logits: a row's forward pass can differ by ~1e-5
with the batch around it or after a preemption recomputed its cache. The Gumbel-max turns such a
difference into another token only at a near tie of the two best scores (tests/test_sampler.py:
no changed draw in 16,000 at 1e-5 noise), where an inverse CDF, whose boundaries move with the
rounding of every probability before the drawn token, changed about one draw in a thousand.
"""

from __future__ import annotations

import numpy as np
import paddle
import paddle.nn.functional as F

from fastdeploy_lp.engine.prompt_logprobs import log_softmax
from fastdeploy_lp.engine.request import Logprob, Request
from fastdeploy_lp.engine.step_rows import StepRows
from fastdeploy_lp.model import cpu_kernels
from fastdeploy_lp.processors.tensor_ops import add_at, fill_at


def _unusable_rows(logits: paddle.Tensor, argmax: paddle.Tensor, weights: paddle.Tensor) -> paddle.Tensor:
    """[rows] bool: rows with a NaN or +inf, or with every logit at -inf, in Paddle's ops (where
    the CPU argmax kernel, which checks the same in its read, does not run).

    One product instead of an elementwise check: a row's sum is NaN or +inf when it holds a NaN or
    a +inf (with -inf elsewhere it is NaN or stays -inf); the sum is taken as a GEMV, which uses
    every core (Paddle's CPU `sum` took 10 ms for 32 x 151,936), against `weights` [vocab, 1] all
    0.5 / vocab: half the mean of finite logits never leaves float32's range, where a plain sum of
    huge ones would. The value at the argmax the sampler computes anyway is -inf when every entry is."""
    total = paddle.matmul(logits, weights).squeeze(1)
    top = paddle.take_along_axis(logits, argmax.unsqueeze(1), axis=1).squeeze(1)
    return paddle.logical_or(paddle.logical_or(paddle.isnan(total), total == float("inf")),
                             top == float("-inf"))


UNUSABLE = ("no token can be sampled: every logit is -inf, NaN or +inf after the logits processors and "
            "sampling options (e.g. an output constraint whose only allowed tokens min_tokens, bad_words or "
            "logit_bias removed, allowed tokens all outside the vocabulary, or a processor that wrote NaN)")


_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)
BUCKET = 512  # tokens per bucket of the two-level draw: sqrt-sized, so a row needs ~2 sqrt(vocab) numbers


def _splitmix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def seeded_uniforms(seeds: np.ndarray, positions: np.ndarray, count: int) -> np.ndarray:
    """[rows, count] float32 in (0, 1), a function of each row's (seed, position) alone: the
    row's key is output `position + 1` of SplitMix64 seeded with `seed`, and its numbers are the
    first `count` outputs of SplitMix64 seeded with that key (24 bits each: exact in float32)."""
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps, as SplitMix64 wants
        key = _splitmix(seeds.astype(np.uint64) + (positions.astype(np.uint64) + np.uint64(1)) * _GOLDEN_GAMMA)
        steps = (np.arange(count, dtype=np.uint64) + np.uint64(1)) * _GOLDEN_GAMMA
        x = _splitmix(key[:, None] + steps[None, :])
    # k + 0.5 is not exact in float32 for k >= 2**23: the largest k rounded up to 1.0, whose Gumbel
    # noise is +inf and drew tokens the processors had masked. Capped below 1; no other value changes.
    u = ((x >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)
    return np.minimum(u, np.float32(1.0 - 2.0 ** -24))


def _gumbel(uniforms: paddle.Tensor) -> paddle.Tensor:
    return -paddle.log(-paddle.log(uniforms))


def _noise_count(vocab: int) -> int:
    size = min(BUCKET, vocab)
    return -(-vocab // size) + size


def _uses_penalties(request: Request) -> bool:
    p = request.params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


class Sampler:
    def __init__(self, max_num_seqs: int, vocab_size: int, eos_token_ids: list[int], deterministic: bool):
        # A deterministic engine measures no dispatch plan (its passes run every op on the kernels),
        # so its greedy draw takes the kernels' argmax as is: exact, the first index of the largest, as Paddle's.
        self.deterministic = deterministic
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._counts: paddle.Tensor | None = None       # [slots, vocab] output token counts
        self._in_prompt: paddle.Tensor | None = None    # [slots, vocab] prompt membership
        self._pending_counts: list[tuple[int, int]] = []  # (slot, token) appended since the last flush
        self._sum_weights: paddle.Tensor | None = None  # [vocab, 1], for the row sums of the NaN/+inf check

    def on_admit(self, request: Request) -> None:
        """Set the penalty state of the request's slot from its prompt and output."""
        self.flush_counts()
        if not _uses_penalties(request):
            return
        if self._counts is None:
            self._counts = paddle.zeros([self.max_num_seqs, self.vocab_size], dtype="float32")
            self._in_prompt = paddle.zeros([self.max_num_seqs, self.vocab_size], dtype="bool")
        prompt = np.bincount(np.asarray(request.prompt_ids, dtype=np.int64), minlength=self.vocab_size) > 0
        # A request resuming after preemption joins with its output so far.
        counts = np.bincount(np.asarray(request.output_ids, dtype=np.int64), minlength=self.vocab_size)
        self._counts[request.slot] = paddle.to_tensor(counts[: self.vocab_size].astype(np.float32))
        self._in_prompt[request.slot] = paddle.to_tensor(prompt[: self.vocab_size])

    # -- stages (their order: engine/stages.py) ----------------------------------------------------
    def penalties(self, rows: StepRows) -> None:
        """The repetition, frequency and presence penalties of each row's request (float32 logits);
        a draft position's row counts the drafts before it as output."""
        self.flush_counts()
        logits = rows.logits if rows.logits.dtype == paddle.float32 else rows.logits.astype("float32")
        rows.logits = self._apply_penalties(logits, rows.requests, rows.draft_history())

    def _apply_penalties(self, logits, requests, drafts=(np.zeros(0, np.int64), np.zeros(0, np.int64))):
        rows = [i for i, r in enumerate(requests) if _uses_penalties(r)]
        if not rows:
            return logits
        slots = paddle.to_tensor([requests[i].slot for i in rows], dtype="int64")
        counts = paddle.index_select(self._counts, slots)
        local = np.full(len(requests), -1, dtype=np.int64)
        local[rows] = np.arange(len(rows))
        draft_rows, penalized = local[drafts[0]], local[drafts[0]] >= 0
        if penalized.any():
            counts = add_at(counts, draft_rows[penalized], drafts[1][penalized],
                            np.ones(int(penalized.sum()), dtype=np.float32))
        seen = paddle.logical_or(counts > 0, paddle.index_select(self._in_prompt, slots))
        column = lambda xs: paddle.to_tensor(xs, dtype="float32").unsqueeze(1)  # noqa: E731
        rep = column([requests[i].params.repetition_penalty for i in rows])
        freq = column([requests[i].params.frequency_penalty for i in rows])
        pres = column([requests[i].params.presence_penalty for i in rows])
        row_index = paddle.to_tensor(rows, dtype="int64")
        part = paddle.index_select(logits, row_index)
        part = paddle.where(seen, paddle.where(part > 0, part / rep, part * rep), part)
        part = part - freq * counts - pres * (counts > 0).astype("float32")
        return paddle.scatter(logits, row_index, part, overwrite=True)

    def min_tokens(self, rows: StepRows) -> None:
        """EOS and the stop token ids are banned in a row until its request has `min_tokens` tokens."""
        ban_rows, ban_cols = [], []
        for i, (r, position) in enumerate(zip(rows.requests, rows.positions.tolist())):
            p = r.params
            if position >= p.min_tokens:
                continue
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
            ban_rows += [i] * len(banned)
            ban_cols += sorted(banned)
        if ban_rows:  # on a copy (astype copies): a retry row by row starts again from this stage's input
            rows.logits = fill_at(rows.logits.astype("float32"), ban_rows, ban_cols)

    @staticmethod
    def temperature(rows: StepRows) -> None:
        """The distribution the draw samples from: softmax of the logits over each row's temperature
        (greedy rows take the argmax of the logits instead, so an all-greedy batch needs none)."""
        if rows.all_greedy:
            return
        temps = [1.0 if r.params.greedy else r.params.temperature for r in rows.requests]
        rows.probs = F.softmax(rows.logits / paddle.to_tensor(temps, dtype="float32").unsqueeze(1), axis=-1)

    @staticmethod
    def min_p(rows: StepRows) -> None:
        """Zero each row's probabilities below its `min_p` times its largest one."""
        min_p = [r.params.min_p for r in rows.requests]
        if rows.probs is None or not any(min_p):
            return
        floor = paddle.to_tensor(min_p, dtype="float32").unsqueeze(1) * rows.probs.max(axis=-1, keepdim=True)
        rows.probs = paddle.where(rows.probs < floor, paddle.zeros_like(rows.probs), rows.probs)

    def top_k_top_p(self, rows: StepRows) -> None:
        """Zero what each row's own top-k and top-p leave out. Rows are sorted only to find each
        one's smallest kept probability; the draw itself stays in token-id order, so whether a
        neighbour made the batch sort changes nothing for a row (ties at that probability are kept)."""
        top_k = [r.params.top_k if r.params.top_k > 0 else self.vocab_size for r in rows.requests]
        top_p = [r.params.top_p for r in rows.requests]
        if rows.probs is None or (min(top_k) >= rows.probs.shape[-1] and min(top_p) >= 1.0):
            return
        probs, vocab = rows.probs, rows.probs.shape[-1]
        sorted_probs = paddle.sort(probs, axis=-1, descending=True)
        rank = paddle.arange(vocab, dtype="int64").unsqueeze(0)
        top_p = paddle.to_tensor(top_p, dtype="float32").unsqueeze(1)
        mass_before = paddle.cumsum(sorted_probs, axis=-1) - sorted_probs
        # top_p >= 1 keeps everything even where float sums reach 1 before the last token.
        in_p = paddle.logical_or(paddle.logical_or(mass_before < top_p, top_p >= 1.0), rank == 0)
        keep = paddle.logical_and(rank < paddle.to_tensor(top_k, dtype="int64").unsqueeze(1), in_p)
        kept = keep.astype("int64").sum(axis=-1, keepdim=True)  # keep is a prefix of the sorted row
        threshold = paddle.take_along_axis(sorted_probs, kept - 1, axis=1)
        rows.probs = paddle.where(probs >= threshold, probs, paddle.zeros_like(probs))

    def draw(self, rows: StepRows) -> None:
        """One token per row: the argmax of the logits for greedy rows, a seeded Gumbel-max over
        `probs` for the others; the logprobs of the logits for requests that ask. A row with
        nothing sensible to sample (NaN, +inf, every token at -inf) fails its request."""
        logits = rows.logits
        on_cpu = logits.dtype == paddle.float32 and logits.place.is_cpu_place()  # what the C argmax takes
        if not on_cpu:
            kernels = None
        elif self.deterministic:
            kernels = cpu_kernels.load_if_built()
        else:
            kernels = cpu_kernels.for_op("argmax", logits.shape[0])
        if kernels is not None:
            tokens, unusable = kernels.argmax(logits)
        else:
            argmax = paddle.argmax(logits, axis=-1)
            if self._sum_weights is None or self._sum_weights.shape[0] != logits.shape[-1]:
                self._sum_weights = paddle.full([logits.shape[-1], 1], 0.5 / logits.shape[-1], dtype="float32")
            tokens = argmax.numpy().astype(np.int64)
            unusable = _unusable_rows(logits, argmax, self._sum_weights).numpy()
        logprobs = self._logprobs(logits, rows.requests)
        if rows.probs is not None:
            uniforms = seeded_uniforms(np.array([r.seed for r in rows.requests], dtype=np.uint64),
                                       rows.positions.astype(np.uint64), _noise_count(logits.shape[-1]))
            drawn = self._two_level_gumbel_max(rows.probs, paddle.to_tensor(uniforms)).numpy()
            tokens = np.where(rows.greedy, tokens, drawn).astype(np.int64)
        rows.tokens = tokens
        rows.logprobs = self._pick_logprobs(logprobs, rows.tokens, rows.requests)
        for i in np.flatnonzero(unusable):
            rows.fail(int(i), UNUSABLE)

    @staticmethod
    def _two_level_gumbel_max(probs, uniforms):
        """One token per row with probability `probs` (rows need not sum to 1), by the Gumbel-max
        trick in two levels: pick a bucket of `BUCKET` consecutive ids with the bucket masses, then
        a token inside it. Exact, and unlike an inverse CDF (where rounding anywhere before the drawn
        token moves its boundaries) only a near tie between the two best scores of a level can
        turn a 1e-5 change of the logits into another token. `uniforms` is [rows, buckets + BUCKET]."""
        rows, vocab = probs.shape
        size = min(BUCKET, vocab)
        buckets = -(-vocab // size)
        if buckets * size != vocab:
            probs = paddle.concat([probs, paddle.zeros([rows, buckets * size - vocab], dtype=probs.dtype)], axis=1)
        probs = probs.reshape([rows, buckets, size])
        bucket = paddle.argmax(paddle.log(probs.sum(axis=-1)) + _gumbel(uniforms[:, :buckets]), axis=-1)
        inside = paddle.take_along_axis(probs, bucket.reshape([rows, 1, 1]).expand([rows, 1, size]), axis=1)
        token = paddle.argmax(paddle.log(inside.squeeze(1)) + _gumbel(uniforms[:, buckets:buckets + size]), axis=-1)
        return bucket * size + token

    # -- bookkeeping ------------------------------------------------------------------------------
    def record_token(self, request: Request, token: int) -> None:
        """Count a token the request really appended (sampled or forced) for its penalties."""
        if _uses_penalties(request):
            self._pending_counts.append((request.slot, token))

    def flush_counts(self) -> None:
        """Apply the recorded tokens in one scatter (before sampling, and before a slot is reused)."""
        if self._pending_counts and self._counts is not None:
            slots, tokens = zip(*self._pending_counts)
            self._counts = add_at(self._counts, list(slots), list(tokens), [1.0] * len(slots))
        self._pending_counts = []

    @staticmethod
    def _logprobs(logits, requests):
        if all(r.params.logprobs is None for r in requests):
            return None
        return log_softmax(logits)  # not F.log_softmax nor a float32 logsumexp: see there

    @staticmethod
    def _pick_logprobs(logprobs, tokens, requests) -> list[Logprob | None]:
        if logprobs is None:
            return [None] * len(requests)
        k = max(r.params.logprobs or 0 for r in requests)
        chosen = paddle.take_along_axis(logprobs, paddle.to_tensor(tokens).unsqueeze(1), axis=1).squeeze(1).numpy()
        top_vals, top_ids = (paddle.topk(logprobs, k, axis=-1) if k else (None, None))
        top_vals = top_vals.numpy() if k else None
        top_ids = top_ids.numpy() if k else None
        out = []
        for i, r in enumerate(requests):
            want = r.params.logprobs
            if want is None:
                out.append(None)
                continue
            top = {int(t): float(v) for t, v in zip(top_ids[i, :want], top_vals[i, :want])} if want else {}
            out.append(Logprob(int(tokens[i]), float(chosen[i]), top))
        return out
