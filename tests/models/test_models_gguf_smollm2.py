"""SmolLM2-135M-Instruct, a real model, read from its Q4_1 GGUF file by rljax.

The file is cached by ``.ci/install_smollm2.sh`` (:mod:`rljax.models.gguf_fetch`); without it these
tests skip, saying so, unless ``RLJAX_REQUIRE_SMOLLM2=1``, which makes a missing file a failure.
References: transformers' own GGUF loading of the same file (torch, float32 and float64) and the
file's chat template rendered by ``apply_chat_template``. The base model's arithmetic figures are
measured and reported (``-s`` prints them; they are also recorded as test properties).
"""

from __future__ import annotations

import asyncio
import re
import time

import jax.numpy as jnp
import numpy as np
import pytest
from smollm2 import CONVERSATIONS, require_smollm2

from rljax import models
from rljax.chat import GenericRenderer, make_renderer

pytestmark = pytest.mark.integration

# Measured over the 248 tokens of CONVERSATIONS: rljax float32 vs transformers float32 3.2e-5, vs
# transformers float64 3.5e-5 (transformers float32 vs float64 4.0e-5): 30 layers of float32 rounding.
ATOL = 1e-4


@pytest.fixture(scope="module")
def smollm2_path():
    return require_smollm2()


@pytest.fixture(scope="module")
def loaded(smollm2_path):
    """``(model, tokenizer, renderer, load seconds)`` of rljax."""
    start = time.perf_counter()
    model = models.from_gguf(smollm2_path)
    seconds = time.perf_counter() - start
    tokenizer = models.gguf_tokenizer(smollm2_path)
    return model, tokenizer, make_renderer("smollm2", tokenizer), seconds


def _hf_model(path):
    """transformers' model of the GGUF file, every weight dequantized to a dense float32 tensor.

    transformers dequantizes the blocks to float32 whatever ``dtype`` it is asked for: its float64
    model of the file is this one cast (``.to(torch.float64)``), bit for bit (measured: all 273
    tensors equal), so the file is dequantized once for both references.
    """
    import torch
    from transformers import AutoModelForCausalLM

    try:  # transformers >= 5 can keep GGUF blocks packed; ask for the dense model explicitly
        from transformers import GgufConfig

        kwargs = dict(quantization_config=GgufConfig(dequantize=True))
    except ImportError:  # older releases always dequantize
        kwargs = {}
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager", **kwargs
    ).eval()


def _padded(rows: list[list[int]]) -> np.ndarray:
    """Rows right-padded with id 0 (causal attention: padding after a token cannot change its logprob)."""
    out = np.zeros((len(rows), max(map(len, rows))), np.int64)
    for i, ids in enumerate(rows):
        out[i, : len(ids)] = ids
    return out


def _hf_token_logprobs(hf, rows: list[list[int]]) -> list[np.ndarray]:
    """float64 ``log p(ids[t] | ids[:t])`` for t >= 1 of each row, from the HF model's logits."""
    import torch

    tokens = _padded(rows)
    with torch.no_grad():
        logits = hf(torch.as_tensor(tokens)).logits[:, :-1].double().numpy()
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    return [picked[i, : len(ids) - 1] for i, ids in enumerate(rows)]


def _rljax_token_logprobs(model, rows: list[list[int]]) -> list[np.ndarray]:
    """rljax's float32 logprobs of each row for t >= 1 (one forward of the right-padded batch)."""
    logp = np.asarray(models.sequence_forward(model, jnp.asarray(_padded(rows))).logprobs)
    return [logp[i, 1 : len(ids)] for i, ids in enumerate(rows)]


def test_loaded_architecture(loaded, record_property):
    model, tokenizer, _, seconds = loaded
    cfg = model.config
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (
        "llama",
        30,
        576,
        1536,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (100000.0, 1e-5, True)
    assert models.num_params(model) == 134_515_008 and len(tokenizer) == 49152
    record_property("load_seconds", round(seconds, 2))
    print(f"\nSmolLM2-135M Q4_1 GGUF -> float32 Decoder in {seconds:.1f} s")


def test_renderer_equals_the_chat_template(loaded, smollm2_path):
    from transformers import AutoTokenizer

    _, tokenizer, renderer, _ = loaded
    hf_tokenizer = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    generic = GenericRenderer(tokenizer)
    for messages in CONVERSATIONS:
        for k in range(1, len(messages) + 1):
            for gen in (True, False):
                want = tokenizer.apply_chat_template(
                    messages[:k], add_generation_prompt=gen, tokenize=True, return_dict=False
                )
                got = renderer.render_ids(messages[:k], add_generation_prompt=gen)
                assert got == list(want) == generic.render_ids(messages[:k], add_generation_prompt=gen)
                # transformers' own GGUF tokenizer agrees on these texts (no spaces before digits)
                assert got == list(
                    hf_tokenizer.apply_chat_template(
                        messages[:k], add_generation_prompt=gen, tokenize=True, return_dict=False
                    )
                )
    text = renderer.decode(renderer.render_ids(CONVERSATIONS[0][:1], add_generation_prompt=True))
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    # SmolLM's vocabulary was trained with every digit split off (transformers 5.x's GGUF conversion
    # does not split them, and gives ["x", "Ġ", "Ġ", "1", "2"] here)
    assert tokenizer.tokenize("x  12") == ["x", "ĠĠ", "1", "2"]


def test_logprobs_match_transformers(loaded, smollm2_path, record_property):
    import torch

    model, _, renderer, _ = loaded
    rows = [renderer.render_ids(m, add_generation_prompt=False) for m in CONVERSATIONS]
    ours = _rljax_token_logprobs(model, rows)
    hf = _hf_model(smollm2_path)
    ref32 = _hf_token_logprobs(hf, rows)
    ref64 = _hf_token_logprobs(hf.to(torch.float64), rows)  # the same dequantized weights, in float64
    del hf
    vs32 = max(float(np.abs(a - b).max()) for a, b in zip(ours, ref32, strict=True))
    vs64 = max(float(np.abs(a - b).max()) for a, b in zip(ours, ref64, strict=True))
    hf32_vs64 = max(float(np.abs(a - b).max()) for a, b in zip(ref32, ref64, strict=True))
    record_property("logprob_max_diff_vs_transformers_fp32", vs32)
    record_property("logprob_max_diff_vs_transformers_fp64", vs64)
    print(f"\nmax |logp diff| over {sum(map(len, rows))} tokens: rljax fp32 vs transformers fp32 {vs32:.2e}, "
          f"vs fp64 {vs64:.2e} (transformers fp32 vs fp64 {hf32_vs64:.2e})")  # fmt: skip
    assert vs32 <= ATOL and vs64 <= ATOL
    assert np.mean([np.abs(r).mean() for r in ref64]) > 0.5  # a real model's text, not a degenerate one


def test_base_model_single_digit_additions(loaded, record_property):
    """Greedy answers of the base model to 24 single-digit additions, through the embedded sampler."""
    from rljax.inference.engine import SamplingParams
    from rljax.inference.sampler import EmbeddedSampler

    model, _, renderer, _ = loaded
    pairs = np.random.default_rng(0).integers(0, 10, size=(24, 2)).tolist()
    prompts = [
        renderer.render_ids(
            [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}],
            add_generation_prompt=True,
        )
        for a, b in pairs
    ]
    sampler = EmbeddedSampler(model, max_batch_size=32, max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=48, stop_token_ids=tuple(renderer.stop_token_ids()))

    async def generate_all():
        return await asyncio.gather(*(sampler.generate(p, params) for p in prompts))

    outs = asyncio.run(generate_all())
    exact = last_number = 0
    for (a, b), out in zip(pairs, outs, strict=True):
        text = renderer.parse_response(out.ids).content.strip()
        numbers = re.findall(r"-?\d+", text)
        exact += text == str(a + b)
        last_number += bool(numbers) and numbers[-1] == str(a + b)
    record_property("additions_exact", exact)
    record_property("additions_last_number", last_number)
    print(
        f"\nSmolLM2-135M-Instruct (Q4_1, dequantized), greedy: {exact}/24 exact, "
        f"{last_number}/24 by last number"
    )
    # the sampler's log-probabilities are the model's: a teacher-forced forward gives the same values
    forward = _rljax_token_logprobs(
        model, [list(p) + list(o.ids) for p, o in zip(prompts, outs, strict=True)]
    )
    for prompt, out, logp in zip(prompts, outs, forward, strict=True):
        assert out.finish_reason in ("stop", "length") and len(out.ids) >= 1
        np.testing.assert_allclose(np.array(out.logprobs), logp[len(prompt) - 1 :], atol=ATOL, rtol=0)
