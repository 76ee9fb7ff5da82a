"""Prompt logprobs (`SamplingParams.prompt_logprobs`, vLLM's meaning), computed in the prefill pass.

The logits at prompt position p score prompt token p + 1. A request that asks has the runner return,
beside its sampling rows, the logits of the positions of each prompt chunk it computes whose next
prompt token has no entry yet (`SequenceFeed.prompt_logits`); the logits of the prompt's last
position are its sampling row and score the first output token, not a prompt token. Those extra
rows follow the sampling rows (runner.py), so `take` hands the logits processors and the sampler
exactly the rows they had before, and requests that do not ask cost nothing.

Each request's entries are appended in prompt order to `Request.prompt_logprobs` (None first). A
chunked prompt adds each chunk's entries in the step that computes it. The prefix cache is not used
while a request's entries are incomplete (`needs_prompt_logits`, read by the scheduler at
admission), as in vLLM: a cached block's keys and values are there but its logits were never kept.
A request preempted part-way recomputes its prompt and only adds the entries it lacked.
"""

from __future__ import annotations

import numpy as np
import paddle

from fastdeploy_lp.engine.request import Logprob, Request


def needs_prompt_logits(request: Request) -> bool:
    """The request asks for prompt logprobs and some of its prompt tokens have no entry yet."""
    return request.prompt_logprobs is not None and len(request.prompt_logprobs) < len(request.prompt_ids)


def feed_rows(request: Request, start: int, count: int) -> tuple[int, int]:
    """(first, count) of the `count` tokens fed from position `start` whose logits score a prompt
    token without an entry: positions `len(entries) - 1` .. `len(prompt) - 2`."""
    if not needs_prompt_logits(request):
        return (0, 0)
    lo = max(start, len(request.prompt_logprobs) - 1)
    hi = min(start + count, len(request.prompt_ids) - 1)
    return (lo - start, hi - lo) if hi > lo else (0, 0)


def take(logits: paddle.Tensor, feeds, requests: list[Request]) -> paddle.Tensor:
    """Split the runner's logits: record the prompt logprobs of the rows past the sampling rows
    (feed i belongs to `requests[i]`) and return the sampling rows alone."""
    counts = [f.prompt_logits[1] for f in feeds]
    extra = sum(counts)
    if not extra:
        return logits
    sampling = logits.shape[0] - extra
    owners = [(r, f.start + f.prompt_logits[0], n) for f, r, n in zip(feeds, requests, counts) if n]
    targets = np.concatenate([np.asarray(r.prompt_ids[p + 1:p + 1 + n], dtype=np.int64) for r, p, n in owners])
    k = max(r.params.prompt_logprobs for r, _, _ in owners)
    values, ranks, top_vals, top_ids = score(logits[sampling:], targets, k)
    row = 0
    for r, _, n in owners:
        want = r.params.prompt_logprobs
        for j in range(row, row + n):
            top = {int(t): float(v) for t, v in zip(top_ids[j, :want], top_vals[j, :want])} if want else {}
            r.prompt_logprobs.append(Logprob(int(targets[j]), float(values[j]), top, int(ranks[j])))
        row += n
    return logits[:sampling]


def log_softmax(logits: paddle.Tensor) -> paddle.Tensor:
    """Log-softmax over the last axis, in float32, with the normalizer's sum taken in float64.

    Not F.log_softmax: Paddle's CPU kernel took ~12 s on one 151,936-token row (it grows with the
    square of the row). Nor `paddle.logsumexp` in float32: on CPU it adds a row's terms one after
    the other, so the sum loses bits as it grows and every value comes out too high, by up to 3e-5
    over 3,072 tokens and 2.5e-4 over 49,152 (a 60-token text scored by lm-evaluation-harness was
    off by 2e-4 in total). Summed in float64 the values are within 3e-6 of an exact log-softmax of
    the same logits (the float32 rounding of the values themselves), at the same cost: 45 ms either
    way for 64 rows of 49,152 on one core (bench/lm_eval_check.py, docs/benchmarks.md)."""
    logits = logits.astype("float32")
    top = logits.max(axis=-1, keepdim=True)
    total = paddle.exp(logits - top).astype("float64").sum(axis=-1, keepdim=True)
    return logits - (top.astype("float64") + paddle.log(total)).astype("float32")


def score(logits: paddle.Tensor, targets: np.ndarray, k: int):
    """Per row, on the logits' device (`log_softmax`): the log-softmax value of `targets[row]`, its
    rank (1 + the tokens scored strictly higher) and the `k` best (values, ids), as host arrays."""
    logprobs = log_softmax(logits)
    chosen = paddle.take_along_axis(logprobs, paddle.to_tensor(targets).unsqueeze(1), axis=1)
    ranks = (logprobs > chosen).astype("int64").sum(axis=1) + 1
    if k:
        top_vals, top_ids = paddle.topk(logprobs, k, axis=-1)
        top_vals, top_ids = top_vals.numpy(), top_ids.numpy()
    else:
        top_vals = top_ids = np.zeros((len(targets), 0))
    return chosen.squeeze(1).numpy(), ranks.numpy(), top_vals, top_ids
