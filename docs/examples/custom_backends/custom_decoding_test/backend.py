"""Example custom guided-decoding backend: every answer is "Custom decoding test".

Serve it with:

    python -m fastdeploy_lp.entrypoints.openai.api_server --trust-custom-code \
        --custom-guided-decoding-backends docs/examples/custom_backends \
        --guided-decoding-backend custom_decoding_test

and pick it per request with `{"nvext": {"guided_decoding_backend": "custom_decoding_test"}}`.
"""

import contextvars

ANSWER = "Custom decoding test"

# Set once per request by set_custom_guided_decoding_parameters, read by the processor.
answer_var = contextvars.ContextVar("answer", default=ANSWER)


async def set_custom_guided_decoding_parameters(request):
    """Runs once before generation; a request may ask for a suffix through `nvext.answer_suffix`."""
    nvext = request.get("nvext") or {}
    answer_var.set(ANSWER + nvext.get("answer_suffix", ""))


async def get_custom_guided_decoding_logits_processor(request, tokenizer):
    target = None

    def force_answer(input_ids, scores):
        nonlocal target
        if target is None:
            target = tokenizer.encode(answer_var.get()) + [tokenizer.eos_token_id]
        step = len(input_ids)
        keep = target[min(step, len(target) - 1)]
        kept = scores[keep].clone()
        scores[:] = float("-inf")
        scores[keep] = kept
        return scores

    return force_answer


async def get_guided_decoding_constrained_generator(response, raw_request):
    """Post-processing hook: tag non-streamed answers so a client can tell this backend ran."""
    if isinstance(response, dict):
        response.setdefault("nvext", {})["guided_decoding_backend"] = "custom_decoding_test"
    return response
