"""The default model's training script, run for a few steps on a slice of the corpus."""

import json
import os
import subprocess
import sys

import numpy as np
import paddle
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "train")
sys.path.insert(0, TRAIN)

from build_corpus import HELDOUT_COUNTRIES, build_corpus  # noqa: E402
from train_default_model import CausalTrainer, ChatTokenizer  # noqa: E402

from fastdeploy_lp.config import ModelConfig  # noqa: E402
from fastdeploy_lp.model import load_model  # noqa: E402

TINY = ["--steps", "3", "--limit-examples", "200", "--vocab", "600", "--hidden", "64", "--intermediate", "128",
        "--layers", "2", "--heads", "4", "--kv-heads", "2", "--batch-tokens", "1024", "--log-every", "1"]
UTF8_SAMPLES = ["今天天气真好", "鲁迅是谁？", "emoji 😀🚀👍🏽 and ß, naïve, ‰", "  two  spaces\tand a tab\n\nnew lines ",
                "<think>\nhmm\n</think>\n\n<function=get_weather>{\"city\": \"Paris\"}</function>"]


def train_tiny(out_dir, seed=0):
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(TRAIN, "train_default_model.py"), "--out", str(out_dir),
                           "--seed", str(seed)] + TINY, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return out_dir


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("tiny_default_model"))


def test_training_writes_every_file_of_a_model_directory(tiny_model_dir):
    for name in ["config.json", "generation_config.json", "model.safetensors", "tokenizer.model",
                 "tokenizer_config.json", "chat_template.jinja", "training_log.json"]:
        assert os.path.isfile(os.path.join(tiny_model_dir, name)), name
    with open(os.path.join(tiny_model_dir, "training_log.json")) as f:
        assert json.load(f)["steps_done"] == 3


def test_checkpoint_loads_through_the_engine_loader(tiny_model_dir):
    config = ModelConfig.from_pretrained(str(tiny_model_dir))
    assert config.architecture == "LlamaForCausalLM" and config.num_hidden_layers == 2
    model = load_model(config)
    logits = model.full_logits([1, 4, 10, 20])
    assert logits.shape == [4, config.vocab_size]
    assert bool(paddle.isfinite(logits).all())


def test_tokenizer_round_trips_any_utf8(tiny_model_dir):
    tok = ChatTokenizer.from_model_dir(str(tiny_model_dir))
    for text in UTF8_SAMPLES:
        ids = tok.sp.encode(text)
        assert tok.sp.decode(ids) == text


def test_chat_symbols_are_single_ids_and_eos_is_im_end(tiny_model_dir):
    tok = ChatTokenizer.from_model_dir(str(tiny_model_dir))
    for symbol in ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<function=", "</function>"]:
        assert len(tok.encode(symbol)) == 1, symbol
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        config = json.load(f)
    assert config["eos_token_id"] == tok.encode("<|im_end|>")[0]
    prompt = tok.chat_ids([{"role": "user", "content": "hi"}])
    assert tok.decode(prompt) == "user\nhi\nassistant\n<think>\n\n</think>\n\n"  # control symbols skipped


def test_batched_training_forward_matches_the_model_forward(tiny_model_dir):
    model = load_model(ModelConfig.from_pretrained(str(tiny_model_dir)))
    ids = np.random.RandomState(0).randint(4, 300, size=[2, 16])
    ids[1, 11:] = 3  # right padding
    hidden = CausalTrainer(model).hidden(paddle.to_tensor(ids))
    for row, length in [(0, 16), (1, 11)]:
        expected = model.full_logits(ids[row, :length].tolist())
        got = model.logits(hidden[row, :length])
        assert float((expected - got).abs().max()) < 1e-4


def test_same_seed_gives_the_same_weights(tiny_model_dir, tmp_path):
    again = train_tiny(tmp_path / "again")
    with open(os.path.join(tiny_model_dir, "model.safetensors"), "rb") as a, \
            open(os.path.join(again, "model.safetensors"), "rb") as b:
        assert a.read() == b.read()


def test_heldout_countries_never_appear_in_a_conversation():
    corpus = build_corpus(0)
    for ex in corpus["train"]:
        if "messages" not in ex:
            continue
        text = json.dumps(ex["messages"], ensure_ascii=False)
        for country in HELDOUT_COUNTRIES:
            if country in text:  # population questions may name them, never their capital
                assert "capital" not in text.lower(), ex
