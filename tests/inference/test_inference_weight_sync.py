"""Weight sync against fake servers: checkpoint files, the admin call sequence, verification, versions.

(The real-server behaviour, including the tied-embedding trap, is in test_inference_vllm_server.py.)
"""

import asyncio
import gc
import os

import httpx
import inference_fakes as fk
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

from rljax import models
from rljax.inference.engine import SamplingParams
from rljax.inference.vllm import (
    SYNC_ATOL,
    SyncConfig,
    VLLMClient,
    WeightSyncError,
    WrittenWeights,
    probe_sequence,
    write_checkpoint,
)
from rljax.inference.vllm.weight_sync import LM_HEAD_FILE

SYNC_PATHS = ["/pause?mode=wait", "/collective_rpc", "/reset_prefix_cache", "/resume"]


def small_model(*, tied: bool = True, seed: int = 0) -> models.Decoder:
    return models.tiny_model(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             tie_word_embeddings=tied, seed=seed)  # fmt: skip


def fake_reference(ids: np.ndarray) -> np.ndarray:
    """The trainer logprobs that make the fake server's scores an exact match."""
    return np.asarray(fk.expected_scores(list(ids)))


def run(coro):
    return asyncio.run(coro)


@pytest.fixture
def two_fakes():
    with fk.FakeVLLM() as a, fk.FakeVLLM() as b:
        yield a, b


def test_probe_sequence_is_deterministic_and_in_range():
    p = probe_sequence(vocab_size=7, length=50, seed=3)
    assert p.shape == (50,) and p.min() >= 0 and p.max() < 7
    np.testing.assert_array_equal(p, probe_sequence(vocab_size=7, length=50, seed=3))
    assert not np.array_equal(p, probe_sequence(vocab_size=7, length=50, seed=4))


@pytest.mark.parametrize("tied, explicit, has_head", [(True, True, True), (True, False, False),
                                                      (False, True, False)])  # fmt: skip
def test_write_checkpoint(tmp_path, tied, explicit, has_head):
    model = small_model(tied=tied)
    write_checkpoint(model, tmp_path, explicit_lm_head=explicit)
    files = sorted(os.listdir(tmp_path))
    assert ("model-lm_head.safetensors" in files) == has_head
    main = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    if has_head:
        head = safetensors.numpy.load_file(tmp_path / LM_HEAD_FILE)
        assert list(head) == ["lm_head.weight"]
        np.testing.assert_array_equal(head["lm_head.weight"], main["model.embed_tokens.weight"])
        np.testing.assert_array_equal(head["lm_head.weight"], np.asarray(model.embed_tokens.get_value()))
    # Still a valid checkpoint for rljax: same logprobs after loading it back.
    back = models.from_pretrained(tmp_path)
    tokens = jnp.array([[1, 5, 9, 2, 33]])
    np.testing.assert_array_equal(
        models.sequence_logprobs(back, tokens), models.sequence_logprobs(model, tokens)
    )
    # A later untied/naive write removes the stale head file (save_pretrained clears model*.safetensors).
    write_checkpoint(model, tmp_path, explicit_lm_head=False)
    assert LM_HEAD_FILE not in os.listdir(tmp_path)


def test_sync_sequence_verification_and_version(two_fakes, tmp_path):
    a, b = two_fakes

    async def main():
        cfg = SyncConfig(directory=str(tmp_path / "w"), probe_length=12)
        async with VLLMClient([a.url, b.url], sync=cfg) as client:
            v = await client.update_weights(small_model(), reference_logprobs=fake_reference)
            c = await client.generate([1, 2], SamplingParams(max_tokens=2))
            v2 = await client.update_weights(
                small_model(seed=1), version=10, reference_logprobs=fake_reference
            )
            c2 = await client.generate([1, 2], SamplingParams(max_tokens=2))
            return v, c, v2, c2, client.last_sync

    v, c, v2, c2, report = run(main())
    assert (v, c.weight_version, v2, c2.weight_version) == (1, 1, 10, 10)
    for fake in (a, b):
        admin = [(p, body) for _, p, body in fake.calls if p != "/v1/completions" and p != "/health"]
        assert [p for p, _ in admin] == SYNC_PATHS * 2
        rpc = admin[1][1]
        assert rpc == {"method": "rljax_reload_weights", "kwargs": {"weights_path": str(tmp_path / "w")}}
        # Verification scored the probe on EVERY server, after the resume.
        scores = [body for _, p, body in fake.calls if p == "/v1/completions" and "prompt_logprobs" in body]
        assert (
            len(scores) == 2
            and scores[0]["prompt"] == probe_sequence(vocab_size=64, length=12, seed=0).tolist()
        )
    assert report.max_abs_diff == (0.0, 0.0) and report.directory == str(tmp_path / "w")
    assert os.path.exists(tmp_path / "w" / LM_HEAD_FILE)


def test_the_clients_own_sync_directory_is_reused_and_removed_with_the_client(two_fakes):
    a, _ = two_fakes

    async def two_syncs(client):
        async with client:
            for seed in (0, 1):
                await client.update_weights(small_model(seed=seed), reference_logprobs=fake_reference)
        return [body["kwargs"]["weights_path"] for _, p, body in a.calls if p == "/collective_rpc"]

    clients = [VLLMClient([a.url], sync=SyncConfig(probe_length=8))]
    paths = run(two_syncs(clients[0]))
    assert len(paths) == 2 and paths[0] == paths[1]
    assert os.path.isfile(os.path.join(paths[0], "model.safetensors"))
    clients.clear()
    gc.collect()
    assert not os.path.exists(paths[0])  # not left in the temporary folder once the client is gone


def test_mismatch_raises_and_blocks_sampling_until_a_good_sync(two_fakes):
    a, b = two_fakes

    async def main():
        async with VLLMClient([a.url, b.url], sync=SyncConfig(probe_length=8)) as client:
            # Default reference = rljax logprobs of the model; the fake serves something else.
            with pytest.raises(
                WeightSyncError, match=r"differ from the trainer's by more than 0.0001"
            ) as info:
                await client.update_weights(small_model())
            assert a.url in str(info.value) and b.url in str(info.value)
            assert client.weight_version == 0  # not bumped
            with pytest.raises(WeightSyncError, match="last weight sync failed"):
                await client.generate([1], SamplingParams(max_tokens=1))
            assert await client.update_weights(small_model(), reference_logprobs=fake_reference) == 1
            return await client.generate([1], SamplingParams(max_tokens=1))

    assert run(main()).weight_version == 1
    assert a.paths().count("/resume") == 2  # resumed after the failed verification too


@pytest.mark.parametrize("mode, match", [("offset_scores", "by more than 0.0001"),
                                         ("missing_prompt_token", "no finite logprob")])  # fmt: skip
def test_one_bad_server_is_caught(two_fakes, mode, match):
    a, b = two_fakes
    b.mode = mode

    async def main():
        async with VLLMClient([a.url, b.url], sync=SyncConfig(probe_length=8)) as client:
            with pytest.raises(WeightSyncError, match=match) as info:
                await client.update_weights(small_model(), reference_logprobs=fake_reference)
            return str(info.value)

    msg = run(main())
    assert b.url in msg and (a.url not in msg or mode != "offset_scores")
    if mode == "offset_scores":
        assert "0.001" in msg  # the measured difference is reported


def test_failed_reload_resumes_and_raises(two_fakes):
    a, b = two_fakes
    b.fail_paths = {"/collective_rpc"}

    async def main():
        async with VLLMClient([a.url, b.url]) as client:
            with pytest.raises(WeightSyncError, match="reloading weights .* failed: .*500"):
                await client.update_weights(small_model(), reference_logprobs=fake_reference)

    run(main())
    for fake in (a, b):
        assert fake.paths()[-1] == "/resume"


@pytest.mark.parametrize("reload_rpc", ["auto", "rljax_reload_weights", "reload_weights"])
def test_reload_rpc_and_fallback_for_servers_without_the_worker_extension(two_fakes, tmp_path, reload_rpc):
    """Server a has rljax's worker extension, b is a plain vLLM (no ``rljax_reload_weights``)."""
    a, b = two_fakes
    b.rpc_methods = {"reload_weights"}

    def rpcs(fake):
        return [body["method"] for _, p, body in fake.calls if p == "/collective_rpc"]

    async def main():
        cfg = SyncConfig(directory=str(tmp_path / "w"), probe_length=8, reload_rpc=reload_rpc)
        async with VLLMClient([a.url, b.url], sync=cfg) as client:
            return await client.update_weights(small_model(), reference_logprobs=fake_reference)

    if reload_rpc == "rljax_reload_weights":  # demanded: b's answer fails the sync (and b is resumed)
        with pytest.raises(WeightSyncError, match="no attribute 'rljax_reload_weights'") as info:
            run(main())
        assert b.url in str(info.value) and b.paths()[-1] == "/resume"
        return
    assert run(main()) == 1
    if reload_rpc == "auto":  # the extension where there is one, vLLM's reload_weights on b only
        assert rpcs(a) == ["rljax_reload_weights"] and rpcs(b) == ["rljax_reload_weights", "reload_weights"]
    else:
        assert rpcs(a) == rpcs(b) == ["reload_weights"]


def test_requests_wait_during_a_sync_and_in_flight_ones_keep_the_old_version(two_fakes):
    a, b = two_fakes
    a.admin_delay_s = b.admin_delay_s = 0.2  # each admin call takes 0.2 s: the sync takes ~0.8 s

    async def main():
        async with VLLMClient([a.url, b.url]) as client:
            a.delay_s = b.delay_s = 0.4
            in_flight = asyncio.create_task(client.generate([1], SamplingParams(max_tokens=1)))
            await asyncio.sleep(0.05)
            a.delay_s = b.delay_s = 0.0
            sync = asyncio.create_task(
                client.update_weights(small_model(), reference_logprobs=fake_reference)
            )
            await asyncio.sleep(0.05)
            later = await client.generate([2], SamplingParams(max_tokens=1))
            await sync
            return await in_flight, later

    old, new = run(main())
    assert old.weight_version == 0 and new.weight_version == 1
    # The later request reached a server only after that server had resumed.
    for fake in (a, b):
        resumed = max(t for t, p, _ in fake.calls if p == "/resume")
        gens = [t for t, p, body in fake.calls if p == "/v1/completions" and body["prompt"] == [2]]
        assert all(t > resumed for t in gens)


def test_tolerance_follows_the_served_dtype(two_fakes):
    """A server 1e-3 off: a float32 sync fails (limit 1e-4), a bfloat16 sync passes (limit 1.0),
    and an explicit atol overrides both."""
    a, b = two_fakes
    a.mode = b.mode = "offset_scores"

    async def main(model, config):
        async with VLLMClient([a.url, b.url], sync=config) as client:
            await client.update_weights(model, reference_logprobs=fake_reference)
            return client.last_sync.max_abs_diff

    f32, bf16 = small_model(), models.cast_model(small_model(), jnp.bfloat16)
    with pytest.raises(WeightSyncError, match="by more than 0.0001"):
        run(main(f32, SyncConfig(probe_length=8)))
    np.testing.assert_allclose(run(main(bf16, SyncConfig(probe_length=8))), [1e-3, 1e-3], rtol=1e-3)
    with pytest.raises(WeightSyncError, match="by more than 1e-05"):
        run(main(bf16, SyncConfig(probe_length=8, atol=1e-5)))
    assert SyncConfig().tolerance(jnp.bfloat16) == SYNC_ATOL["bfloat16"] == 1.0
    assert SyncConfig().tolerance(np.float32) == 1e-4 and SyncConfig(atol=0.5).tolerance(np.float32) == 0.5


@pytest.mark.parametrize("policy", ["retry", "warn"])
def test_on_mismatch_policies(two_fakes, policy):
    a, b = two_fakes
    b.mode = "offset_scores"

    async def main():
        async with VLLMClient([a.url, b.url], sync=SyncConfig(probe_length=8, on_mismatch=policy)) as c:
            if policy == "retry":  # reloads once more, verifies again, still off: raises
                with pytest.raises(WeightSyncError, match="by more than"):
                    await c.update_weights(small_model(), reference_logprobs=fake_reference)
                return c.weight_version, None
            version = await c.update_weights(small_model(), reference_logprobs=fake_reference)
            return version, c.last_sync.max_abs_diff

    version, diffs = run(main())
    reloads = b.paths().count("/collective_rpc")
    if policy == "retry":
        assert version == 0 and reloads == 2
    else:  # warn: keeps the servers, reports the measured differences, the version advances
        assert version == 1 and reloads == 1
        assert diffs[0] == 0.0 and abs(diffs[1] - 1e-3) < 1e-6


def test_sync_config_validation():
    with pytest.raises(ValueError, match="pause_mode"):
        SyncConfig(pause_mode="later")
    with pytest.raises(ValueError, match="probe_ids"):
        SyncConfig(probe_ids=(1,))
    with pytest.raises(ValueError, match="atol"):
        SyncConfig(atol=0)
    with pytest.raises(ValueError, match="on_mismatch"):
        SyncConfig(on_mismatch="ignore")
    with pytest.raises(ValueError, match="reload_rpc"):
        SyncConfig(reload_rpc="load_model")


class HoldFirstGeneration(httpx.AsyncBaseTransport):
    """Real HTTP, except that the FIRST generation is held in transit (sent by the client, not yet
    at the server) until ``release()`` is true: the latest a request sent before a sync can arrive."""

    def __init__(self, release) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.release = release
        self.holding = self.held = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions" and not self.held:
            self.held = self.holding = True
            while not self.release():
                await asyncio.sleep(0.005)
            self.holding = False
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


@pytest.mark.parametrize("pause_mode", ["wait", "abort"])
def test_a_request_sent_just_before_a_sync_is_labelled_with_the_weights_that_generated_it(
    pause_mode, tmp_path
):
    """A generation leaves the client as version 0, then a sync begins. Released at the latest
    moment (once the fake server is paused, or once the sync waits for it), it must come back
    labelled with the weights that generated it: the fake records how many reloads it had at that
    moment (version v == v reloads). "wait" syncs pause only after it was answered (v0, sent once);
    with "abort" it reaches the paused server, runs after the reload, and is sent again (v1)."""
    clients: list[VLLMClient] = []
    with fk.FakeVLLM() as fake:
        fake.honour_pause = True  # a generation arriving while paused runs after /resume, as in vLLM
        transport = HoldFirstGeneration(lambda: fake.pauses > 0 or getattr(clients[0], "draining", False))
        written = WrittenWeights(
            os.fspath(tmp_path),
            np.arange(1, 9),
            np.asarray(fk.expected_scores(list(range(1, 9)))),
            "float32",
            None,
        )

        async def main():
            sync = SyncConfig(pause_mode=pause_mode, probe_length=8)
            async with VLLMClient([fake.url], transport=transport, sync=sync) as client:
                clients.append(client)
                sent = asyncio.create_task(client.generate([1, 2], SamplingParams(max_tokens=3)))
                while not transport.holding:
                    await asyncio.sleep(0.005)
                assert await client.update_weights_from(written, version=1) == 1
                return await sent

        out = run(main())
    generated = [reloads for path, prompt, reloads, _ in fake.served if prompt == [1, 2]]
    assert out.weight_version == generated[-1]  # the label is the version that generated it
    assert generated == ([0] if pause_mode == "wait" else [1, 1])
    assert list(out.ids) == fk.expected_generation([1, 2], 3)[0]


def test_keep_pause_mode_is_refused_for_a_client_that_labels_whole_completions():
    with pytest.raises(ValueError, match="pause_mode='keep'.*InFlightVLLMClient"):
        VLLMClient(["http://127.0.0.1:1"], sync=SyncConfig(pause_mode="keep"))
