"""Real vLLM servers for rljax: launcher, async token-in/token-out client, weight sync (design §5).

>>> from rljax.inference.vllm import VLLMClient, ServerConfig, SyncConfig
>>> VLLMClient(["http://127.0.0.1:8000"]).sync_config == SyncConfig()
True
"""

from rljax.inference.vllm.client import (
    AllServersDownError,
    ClientConfig,
    MalformedResponseError,
    RequestRejectedError,
    ServerFaultError,
    ServerUnavailableError,
    VLLMClient,
    VLLMClientError,
    completion_payload,
    parse_completion,
    parse_prompt_logprobs,
    score_payload,
)
from rljax.inference.vllm.launcher import (
    ServerConfig,
    ServerGroup,
    ServerStartError,
    VLLMServer,
    find_vllm_python,
    free_port,
)
from rljax.inference.vllm.supervisor import (
    CurrentWeights,
    LiveServers,
    ServedAdapter,
    ServerSupervisor,
    SupervisorConfig,
)
from rljax.inference.vllm.weight_sync import (
    SYNC_ATOL,
    SyncConfig,
    SyncReport,
    WeightSyncError,
    WrittenWeights,
    probe_sequence,
    reload_in_place,
    sync_weights,
    verify_weights,
    write_checkpoint,
    write_distributed,
)

__all__ = [
    "SYNC_ATOL",
    "AllServersDownError",
    "ClientConfig",
    "CurrentWeights",
    "LiveServers",
    "MalformedResponseError",
    "RequestRejectedError",
    "ServedAdapter",
    "ServerConfig",
    "ServerGroup",
    "ServerFaultError",
    "ServerStartError",
    "ServerSupervisor",
    "ServerUnavailableError",
    "SyncConfig",
    "SupervisorConfig",
    "SyncReport",
    "VLLMClient",
    "VLLMClientError",
    "VLLMServer",
    "WeightSyncError",
    "WrittenWeights",
    "completion_payload",
    "find_vllm_python",
    "free_port",
    "parse_completion",
    "parse_prompt_logprobs",
    "probe_sequence",
    "reload_in_place",
    "score_payload",
    "sync_weights",
    "verify_weights",
    "write_checkpoint",
    "write_distributed",
]
