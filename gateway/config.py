"""``pagedserve gateway`` options (a frozen dataclass turned into argparse flags).

The admin API's bearer token is not an option (it would show in ``ps``): it comes from the
environment variable ``PAGEDSERVE_ADMIN_TOKEN``. Unset or empty, the admin API is disabled and
every ``/admin/`` call answers 403. The API key of ``/v1/*`` comes from ``PAGEDSERVE_API_KEY``
or ``--api-key`` (as vLLM's ``--api-key``; the variable keeps it out of ``ps``).
"""

from __future__ import annotations

from dataclasses import dataclass

from contracts import options
from contracts.options import flag
from contracts.queue_keys import GATEWAY_TTL_S, check_node
from kvstore.protocol import LEASE_TIMEOUT_S

ADMIN_TOKEN_ENV = "PAGEDSERVE_ADMIN_TOKEN"
API_KEY_ENV = "PAGEDSERVE_API_KEY"


@dataclass(frozen=True)
class GatewayConfig:
    model: str = options.model(
        ": its tokenizer, chat template and context length (no weights are loaded); must match "
        "the workers'"
    )
    served_model_name: str = flag(
        "",
        "the model name clients send and /v1/models lists; empty: --model as "
        "given ('tiny', 'smollm2'), or the basename of its directory or .gguf file",
    )
    host: str = flag("127.0.0.1", "address to listen on")
    port: int = flag(8000, "TCP port to listen on")
    reuse_port: bool = flag(
        False,
        "share the port with other gateway processes (SO_REUSEPORT: the kernel "
        "spreads connections among them); `pagedserve up --gateways N` sets it. With "
        "PROMETHEUS_MULTIPROC_DIR set, /metrics sums the request metrics of all of them",
    )
    redis_url: str = options.redis_url()
    kvstore: str = options.kvstore("the kvstore's endpoint (health, /metrics and the admin API)")
    max_body_bytes: int = flag(
        8 * 1024 * 1024,
        "largest request body accepted; larger ones get 413",
    )
    max_model_len: int = flag(
        0,
        "context length (prompt + max_tokens) to enforce; 0 takes the model "
        "config's max_position_embeddings",
    )
    max_n: int = flag(128, "largest n, best_of and beam_width a request may ask for")
    max_queued: int = flag(
        4096,
        "requests waiting or running in Redis beyond which new ones get 503 "
        "(back-pressure; the stream is never trimmed)",
    )
    worker_idle_s: float = flag(
        LEASE_TIMEOUT_S,
        "/health counts a worker alive if the kvstore heard from it this recently "
        "(the kvstore's --lease-timeout-s)",
    )
    kvstore_timeout_s: float = flag(2.0, "how long to wait for a kvstore reply")
    header_timeout_s: float = flag(
        60.0,
        "a connection whose request headers are not complete this long after it "
        "opened, or after its last response ended, is closed: a client that sends its "
        "headers slowly (slowloris) or an idle keep-alive connection",
    )
    shutdown_timeout_s: float = flag(
        30.0,
        "on SIGINT/SIGTERM the gateway stops accepting requests (new ones get 503, "
        "/health says draining) and gives those in flight this long to finish; then each "
        "is cut: a stream gets an error event and [DONE], a non-streaming request a 503",
    )
    request_timeout_s: float = flag(
        600.0,
        "server-side deadline of one request, from its arrival: past it, a stream "
        "gets an error event (code request_timeout) and [DONE], a non-streaming request a "
        "504, and its work is aborted; 0 disables it",
    )
    sse_keepalive_s: float = flag(
        15.0,
        "a stream with nothing to send for this long gets an SSE comment line "
        "(': keep-alive'), so clients and proxies see it alive (a long queue, a long "
        "prompt); 0 disables them",
    )
    api_key: str = flag(
        "",
        f"require 'Authorization: Bearer <key>' on /v1/* (401 otherwise); "
        f"${API_KEY_ENV} is used when this is empty, and keeps the key out of ps. "
        "/health and /metrics stay open",
    )
    liveness_ttl_s: float = flag(
        GATEWAY_TTL_S,
        "the gateway renews its liveness key in Redis every third of this; workers "
        "abort the requests of a gateway whose key expired (it died: nobody would read them)",
    )
    redis_outage_s: float = flag(
        30.0,
        "while Redis is unreachable, requests in flight wait this long for it to "
        "come back (then go on where they were) before they end with an error",
    )
    routing: str = flag(
        "prefix",
        "how a request is placed on one of the kvstore's pools (GPUs), when it has several: "
        "'prefix' (the kvstore prices each pool by the cost of bringing the prompt's cached "
        "prefix there plus the work queued and running there, and takes the cheapest), "
        "'least_loaded' (the work alone), 'round_robin'",
        choices=["prefix", "least_loaded", "round_robin"],
    )
    move_after_s: float = flag(
        60.0,
        "with several pools (GPUs): the requests queued on a pool that has had no worker this "
        "long (its GPU failed, its worker cannot start) move to the pools that have one, and "
        "resume there from what they streamed; 0: they wait for a worker of their own pool",
    )
    node: str = flag(
        "",
        "the host whose kvstore --kvstore is, when several hosts share one Redis: its requests "
        "go to pagedserve:requests:NODE:POOL, which that host's workers (--node NODE) read; "
        "empty: the first host (pagedserve:requests...)",
    )
    nodes: str = flag(
        "",
        "other hosts sharing this Redis, to route across hosts: NAME=ENDPOINT[,NAME=ENDPOINT] "
        "(each host's kvstore endpoint; its workers run with --node NAME). Every host's "
        "kvstore prices each request (by --routing) and the cheapest host takes it",
    )
    log_level: str = options.log_level()

    def __post_init__(self) -> None:  # ValueError: one line at the command line
        names = [name for name, _ in self.node_endpoints()]
        if self.node and (check_node(self.node) in names):
            raise ValueError(f"--node {self.node!r} is this gateway's own host, not one of --nodes")

    def node_endpoints(self) -> list[tuple[str, str]]:
        """``--nodes`` as (name, kvstore endpoint) pairs."""
        pairs = []
        for part in filter(None, (x.strip() for x in self.nodes.split(","))):
            name, sep, endpoint = part.partition("=")
            if not sep or not endpoint:
                raise ValueError(f"--nodes {part!r}: expected NAME=ENDPOINT")
            pairs.append((check_node(name), endpoint))
        if len({name for name, _ in pairs}) != len(pairs):
            raise ValueError(f"--nodes {self.nodes!r}: a name twice")
        return pairs

    def resolved_api_key(self, env: dict[str, str]) -> str | None:
        """The /v1 API key: the flag, else the environment's; None: no key required."""
        return self.api_key or env.get(API_KEY_ENV) or None

    def model_name(self) -> str:
        """The served model name: the flag, else --model's basename (less a .gguf suffix)."""
        if self.served_model_name:
            return self.served_model_name
        name = self.model.rstrip("/").rsplit("/", 1)[-1] or self.model
        return name[: -len(".gguf")] if name.lower().endswith(".gguf") else name
