"""A GGUF file's own tokenizer, rebuilt from its metadata as llama.cpp reads it.

* `tokenizer.ggml.model = gpt2`: byte-level BPE (tokens, merges). The pre-tokenizer is the one
  llama.cpp applies for the file's `tokenizer.ggml.pre` (the splitting regexes of the original
  `tokenizer.json`), built as a `tokenizers` pipeline.
* `tokenizer.ggml.model = llama`: SentencePiece (tokens, scores, token types), rebuilt as a
  SentencePiece model (BPE, byte fallback), so encoding is SentencePiece's own.

Control tokens (`<|im_start|>`) and user-defined ones are matched in text as special tokens; the
BOS/EOS ids, whether BOS is prepended and the chat template come from the metadata. A
`--tokenizer DIR` of Hugging Face files replaces all of this.
"""

from __future__ import annotations

from fastdeploy_lp.gguf_file import GGUFError, GGUFModel

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # token types (SentencePiece's)

_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_LLAMA3 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
           r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
_QWEN2 = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
          r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
# `tokenizer.ggml.pre` -> (the regexes llama.cpp splits with, in order; whether a whole word found in
# the vocabulary skips the merges, as Llama 3's tokenizer.json says with `ignore_merges`).
PRE_TOKENIZERS = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe"), ([_LLAMA3], True)),
    **dict.fromkeys(("qwen2", "stablelm2"), ([_QWEN2], False)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
                    ([r"\p{N}", _GPT2], False)),
    **dict.fromkeys(("gpt-2", "gpt2", "mpt", "olmo", "jais"), ([_GPT2], False)),
}


def build(model: GGUFModel):
    """`(tokenizer, config)`: a `tokenizers.Tokenizer` or a `SentencePieceProcessor`, and the
    `tokenizer_config.json`-like entries the engine reads (bos/eos tokens, add_bos_token,
    chat_template)."""
    kind = model.value("tokenizer.ggml.model")
    tokens = model.value("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        raise GGUFError(f"model: {model.path!r} carries no tokenizer; pass --tokenizer with a Hugging Face "
                        f"tokenizer directory")
    types = model.value("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(model, tokens, types)
    elif kind == "llama":
        tokenizer = _sentencepiece(model, tokens, types)
    else:
        raise GGUFError(f"model: GGUF tokenizer model {kind!r} is not supported (gpt2 and llama are); pass "
                        f"--tokenizer with a Hugging Face tokenizer directory")

    def token(key: str) -> str | None:
        i = model.value(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {"bos_token": token("bos"), "eos_token": token("eos"), "unk_token": token("unknown"),
              "pad_token": token("padding"),
              "add_bos_token": bool(model.value("tokenizer.ggml.add_bos_token", kind == "llama")),
              "chat_template": model.value("tokenizer.chat_template")}
    return tokenizer, config


def _byte_level_bpe(model: GGUFModel, tokens: list[str], types: list[int]):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    pre = model.value("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"model: GGUF pre-tokenizer {pre!r} is not supported ({', '.join(sorted(PRE_TOKENIZERS))} "
                        f"are); pass --tokenizer with the model's Hugging Face tokenizer directory")
    patterns, ignore_merges = PRE_TOKENIZERS[pre]
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    merges = [tuple(m.split(" ", 1)) for m in model.value("tokenizer.ggml.merges") or []]
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    bos = model.value("tokenizer.ggml.bos_token_id")
    if model.value("tokenizer.ggml.add_bos_token", False) and bos is not None:  # as llama.cpp: BOS first
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], int(bos))])
    return tokenizer


def _sentencepiece(model: GGUFModel, tokens: list[str], types: list[int]):
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as sp_model

    scores = model.value("tokenizer.ggml.scores") or [0.0] * len(tokens)
    proto = sp_model.ModelProto()
    for piece, score, kind in zip(tokens, scores, types):
        proto.pieces.add(piece=piece, score=float(score), type=kind if NORMAL <= kind <= BYTE else NORMAL)
    spec = proto.trainer_spec
    spec.model_type = sp_model.TrainerSpec.BPE
    spec.byte_fallback = BYTE in types
    for key, field in (("unknown", "unk_id"), ("bos", "bos_id"), ("eos", "eos_id"), ("padding", "pad_id")):
        value = model.value(f"tokenizer.ggml.{key}_token_id")
        setattr(spec, field, -1 if value is None else int(value))
    norm = proto.normalizer_spec
    norm.name, norm.add_dummy_prefix = "identity", bool(model.value("tokenizer.ggml.add_space_prefix", True))
    norm.remove_extra_whitespaces, norm.escape_whitespaces = False, True
    try:
        return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    except RuntimeError as e:
        raise GGUFError(f"model: the GGUF SentencePiece vocabulary does not load ({e}); pass --tokenizer") from e
