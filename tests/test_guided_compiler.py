"""Constraint compilation and the matchers it yields, without forward passes: request forms, strict
JSON, structural tags (a trigger can only continue as a valid tag), the cache, and sentencepiece."""

from __future__ import annotations

import json
import os
import random
import re

import numpy as np
import pytest
from conftest import fixture_dir
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from fastdeploy_lp import LLM, FDConfig, GuidedDecodingParams, SamplingParams
from fastdeploy_lp.processors import EngineContext
from fastdeploy_lp.processors.guided import GuidedDecodingLogitsProcessor
from fastdeploy_lp.processors.guided.compiler import grammar_source, is_gbnf

TAGS = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": [
    {"begin": "<function=get_weather>", "content": {"type": "json_schema", "json_schema": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
        "additionalProperties": False}}, "end": "</function>"},
    {"begin": "<function=get_date>", "content": {"type": "json_schema", "json_schema": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}, "end": "</function>"}]}}
CALL = re.compile(r"<function=(get_weather|get_date)>(\{.*?\})</function>", re.S)


def _guide(model: str) -> GuidedDecodingLogitsProcessor:
    cfg = FDConfig.create(model, device="cpu")
    return GuidedDecodingLogitsProcessor(cfg, EngineContext.load(cfg))


@pytest.fixture(scope="module")
def guide():
    return _guide(fixture_dir("qwen2"))


def _tok(guide):
    return guide.tokenizer


def _fixture_tokenizer():
    from fastdeploy_lp.tokenizer import Tokenizer

    return Tokenizer(fixture_dir("qwen2"))


def _allowed(matcher, width):
    bits = allocate_token_bitmask(1, width)
    fill_next_token_bitmask(matcher, bits, 0)
    return np.flatnonzero(np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[0, :width])


def _accepts(guide, gd, text, complete=True):
    m = guide.compiler.compile(gd).new_matcher()
    ok = m.consume_tokens(_fixture_tokenizer().encode(text))
    return ok and (m.is_accepting() or not complete)


# -- request forms ------------------------------------------------------------------------------
def test_gbnf_and_lark_are_told_apart():
    assert is_gbnf('root ::= "a"') and is_gbnf('\n  root::= x\nx ::= "b"')
    assert not is_gbnf('start: "a" | "b"') and not is_gbnf('start: A\nA: "::="')


def test_json_text_and_dict_share_one_cache_entry(guide):
    schema = {"type": "object", "properties": {"q": {"type": "boolean"}}}
    misses = guide.compiler.misses
    a = guide.compiler.compile(GuidedDecodingParams(json=schema))
    b = guide.compiler.compile(GuidedDecodingParams(json=json.dumps(schema)))
    assert a is b and guide.compiler.misses == misses + 1


def test_errors_are_cached_too_and_the_cache_is_bounded():
    g = _guide(fixture_dir("qwen2"))
    g.compiler.cache_size = 3
    for _ in range(2):
        with pytest.raises(ValueError, match="^guided_regex"):
            g.compiler.compile(GuidedDecodingParams(regex="(x"))
    assert (g.compiler.misses, g.compiler.hits) == (1, 1)
    for i in range(5):
        g.compiler.compile(GuidedDecodingParams(regex=f"x{i}"))
    assert len(g.compiler._cache) == 3


def test_openai_strict_json_schema_admits_no_extra_keys(guide):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "o": {
        "type": "object", "properties": {"b": {"type": "integer"}}}}, "required": ["a"]}
    loose = GuidedDecodingParams(json=schema)
    strict = GuidedDecodingParams(json={"name": "thing", "schema": schema, "strict": True})
    assert _accepts(guide, loose, '{"a": 1, "z": 2}') and _accepts(guide, loose, '{"a": 1, "o": {"c": 1}}')
    assert not _accepts(guide, strict, '{"a": 1, "z": 2}', complete=False)
    assert not _accepts(guide, strict, '{"a": 1, "o": {"c": 1}}', complete=False)
    assert _accepts(guide, strict, '{"a": 1, "o": {"b": 2}}')
    assert _accepts(guide, GuidedDecodingParams(json={"name": "x", "schema": schema}), '{"a": 1, "z": 2}')


def test_each_form_accepts_its_language(guide):
    cases = [
        (GuidedDecodingParams(json_object=True), '{"any": [1, 2]}', "[1]"),
        (GuidedDecodingParams(json="true"), "[1, null]", "nul"),
        (GuidedDecodingParams(regex=r"\d{3}-\d{4}"), "555-1234", "555-12345"),
        (GuidedDecodingParams(choice=["yes", "no"]), "no", "maybe"),
        (GuidedDecodingParams(grammar='root ::= "a" [0-9]+'), "a42", "b42"),
        (GuidedDecodingParams(grammar='start: "a" NUM\nNUM: /[0-9]+/'), "a42", "a"),
        (GuidedDecodingParams(json={"type": "object", "properties": {"x": {"type": "integer"}}},
                              whitespace_pattern=" ?"), '{"x": 1}', '{"x":\n1}'),
        (GuidedDecodingParams(structural_tag={"type": "structural_tag", "format": {
            "type": "sequence", "elements": [{"type": "const_string", "value": "A:"},
                                             {"type": "regex", "pattern": "[0-9]+"},
                                             {"type": "or", "elements": [{"type": "const_string", "value": "!"},
                                                                         {"type": "grammar", "grammar": 'root ::= "?"'}]}]}}),
         "A:12?", "A:x"),
        (GuidedDecodingParams(structural_tag={"type": "structural_tag", "format": {
            "type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"}}),
         "<think>a < b</think>", "<think>a</think>b"),
        (GuidedDecodingParams(structural_tag={"type": "structural_tag", "format": {
            "type": "tags_with_separator", "separator": ",", "at_least_one": True,
            "tags": [{"begin": "(", "content": {"type": "json_schema", "json_schema": {"type": "integer"}},
                      "end": ")"}]}}), "(1),(22)", ""),
    ]
    for gd, good, bad in cases:
        assert _accepts(guide, gd, good), (gd, good)
        assert not _accepts(guide, gd, bad), (gd, bad)


def test_choice_is_one_lexeme_with_prefixes_quotes_and_the_empty_string(guide):
    gd = GuidedDecodingParams(choice=["a", "ab", "", 'q"\\\n', "a"])
    for text in ["a", "ab", 'q"\\\n']:
        assert _accepts(guide, gd, text), text
    for text in ["b", "abc", "aa", "q"]:
        assert not _accepts(guide, gd, text), text
    assert guide.compiler.compile(gd).new_matcher().is_accepting()  # "" is one of the options
    assert not guide.compiler.compile(GuidedDecodingParams(choice=["x"])).new_matcher().is_accepting()


def test_field_names_in_messages():
    bad = [(GuidedDecodingParams(json=[1]), "guided_json: must be a JSON schema object"),
           (GuidedDecodingParams(json="false"), "guided_json: must be a JSON schema object (or true), got false"),
           (GuidedDecodingParams(json={"name": "n", "schema": 3}), "guided_json: 'schema' must be"),
           (GuidedDecodingParams(structural_tag={"type": "structural_tag"}), "structural_tag: needs 'format'"),
           (GuidedDecodingParams(structural_tag="{oops"), "structural_tag: invalid JSON"),
           (GuidedDecodingParams(structural_tag={"type": "structural_tag", "format": {"type": "tag", "begin": "<a>",
                                 "content": {"type": "regex"}, "end": "</a>"}}),
            "structural_tag.format.content.pattern: must be a non-empty string"),
           (GuidedDecodingParams(structural_tag={"type": "structural_tag", "structures": [{"begin": "<a>"}],
                                                 "triggers": ["<a"]}), "structural_tag.structures[0]")]
    for gd, message in bad:
        with pytest.raises(ValueError) as info:
            grammar_source(gd)
        assert str(info.value).startswith(message), str(info.value)


# -- triggered tags -----------------------------------------------------------------------------
def test_after_a_trigger_only_tag_continuations_are_allowed(guide):
    tok = _fixture_tokenizer()
    m = guide.compiler.compile(GuidedDecodingParams(structural_tag=TAGS)).new_matcher()
    assert m.consume_tokens(tok.encode("Sure. <function="))
    assert not m.is_accepting()
    nexts = {tok.token_bytes[i] for i in _allowed(m, guide.vocab_size)}
    assert nexts and all(b"get_weather>".startswith(b) or b"get_date>".startswith(b) for b in nexts), nexts
    assert m.consume_tokens(tok.encode('get_date>{"tz": "CET"}</function> done'))
    assert m.is_accepting()


def test_adversarial_walks_never_leave_a_trigger_unfinished_or_invalid(guide):
    """Walk the mask preferring tokens that build the trigger (including tokens that complete it
    and run on) and then tokens of a plausible call; every trigger must start a valid tag."""
    tok = _fixture_tokenizer()
    compiled = guide.compiler.compile(GuidedDecodingParams(structural_tag=TAGS))
    trigger, call_text = b"<function=", b'get_weather>{"city": "Paris"}</function>get_date>{"tz": "UTC"}</function>'
    eos = set(guide.fd_config.model_config.eos_token_ids)
    rng = random.Random(0)
    finished = calls = 0
    for _ in range(120):
        m = compiled.new_matcher()
        text = b""
        for _ in range(60):
            allowed = [t for t in _allowed(m, guide.vocab_size).tolist()]
            inside = text.rfind(trigger) > text.rfind(b"</function>")
            if inside:
                tempting = [t for t in allowed if tok.token_bytes[t] and tok.token_bytes[t] in call_text]
            else:
                k = max(k for k in range(len(trigger)) if text.endswith(trigger[:k]))
                want = trigger[k:]
                tempting = [t for t in allowed if tok.token_bytes[t] and (
                    want.startswith(tok.token_bytes[t]) or tok.token_bytes[t].startswith(want))]
            t = rng.choice(tempting) if tempting and rng.random() < 0.7 else rng.choice(allowed)
            if eos & set(allowed) and rng.random() < 0.05:
                t = min(eos & set(allowed))
            if t in eos:
                assert m.is_accepting()
                finished += 1
                break
            assert m.consume_token(t), m.get_error()
            text += tok.token_bytes[t]
        s = text.decode("utf-8", errors="replace")
        at = 0
        while (p := s.find("<function=", at)) >= 0:
            call = CALL.match(s, p)
            if call is None:  # only an unfinished walk may stop inside a tag, on a valid prefix
                rest = s[p:]
                assert any(rest.startswith(b) or b.startswith(rest) for b in ("<function=get_weather>",
                                                                              "<function=get_date>")), rest
                assert not m.is_accepting()
                break
            json.loads(call.group(2))
            calls, at = calls + 1, call.end()
    assert finished > 5 and calls > 30


def test_required_tool_form_rejects_plain_text_and_stop_after_first_ends_the_output(guide):
    required = GuidedDecodingParams(structural_tag={"type": "structural_tag", "format": {
        **TAGS["format"], "at_least_one": True, "stop_after_first": True}})
    assert not _accepts(guide, required, "just text")
    # xgrammar's at_least_one: the output starts with a tag, no free text before it
    assert not _accepts(guide, required, 'hi <function=get_date>{"tz": "UTC"}</function>', complete=False)
    m = guide.compiler.compile(required).new_matcher()
    assert m.consume_tokens(_fixture_tokenizer().encode('<function=get_date>{"tz": "UTC"}</function>'))
    assert m.is_stopped()  # nothing may follow: only EOS is left
    assert _allowed(m, guide.vocab_size).tolist() == guide.fd_config.model_config.eos_token_ids


def test_legacy_structures_form_equals_triggered_tags(guide):
    legacy = {"type": "structural_tag", "triggers": ["<function="], "structures": [
        {"begin": t["begin"], "schema": t["content"]["json_schema"], "end": t["end"]} for t in TAGS["format"]["tags"]]}
    assert grammar_source(GuidedDecodingParams(structural_tag=legacy)) == \
        grammar_source(GuidedDecodingParams(structural_tag=TAGS))


# -- sentencepiece --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory):
    """A tiny sentencepiece (byte fallback) tokenizer and a random Llama checkpoint over it, with a
    logits width padded past the vocabulary."""
    import sentencepiece as spm
    from safetensors.numpy import save_file

    d = tmp_path_factory.mktemp("sp_model")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(['The capital of France is Paris.', 'London is the capital of England.',
                                 '{"name": "Paris", "population": 2148000}', 'Berlin, Rome and Madrid.'] * 40))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(d / "tokenizer"), vocab_size=300,
                                   byte_fallback=True, model_type="bpe", character_coverage=1.0,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    vocab, hidden, inter = 320, 32, 64
    rng = np.random.default_rng(0)
    w = lambda *s: (rng.standard_normal(s) * 0.5).astype(np.float32)  # noqa: E731
    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float32)}
    p = "model.layers.0."
    tensors.update({p + "self_attn.q_proj.weight": w(hidden, hidden), p + "self_attn.k_proj.weight": w(16, hidden),
                    p + "self_attn.v_proj.weight": w(16, hidden), p + "self_attn.o_proj.weight": w(hidden, hidden),
                    p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                    p + "mlp.down_proj.weight": w(hidden, inter),
                    p + "input_layernorm.weight": np.ones(hidden, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(hidden, np.float32)})
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 256, "tie_word_embeddings": True, "eos_token_id": 2, "bos_token_id": 1,
        "torch_dtype": "float32"}))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>"}))
    return str(d)


def test_sentencepiece_model_generates_valid_constrained_output(sentencepiece_model):
    import jsonschema

    assert os.path.isfile(os.path.join(sentencepiece_model, "tokenizer.model"))
    llm = LLM(sentencepiece_model, max_num_seqs=4, device="cpu")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["name", "population"], "additionalProperties": False}
    kinds = [GuidedDecodingParams(regex="(Paris|London) is the capital"), GuidedDecodingParams(json=schema),
             GuidedDecodingParams(choice=["über", "Ünïcödé"]), GuidedDecodingParams(json_object=True)]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=60, guided_decoding=kinds[s % 4]) for s in range(8)]
    outs = llm.generate(["The capital of France"] * 8, params, use_tqdm=False)
    padded = set(range(300, 320))
    for s, out in enumerate(outs):
        gd, text = kinds[s % 4], out.outputs.text
        if gd is None:
            continue
        assert not padded & set(out.outputs.token_ids)
        if gd.regex:
            assert out.outputs.finish_reason == "stop" and re.fullmatch("(Paris|London) is the capital", text), text
        elif gd.choice:
            assert out.outputs.finish_reason == "stop" and text in gd.choice, text
        elif gd.json is not None and out.outputs.finish_reason == "stop":
            jsonschema.validate(json.loads(text), schema)
        elif out.outputs.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_sentencepiece_fast_forward_tokens_spell_the_forced_text(sentencepiece_model):
    """The forced text at the start has no dummy-prefix space, so neither may its tokens."""
    from fastdeploy_lp.tokenizer import Tokenizer

    guide = _guide(sentencepiece_model)
    tok = Tokenizer(sentencepiece_model)
    m = guide.compiler.compile(GuidedDecodingParams(regex="The capital is (Paris|Rome)")).new_matcher()
    forced = m.compute_ff_tokens()
    spelled = b"".join(tok.token_bytes[t] for t in forced)
    assert spelled and m.compute_ff_bytes().startswith(spelled) and spelled.startswith(b"The")
    assert m.consume_tokens(forced)


def test_custom_formats_are_dropped_and_unimplemented_standard_ones_refused(guide):
    custom = GuidedDecodingParams(json={"type": "object", "properties": {
        "format": {"type": "string", "format": "topic"}, "b": {"type": "string", "format": "byte"}},
        "required": ["format"]})
    assert _accepts(guide, custom, '{"format": "anything"}')
    with pytest.raises(ValueError, match="^guided_json: .*uri-reference"):
        guide.compiler.compile(GuidedDecodingParams(json={"type": "string", "format": "uri-reference"}))
    dated = GuidedDecodingParams(json={"type": "string", "format": "date"})
    assert _accepts(guide, dated, '"2024-02-29"') and not _accepts(guide, dated, '"yesterday"')
