"""Quick unit tests of the Tinker API's pieces without a server: the protobuf bodies against the SDK's
own encoder / decoder, packing, and the loss options."""

from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402

from rljax.tinker.losses import check_config  # noqa: E402
from rljax.tinker.packing import Datum, pack_datums  # noqa: E402
from rljax.tinker.wire import (  # noqa: E402
    decode_forward_backward,
    encode_forward_backward_output,
    encode_sample_response,
)


def test_forward_backward_request_decodes_what_the_sdk_encodes():
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [0.0, 0.5, 1.0]},
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[datum], loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}
        ),
        model_id="m",
        seq_id=3,
    )
    msg = forward_backward_request_to_proto(request)
    msg.forward_only = True
    req = decode_forward_backward(msg.SerializeToString())
    assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == ("m", 3, "ppo", True)
    assert req.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    tokens, inputs = req.data[0]
    assert tokens.tolist() == [5, 6, 7] and inputs["target_tokens"].tolist() == [6, 7, 8]
    np.testing.assert_array_equal(inputs["weights"], np.array([0.0, 0.5, 1.0], np.float32))
    with pytest.raises(ValueError, match="malformed"):
        decode_forward_backward(b"\xff\x00garbage")


def test_outputs_decode_with_the_sdk():
    outs = [{"logprobs": np.array([-1.0, -2.0], np.float32)}, {"logprobs": np.array([-3.0], np.float32)}]
    got = deserialize_forward_backward_output(encode_forward_backward_output(outs, {"loss:sum": 6.0}))
    assert got.metrics == {"loss:sum": 6.0}
    assert [o["logprobs"].tolist() for o in got.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]
    res = deserialize_sample_response(
        encode_sample_response([((4, 5), (-0.5, -0.25), "length")], [np.nan, -1.5])
    )
    seq = res.sequences[0]
    assert list(seq.tokens) == [4, 5] and seq.stop_reason == "length" and seq.logprobs == [-0.5, -0.25]
    assert res.prompt_logprobs == [None, -1.5]


def test_packing_keeps_every_datum_and_fixed_shapes():
    rng = np.random.default_rng(0)
    datums = [
        Datum(rng.integers(0, 9, n), rng.integers(0, 9, n), {"weights": rng.random(n)})
        for n in (5, 17, 3, 30)
    ]
    p = pack_datums(datums, float_inputs={"weights": 1.0}, min_len=8)
    rows, length = p.arrays["tokens"].shape
    assert length == 32 and rows & (rows - 1) == 0 and p.num_segments == 8
    for d, tokens, w in zip(
        datums, p.per_datum(p.arrays["tokens"]), p.per_datum(p.arrays["weights"]), strict=True
    ):
        np.testing.assert_array_equal(tokens, d.tokens)
        np.testing.assert_allclose(w, d.inputs["weights"], rtol=1e-6)
    assert p.arrays["mask"].sum() == sum(len(d.tokens) for d in datums)


def test_packing_and_outputs_of_k_targets_per_position():
    """[N, K] targets (ragged K, mixed with a one-target datum): packed [R, L, K'] with K' = 4, the extra
    columns weight 0; per_datum gives each datum its own shape back, and the outputs decode with the
    SDK in the datums' shapes (one ArrayRecord per run of equal trailing shapes)."""
    rng = np.random.default_rng(1)
    shapes = [(4, 3), (6,), (3, 3), (5, 2)]
    datums = []
    for shape in shapes:
        n = shape[0]
        inputs = {"weights": rng.random(shape)} if len(shape) == 2 else {}
        datums.append(Datum(rng.integers(0, 9, n), rng.integers(1, 9, shape), inputs))
    p = pack_datums(datums, float_inputs={"weights": 1.0}, min_len=8, target_inputs=("weights",))
    assert p.arrays["targets"].shape[2] == 4 and p.arrays["weights"].shape == p.arrays["targets"].shape
    for d, t, w in zip(
        datums, p.per_datum(p.arrays["targets"]), p.per_datum(p.arrays["weights"]), strict=True
    ):
        np.testing.assert_array_equal(t, d.targets)
        np.testing.assert_allclose(w, d.inputs.get("weights", np.ones(d.targets.shape)), rtol=1e-6)
    # the weight on every padded column (and padding) is 0: the loss sum covers exactly the real targets
    real = sum(float(np.sum(d.inputs.get("weights", np.ones(d.targets.shape)))) for d in datums)
    assert float(p.arrays["weights"].sum()) == pytest.approx(real, rel=1e-6)
    outs = [{"logprobs": -np.abs(rng.normal(size=d.targets.shape)).astype(np.float32)} for d in datums]
    got = deserialize_forward_backward_output(encode_forward_backward_output(outs, {"loss:sum": 1.0}))
    assert len(got.loss_fn_outputs) == 4
    for o, want in zip(got.loss_fn_outputs, outs, strict=True):
        assert o["logprobs"].shape == list(want["logprobs"].shape)
        np.testing.assert_array_equal(
            o["logprobs"].to_numpy().reshape(want["logprobs"].shape), want["logprobs"]
        )


def test_loss_options():
    assert check_config("ppo", None) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert check_config("dro", {"beta": 0.1}) == {"beta": 0.1}
    with pytest.raises(ValueError, match="beta"):
        check_config("dro", None)
    with pytest.raises(ValueError, match="not options"):
        check_config("cross_entropy", {"beta": 1.0})
    with pytest.raises(ValueError, match="unknown loss_fn"):
        check_config("nope", None)
    with pytest.raises(ValueError, match="stable_reinforce"):
        check_config("stable_reinforce", None)


def test_api_keys_are_checked_when_configured():
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from rljax.tinker.server import make_app
    from rljax.tinker.service import ServiceOptions

    app = make_app(SimpleNamespace(options=ServiceOptions(api_keys=("tml-right",))))
    with TestClient(app) as c:
        # the health probe answers without a key (as vLLM's /health) and says nothing else
        assert c.get("/api/v1/healthz").json() == {"status": "ok"}
        assert c.post("/api/v1/telemetry", json={}).status_code == 401
        assert c.post("/api/v1/telemetry", json={}, headers={"X-API-Key": "tml-wrong"}).status_code == 401
        # the step's routes, answered in front of FastAPI, check the key alike
        for route in ("forward_backward", "optim_step", "retrieve_future"):
            r = c.post(f"/api/v1/{route}", json={"request_id": "req-1"})
            assert r.status_code == 401 and "API key" in r.json()["detail"]
        assert c.get("/api/v1/retrieve_future", headers={"X-API-Key": "tml-right"}).status_code == 405
    with TestClient(make_app(SimpleNamespace(options=ServiceOptions()))) as c:  # no keys: any key
        assert c.get("/api/v1/healthz", headers={"X-API-Key": "tml-x"}).status_code == 200


def test_stop_strings_cut_at_the_first_token_that_completes_them():
    from rljax.chat import toy_tokenizer
    from rljax.tinker.sampling import SamplerPool, Stops, cut_at_stop_string

    tok = toy_tokenizer("chatml")
    rng = np.random.default_rng(0)

    def reference(ids, strings):  # every prefix, shortest first
        for n in range(1, len(ids) + 1):
            if any(s in tok.decode(ids[:n]) for s in strings):
                return n
        return None

    texts = ["ab\n\nUser: hi", "no stop here", "\n\nUser:", "x\n\nUs", "é\n\nUser:é", "<|im_end|>\n\nUser:"]
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        for strings in (["\n\nUser:"], ["User", "b\n"], ["é"], ["<|im_end|>"], []):
            assert cut_at_stop_string(ids, strings, tok) == reference(ids, strings), (text, strings)
    for _ in range(50):  # random byte strings, random stops taken from them
        ids = [int(t) for t in rng.integers(32, 127, size=int(rng.integers(1, 30)))]
        i = int(rng.integers(0, len(ids)))
        stop = tok.decode(ids[i : i + int(rng.integers(1, 4))])
        assert cut_at_stop_string(ids, [stop], tok) == reference(ids, [stop])
    # single-token strings also stop the engine early; longer ones are only cut afterwards
    stops = SamplerPool.stops(["<|im_end|>", "\n\nUser:", 7], tok)
    assert stops.ids == (tok.convert_tokens_to_ids("<|im_end|>"), 7)
    assert stops.strings == ("<|im_end|>", "\n\nUser:")
    assert SamplerPool.stops(None, tok) == Stops((tok.eos_token_id,))  # None: EOS
    assert SamplerPool.stops([], tok) == Stops()  # []: nothing
