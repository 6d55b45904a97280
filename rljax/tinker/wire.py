"""The protobuf bodies of the Tinker protocol (the schema ships with the SDK as
``tinker.proto.tinker_public_pb2``; this module reads and writes its messages).

* ``POST /api/v1/forward_backward`` sends a ``ForwardBackwardRequest`` (``Content-Type:
  application/x-protobuf``, optionally ``Content-Encoding: zstd``): ``model_id``, ``seq_id``, ``loss_fn``,
  ``forward_only``, ``loss_fn_config`` (float map; ``loss_fn_config_v2`` numbers or text win), and
  ``data``: each Datum holds ``model_input`` chunks (``encoded_text.tokens``: int32 little-endian
  bytes) and ``loss_fn_inputs`` name -> ``Tensor`` (``dense`` bytes of ``dtype`` with ``shape``, or a
  ``sparse_csr`` matrix).
* ``retrieve_future`` answers a ``ForwardBackwardOutput`` or a ``SampleResponse`` as protobuf
  (the SDK asks with ``Accept: application/x-protobuf`` and accepts nothing else for these two):
  per-datum outputs as ONE ``ArrayRecord`` whose ``fields`` are ``BatchedTensor`` s (all datums'
  values concatenated in ``data``, int64 byte ``offsets`` of each datum's start plus the end).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

__all__ = [
    "FwdBwdRequest",
    "decode_forward_backward",
    "encode_forward_backward_output",
    "encode_sample_response",
]


def _pb():  # noqa: ANN202
    from tinker.proto import tinker_public_pb2

    return tinker_public_pb2


@dataclasses.dataclass(frozen=True)
class FwdBwdRequest:
    """A decoded forward_backward request; ``data``: (tokens, {input name: array}) per datum."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[tuple[np.ndarray, dict[str, np.ndarray]]]


_NUMPY = {1: np.float32, 2: np.int64, 3: np.int32}


def _tensor(msg, name: str) -> np.ndarray:  # noqa: ANN001
    dtype = _NUMPY.get(msg.dtype)
    if dtype is None:
        raise ValueError(f"loss_fn_inputs[{name!r}]: unsupported tensor dtype {msg.dtype}")
    shape = tuple(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype)
        crow = np.frombuffer(csr.crow_indices, np.int64)
        col = np.frombuffer(csr.col_indices, np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1:
            raise ValueError(f"loss_fn_inputs[{name!r}]: malformed sparse CSR tensor of shape {shape}")
        dense = np.zeros(shape, dtype)
        for r in range(shape[0]):
            dense[r, col[crow[r] : crow[r + 1]]] = values[crow[r] : crow[r + 1]]
        return dense
    values = np.frombuffer(msg.dense, dtype)
    if shape and int(np.prod(shape)) != values.size:
        raise ValueError(f"loss_fn_inputs[{name!r}]: {values.size} values do not fill shape {list(shape)}")
    return values.reshape(shape) if shape else values


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    """Parses a ``ForwardBackwardRequest`` body (ValueError on a malformed one)."""
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise ValueError(
            f"malformed forward_backward body (not a ForwardBackwardRequest protobuf): {e}"
        ) from None
    config: dict[str, float | str] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, datum in enumerate(msg.data):
        tokens = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk") if chunk.DESCRIPTOR.oneofs else None
            if not chunk.HasField("encoded_text"):
                raise ValueError(
                    f"datum {i}: only text chunks are supported (got {kind or 'an image/audio chunk'})"
                )
            tokens.append(np.frombuffer(chunk.encoded_text.tokens, np.int32))
        ids = np.concatenate(tokens) if tokens else np.zeros((0,), np.int32)
        inputs = {name: _tensor(t, name) for name, t in datum.loss_fn_inputs.items()}
        data.append((ids, inputs))
    return FwdBwdRequest(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data)


def encode_forward_backward_output(
    outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]
) -> bytes:
    """A ``ForwardBackwardOutput``: per-datum float32 arrays (e.g. ``logprobs``, ``[N]`` or ``[N, K]``)
    and the metrics. Consecutive datums whose arrays have the same trailing shapes share one
    ``ArrayRecord`` (``trailing_shape`` [K] for ``[N, K]``); ragged ones (another K) start a new one,
    as the protocol has it."""
    pb = _pb()
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    names = list(outputs[0]) if outputs else []
    groups: list[list[Mapping[str, np.ndarray]]] = []
    for o in outputs:
        key = [np.shape(o[name])[1:] for name in names]
        if not groups or [np.shape(groups[-1][0][name])[1:] for name in names] != key:
            groups.append([])
        groups[-1].append(o)
    for group in groups or [[]]:
        record = msg.loss_fn_outputs.add()
        record.num_datums = len(group)
        for name in names:
            arrays = [np.ascontiguousarray(o[name], np.float32) for o in group]
            sizes = np.array([0] + [a.nbytes for a in arrays], np.int64)
            bt = record.fields[name]
            bt.dtype = pb.DTYPE_FLOAT32
            bt.data = b"".join(a.tobytes() for a in arrays)
            bt.offsets = np.cumsum(sizes).astype(np.int64).tobytes()
            bt.trailing_shape.extend(list(arrays[0].shape[1:]))
    return msg.SerializeToString()


def encode_sample_response(
    sequences: Sequence[tuple[Sequence[int], Sequence[float], str]], prompt_logprobs: Sequence[float] | None
) -> bytes:
    """A ``SampleResponse``: (tokens, logprobs, stop reason "stop" / "length") per sequence and,
    when asked, the prompt logprobs (entry 0 is NaN: the first token has no context)."""
    pb = _pb()
    msg = pb.SampleResponse()
    for tokens, logprobs, reason in sequences:
        seq = msg.sequences.add()
        seq.tokens = np.asarray(tokens, np.int32).tobytes()
        seq.logprobs = np.asarray(logprobs, np.float32).tobytes()
        seq.stop_reason = pb.STOP_REASON_LENGTH if reason == "length" else pb.STOP_REASON_STOP
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, np.float32).tobytes()
    return msg.SerializeToString()
