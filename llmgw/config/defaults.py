"""Every configuration default, each defined once, with the reason beside it.

``server.yaml`` and ``agent.yaml`` fall back to these, and so does every part that can
also run without a configuration file (the gateway, its worker processes, the registry,
the agent, ``llmgw up``): they import the value from here rather than repeat it.
Plain values only, so any part may import this module (``docs/config.md`` lists the
defaults for operators).
"""

from __future__ import annotations

from pathlib import Path

# --- where things are ---------------------------------------------------------------------

DEFAULT_SERVER_STATE_DIR = Path("/var/lib/llmgw")
DEFAULT_AGENT_STATE_DIR = Path("/var/lib/llmgw-agent")
#: The SQLite store's file in the control plane's state directory.
DEFAULT_SQLITE_NAME = "llmgw.db"
#: Loopback by default: a fresh install exposes nothing until the operator says where.
DEFAULT_LISTEN_HOST = "127.0.0.1"
#: The control plane's RPC port (agents, ``llmgw ctl`` and peer control planes dial it).
DEFAULT_RPC_PORT = 7070
#: The gateway's HTTP port (the OpenAI-compatible API).
DEFAULT_HTTP_PORT = 8080
#: Where Hugging Face repositories (hf://org/repo) are fetched from; a mirror can replace it.
DEFAULT_HF_ENDPOINT = "https://huggingface.co"
DEFAULT_LOG_LEVEL = "info"

# --- nodes and the fleet (server.yaml, agent.yaml) ---------------------------------------

#: Agents send a heartbeat this often (seconds)...
DEFAULT_HEARTBEAT_INTERVAL = 2.0
#: ...and a node that has sent none for this long is lost: five missed heartbeats, so one
#: slow network moment or GC pause does not flap a node, while a dead node does not stay
#: online for long.
DEFAULT_NODE_LOST_AFTER = 10.0
#: Seconds a leading control plane's lease lasts without renewal (server.yaml
#: ``leader_lease``): a frozen or cut-off leader is replaced after about this long, a dead
#: one (its database session closes with it) within a second. Shorter leases let a slow
#: database (a Patroni failover takes ~10-30 s) depose healthy leaders.
DEFAULT_LEADER_LEASE = 10.0
#: A lost node's replicas are placed elsewhere only after this grace: moving a replica
#: means loading its weights elsewhere (minutes for large models), while an agent restart
#: or short network cut comes back within seconds and must not reshuffle the fleet.
DEFAULT_REPLACE_GRACE = 30.0
#: An agent that cannot reach any control plane retries with exponential backoff capped here:
#: a restarted control plane must have its nodes back within about a second, not after a
#: backoff that grew during a long outage. Dialling a dead address costs one refused TCP
#: connection, and the agent's jitter spreads a fleet's attempts over the interval.
DEFAULT_RECONNECT_BACKOFF_MAX = 1.0

# --- the gateway's upstream deadlines (server.yaml ``gateway:``) -------------------------

#: Seconds to establish a TCP connection to a replica. Replicas sit on the same network
#: as the gateway: a healthy one accepts in milliseconds, so waiting longer only delays
#: the retry on another replica.
DEFAULT_UPSTREAM_CONNECT_TIMEOUT = 5.0
#: Seconds from sending a request to the response head, and again from the head to the
#: first body chunk. A non-streaming completion sends nothing until it is finished, which
#: on a slow CPU replica with a long max_tokens can take minutes; a stream's first chunk
#: waits for queueing and prefill of a long prompt. 600 s covers both; past it the
#: replica is stuck, and the client gets a 504 instead of waiting forever.
DEFAULT_UPSTREAM_FIRST_BYTE_TIMEOUT = 600.0
#: Seconds allowed between two body chunks once the first has arrived. A decoding step
#: takes milliseconds to a second; a preempted request recomputing a long prompt on a
#: saturated replica can pause for tens of seconds. Longer than 60 s means a stalled
#: engine: the stream ends with an error event rather than hanging the client.
DEFAULT_UPSTREAM_CHUNK_TIMEOUT = 60.0
#: Gateway processes on the HTTP port: one, in the server process, until the operator
#: measures that one core is the limit (docs/gateway.md).
DEFAULT_GATEWAY_WORKERS = 1
#: Seconds a stopping gateway (SIGTERM/SIGINT) gives its in-flight requests to finish
#: before it ends the streams still running with an SSE error event. Long enough for
#: most answers to complete; short enough to fit systemd's default 90 s stop timeout.
DEFAULT_GATEWAY_SHUTDOWN_GRACE = 30.0

# --- tracing (server.yaml ``tracing:``) --------------------------------------------------

#: Service name reported when the config does not give one.
DEFAULT_TRACING_SERVICE_NAME = "llmgw-gateway"
#: Every request is traced once an endpoint is set: an operator who turns tracing on
#: is usually looking at a problem, and lowers the ratio for a busy fleet.
DEFAULT_TRACING_SAMPLE_RATIO = 1.0

# --- API keys and admission (server.yaml ``auth:``, ``serving:``) ------------------------

#: API keys are required: off only for loopback demos (``llmgw up``).
DEFAULT_AUTH_ENABLED = True
#: Largest request body accepted (413 above it). Long-context prompts are well under
#: 1 MB of JSON; 16 MiB leaves room for big embedding batches.
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
#: Requests in flight per ready replica before further ones queue. vLLM's default
#: ``max_num_seqs`` is 256: past that the engine queues internally anyway, where the
#: gateway can no longer route around a busy replica.
DEFAULT_MAX_INFLIGHT_PER_REPLICA = 256
#: Requests that may wait per model once every replica is at its limit; more are shed.
DEFAULT_QUEUE_SIZE = 1024
#: Seconds a request may wait in a model's queue before it is answered 503.
DEFAULT_QUEUE_TIMEOUT = 30.0
#: Seconds between writes of the gateway's usage counters to the store: a crash loses at
#: most this much accounting, and a busy gateway writes a few rows this often, not per request.
DEFAULT_USAGE_FLUSH_INTERVAL = 10.0

# --- routing (server.yaml ``routing:``; docs/gateway.md) ---------------------------------

#: KV-cache aware routing: a request goes where its prefix is already cached.
DEFAULT_ROUTING_POLICY = "kv"
#: Seconds a routed-but-unconfirmed block counts as held by the replica it was sent to
#: (llm-d's speculative entries): long enough for prefill plus the agent's event relay,
#: short enough that a request that failed does not attract its prefix for long.
DEFAULT_UNCONFIRMED_TTL = 2.0
#: Seconds allowed for one ``/tokenize`` call. A loopback call to vLLM takes a few
#: milliseconds (bench/tokens.py); past this the replica is busy, and routing
#: approximately now beats a precise decision later.
DEFAULT_TOKENIZE_TIMEOUT = 0.5
#: Seconds after a routed request within which the replica is expected to report some of
#: its leading blocks. Covers prefill of a long prompt plus the agent's batching.
DEFAULT_AGREEMENT_WINDOW = 10.0
#: Consecutive routed requests whose blocks the replica did not report while it reported
#: others, before the alarm is raised (one failed request is not a disagreement).
DEFAULT_MISMATCH_ALARM_AFTER = 3
