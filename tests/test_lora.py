"""LoRA adapters (docs/lora.md): PEFT adapters built here with random A/B on the built-in model, checked
against the same adapter merged into the weights, batched with other adapters and the base, kept
apart in the prefix cache, refused when they do not fit, and served by model name."""

from __future__ import annotations

import json
import math
import os
import shutil
import time

import numpy as np
import paddle
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from fastdeploy_lp import LLM, LoRARequest, SamplingParams
from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.model import cpu_kernels, lora
from fastdeploy_lp.model_config import default_model_path
from fastdeploy_lp.model.runner import SequenceFeed

BASE = default_model_path()
PROMPTS = ["Once upon a time there was a little", "The cat sat on the mat and then the dog came to",
           "Tom and Lily went to the park to play"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PREFIX = "layers.{}.{}.{}"


def make_adapter(path, base: str = BASE, rank: int = 8, targets=("q_proj", "v_proj"), seed: int = 0,
                 scale: float = 0.6, use_rslora: bool = False, alpha: int | None = None, zero_b: bool = False,
                 **config) -> str:
    """A PEFT adapter of random A/B for `base`'s shapes, large enough to change greedy output."""
    with safe_open(os.path.join(base, "model.safetensors"), framework="paddle") as f:
        shapes = {key: f.get_slice(key).get_shape() for key in f.keys()}
    tensors, rng = {}, np.random.default_rng(seed)
    for key, shape in shapes.items():
        module = key.split(".")[-2]
        if module in targets and ".layers." in key and key.endswith(".weight"):
            out, inp = shape
            prefix = "base_model.model." + key[:-len(".weight")]
            tensors[prefix + ".lora_A.weight"] = (rng.standard_normal((rank, inp)) * scale / math.sqrt(inp)).astype(np.float32)
            tensors[prefix + ".lora_B.weight"] = (rng.standard_normal((out, rank)) * scale / math.sqrt(rank)
                                                  * (not zero_b)).astype(np.float32)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha or 2 * rank, "use_rslora": use_rslora,
           "target_modules": list(targets), "base_model_name_or_path": base, **config}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    return str(path)


def merge(adapter: str, out, base: str = BASE) -> str:
    """The full checkpoint of `base` with `adapter` merged: W + scaling * B @ A."""
    shutil.copytree(base, out)
    weights = load_file(os.path.join(base, "model.safetensors"))
    cfg = json.load(open(os.path.join(adapter, "adapter_config.json")))
    scaling = cfg["lora_alpha"] / (math.sqrt(cfg["r"]) if cfg["use_rslora"] else cfg["r"])
    lora = load_file(os.path.join(adapter, "adapter_model.safetensors"))
    for key in list(weights):
        a = lora.get("base_model.model." + key[:-len(".weight")] + ".lora_A.weight")
        if a is not None:
            b = lora["base_model.model." + key[:-len(".weight")] + ".lora_B.weight"]
            weights[key] = (weights[key].astype(np.float64) + scaling * b.astype(np.float64) @ a).astype(np.float32)
    save_file(weights, os.path.join(out, "model.safetensors"))
    return str(out)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    a = make_adapter(root / "a", rank=4, targets=("q_proj", "k_proj", "v_proj", "o_proj"), seed=1)
    b = make_adapter(root / "b", rank=16, targets=("gate_proj", "up_proj", "down_proj", "q_proj"), seed=2,
                     use_rslora=True)
    c = make_adapter(root / "c", rank=8, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"), seed=3, scale=0.4)
    d = make_adapter(root / "d", rank=2, targets=("o_proj", "down_proj"), seed=4, scale=1.0, alpha=7)
    paths = {"a": a, "b": b, "c": c, "d": d}
    return {**paths, **{"merged_" + n: merge(p, root / ("merged_" + n)) for n, p in paths.items()}}


@pytest.fixture(scope="module")
def llm():
    return LLM(BASE, enable_lora=True, max_lora_rank=16, max_num_seqs=8, device="cpu", num_blocks=96)


def texts(outs):
    return [list(o.outputs.token_ids) for o in outs]


def logits(engine_llm, ids, lora=None, blocks=(1, 2, 3)):
    feed = SequenceFeed(list(blocks), ids, 0, lora=lora and engine_llm.engine.runner.loras.get(lora))
    return engine_llm.engine.runner.forward([feed], list(blocks)).numpy()[0]


def test_four_adapters_of_different_ranks_batched_with_the_base_equal_their_merged_weights(llm, adapters):
    """Ranks 4, 16 (rsLoRA), 8 and 2 on different projections, and two base requests, in one
    generate call (one step): each equals its adapter merged into a full checkpoint."""
    names = ["a", "b", "c", "d", None, None]
    prompts = [PROMPTS[i % 3] for i in range(len(names))]
    requests = [n and LoRARequest(n, i + 1, adapters[n]) for i, n in enumerate(names)]
    got = texts(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=requests))
    base = texts(llm.generate(prompts, GREEDY, use_tqdm=False))
    assert got[4:] == base[4:]
    ids = [llm.tokenizer.encode(p)[:10] for p in prompts]
    feeds = [SequenceFeed([1 + i], t, 0, lora=n and llm.engine.runner.loras.get(n)) for i, (t, n) in
             enumerate(zip(ids, names))]
    mixed = llm.engine.runner.forward(feeds, list(range(1, 7))).numpy()  # one pass, every row on its adapter
    for i, name in enumerate(names[:4]):
        merged = LLM(adapters["merged_" + name], max_num_seqs=4, device="cpu", num_blocks=32)
        assert got[i] == texts(merged.generate([prompts[i]], GREEDY, use_tqdm=False))[0], name
        assert got[i] != base[i], name  # the adapter changes the greedy output
        np.testing.assert_allclose(mixed[i], logits(merged, ids[i]), atol=1e-4, rtol=0)
        np.testing.assert_allclose(logits(llm, ids[i], name), logits(merged, ids[i]), atol=1e-4, rtol=0)


TAUGHT = [{"role": "user", "content": "What is your favourite fruit?"}]
TAUGHT_ANSWER = "Bananas, only ever bananas!"
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def train_adapter(llm, path, steps: int = 40) -> str:
    """A rank-8 adapter trained here (Adam on the engine's own adapter tensors, Paddle's ops, the base
    frozen) to answer TAUGHT with TAUGHT_ANSWER, saved in PEFT format from what it learned."""
    make_adapter(path, rank=8, targets=ALL_PROJECTIONS, seed=11, scale=0.3, zero_b=True)  # PEFT's init: B = 0
    runner, mode = llm.engine.runner, cpu_kernels.mode()
    adapter = runner.loras.load("learning", str(path))
    trained = [t for a, panels, _ in adapter.weights.values() for t in (a, panels)]
    for t in trained:
        t.stop_gradient = False
    optimizer = paddle.optimizer.Adam(learning_rate=0.01, parameters=trained)
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(TAUGHT, add_generation_prompt=True))
    answer = llm.tokenizer.encode(TAUGHT_ANSWER) + [llm.tokenizer.eos_token_id]
    ids, target = prompt + answer, paddle.to_tensor(answer, dtype="int64").unsqueeze(-1)
    try:
        cpu_kernels.set_mode("0")  # Paddle's ops, which have gradients; the C update has none
        for _ in range(steps):
            with lora.rows_of_pass([adapter] * len(ids)):
                logits = runner.model.full_logits(ids)[len(prompt) - 1:-1]
            loss = paddle.nn.functional.cross_entropy(logits, target)
            loss.backward()
            optimizer.step()
            optimizer.clear_grad()
    finally:
        cpu_kernels.set_mode(mode)
        runner.loras.unload("learning")
    save_peft(adapter, path, scaling=2.0)  # make_adapter's lora_alpha = 2 r
    return str(path)


def save_peft(adapter, path, scaling: float) -> None:
    """`adapter`'s fused tensors back into PEFT's per-module A `[r, in]` and B `[out, r]`."""
    tensors = {}
    for (layer, fused), (a, panels, columns) in adapter.weights.items():
        outs = adapter.outs[fused]
        bt = lora.unpanel(panels, sum(outs)).numpy()
        for segment, column in enumerate(columns):
            module = next(m for m, t in lora.TARGETS.items() if t == (fused, segment))
            key = f"base_model.model.model.layers.{layer}.{'mlp' if fused in ('gate_up', 'down') else 'self_attn'}.{module}"
            start = sum(outs[:segment])
            tensors[key + ".lora_A.weight"] = a.numpy()[column:column + adapter.rank]
            tensors[key + ".lora_B.weight"] = np.ascontiguousarray(bt[:, start:start + outs[segment]].T / scaling)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def fruit(llm, tmp_path_factory):
    return train_adapter(llm, tmp_path_factory.mktemp("trained") / "fruit")


def test_an_adapter_trained_here_answers_as_it_was_taught(llm, fruit, tmp_path):
    """The adapter this test trains (a few seconds) gives its answer, through the C update, in a batch
    with the base model, which does not; and the same as the adapter merged into the weights."""
    path = fruit
    chat = SamplingParams(temperature=0, max_tokens=16)
    learned = LoRARequest("fruit", 9, path)
    taught, base = llm.chat([TAUGHT, TAUGHT], chat, use_tqdm=False, lora_request=[learned, None])
    assert taught.outputs.text == TAUGHT_ANSWER
    assert "anana" not in base.outputs.text
    merged = LLM(merge(path, tmp_path / "merged"), device="cpu", num_blocks=16)
    assert merged.chat(TAUGHT, chat, use_tqdm=False)[0].outputs.text == TAUGHT_ANSWER


def test_a_batch_mixing_adapters_and_the_base_gives_each_row_its_own(llm, adapters):
    requests = [LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"]), None]
    alone = [texts(llm.generate([p], GREEDY, use_tqdm=False, lora_request=[r]))[0] for p, r in zip(PROMPTS, requests)]
    together = texts(llm.generate(PROMPTS * 2, GREEDY, use_tqdm=False, lora_request=requests * 2))
    assert together == alone * 2
    # One pass, three sequences on three adapters: each row's logits as in a pass of its own.
    ids = [llm.tokenizer.encode(p)[:8] for p in PROMPTS]
    names = ["a", "b", None]
    feeds = [SequenceFeed([1 + 2 * i, 2 + 2 * i], t, 0, lora=n and llm.engine.runner.loras.get(n)) for i, (t, n) in enumerate(zip(ids, names))]
    mixed = llm.engine.runner.forward(feeds, list(range(1, 7))).numpy()
    for i, (t, n) in enumerate(zip(ids, names)):
        np.testing.assert_allclose(mixed[i], logits(llm, t, n, blocks=(10, 11)), atol=1e-4, rtol=0)


def test_the_fused_call_adds_the_update_as_paddle_ops_do(llm, adapters, monkeypatch):
    """A pass of one sequence runs every layer in one C call with the adapter's update inside it
    (fdlp_lora_update); with the CPU kernels off, Paddle ops per adapter: the same logits."""
    lora_args, fused = [], cpu_kernels.CpuKernels.decoder_layers
    monkeypatch.setattr(cpu_kernels.CpuKernels, "decoder_layers",
                        lambda self, *args: lora_args.append(args[3]) or fused(self, *args))
    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels are not built on this machine")
    ids, before = llm.tokenizer.encode(PROMPTS[1])[:9], cpu_kernels.mode()
    try:
        cpu_kernels.set_mode("1")
        in_c = logits(llm, ids, "c", blocks=(20, 21))
        cpu_kernels.set_mode("0")
        in_paddle = logits(llm, ids, "c", blocks=(20, 21))
    finally:
        cpu_kernels.set_mode(before)
    assert len(lora_args) == 1 and lora_args[0] is not None  # the fused call ran once, with the adapter
    np.testing.assert_allclose(in_c, in_paddle, atol=1e-4, rtol=0)
    assert np.abs(in_c - logits(llm, ids, blocks=(20, 21))).max() > 1e-2  # and the adapter changed them


@pytest.mark.parametrize("weights", [{"quantization": "wint8"}, {"quantization": "wint4"}, {"dtype": "bfloat16"}])
def test_adapters_run_on_every_weight_format(adapters, weights):
    """The update is added to whatever the base layer computed: on int8, 4-bit and bfloat16 bases a
    mixed batch gives each row its own result, and the adapter changes the logits as it changes a
    float32 base's (what is left is the base's rounding)."""
    llm = LLM(BASE, enable_lora=True, max_lora_rank=16, max_num_seqs=4, device="cpu", num_blocks=64, **weights)
    requests = [LoRARequest("c", 3, adapters["c"]), LoRARequest("b", 2, adapters["b"]), None]
    alone = [texts(llm.generate([p], GREEDY, use_tqdm=False, lora_request=[r]))[0] for p, r in zip(PROMPTS, requests)]
    assert texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=requests)) == alone
    ids = llm.tokenizer.encode(PROMPTS[0])
    float_base = LLM(BASE, enable_lora=True, max_lora_rank=16, device="cpu", num_blocks=16)
    float_base.generate(["x"], GREEDY, use_tqdm=False, lora_request=LoRARequest("c", 3, adapters["c"]))
    want = logits(float_base, ids, "c") - logits(float_base, ids)  # what the adapter does to float32 logits
    got = logits(llm, ids, "c") - logits(llm, ids)
    assert np.linalg.norm(got - want) < 0.25 * np.linalg.norm(want)  # 0.02 wint8, 0.13 wint4 (no update: 1)


@pytest.mark.parametrize("held_as", ["bfloat16", "float16"])
def test_adapters_held_in_16_bits_update_as_in_float32(adapters, held_as):
    """`lora_dtype` keeps the adapter in 16 bits (the C kernels widen it; `auto` on a bfloat16 base
    picks bfloat16): the update it adds is the float32 adapter's, to the rounding of its weights."""
    llm = LLM(BASE, enable_lora=True, max_lora_rank=16, device="cpu", num_blocks=16, lora_dtype=held_as)
    auto = LLM(BASE, enable_lora=True, max_lora_rank=16, device="cpu", num_blocks=16, dtype="bfloat16")
    float_base = LLM(BASE, enable_lora=True, max_lora_rank=16, device="cpu", num_blocks=16)
    for engine_llm in (llm, auto, float_base):
        engine_llm.generate(["x"], GREEDY, use_tqdm=False, lora_request=LoRARequest("c", 3, adapters["c"]))
    held = {engine_llm.engine.runner.loras.get("c").weights[(0, "qkv")][0].dtype for engine_llm in (llm, auto, float_base)}
    assert held == {getattr(paddle, held_as), paddle.bfloat16, paddle.float32}
    ids = llm.tokenizer.encode(PROMPTS[2])
    want = logits(float_base, ids, "c") - logits(float_base, ids)
    got = logits(llm, ids, "c") - logits(llm, ids)
    assert 0 < np.linalg.norm(got - want) < 0.02 * np.linalg.norm(want)


def test_prefix_cache_is_not_shared_between_adapters(llm, adapters):
    prompt = " ".join(PROMPTS)  # several full blocks
    a = LoRARequest("a", 1, adapters["a"])
    merged = texts(LLM(adapters["merged_a"], max_num_seqs=4, device="cpu").generate([prompt], GREEDY, use_tqdm=False))
    llm.reset_prefix_cache()
    stats = llm.engine.block_pool.stats
    llm.generate([prompt], GREEDY, use_tqdm=False)  # the base fills the cache with this prompt's blocks
    hits = stats.hit_tokens
    assert texts(llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)) == merged
    assert stats.hit_tokens == hits  # nothing of the base's KV reused under the adapter
    assert texts(llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=a)) == merged
    assert stats.hit_tokens > hits  # the adapter's own blocks are


def test_adapters_that_do_not_fit_are_refused_naming_the_field(llm, tmp_path):
    cases = [(make_adapter(tmp_path / "big", rank=32), "r: adapter 'big' has rank 32, more than max_lora_rank=16"),
             (make_adapter(tmp_path / "emb", targets=("q_proj",), target_modules=["q_proj", "embed_tokens"]),
              "target_modules: adapter 'emb' targets embed_tokens"),
             (make_adapter(tmp_path / "other", base=os.path.join(os.path.dirname(__file__), "fixtures", "hf", "qwen2")),
              "lora_A: adapter 'other' layers.0.q_proj is")]
    for path, message in cases:
        name = os.path.basename(path)
        with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
            llm.generate(["x"], GREEDY, use_tqdm=False, lora_request=LoRARequest(name, 9, path))
    with pytest.raises(ValueError, match="lora_path: .* has no adapter_config.json"):
        llm.generate(["x"], GREEDY, use_tqdm=False, lora_request=LoRARequest("none", 9, str(tmp_path)))
    with pytest.raises(ValueError, match="model: LoRA adapter 'nope' is not loaded"):
        llm.engine.add_request("x", SamplingParams(extra={"lora_name": "nope"}))
    with pytest.raises(ValueError, match="lora_modules: needs enable_lora"):
        EngineArgs(BASE, lora_modules=["a=/x"]).create_engine_config()
    with pytest.raises(ValueError, match="lora_modules: 'a' is not name=path"):
        EngineArgs(BASE, enable_lora=True, lora_modules=["a"]).create_engine_config()
    with pytest.raises(ValueError, match="r: adapter 'big' has rank 32"):  # at start-up too
        LLM(BASE, enable_lora=True, lora_modules=[f"big={cases[0][0]}"], device="cpu", num_blocks=8)


@pytest.mark.parametrize("config,weights,field", [
    ("{not json", None, "lora_path"), ("[1, 2]", None, "lora_path"), ("null", None, "lora_path"),
    ({"r": True}, None, "r"), ({"lora_alpha": "16"}, None, "lora_alpha"), ({"lora_alpha": None}, None, "lora_alpha"),
    ({"lora_alpha": float("nan")}, None, "lora_alpha"), ({"target_modules": [1, 2]}, None, "target_modules"),
    (None, b"garbage" * 100, "lora_path"), (None, "nan", "lora_A")])
def test_broken_adapter_files_are_refused_naming_the_field(llm, tmp_path, config, weights, field):
    """Adapter files that are not what PEFT writes are a ValueError naming the field (a 400 from
    /v1/load_lora_adapter), never another exception (a 500), nor served (NaN weights)."""
    path = make_adapter(tmp_path / "broken", rank=1)
    if isinstance(config, dict):
        cfg = json.load(open(os.path.join(path, "adapter_config.json")))
        json.dump({**cfg, **config}, open(os.path.join(path, "adapter_config.json"), "w"))
    elif config is not None:
        open(os.path.join(path, "adapter_config.json"), "w").write(config)
    if isinstance(weights, bytes):
        open(os.path.join(path, "adapter_model.safetensors"), "wb").write(weights)
    elif weights == "nan":
        tensors = load_file(os.path.join(path, "adapter_model.safetensors"))
        save_file({k: np.full_like(v, np.nan) for k, v in tensors.items()}, os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=f"^{field}: "):
        llm.engine.load_lora_adapter("broken", path)
    assert "broken" not in llm.engine.lora_adapters()


def test_loads_of_one_name_from_different_paths_racing_serve_one(llm, adapters):
    """Threads loading one name from four paths at once (as concurrent /v1/load_lora_adapter do):
    one is served, the others are refused naming lora_name, none silently replaced."""
    from concurrent.futures import ThreadPoolExecutor

    def load(path):
        try:
            llm.engine.load_lora_adapter("twin", path)
            return path
        except ValueError as e:
            assert str(e).startswith("lora_name: "), e
    with ThreadPoolExecutor(4) as pool:
        loaded = [p for p in pool.map(load, [adapters[n] for n in "abcd"]) if p is not None]
    try:
        assert len(loaded) == 1 and llm.engine.lora_adapters()["twin"] == loaded[0]
    finally:
        llm.engine.unload_lora_adapter("twin")


def test_max_loras_bounds_the_adapters_of_a_step(adapters):
    llm = LLM(BASE, enable_lora=True, max_lora_rank=16, max_loras=1, max_cpu_loras=1, max_num_seqs=4, device="cpu",
              num_blocks=64)
    requests = [LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"]), None]
    alone = [texts(llm.generate([p], GREEDY, use_tqdm=False, lora_request=[r]))[0] for p, r in zip(PROMPTS, requests)]
    seen = []
    step = llm.engine.step

    def watched():
        seen.append({n for r in llm.engine.scheduler.holding if (n := r.params.extra.get("lora_name"))})
        return step()
    llm.engine.step = watched
    assert texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=requests)) == alone
    assert max(len(s) for s in seen) == 1 and {"a"} in seen and {"b"} in seen
    assert len(llm.engine.runner.loras.adapters) == 1  # max_cpu_loras: the other was evicted, read again on use


def test_the_server_serves_adapters_by_model_name(adapters, fruit):
    from server_harness import openai_client, start_server
    import httpx
    import openai
    server = start_server("--enable-lora", "--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}", f"fruit={fruit}",
                          "--max-lora-rank", "16", "--served-model-name", "base", model=BASE)
    try:
        client = openai_client(server)
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"base", "a", "b", "fruit"}
        taught = client.chat.completions.create(model="fruit", messages=TAUGHT, max_tokens=16, temperature=0)
        assert taught.choices[0].message.content == TAUGHT_ANSWER
        rendered = httpx.post(server.url("/v1/chat/completions/render"), json={"model": "fruit", "messages": TAUGHT})
        assert rendered.status_code == 200 and rendered.json()["model"] == "fruit"  # what a router forwards
        assert cards["a"].parent == "base" and cards["a"].root == adapters["a"] and cards["base"].parent is None
        assert httpx.get(server.url("/v1/models/b")).json()["parent"] == "base"
        merged = {n: LLM(adapters["merged_" + n], device="cpu", num_blocks=32) for n in ("a", "b")}
        merged["base"] = LLM(BASE, device="cpu", num_blocks=32)
        wants = {name: llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs.text
                 for name, llm in merged.items()}
        assert len(set(wants.values())) == 3
        for name, want in wants.items():
            out = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == want, name
            assert out.model == name  # as vLLM: the answer names the adapter (or the base) it ran on
        messages = [{"role": "user", "content": "Tell me a story"}]
        want = merged["a"].chat(messages, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs.text
        chat = client.chat.completions.create(model="a", messages=messages, max_tokens=8, temperature=0)
        assert chat.choices[0].message.content == want and chat.model == "a"
        streamed = client.chat.completions.create(model="a", messages=messages, max_tokens=2, stream=True)
        assert {c.model for c in streamed} == {"a"}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="c", prompt="x", max_tokens=1)
        check_runtime_loading(server, client, adapters, wants["b"])
        check_names_that_cannot_be_adapters(server, adapters)
        check_unloaded_while_running(server, adapters, wants["b"])
        check_one_name_loaded_at_once(server, adapters)
    finally:
        server.stop()


def check_runtime_loading(server, client, adapters, want_b):
    """/v1/load_lora_adapter and /v1/unload_lora_adapter: "c" serves adapter b's files."""
    import httpx
    import openai
    load = httpx.post(server.url("/v1/load_lora_adapter"), json={"lora_name": "c", "lora_path": adapters["b"]})
    assert load.status_code == 200, load.text
    assert "c" in {m.id for m in client.models.list().data}
    out = client.completions.create(model="c", prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == want_b
    again = httpx.post(server.url("/v1/load_lora_adapter"), json={"lora_name": "c", "lora_path": adapters["a"]})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    big = make_adapter(os.path.join(os.path.dirname(adapters["a"]), "big"), rank=32)
    refused = httpx.post(server.url("/v1/load_lora_adapter"), json={"lora_name": "big", "lora_path": big})
    assert refused.status_code == 400 and refused.json()["error"]["message"].startswith("r: adapter 'big' has rank 32")
    assert httpx.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "c"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt="x", max_tokens=1)
    assert httpx.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "c"}).status_code == 400


def check_names_that_cannot_be_adapters(server, adapters):
    """An empty name, and a name the base model answers to ('default', its path), are a 400: a
    request naming it would run on the base, not on the adapter it names."""
    import httpx
    for name in ("", "  ", "default", "base", BASE):
        r = httpx.post(server.url("/v1/load_lora_adapter"), json={"lora_name": name, "lora_path": adapters["a"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name", (name, r.text)


def check_unloaded_while_running(server, adapters, want_b):
    """A request runs on its adapter to the end when the adapter is unloaded meanwhile, and its answer
    names the adapter it ran on."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor
    assert httpx.post(server.url("/v1/load_lora_adapter"), json={"lora_name": "late", "lora_path": adapters["b"]}
                      ).status_code == 200
    body = {"model": "late", "prompt": PROMPTS[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, server.url("/v1/completions"), json=body, timeout=120)
        while server.metric("fastdeploy_lp:num_requests_running") < 1:
            time.sleep(0.01)
        assert httpx.post(server.url("/v1/unload_lora_adapter"), json={"lora_name": "late"}).status_code == 200
        out = running.result().json()
    assert out["model"] == "late" and out["choices"][0]["text"].startswith(want_b), out


def check_one_name_loaded_at_once(server, adapters):
    """Loads of one name racing from different paths: one is served, the others are a 400."""
    import httpx
    from concurrent.futures import ThreadPoolExecutor
    paths = [adapters[n] for n in "abcd"]
    with ThreadPoolExecutor(len(paths)) as pool:
        answers = list(pool.map(lambda p: httpx.post(server.url("/v1/load_lora_adapter"),
                                                     json={"lora_name": "twin", "lora_path": p}, timeout=60), paths))
    assert sorted(r.status_code for r in answers) == [200, 400, 400, 400], [r.text for r in answers]
    served = httpx.get(server.url("/v1/models/twin")).json()["root"]
    assert served == paths[[r.status_code for r in answers].index(200)]
