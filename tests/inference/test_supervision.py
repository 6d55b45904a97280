"""Supervised servers and the per-token progress deadline, against in-process fakes (no vLLM).

The request-fault rows of ``benchmarks/fault_matrix.py`` (500, stream cut mid-response, stall, a
server that accepts and never answers) must each come back from the other server with exactly the
fakes' closed-form tokens; the supervisor must keep syncs off a dead server, restore it with the
current weights when it answers again (verified by the probe), restart a launched server that
died, stop the client with the mismatch figure when a restored server serves wrong weights, and
end with one error naming every server when none is left.
"""

import asyncio
import importlib.util
import os
import pathlib
import sys
import time
from collections.abc import Callable

import inference_fakes as fk
import numpy as np
import pytest
from test_inference_launcher import fake_config

from rljax.inference.engine import SamplingParams
from rljax.inference.vllm import (
    AllServersDownError,
    ClientConfig,
    ServerConfig,
    ServerFaultError,
    ServerSupervisor,
    SupervisorConfig,
    VLLMClient,
    VLLMServer,
    WeightSyncError,
    WrittenWeights,
    free_port,
)
from rljax.inference.vllm.client import assemble_stream
from rljax.inference.vllm.pause import InFlightVLLMClient

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "fault_matrix.py")
FAST = SupervisorConfig(health_interval_s=0.2, health_timeout_s=1.0, health_failures=2, backoff_s=0.1)
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture(scope="module")
def matrix():
    spec = importlib.util.spec_from_file_location("fault_matrix_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def lines(*chunks: str):
    async def gen():
        for c in chunks:
            yield c

    return gen()


def test_assemble_stream_concatenates_chunks_and_rejects_a_cut_stream():
    c1 = '{"choices": [{"index": 0, "token_ids": [7], "prompt_token_ids": [1, 2], "finish_reason": null, "logprobs": {"token_logprobs": [-0.5], "tokens": ["token_id:7"]}}]}'  # noqa: E501
    c2 = '{"choices": [{"index": 0, "token_ids": [8, 9], "finish_reason": "length", "logprobs": {"token_logprobs": [-1.0, -2.0], "tokens": ["token_id:8", "token_id:9"]}}]}'  # noqa: E501
    progress = [0.0]
    body = asyncio.run(assemble_stream(lines(f"data: {c1}", "", f"data: {c2}", "data: [DONE]"), progress))
    choice = body["choices"][0]
    assert choice["token_ids"] == [7, 8, 9] and choice["prompt_token_ids"] == [1, 2]
    assert choice["logprobs"]["token_logprobs"] == [-0.5, -1.0, -2.0] and choice["finish_reason"] == "length"
    assert progress[0] > 0
    with pytest.raises(ServerFaultError, match="without a finish reason"):
        asyncio.run(assemble_stream(lines(f"data: {c1}")))
    with pytest.raises(ServerFaultError, match="reported an error"):
        asyncio.run(assemble_stream(lines(f"data: {c1}", 'data: {"error": {"message": "boom"}}')))


@pytest.mark.slow
@pytest.mark.parametrize("row", ["row_http500", "row_stream_cut", "row_stall", "row_silent"])
def test_request_faults_are_retried_with_no_token_lost_or_doubled(matrix, row):
    r = getattr(matrix, row)()
    print(f"\n{r.fault}: detected after {r.detected_after_s:.2f} s; {r.outcome}")
    assert r.details["ids"] == r.details["expected"]  # the closed-form rule, token for token
    assert r.details["good_requests"] == 1 and r.ok
    if row in ("row_stall", "row_silent"):  # the progress deadline (3 s), not the 300 s read timeout
        assert 3.0 <= r.detected_after_s < 60.0


@pytest.mark.slow
def test_stall_is_not_counted_while_a_sync_holds_requests(matrix):
    # A server that takes 1.5 s per answer while a "sync" clears the gate: the deadline (1 s) does
    # not fire, because time under a sync hold is not stall time.
    with fk.FakeVLLM(delay_s=1.5) as slow:

        async def main():
            async with VLLMClient([slow.url], stall_timeout_s=1.0, max_retries=0) as client:
                task = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_tokens=3)))
                await asyncio.sleep(0.2)
                client._open.clear()
                await asyncio.sleep(1.6)
                client._open.set()
                out = await task
                with pytest.raises(Exception, match="stalled, no token for 1 s"):
                    await client.generate(PROMPT, SamplingParams(max_tokens=3))
                return out

        out = asyncio.run(main())
    assert list(out.ids) == fk.expected_generation(PROMPT, 3)[0]


def written(directory) -> WrittenWeights:
    """Weights 'written' for the fakes: their scoring rule is the expected probe logprobs."""
    probe = np.arange(1, 9)
    return WrittenWeights(
        os.fspath(directory), probe, np.asarray(fk.expected_scores(probe.tolist())), "float32", None
    )


def rpc_dirs(fake) -> list[str]:
    return [b["kwargs"]["weights_path"] for _, p, b in fake.calls if p == "/collective_rpc"]


async def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


@pytest.mark.slow
def test_sync_skips_a_dead_url_server_which_is_restored_with_the_current_weights(tmp_path):
    a, b = fk.FakeVLLM().start(), fk.FakeVLLM().start()
    port = int(a.url.rsplit(":", 1)[1])
    try:

        async def main():
            client = VLLMClient([a.url, b.url], backoff_s=0.01, cooldown_s=0.5)
            supervisor = ServerSupervisor(client, [None, None], FAST)
            async with client:
                a.stop()  # the server given by URL dies
                await wait_for(lambda: client.servers[0].down, what="server 0 out of service")
                version = await client.update_weights_from(written(tmp_path / "v1"), version=1)
                outs = await asyncio.gather(
                    *(client.generate([i + 1], SamplingParams(max_tokens=2)) for i in range(4))
                )
                nonlocal_a = fk.FakeVLLM(port=port).start()  # back on the same port, initial weights
                await wait_for(lambda: not client.servers[0].down, what="server 0 back")
                return version, outs, nonlocal_a, supervisor.events

        version, outs, a2, events = asyncio.run(main())
    finally:
        b.stop()
    try:
        assert version == 1 and all(len(o.ids) == 2 for o in outs)
        assert rpc_dirs(b) == [os.fspath(tmp_path / "v1")]  # the sync reached the live server only
        assert rpc_dirs(a2) == [os.fspath(tmp_path / "v1")]  # the restored one got the current weights
        assert a2.count() == 1  # ... and its probe was scored before it was back in service
        kinds = [e.kind for e in events if e.server == 0]
        assert kinds == ["down", "up"] and "probe max abs diff 0" in events[-1].detail
    finally:
        a2.stop()


@pytest.mark.slow
def test_restored_server_with_wrong_weights_stops_the_client_with_the_figure(tmp_path):
    with fk.FakeVLLM() as a, fk.FakeVLLM() as b:

        async def main():
            client = VLLMClient([a.url, b.url], backoff_s=0.01)
            ServerSupervisor(client, [None, None], FAST)
            async with client:
                await client.update_weights_from(written(tmp_path / "v1"), version=1)
                a.mode = "unhealthy"  # /health answers 503
                await wait_for(lambda: client.servers[0].down, what="server 0 out of service")
                before = len(rpc_dirs(a))
                a.mode = "offset_scores"  # healthy again, but its weights are off by 1e-3
                await wait_for(lambda: client._sync_error is not None, what="mismatch")
                with pytest.raises(WeightSyncError, match="probe max abs diff 0.001"):
                    await client.generate([1], SamplingParams(max_tokens=2))
                return client._sync_error, rpc_dirs(a)[before:], client.servers[0].down

        error, reloads, down = asyncio.run(main())
    assert reloads == [os.fspath(tmp_path / "v1")] * 2  # reloaded once more before giving up
    assert error.diffs == pytest.approx((1e-3,), rel=1e-6) and down  # the figure: the fake's offset


@pytest.mark.integration  # launches (fake) server processes
def test_launched_server_that_dies_is_restarted_and_requests_complete(fake_shim, tmp_path):
    # Two launched (fake) servers; server 0 answers slowly and is SIGKILLed holding requests.
    servers = [
        VLLMServer(fake_config(fake_shim, tmp_path, DELAY=3.0), python=sys.executable).start(),
        VLLMServer(fake_config(fake_shim, tmp_path), python=sys.executable).start(),
    ]
    try:

        async def main():
            client = VLLMClient([s.url for s in servers], backoff_s=0.05, cooldown_s=1.0)
            supervisor = ServerSupervisor(client, servers, FAST)
            async with client:
                tasks = [
                    asyncio.create_task(client.generate([i + 1], SamplingParams(max_tokens=4)))
                    for i in range(6)
                ]
                await wait_for(lambda: client.servers[0].outstanding > 0, what="requests on server 0")
                old_pid = servers[0].process.pid
                os.killpg(old_pid, 9)
                outs = await asyncio.gather(*tasks)
                await wait_for(
                    lambda: not client.servers[0].down and supervisor.restarts[0] == 1, what="restart"
                )
                return outs, old_pid, supervisor.events

        outs, old_pid, events = asyncio.run(main())
        assert [list(o.ids) for o in outs] == [fk.expected_generation([i + 1], 4)[0] for i in range(6)]
        assert servers[0].running and servers[0].process.pid != old_pid
        assert [e.kind for e in events if e.server == 0] == ["down", "restart", "up"]
        assert "process exited" in events[0].detail or "GET /health" in events[0].detail
    finally:
        for s in servers:
            s.stop()


def test_all_servers_down_ends_with_one_error_naming_them():
    dead = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]

    async def main():
        client = VLLMClient(dead, all_down_timeout_s=1.0, backoff_s=0.01, cooldown_s=0.1)
        ServerSupervisor(client, [None, None], FAST)
        async with client:
            start = time.monotonic()
            with pytest.raises(AllServersDownError) as first:
                await client.generate([1], SamplingParams(max_tokens=2))
            took = time.monotonic() - start
            with pytest.raises(AllServersDownError) as second:
                await client.generate([1], SamplingParams(max_tokens=2))
            return first.value, second.value, took

    first, second, took = asyncio.run(main())
    assert first is second  # one error, the same for every request
    message = str(first)
    assert all(url in message for url in dead) and "all_down_timeout_s" in message
    assert "given by URL" in message and "ConnectError" in message
    assert took >= 1.0


def test_health_check_failure_takes_a_server_out_and_its_requests_fail_over():
    # Server 0 keeps its socket open but answers /health with 503: after 2 failed checks it is out,
    # and a request it holds goes to server 1 at once (long before its own 30 s answer).
    with fk.FakeVLLM(delay_s=30.0) as a, fk.FakeVLLM() as b:

        async def main():
            client = VLLMClient([a.url, b.url], stall_timeout_s=None, backoff_s=0.0)
            ServerSupervisor(client, [None, None], FAST)
            async with client:
                task = asyncio.create_task(client.generate(PROMPT, SamplingParams(max_tokens=3)))
                await wait_for(lambda: client.servers[0].outstanding == 1, what="request on server 0")
                start = time.monotonic()
                a.mode = "unhealthy"
                out = await task
                return out, time.monotonic() - start, client.servers[0].down_reason

        out, took, reason = asyncio.run(main())
    assert list(out.ids) == fk.expected_generation(PROMPT, 3)[0] and b.count() == 1
    assert "HTTP 503" in reason and took < 25.0


def test_supervisor_rejects_a_launched_server_that_is_not_the_clients():
    client = VLLMClient(["http://127.0.0.1:1"])
    other = VLLMServer(ServerConfig(model="/m", port=free_port()), python=sys.executable)
    with pytest.raises(ValueError, match="is not client server"):
        ServerSupervisor(client, [other])
    with pytest.raises(ValueError, match="launched entries"):
        ServerSupervisor(client, [None, None])


@pytest.mark.slow
def test_engine_set_supervises_its_vllm_client_from_the_initial_weights(tmp_path, tiny_models):
    from rljax.run.config import EngineSection
    from rljax.run.engines import EngineSet

    section = EngineSection(
        kind="vllm",
        urls=("http://127.0.0.1:1",),
        client=ClientConfig(stall_timeout_s=7.0),
        supervisor=SupervisorConfig(health_interval_s=0.5),
    )
    engines = EngineSet(section, {}, workdir=tmp_path, seed=0)
    client = engines.start_policy(tiny_models.a)
    supervisor = client.supervisor
    assert isinstance(supervisor, ServerSupervisor) and supervisor.launched == [None]
    assert supervisor.config.health_interval_s == 0.5 and client.stall_timeout_s == 7.0
    # A server back in service is verified against the initial weights until the first sync.
    current = client.current
    assert current.directory is None and len(current.probe) == section.sync.probe_length
    reference = tiny_models.logprobs(tiny_models.a, current.probe.tolist())
    np.testing.assert_allclose(current.expected, reference, rtol=0, atol=1e-6)
    engines.close()
    assert supervisor.closing  # no restart may race the shutdown


def sync_while_server_0_fails(
    a: fk.FakeVLLM,
    b: fk.FakeVLLM,
    directory: pathlib.Path,
    config: SupervisorConfig,
    fail: Callable[[fk.FakeVLLM], object],
) -> tuple[int, str, list[str]]:
    """Syncs ``directory`` to fakes ``a`` and ``b``; ``fail(a)`` runs once server 0 holds the sync's
    /pause (held 30 s). Returns the synced version, the client's current directory and server 0's
    supervisor events."""

    async def main():
        client = VLLMClient([a.url, b.url], backoff_s=0.01)
        supervisor = ServerSupervisor(client, [None, None], config)
        async with client:
            a.admin_delay_s = 30.0
            sync = asyncio.create_task(client.update_weights_from(written(directory), version=1))
            await wait_for(lambda: a.count("/pause?mode=wait") == 1, what="pause sent to server 0")
            fail(a)
            version = await asyncio.wait_for(sync, timeout=25.0)  # long before server 0's 30 s
            return version, client.current.directory, [e.kind for e in supervisor.events if e.server == 0]

    try:
        return asyncio.run(main())
    finally:
        a.admin_delay_s = 0.0


@pytest.mark.slow
def test_server_lost_during_a_sync_is_dropped_from_it(tmp_path):
    # Server 0 hangs in /pause (30 s) and stops answering /health: the supervisor takes it out,
    # which aborts the sync's posts to it, and the sync is redone on server 1 alone.
    with fk.FakeVLLM() as a, fk.FakeVLLM() as b:
        version, current, kinds = sync_while_server_0_fails(
            a, b, tmp_path / "v1", FAST, lambda fake: setattr(fake, "mode", "unhealthy")
        )
    assert version == 1 and current == os.fspath(tmp_path / "v1")
    assert rpc_dirs(b) == [os.fspath(tmp_path / "v1")] and rpc_dirs(a) == []
    assert kinds[0] == "down"


@pytest.mark.slow
def test_a_server_killed_mid_sync_is_dropped_from_it_though_its_first_check_only_finds_it_closed(tmp_path):
    # Server 0 dies (its connections dropped, its port closed) while it holds the sync's /pause. The
    # check right after sees a closed port: one failed check of the two that take a server out. The
    # sync waits for the verdict and is redone on server 1 instead of failing the run.
    config = SupervisorConfig(health_interval_s=1.0, health_timeout_s=1.0, health_failures=2, backoff_s=0.1)
    with fk.FakeVLLM() as a, fk.FakeVLLM() as b:
        version, _, kinds = sync_while_server_0_fails(a, b, tmp_path / "v1", config, fk.FakeVLLM.stop)
    assert version == 1 and kinds[:1] == ["down"]
    assert rpc_dirs(b) == [os.fspath(tmp_path / "v1")] and rpc_dirs(a) == []


def generated_labels(fake) -> list[str]:
    """The version label each generation of ``fake`` was sampled under (the fake's own record)."""
    return [label for path, _, _, label in fake.served if path == fk.GENERATE_PATH]


@pytest.mark.slow
def test_in_flight_switches_are_recorded_and_a_restored_server_serves_them_with_their_label(tmp_path):
    # Two in-flight switches (v1, v2) on both servers; then server 0 dies and comes back on its
    # initial weights with vLLM's "default" label. The supervisor must restore the weights of the
    # LAST switch and label the server v2, so its tokens say v2 (the fake tags them with its label).
    a, b = fk.FakeVLLM().start(), fk.FakeVLLM().start()
    port = int(a.url.rsplit(":", 1)[1])
    try:

        async def main():
            client = InFlightVLLMClient([a.url, b.url], backoff_s=0.01, cooldown_s=0.5)
            ServerSupervisor(client, [None, None], FAST)
            async with client:
                for v in (1, 2):
                    assert await client.update_weights_from(written(tmp_path / f"v{v}"), version=v) == v
                a.stop()
                await wait_for(lambda: client.servers[0].down, what="server 0 out of service")
                back = fk.FakeVLLM(port=port).start()
                await wait_for(lambda: not client.servers[0].down, what="server 0 back")
                outs = await asyncio.gather(
                    *(client.generate([i + 1], SamplingParams(max_tokens=2)) for i in range(6))
                )
                return outs, back, client.current

        outs, back, current = asyncio.run(main())
    finally:
        b.stop()
    try:
        assert all(o.token_versions() == [2, 2] for o in outs)
        assert generated_labels(back) and set(generated_labels(back)) == {"2"}  # it served, as v2
        assert rpc_dirs(back) == [os.fspath(tmp_path / "v2")] and back.label == "2"
        assert current.directory == os.fspath(tmp_path / "v2") and current.version == 2
    finally:
        back.stop()


@pytest.mark.slow
def test_in_flight_switch_skips_a_server_out_of_service(tmp_path):
    # Server 0 is out of service (its /health answers 503, its other routes still answer): the
    # switch must not touch it (no pause, reload or relabel); it gets v1 and its label when restored.
    with fk.FakeVLLM() as a, fk.FakeVLLM() as b:

        async def main():
            client = InFlightVLLMClient([a.url, b.url], backoff_s=0.01)
            ServerSupervisor(client, [None, None], FAST)
            async with client:
                a.mode = "unhealthy"
                await wait_for(lambda: client.servers[0].down, what="server 0 out of service")
                version = await client.update_weights_from(written(tmp_path / "v1"), version=1)
                out = await client.generate([1], SamplingParams(max_tokens=2))
                a.mode = "ok"  # back: restored with v1 and its label before serving
                await wait_for(lambda: not client.servers[0].down, what="server 0 back")
                return version, out

        version, out = asyncio.run(main())
    switch_pause = "/pause?mode=keep&clear_cache=true"
    assert version == 1 and out.token_versions() == [1, 1]
    assert a.count(switch_pause) == 0 and b.count(switch_pause) == 1  # the switch: server 1 only
    assert a.count("/pause?mode=wait") == 1  # server 0: the restore's reload
    assert rpc_dirs(b) == rpc_dirs(a) == [os.fspath(tmp_path / "v1")]
    assert a.label == b.label == "1"


@pytest.mark.parametrize("turns", [0, 1, 2])
def test_stop_returns_when_a_poke_lands_with_the_cancellation(turns):
    # A request fails (it pokes the health loop) just as the client closes: the loop's wait must
    # end on the cancellation, not swallow it (Python 3.11's wait_for did: stop() then hung).
    with fk.FakeVLLM() as fake:

        async def main():
            client = VLLMClient([fake.url])
            supervisor = ServerSupervisor(client, [None], SupervisorConfig(health_interval_s=30.0))
            async with client:
                await wait_for(lambda: bool(supervisor._poke._waiters), what="the loop waits for a poke")
                supervisor.poke(0)
                for _ in range(turns):  # the poke's wake-up may or may not have run
                    await asyncio.sleep(0)
                await asyncio.wait_for(supervisor.stop(), timeout=5.0)
            return supervisor._task

        assert asyncio.run(main()) is None
