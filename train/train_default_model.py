"""Train the default model shipped in `fastdeploy_lp/default_model/`, on CPU, from nothing.

    PYTHONPATH=. python train/train_default_model.py --out /tmp/default_model --seed 0 \
        --steps 2000 --max-minutes 35

1. builds the corpus (`build_corpus.py`) from the data kept in `train/data/`;
2. trains a sentencepiece BPE tokenizer on it (byte fallback, so any UTF-8 text encodes;
   `<|im_start|>`/`<|im_end|>` are control symbols, `<think>`, `</think>`, `<function=`,
   `</function>` and the newline are user-defined symbols, each a single id);
3. trains a small Llama decoder (`DecoderForCausalLM`) with AdamW and a cosine schedule; the loss
   covers the assistant answer of each conversation (prompts rendered by `chat_template.jinja`
   exactly as the engine renders them) and every token of the plain text documents;
4. writes `model.safetensors` (via `save_pretrained`), `config.json`, `generation_config.json`,
   `tokenizer.model`, `tokenizer_config.json` and `chat_template.jinja` into `--out`.

Everything random is seeded from `--seed` (Python, numpy, Paddle). `--steps` fixes the schedule;
`--max-minutes` is a wall-clock budget after which training stops early and saves what it has.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import sys
import time

import numpy as np
import paddle
import paddle.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from build_corpus import build_corpus  # noqa: E402

from fastdeploy_lp.config import ModelConfig  # noqa: E402
from fastdeploy_lp.model import DecoderForCausalLM, save_pretrained  # noqa: E402

logger = logging.getLogger("train_default_model")

TEMPLATE_PATH = os.path.join(HERE, "chat_template.jinja")
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
CONTROL_SYMBOLS = ["<|im_start|>", "<|im_end|>"]
USER_DEFINED_SYMBOLS = ["<think>", "</think>", "<function=", "</function>", "\n"]
IM_END = "<|im_end|>"


# -- tokenizer and chat format --------------------------------------------------------------------

def train_tokenizer(lines: list[str], vocab_size: int, out_path: str) -> None:
    """A sentencepiece BPE model with byte fallback and the chat format's symbols."""
    import sentencepiece as spm

    prefix = out_path[: -len(".model")]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=prefix, model_type="bpe", vocab_size=vocab_size,
        byte_fallback=True, character_coverage=0.9999, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=False, split_digits=True,
        allow_whitespace_only_pieces=True, max_sentence_length=16384,
        control_symbols=CONTROL_SYMBOLS, user_defined_symbols=USER_DEFINED_SYMBOLS,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, unk_piece=UNK, bos_piece=BOS, eos_piece=EOS, pad_piece=PAD,
        num_threads=1, shuffle_input_sentence=False, minloglevel=2)
    os.remove(prefix + ".vocab")


def template_environment():
    """Jinja as `transformers` (and the engine) render chat templates."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    return env


class ChatTokenizer:
    """The sentencepiece model plus the chat template, encoding the way the engine does:
    control-symbol text (`<|im_end|>`) is split out first and mapped to its id."""

    def __init__(self, tokenizer_path: str, template_source: str):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=tokenizer_path)
        self.template = template_environment().from_string(template_source)
        self.controls = sorted((self.sp.id_to_piece(i) for i in range(self.sp.get_piece_size())
                                if self.sp.is_control(i)), key=len, reverse=True)
        self.im_end = self.sp.piece_to_id(IM_END)
        self.eos_ids = [self.im_end, self.sp.eos_id()]

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "ChatTokenizer":
        with open(os.path.join(model_dir, "chat_template.jinja"), encoding="utf-8") as f:
            return cls(os.path.join(model_dir, "tokenizer.model"), f.read())

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = True,
               enable_thinking: bool = False) -> str:
        return self.template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    enable_thinking=enable_thinking)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        while text:
            hits = [(text.find(s), s) for s in self.controls if s in text]
            if not hits:
                ids += self.sp.encode(text)
                break
            at, symbol = min(hits)
            ids += self.sp.encode(text[:at]) if at else []
            ids.append(self.sp.piece_to_id(symbol))
            text = text[at + len(symbol):]
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([i for i in ids if not self.sp.is_control(i)])

    def chat_ids(self, messages: list[dict], tools: list | None = None, enable_thinking: bool = False) -> list[int]:
        return self.encode(self.render(messages, tools, True, enable_thinking))


def tokenizer_lines(examples: list[dict], template_source: str) -> list[str]:
    """The corpus as the tokenizer sees it: rendered conversations and documents, one line each."""
    env = template_environment().from_string(template_source)
    lines = []
    for ex in examples:
        if "text" in ex:
            text = ex["text"]
        else:
            text = env.render(messages=ex["messages"], tools=ex["tools"], add_generation_prompt=False,
                              enable_thinking=ex["enable_thinking"]) + ex["messages"][-1]["content"]
        for symbol in CONTROL_SYMBOLS:
            text = text.replace(symbol, "\n")
        lines += [line for line in text.split("\n") if line]
    return lines


def encode_example(ex: dict, tok: ChatTokenizer) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 loss weight per token (1 where the token is a training target)."""
    if "text" in ex:
        ids = tok.encode(ex["text"]) + [tok.sp.eos_id()]
        return ids, [0] + [1] * (len(ids) - 1)
    prompt = tok.chat_ids(ex["messages"][:-1], ex["tools"], ex["enable_thinking"])
    answer = tok.encode(ex["messages"][-1]["content"]) + [tok.im_end]
    return prompt + answer, [0] * len(prompt) + [1] * len(answer)


# -- model ----------------------------------------------------------------------------------------

def model_config_dict(args, tok: ChatTokenizer) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": tok.sp.get_piece_size(),
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.hidden // args.heads,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "bos_token_id": tok.sp.bos_id(),
        "eos_token_id": tok.im_end,
        "pad_token_id": tok.sp.pad_id(),
        "torch_dtype": "float32",
    }


def initialize(model: DecoderForCausalLM, seed: int) -> None:
    """GPT-2 style init from numpy (so it does not depend on Paddle's generator): N(0, 0.02), the
    residual output projections scaled by 1/sqrt(2 * layers), norms at one."""
    rng = np.random.RandomState(seed)
    depth_scale = 1.0 / math.sqrt(2 * model.config.num_hidden_layers)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("norm.weight"):
            continue
        std = 0.02 * (depth_scale if name.endswith(("o_weight", "down_weight")) else 1.0)
        param.set_value(rng.normal(0.0, std, param.shape).astype("float32"))


class CausalTrainer:
    """A batched causal forward over `[batch, time]` right-padded ids, computing exactly what
    `DecoderForCausalLM.forward` computes for each row (the model's own path runs one sequence
    at a time). It calls the model's parameters directly; padding sits after every real token, so
    the causal mask alone keeps it out of the real positions."""

    def __init__(self, model: DecoderForCausalLM):
        self.model = model
        cfg = model.config
        self.eps = cfg.rms_norm_eps
        d = cfg.head_dim
        # x @ rotate == roll(x, half): the rotary tables' sin carries rotate_half's sign.
        rotate = np.zeros([d, d], "float32")
        for i in range(d // 2):
            rotate[i + d // 2, i] = 1.0
            rotate[i, i + d // 2] = 1.0
        self.rotate = paddle.to_tensor(rotate)
        self._tables: dict[int, tuple] = {}

    def _rms(self, x, weight):
        return weight * (x * paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + self.eps))

    def tables(self, length: int):
        if length not in self._tables:
            m = self.model
            cos, sin = m.rotary.tables(paddle.arange(length, dtype="int64"), "float32")  # [T, 1, D]
            mask = paddle.triu(paddle.full([length, length], float("-inf")), 1)
            self._tables[length] = (cos.transpose([1, 0, 2]).unsqueeze(0), sin.transpose([1, 0, 2]).unsqueeze(0), mask)
        return self._tables[length]

    def hidden(self, ids: paddle.Tensor) -> paddle.Tensor:
        m = self.model
        b, t = ids.shape
        cos, sin, mask = self.tables(t)
        x = m.embed_tokens(ids)
        for layer in m.layers:
            a = layer.self_attn
            kv, group, d = a.num_kv_heads, a.num_heads // a.num_kv_heads, a.head_dim
            h = self._rms(x, layer.input_layernorm.weight)
            q, k, v = paddle.split(paddle.matmul(h, a.qkv_weight, transpose_y=True),  # weights are [out, in]
                                   [a.q_size, a.kv_size, a.kv_size], axis=-1)
            q = q.reshape([b, t, a.num_heads, d]).transpose([0, 2, 1, 3])
            k = k.reshape([b, t, kv, d]).transpose([0, 2, 1, 3])
            v = v.reshape([b, t, kv, d]).transpose([0, 2, 1, 3])
            q = q * cos + paddle.matmul(q, self.rotate) * sin
            k = k * cos + paddle.matmul(k, self.rotate) * sin
            # grouped-query attention without repeating k/v: the query heads of one kv head are
            # stacked along time
            scores = paddle.matmul(q.reshape([b, kv, group * t, d]), k, transpose_y=True) * a.scale
            probs = F.softmax(scores.reshape([b, kv, group, t, t]) + mask, axis=-1)
            out = paddle.matmul(probs.reshape([b, kv, group * t, t]), v)
            out = out.reshape([b, a.num_heads, t, d]).transpose([0, 2, 1, 3]).reshape([b, t, a.q_size])
            x = x + paddle.matmul(out, a.o_weight, transpose_y=True)
            gate, up = paddle.split(paddle.matmul(self._rms(x, layer.post_attention_layernorm.weight),
                                                  layer.mlp.gate_up_weight, transpose_y=True), 2, axis=-1)
            x = x + paddle.matmul(F.swiglu(gate, up), layer.mlp.down_weight, transpose_y=True)
        return self._rms(x, m.norm.weight)

    def loss(self, ids: np.ndarray, weights: np.ndarray) -> paddle.Tensor:
        """Mean next-token cross entropy over the positions whose target has weight 1."""
        b, t = ids.shape
        rows = np.nonzero(weights[:, 1:].reshape(-1))[0]
        positions = (rows // (t - 1)) * t + rows % (t - 1)  # the token before each target
        targets = ids[:, 1:].reshape(-1)[rows]
        hidden = self.hidden(paddle.to_tensor(ids)).reshape([b * t, -1])
        picked = paddle.gather(hidden, paddle.to_tensor(positions.astype("int64")))
        logits = self.model.logits(picked)
        return F.cross_entropy(logits, paddle.to_tensor(targets.astype("int64")).unsqueeze(-1))


def make_batches(lengths: list[int], batch_tokens: int, rng: np.random.RandomState) -> list[np.ndarray]:
    """Groups of example indices of similar length, each under `batch_tokens` padded tokens."""
    order = np.lexsort((rng.random_sample(len(lengths)), np.asarray(lengths)))
    batches, current, longest = [], [], 0
    for i in order:
        padded = _pad_len(max(longest, lengths[i]))
        if current and padded * (len(current) + 1) > batch_tokens:
            batches.append(np.asarray(current))
            current, longest = [], 0
        current.append(i)
        longest = max(longest, lengths[i])
    if current:
        batches.append(np.asarray(current))
    rng.shuffle(batches)
    return batches


def _pad_len(n: int) -> int:
    return (n + 7) // 8 * 8


def collate(encoded: list[tuple[list[int], list[int]]], index: np.ndarray, pad_id: int):
    t = _pad_len(max(len(encoded[i][0]) for i in index))
    ids = np.full([len(index), t], pad_id, dtype="int64")
    weights = np.zeros([len(index), t], dtype="int64")
    for row, i in enumerate(index):
        seq, w = encoded[i]
        ids[row, : len(seq)] = seq
        weights[row, : len(w)] = w
    return ids, weights


def learning_rate(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * progress))


# -- generation (sanity checks, evaluation, tests) ------------------------------------------------

@paddle.no_grad()
def greedy(model: DecoderForCausalLM, prompt_ids: list[int], stop_ids: list[int], max_tokens: int = 64) -> list[int]:
    """Greedy continuation without a cache: simple and exact, fine for short answers."""
    ids, out = list(prompt_ids), []
    for _ in range(max_tokens):
        token = int(paddle.argmax(model.full_logits(ids)[-1]))
        if token in stop_ids:
            break
        out.append(token)
        ids.append(token)
    return out


def answer(model: DecoderForCausalLM, tok: ChatTokenizer, messages: list[dict], *, tools=None,
           enable_thinking: bool = False, max_tokens: int = 64) -> str:
    ids = tok.chat_ids(messages, tools, enable_thinking)
    return tok.decode(greedy(model, ids, tok.eos_ids, max_tokens))


# -- files ----------------------------------------------------------------------------------------

def write_tokenizer_files(out: str, tok: ChatTokenizer, template_source: str) -> None:
    sp = tok.sp
    added = {}
    for i in range(sp.get_piece_size()):
        if sp.is_control(i) or sp.is_unknown(i) or (i < 16 and sp.id_to_piece(i) in USER_DEFINED_SYMBOLS):
            added[str(i)] = {"content": sp.id_to_piece(i), "lstrip": False, "normalized": False,
                             "rstrip": False, "single_word": False,
                             "special": bool(sp.is_control(i) or sp.is_unknown(i))}
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "model_max_length": 2048,
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": UNK,
        "add_bos_token": False,
        "add_eos_token": False,
        "legacy": True,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": added,
        "chat_template": template_source,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
    with open(os.path.join(out, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template_source)


def write_model_files(out: str, config: dict) -> None:
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": [config["eos_token_id"], 2],
                  "pad_token_id": config["pad_token_id"]}
    with open(os.path.join(out, "generation_config.json"), "w", encoding="utf-8") as f:
        json.dump(generation, f, indent=2)
        f.write("\n")


# -- main -----------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Train the fastdeploy_lp default model on CPU.")
    p.add_argument("--out", required=True, help="output model directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps (fixes the LR schedule)")
    p.add_argument("--max-minutes", type=float, default=35.0, help="wall-clock budget; stops early when spent")
    p.add_argument("--batch-tokens", type=int, default=1536, help="padded tokens per batch")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=3072)
    p.add_argument("--bos-rate", type=float, default=0.3,
                   help="share of examples that start with <s>, so the model works whether or not a caller adds it")
    p.add_argument("--limit-examples", type=int, default=0, help="train on the first N shuffled examples (smoke tests)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--checkpoint-minutes", type=float, default=5.0)
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    random.seed(args.seed)
    np.random.seed(args.seed)
    paddle.seed(args.seed)
    paddle.set_device("cpu")
    start = time.time()
    os.makedirs(args.out, exist_ok=True)

    with open(TEMPLATE_PATH, encoding="utf-8") as f:
        template_source = f.read()
    examples = build_corpus(args.seed)["train"]
    random.Random(args.seed).shuffle(examples)
    if args.limit_examples:
        examples = examples[: args.limit_examples]
    logger.info("corpus: %d examples", len(examples))

    tokenizer_path = os.path.join(args.out, "tokenizer.model")
    train_tokenizer(tokenizer_lines(examples, template_source), args.vocab, tokenizer_path)
    tok = ChatTokenizer(tokenizer_path, template_source)
    write_tokenizer_files(args.out, tok, template_source)
    bos_rng = random.Random(args.seed + 1)
    encoded = []
    for ex in examples:
        ids, weights = encode_example(ex, tok)
        if bos_rng.random() < args.bos_rate:
            ids, weights = [tok.sp.bos_id()] + ids, [0] + weights
        encoded.append((ids, weights))
    lengths = [len(ids) for ids, _ in encoded]
    logger.info("tokenizer: %d pieces; corpus %d tokens (%d trained), longest example %d tokens",
                tok.sp.get_piece_size(), sum(lengths), sum(sum(w) for _, w in encoded), max(lengths))

    config = model_config_dict(args, tok)
    write_model_files(args.out, config)
    model = DecoderForCausalLM(ModelConfig.from_dict(config, args.out))
    initialize(model, args.seed)
    n_params = sum(int(np.prod(p.shape)) for p in model.parameters())
    logger.info("model: %d parameters (%.2f M)", n_params, n_params / 1e6)

    no_decay = {p.name for n, p in model.named_parameters() if n.endswith("norm.weight")}
    optimizer = paddle.optimizer.AdamW(
        learning_rate=args.lr, parameters=model.parameters(), beta1=0.9, beta2=0.95,
        weight_decay=args.weight_decay, apply_decay_param_fun=lambda name: name not in no_decay,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    trainer = CausalTrainer(model)
    model.train()

    batch_rng = np.random.RandomState(args.seed)
    batches, epoch = [], 0
    budget = args.max_minutes * 60
    last_checkpoint = time.time()
    window_loss, window_tokens, window_start = 0.0, 0, time.time()
    step = 0
    for step in range(args.steps):
        if not batches:
            batches = make_batches(lengths, args.batch_tokens, batch_rng)
            epoch += 1
        ids, weights = collate(encoded, batches.pop(), tok.sp.pad_id())
        optimizer.set_lr(learning_rate(step, args))
        loss = trainer.loss(ids, weights)
        loss.backward()
        optimizer.step()
        optimizer.clear_grad()
        window_loss += float(loss)
        window_tokens += ids.size
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            elapsed = time.time() - window_start
            n = (step % args.log_every) + 1
            logger.info("step %5d/%d  epoch %d  loss %.4f  lr %.2e  %.0f tok/s  %.1f min", step + 1, args.steps,
                        epoch, window_loss / n, learning_rate(step, args), window_tokens / elapsed,
                        (time.time() - start) / 60)
            window_loss, window_tokens, window_start = 0.0, 0, time.time()
        if time.time() - last_checkpoint > args.checkpoint_minutes * 60:
            save_pretrained(model, args.out)
            last_checkpoint = time.time()
        if time.time() - start > budget:
            logger.warning("time budget of %.1f min spent after %d of %d steps; stopping early",
                           args.max_minutes, step + 1, args.steps)
            break

    model.eval()
    save_pretrained(model, args.out)
    minutes = (time.time() - start) / 60
    logger.info("saved %s after %d steps in %.1f min", args.out, step + 1, minutes)
    with open(os.path.join(args.out, "training_log.json"), "w", encoding="utf-8") as f:
        json.dump({"seed": args.seed, "steps_done": step + 1, "steps": args.steps, "minutes": round(minutes, 1),
                   "parameters": n_params, "examples": len(examples), "epochs": epoch,
                   "command": "train/train_default_model.py " + " ".join(argv if argv is not None else sys.argv[1:])},
                  f, indent=2)
        f.write("\n")
    for question in ["What is the capital of France?", "今天天气真好"]:
        logger.info("sample: %s -> %r", question, answer(model, tok, [{"role": "user", "content": question}]))


if __name__ == "__main__":
    main()
