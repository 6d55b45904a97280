"""benchmarks/generation_bench.py: the vLLM hook sends ignore_eos, and a run without vLLM still reports
the sampler's figure and says why vLLM was not measured."""

import asyncio
import importlib.util
import json
import os

import httpx
import pytest

from rljax.inference.engine import SamplingParams

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "generation_bench.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("generation_bench_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_vllm_client_of_the_benchmark_ignores_eos(bench):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        n = body["max_tokens"]
        choice = {
            "token_ids": list(range(n)),
            "logprobs": {"token_logprobs": [-0.5] * n, "tokens": [f"token_id:{i}" for i in range(n)]},
            "finish_reason": "length",
        }
        return httpx.Response(200, json={"choices": [choice]})

    async def go():
        async with bench.IgnoreEosClient(["http://vllm.test"], transport=httpx.MockTransport(handler)) as c:
            return await c.generate([5, 6], SamplingParams(max_tokens=3))

    out = asyncio.run(go())
    assert out.ids == (0, 1, 2) and out.logprobs == (-0.5,) * 3
    assert seen[0]["ignore_eos"] is True and seen[0]["prompt"] == [5, 6] and "stop_token_ids" not in seen[0]


def test_without_vllm_the_sampler_figure_is_still_printed(bench, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RLJAX_VLLM_PYTHON", os.fspath(tmp_path / "no-such-python"))
    args = ["--engines", "embedded,vllm", "--num-prompts", "3", "--prompt-len", "5", "--max-tokens", "4"]
    assert bench.main([*args, "--repeats", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "embedded:" in out and "generated tokens/s" in out
    assert "vllm: not measured" in out and "does not exist" in out
    assert "ratio embedded/vLLM: n/a" in out


def test_without_tunix_the_sampler_figure_is_still_printed(bench, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("RLJAX_TUNIX_PYTHON", os.fspath(tmp_path / "no-such-python"))
    args = ["--tunix", "--model", "tiny", "--num-prompts", "3", "--prompt-len", "5", "--max-tokens", "4"]
    assert bench.main([*args, "--repeats", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "tunix: not measured" in out and ".ci/install_tunix.sh" in out
    assert "embedded:" in out and "generated tokens/s" in out


def test_tunix_peer_spec_and_ready_line(bench):
    peer = bench._sibling("tunix_peer")
    spec = peer.model_spec(bench._sibling("train_step_bench").CONFIGS["small"])
    assert spec["hidden_size"] == 512 and spec["num_layers"] == 8 and spec["tie_word_embeddings"]
    ready = {"versions": {"google-tunix": "0.1.7"}, "startup_s": 1.0, "max_abs_logprob_diff": 2e-6}
    assert "WARNING" not in peer.describe_ready(ready)
    assert "WARNING" in peer.describe_ready({**ready, "max_abs_logprob_diff": 0.4})
    assert "best 3, median 2 tokens/s" in peer.summary([1.0, 2.0, 3.0])
