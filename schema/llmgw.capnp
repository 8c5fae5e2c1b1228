@0xd3a1c5e7f9b20461;
# llmgw's wire contract: control plane <-> agents, control plane <-> ctl/clients.
# Capabilities carry authority: nothing is addressed by id when a capability can say it.
# Field numbers are forever; add fields at the end of a struct with a new number.

struct KeyValue {
  key @0 :Text;
  value @1 :Text;
}

struct Gpu {
  index @0 :UInt32;
  uuid @1 :Text;
  name @2 :Text;
  memoryTotalMb @3 :UInt64;
  memoryFreeMb @4 :UInt64;
  gpuClass @5 :Text;       # "a100-80g", "a100-80g-mig-3g.40gb"; index >= 1000: a MIG instance (card/migN)
}

struct Hardware {
  cpuCount @0 :UInt32;
  memoryTotalMb @1 :UInt64;
  memoryAvailableMb @2 :UInt64;
  gpus @3 :List(Gpu);
  gpuNote @4 :Text;        # why there are no GPUs, in words ("no GPUs: NVML library not found")
  diskFreeMb @5 :UInt64;   # free space where the agent keeps model weights (0 = unknown)
  diskTotalMb @6 :UInt64;
  driverVersion @7 :Text;  # NVIDIA driver ("" = none)
  cudaVersion @8 :Text;    # the newest CUDA the driver supports
  os @9 :Text;
  arch @10 :Text;
  cpuFlags @11 :List(Text); # the CPU's vector extensions
}

# A node's live telemetry (llmgw/telemetry.py): readings by name; a sensor not read is absent.
struct Reading {
  name @0 :Text;
  value @1 :Float64;
}

struct GpuTelemetry {
  index @0 :UInt32;        # the card's index
  uuid @1 :Text;
  gpuClass @2 :Text;
  ageMs @3 :UInt32;        # how old the readings are
  readings @4 :List(Reading);
  throttleReasons @5 :List(Text);
  throttleKnown @6 :Bool;  # false: the reasons could not be read (the list is empty)
}

struct ShardUsage {
  shardId @0 :Text;
  cores @1 :Float64;       # NaN: not known yet (a rate needs two samples)
  memoryBytes @2 :UInt64;
}

struct ForeignGpuProcess {
  pid @0 :UInt32;
  name @1 :Text;
  gpu @2 :UInt32;          # placement index (>= 1000: a MIG instance)
  usedMemoryMb @3 :Int64;  # -1: the driver does not say
}

struct XidCount {
  pciAddress @0 :Text;
  xid @1 :UInt32;
  count @2 :UInt64;
  lastMessage @3 :Text;
}

struct Telemetry {
  ageMs @0 :UInt32;        # how old the host sample is
  host @1 :List(Reading);
  gpus @2 :List(GpuTelemetry);
  shards @3 :List(ShardUsage);
  foreignProcesses @4 :List(ForeignGpuProcess);
  xids @5 :List(XidCount);
  note @6 :Text;
}

struct EngineInfo {
  name @0 :Text;
  installed @1 :Bool;
  version @2 :Text;
  installable @3 :Bool;
  detail @4 :Text;
  state @5 :Text;          # what the agent is doing about it ("installing: downloading X (16 MB)"); "" = idle
  path @6 :Text;           # what the agent runs: llama-server, or the Python of vLLM/SGLang ("" = none/built in)
  origin @7 :Text;         # where that path comes from: "agent.yaml" (named by the operator), "installed", "built-in"
}

struct Adapter {
  name @0 :Text;           # shares the model namespace: requests name it as their "model"
  source @1 :Text;         # where its files come from (local path, http(s) URL, hf://org/repo[@rev])
}

struct Profile {
  replicas @0 :UInt32;
  memoryMb @1 :UInt64;
  cpuCores @2 :Float64;
  gpus @3 :UInt32;
  engineArgs @4 :List(Text);
  engineEnv @5 :List(KeyValue);
  nodeLabels @6 :List(Text);   # "key=value": a node must carry every one to run a replica
  gpuClass @7 :Text;           # the GPU class each replica runs on ("" = any)
}

struct Model {
  name @0 :Text;
  engine @1 :Text;
  source @2 :Text;
  profile @3 :Profile;
  adapters @4 :List(Adapter);
  maxLoadedAdapters @5 :UInt32;  # 0: every adapter loaded at start; N: at most N per replica, loaded on demand
}

struct ShardSpec {
  id @0 :Text;
  model @1 :Text;
  engine @2 :Text;
  source @3 :Text;
  args @4 :List(Text);
  env @5 :List(KeyValue);
  memoryMb @6 :UInt64;
  cpuCores @7 :Float64;
  gpus @8 :List(UInt32);
  adapters @9 :List(Adapter);    # LoRA adapters of the model; the node fetches each like the weights
  maxLoadedAdapters @10 :UInt32; # 0: every adapter loaded at start; N: at most N at a time (vLLM, runtime API)
  fingerprint @11 :Text;        # the model definition this shard runs (rollouts compare it; kept across adoption)
  apiKey @12 :Text;             # the engine's secret: the gateway sends it as a Bearer token; never logged or shown
  gpuUuids @13 :List(Text);     # the UUID of each of gpus (a MIG instance is named to CUDA by its MIG-... UUID)
}

enum ShardState {
  starting @0;
  ready @1;
  unhealthy @2;
  restarting @3;
  failed @4;
  stopping @5;
  stopped @6;
}

struct ShardStatus {
  id @0 :Text;
  state @1 :ShardState;
  endpoint @2 :Text;       # "http://host:port" of the engine's OpenAI API
  pid @3 :UInt32;
  restarts @4 :UInt32;
  message @5 :Text;
  lastOutput @6 :List(Text);
  compute @7 :Compute;     # what the engine computes on (read from its output at READY)
  hasCompute @8 :Bool;     # false: not known yet (compute is then empty)
  adapters @9 :List(KeyValue);  # adapter name -> its path on the node, as the engine loads it
}

# What an engine says it computes on (llmgw.spec.Compute). Sizes in MiB.
struct ComputeDevice {
  name @0 :Text;           # "CUDA0", "CPU"
  description @1 :Text;    # "NVIDIA H200"
  memoryTotalMb @2 :UInt64;
  memoryFreeMb @3 :UInt64;
}

struct Compute {
  backend @0 :Text;
  devices @1 :List(ComputeDevice);
  modelBufferMb @2 :Float64;
  kvBufferMb @3 :Float64;
  layersOffloaded @4 :Int32;   # -1: the engine did not say
  layersTotal @5 :Int32;
  threads @6 :UInt32;
  source @7 :Text;             # "engine", "nvidia-smi", "default"
  notes @8 :List(Text);
}

struct RunningShard {
  spec @0 :ShardSpec;
  status @1 :ShardStatus;
}

struct Registration {
  nodeId @0 :Text;         # must equal the name in the node's certificate
  address @1 :Text;        # the node's address on the route to the control plane
  hardware @2 :Hardware;
  shards @3 :List(RunningShard);   # engines this agent runs now (adopted or started earlier)
  engines @4 :List(EngineInfo);
  features @5 :List(Text);
  agent @6 :Agent;
  version @7 :Text;        # llmgw version of the agent
  labels @8 :List(Text);   # "key=value" (agent.yaml labels): profiles' node_labels select nodes by them
  jobs @9 :List(Text);     # training jobs this agent runs now: a new leader adopts them (Agent.adoptJob)
}

interface Cluster {
  # Bootstrap capability on the RPC port. The TLS client certificate names the caller and its role;
  # each method checks it.
  join @0 (registration :Registration) -> (desk :NodeDesk, heartbeatIntervalMs :UInt32);
  # Nodes only. The session lasts as long as this connection; a second join for the same node replaces it.
  admin @1 () -> (admin :Admin);
  # Admin certificates only. On a standby, the leader's Admin (reached over the standby's peer session).
  peer @2 (feed :GatewayFeed, version :Text) -> (peer :ControlPeer, epoch :UInt64);
  # Control-plane certificates named in the store only, and only while this control plane leads:
  # the leader streams its gateway's routes and KV-cache state into the standby's feed.
}

struct RouteReplica {
  # One ready replica as the gateway routes to it (llmgw.router.replicas.Replica).
  id @0 :Text;
  model @1 :Text;
  endpoint @2 :Text;
  nodeId @3 :Text;
  engine @4 :Text;
  adapters @5 :List(KeyValue);  # adapter name -> its path on the node
  apiKey @6 :Text;              # the engine's secret: sent over mutual TLS to control planes only
}

struct RouteModel {
  name @0 :Text;
  engine @1 :Text;
  adapters @2 :List(Text);
  maxLoadedAdapters @3 :UInt32;
}

interface GatewayFeed {
  # A standby's gateway, fed by the leader in order: the whole route table on every change,
  # KV-cache deltas per replica (a reset first: a full copy).
  routes @0 (replicas :List(RouteReplica), models :List(RouteModel)) -> ();
  kvUpdate @1 (replica :Text, update :KvUpdate) -> ();
  kvForget @2 (replica :Text) -> ();
  accessChanged @3 () -> ();
  # Keys, tenants or serving.stopped changed in the store: reload them now.
  restart @4 () -> ();
  # Restart this standby (llmgw ctl restart): it stops gracefully and runs again, once this call has answered.
  admissionShares @5 (shares :List(TenantShare), default :Float64) -> ();
  # This standby's gateway's shares of the tenants' limits (docs/ha.md): `shares` for the tenants named,
  # `default` (1/N, N the control planes) for every other. Answers once the gateway applied them.
  receiveRelease @6 (name :Text, offset :UInt64, chunk :Data) -> (received :UInt64);
  upgrade @7 (name :Text, sha256 :Text) -> (release :Text, previous :Text);
  # As Agent.receiveRelease and Agent.upgrade, for this standby: `llmgw ctl upgrade` upgrades the control
  # planes (standbys first) through the leader. The standby answers, then exits with status 75.
}

struct TenantShare {
  # One gateway's fractions, each in (0, 1], of one tenant's limits.
  tenant @0 :Text;
  concurrency @1 :Float64;
  rpm @2 :Float64;
  tpm @3 :Float64;
}

struct TenantDemand {
  # What one tenant asked of one gateway since its previous report.
  tenant @0 :Text;
  inFlight @1 :UInt32;     # admitted or queued now
  admitted @2 :UInt64;     # since the previous report
  shed @3 :UInt64;
  tokens @4 :UInt64;       # tokens asked for (estimates), tenants with a token budget only
}

interface ControlPeer {
  # The leader's side of one standby's peer session.
  ping @0 () -> (epoch :UInt64);
  # Fails once the leader no longer leads.
  admin @1 (actor :Text) -> (admin :Admin);
  # The leader's Admin for a standby's admin caller (actor: the caller's certificate name).
  reportDemand @2 (tenants :List(TenantDemand)) -> ();
  # The standby's gateway's demand per tenant, every second: the leader shares the tenant limits by it.
}

interface NodeDesk {
  # The control plane's side of one node session.
  heartbeat @0 (hardware :Hardware, telemetry :Telemetry) -> ();
  # telemetry: the latest sample (unset from agents before issue 16)
  reportEngines @1 (engines :List(EngineInfo)) -> ();
  # The node's engines changed (install progress, installed, failed): the full list, replacing the last.
  reportConfigProblem @2 (problem :Text) -> ();
  # Why the agent runs on an older configuration (an edited agent.yaml that does not load); "": none now.
  jobResult @3 (id :Text, offset :UInt64) -> (chunk :Data, total :UInt64, sha256 :Text, format :Text);
  # A piece of finished training job ID's result (an adapter source llmgw-job://ID), from OFFSET.
}

# LoRA fine-tuning jobs (issue 17): the control plane keeps them, a node trains.
struct TrainingParams {
  steps @0 :UInt32;          # optimiser steps (0: run `epochs` passes over the pairs)
  epochs @1 :Float64;
  rank @2 :UInt32;
  alpha @3 :Float64;
  learningRate @4 :Float64;
  seed @5 :UInt32;
  maxSeqLen @6 :UInt32;
}

struct TrainingJobView {
  id @0 :Text;
  adapter @1 :Text;          # the name the result is registered under
  model @2 :Text;            # the catalog model it is for
  weights @3 :Text;          # the safetensors source trained on (the model's own by default)
  node @4 :Text;             # the node asked for ("" = any that fits)
  assignedNode @5 :Text;     # where it trains ("" while queued)
  gpuMib @6 :UInt64;         # card memory it needs (0: trains on the CPU)
  gpu @7 :Int32;             # the placement index it trains on (-1: CPU or not yet placed)
  params @8 :TrainingParams;
  state @9 :Text;            # queued | running | succeeded | failed | cancelled
  message @10 :Text;
  step @11 :UInt32;
  steps @12 :UInt32;
  loss @13 :Float64;         # NaN: none yet
  firstLoss @14 :Float64;
  peakMemoryBytes @15 :UInt64;
  device @16 :Text;
  pairs @17 :UInt32;
  createdBy @18 :Text;
  createdAt @19 :Float64;
  updatedAt @20 :Float64;
  resultBytes @21 :UInt64;   # 0: no result kept
  resultSha256 @22 :Text;
  resultFormat @23 :Text;    # "peft" (a .tar of the PEFT directory) or "gguf"
  register @24 :Bool;        # add the result to the model as an adapter once it succeeds
}

struct TrainingJobSpec {
  # What a node gets to train: sent by the leader's scheduler over the node's session.
  id @0 :Text;
  model @1 :Text;
  weights @2 :Text;
  params @3 :TrainingParams;
  gpu @4 :Int32;             # placement index of the card (-1: the CPU)
  gpuUuid @5 :Text;
  gguf @6 :Bool;             # the model is served by llama.cpp: convert the adapter to GGUF
}

interface JobReporter {
  # Handed by the control plane per job: what the trainer does flows up through it, for that job only.
  event @0 (json :Text) -> ();
  # One trainer event (start, progress, done, error) as the trainer printed it.
  result @1 (offset :UInt64, chunk :Data, total :UInt64, sha256 :Text, format :Text) -> ();
  # A piece of the result file (checksummed as a whole: sha256 of all TOTAL bytes); OFFSET 0 starts afresh.
  finished @2 (ok :Bool, message :Text) -> ();
  # The job ended: ok once the whole result was sent; message says why it failed or was cancelled.
}

interface TrainingJob {
  # Handed by the agent per job.
  cancel @0 () -> ();
  # Cancels the job's nursery: the trainer's process group is killed, nothing is left running.
  logs @1 (lines :UInt32) -> (lines :List(Text));
}

interface Agent {
  # The agent's side of one node session, handed over in the registration.
  startShard @0 (spec :ShardSpec, reporter :ShardReporter) -> (shard :Shard);
  # Idempotent per spec.id: starting a shard that runs already re-binds it to this reporter.
  adopt @1 (id :Text, reporter :ShardReporter) -> (shard :Shard);
  # Re-binds a running shard (reported at registration) to a reporter of this session.
  ping @2 () -> ();
  wantEngines @3 (engines :List(KeyValue)) -> ();
  # The engines this node should have: name -> version ("" = the version the agent's llmgw was checked
  # against). The agent converges on it in the background and reports progress through NodeDesk.reportEngines.
  checkEngine @4 (engine :Text) -> (output :Text);
  # Runs the engine's version and device check on the node; fails with the reason when it cannot run.
  controlPlanes @5 (addresses :List(Text)) -> ();
  # The RPC addresses of every control plane of the cluster, the leader first: the agent dials them
  # (and keeps them beside its state) from now on, before the ones its agent.yaml names.
  settings @6 (json :Text) -> ();
  # This node's layer of the cluster settings (agents.default with agents.nodes.<id> over it), a JSON
  # mapping of agent.yaml keys. An agent it changes restarts on it, engines kept; fails with the reason
  # when it does not load with the node's agent.yaml.
  restart @7 () -> ();
  # Restart the agent (the same command, exec'd once this call has answered); its engines keep serving.
  logs @8 (source :Text, lines :UInt32, after :UInt64) -> (lines :List(Text), sources :List(Text), cursor :UInt64);
  # The last LINES lines of SOURCE: "agent" (the agent's own log, redacted) or a shard id (its engine's
  # output), oldest first; sources lists what this node can show ("agent" first, then its shards). With
  # AFTER (a cursor an earlier call returned), only the lines added since (at most LINES, the newest):
  # how `ctl logs -f` follows, holding nothing on the node between calls.
  receiveRelease @9 (name :Text, offset :UInt64, chunk :Data) -> (received :UInt64);
  # A piece of the llmgw wheel NAME (llmgw-VERSION-py3-none-any.whl), written at OFFSET (0 starts it
  # afresh); returns the bytes held. Agents listing the feature "upgrade" answer it.
  upgrade @10 (name :Text, sha256 :Text, rollbackAfterMs :UInt32) -> (release :Text, previous :Text);
  # Installs the received wheel NAME (checked against SHA256) as a new release beside the running one,
  # switches the release root's `current` link to it, answers, then exits with status 75 so its service
  # manager starts the new release (engines keep running and are adopted). Fails with the reason, nothing
  # switched, for a damaged wheel, a version already running, a failed install, or an agent not run from
  # a release root (llmgw/releases.py). A new release whose agent has not joined a control plane within
  # ROLLBACK_AFTER_MS (0: no limit) switches back by itself.
  rollback @11 () -> (release :Text, previous :Text);
  # Switches `current` back to the previous release, answers, exits with status 75.
  startJob @13 (spec :TrainingJobSpec, pairs :Data, reporter :JobReporter) -> (job :TrainingJob);
  adoptJob @14 (id :Text, reporter :JobReporter) -> (job :TrainingJob);
  # Re-binds job ID (listed in the registration) to a reporter of this session: a new leader after a
  # failover. The job's reports waited for it; fails for a job that no longer runs here.
  # Trains SPEC on PAIRS (JSONL) in a nursery of its own, reporting through REPORTER; fails with the
  # reason when it cannot start (another job trains here, no vLLM environment to train with). Agents
  # listing the feature "training" answer it.
  firewall @12 (json :Text) -> ();
  # The cluster setting `firewall` ({"enabled": bool, "networks": [CIDR, ...]}) as JSON: the agent keeps
  # it and keeps its engines' ports reachable only from the control planes and those networks
  # (llmgw/node/firewall.py). Fails with the reason for a setting that does not check. Agents listing the
  # feature "firewall" answer it.
}

struct KvUpdate {
  # The KV-cache blocks one engine holds, as its KV events say, net of what was sent before.
  reset @0 :Bool;          # true: the replica holds exactly `stored` (full copy or resync); false: a net change
  stored @1 :List(UInt64); # block hashes (vLLM's 64-bit event form) added
  removed @2 :List(UInt64);# block hashes evicted (empty when reset)
  blockSize @3 :UInt32;    # tokens per block (0: not known yet)
  eventsApplied @4 :UInt64;# cumulative counters of the shard's subscriber, for metrics
  gaps @5 :UInt64;
  resyncs @6 :UInt64;
}

interface ShardReporter {
  # Handed by the control plane per shard: status flows up through it, for that shard only.
  status @0 (status :ShardStatus) -> ();
  kvUpdate @1 (update :KvUpdate) -> ();
  # KV-cache block changes of this shard's engine (batched by the agent, bounded rate).
}

interface Shard {
  # Handed by the agent per shard: the control plane's handle on that engine.
  stop @0 (graceMs :UInt32) -> ();
  status @1 () -> (status :ShardStatus);
  logs @2 (lines :UInt32) -> (lines :List(Text));
  drain @3 (timeoutMs :UInt32) -> (idle :Bool, inFlight :UInt32);
  # Waits until the engine has no request in flight (running or waiting), at most timeoutMs;
  # idle is false when the time ran out or the engine cannot say (inFlight: the last count).
}

struct NodeView {
  id @0 :Text;
  address @1 :Text;
  state @2 :Text;          # online | disconnected | lost
  hardware @3 :Hardware;
  engines @4 :List(EngineInfo);
  secondsSinceHeartbeat @5 :Float64;
  shards @6 :UInt32;
  version @7 :Text;
  configProblem @8 :Text;  # why the node runs on an older configuration (refused settings, bad agent.yaml); "": none
  labels @9 :List(Text);   # "key=value"
  telemetry @10 :Telemetry; # the latest sample, ages as of this answer, stale readings left out
}

struct ReplicaView {
  id @0 :Text;
  model @1 :Text;
  nodeId @2 :Text;
  state @3 :Text;
  endpoint @4 :Text;
  pid @5 :UInt32;
  restarts @6 :UInt32;
  message @7 :Text;
  lastOutput @8 :List(Text);
  compute @9 :Compute;
  hasCompute @10 :Bool;
  computeSummary @11 :Text;  # one line for tables: "CPU, 0.4 MiB model, 0.5 MiB KV"
  fingerprint @12 :Text;     # of the model definition the replica runs
  outdated @13 :Bool;        # the catalog's definition of its model has changed since: a rollout replaces it
}

struct Rollout {
  # What saving a model's definition does to its running replicas.
  kind @0 :Text;       # "new", "unchanged", "surge" (new ready before old stops), "in-place" (no room), "blocked"
  outdated @1 :UInt32; # running replicas of an older definition that will be replaced
  message @2 :Text;    # the same in words, for people
}

struct ClusterStatus {
  version @0 :Text;
  nodesOnline @1 :UInt32;
  nodesLost @2 :UInt32;
  replicasReady @3 :UInt32;
  replicasTotal @4 :UInt32;
  models @5 :UInt32;
  gatewayUrl @6 :Text;
  unplaceable @7 :List(Text);
  servingStopped @8 :Bool;
  admission @9 :List(TenantAdmission);
  kvAlarms @10 :List(Text);  # KV routing alarms in words (hash mismatch between router and engine, ...)
  leader @11 :Text;          # the control plane that leads (answers this call)
  epoch @12 :UInt64;         # its epoch: grows by one at every change of leader
  leaderSince @13 :Float64;  # Unix seconds it has led since
  controlPlanes @14 :List(ControlPlaneView);
  routing @15 :Text;         # the leader gateway's routing in words (server.yaml routing: + setting routing)
  # Per tenant, since this control plane's gateway started.
}

struct ControlPlaneView {
  name @0 :Text;
  rpcAddress @1 :Text;
  httpAddress @2 :Text;
  role @3 :Text;        # "leader", "standby" (streaming from the leader), "down" (no peer session)
  lastSeen @4 :Float64; # Unix seconds it last started
  version @5 :Text;     # its llmgw release, where the leader knows it (itself, attached standbys); "" otherwise
}

struct Tenant {
  name @0 :Text;
  allModels @1 :Bool;
  models @2 :List(Text);
  # Ignored when allModels is set.
  maxConcurrency @3 :UInt32;
  rpm @4 :UInt32;
  tpm @5 :UInt32;
  # Limits: 0 means unlimited.
  createdAt @6 :Float64;
  updatedAt @7 :Float64;
}

struct ApiKey {
  id @0 :Text;
  tenant @1 :Text;
  name @2 :Text;
  createdAt @3 :Float64;
  revokedAt @4 :Float64;
  # 0 while active.
}

struct UsageRow {
  tenant @0 :Text;
  model @1 :Text;
  requests @2 :UInt64;
  promptTokens @3 :UInt64;
  completionTokens @4 :UInt64;
}

struct TenantAdmission {
  tenant @0 :Text;
  admitted @1 :UInt64;
  queued @2 :UInt64;
  shed @3 :UInt64;
  inFlight @4 :UInt32;
  share @5 :Float64;  # this gateway's fraction of the tenant's limits (concurrency; 1 with one gateway)
}

interface Admin {
  status @0 () -> (status :ClusterStatus);
  listNodes @1 () -> (nodes :List(NodeView));
  listReplicas @2 () -> (replicas :List(ReplicaView), unplaceable :List(Text));
  listModels @3 () -> (models :List(Model));
  addModel @4 (model :Model, replace :Bool) -> (model :Model, rollout :Rollout);
  # Fails with the validation error, naming the field, when the model is invalid.
  # rollout: what the cluster will do about running replicas of an older definition.
  removeModel @5 (name :Text) -> (removed :Bool);
  replicaLogs @6 (id :Text, lines :UInt32) -> (lines :List(Text));
  # Tenants and API keys (issue 3). Each change is audited and reaches the gateway at once.
  listTenants @7 () -> (tenants :List(Tenant));
  putTenant @8 (tenant :Tenant, create :Bool) -> (tenant :Tenant);
  # create: fails if the name exists; otherwise fails if it does not.
  removeTenant @9 (name :Text) -> (removed :Bool);
  # Also revokes the tenant's keys.
  createKey @10 (tenant :Text, name :Text) -> (key :ApiKey, secret :Text);
  # secret is the whole key, returned this once; only its hash is stored.
  listKeys @11 () -> (keys :List(ApiKey));
  revokeKey @12 (id :Text) -> (key :ApiKey);
  usage @13 () -> (rows :List(UsageRow));
  setServingStopped @14 (stopped :Bool) -> (stopped :Bool);
  # Sets the cluster setting serving.stopped (every POST under /v1/ answers 503 system_stopped).
  checkEngine @15 (node :Text, engine :Text) -> (output :Text);
  # Runs ENGINE's version and device check on NODE (through its agent) and returns the output.
  getSettings @16 (key :Text) -> (settings :List(Setting));
  # The current version of every stored setting (key ""), or of the one stored key KEY belongs to.
  setSetting @17 (key :Text, valueJson :Text, unset :Bool) -> (setting :Setting);
  # Sets KEY (a stored key, or a dotted key below one) to the JSON value, or removes it (unset).
  # Fails naming the key path and the reason when the key or the value is not allowed; nothing is stored then.
  settingHistory @18 (key :Text) -> (versions :List(Setting));
  # Every version of the stored key KEY belongs to, oldest first.
  restartCluster @19 () -> (agents :UInt32, standbys :UInt32, leader :Text);
  # Restart every agent (each back before the next step), then every standby, then the leader; engines keep
  # serving. Answers once the standbys are back; the leader restarts right after answering.
  createJoinToken @20 (role :Text, name :Text, ttlSeconds :Float64, labels :List(Text),
                       disabledEngines :List(Text)) -> (token :Text, expiresAt :Float64, controlPlanes :List(Text));
  # A one-time token a new machine redeems once (JoinDesk.redeem) for a certificate of ROLE named NAME
  # ("control": a new control plane); it expires after ttlSeconds. The token is returned this once.
  # labels ("key=value") and disabledEngines (nodes only) are what the node writes into its agent.yaml.
  listJoinTokens @21 () -> (tokens :List(JoinTokenView));
  removeControlPlane @22 (name :Text) -> (removed :Bool);
  # Forgets control plane NAME, revokes its certificate and its pending tokens, and ends its peer session.
  # Refused for the leader itself (stop it first: another leads, then remove it).

  createAdminToken @23 (name :Text) -> (token :Text, view :AdminTokenView);
  # A bearer token for the HTTP admin API (/api/v1/*), returned this once; only its SHA-256 is stored.
  listAdminTokens @24 () -> (tokens :List(AdminTokenView));
  revokeAdminToken @25 (id :Text) -> (view :AdminTokenView);

  nodeLogs @27 (node :Text, source :Text, lines :UInt32, after :UInt64)
      -> (lines :List(Text), sources :List(Text), cursor :UInt64);
  # Agent.logs of NODE, over the session it holds; fails saying so for a node not connected or an agent
  # too old to answer.
  removeNode @26 (name :Text) -> (removed :Bool, certificatesRevoked :UInt32, tokensRevoked :UInt32);
  # Forgets node NAME: revokes every certificate it was issued or connected with and its pending join
  # tokens, ends its session and stops placing there (its replicas are placed elsewhere). Its engines are
  # not contacted: stop the agent on the machine (`llmgw service stop`) to end them.
  uploadRelease @28 (name :Text, offset :UInt64, chunk :Data) -> (received :UInt64);
  # A piece of the llmgw wheel NAME for `ctl upgrade`, kept by the leader (OFFSET 0 starts it afresh).
  upgradeNode @29 (node :Text, name :Text, sha256 :Text, rollbackAfterMs :UInt32) -> (release :Text, previous :Text);
  # Sends the uploaded wheel NAME to NODE over its session and has its agent install it and restart on
  # it (Agent.receiveRelease, Agent.upgrade).
  rollbackNode @30 (node :Text) -> (release :Text, previous :Text);
  # Agent.rollback of NODE.
  upgradeControlPlane @31 (name :Text, release :Text, sha256 :Text) -> (release :Text, previous :Text);
  # Installs the uploaded wheel RELEASE on control plane NAME (the leader itself, or an attached standby
  # through its GatewayFeed) and has it restart on it (exit status 75) once this call has answered.

  trainJob @32 (adapter :Text, model :Text, weights :Text, node :Text, gpuMib :UInt64, params :TrainingParams,
                pairs :Data, register :Bool) -> (job :TrainingJobView);
  # Queues a LoRA training job: PAIRS (JSONL) are checked first (bad lines refused with their numbers),
  # MODEL must be in the catalog, ADAPTER a free name. The leader's scheduler sends it to a node.
  # REGISTER: once it succeeds, the result is added to MODEL as adapter ADAPTER (llmgw-job://ID).
  listJobs @33 () -> (jobs :List(TrainingJobView));
  cancelJob @34 (id :Text) -> (job :TrainingJobView);
  # A queued job is cancelled at once; a running one once its node has killed the trainer.
  jobLogs @35 (id :Text, lines :UInt32) -> (lines :List(Text));
  # The job's events as the trainer printed them, and what the control plane did with it.
  downloadJob @36 (id :Text, offset :UInt64, length :UInt32) -> (chunk :Data, total :UInt64, sha256 :Text,
                                                                 format :Text);
  # A piece of a finished job's result.
}

struct AdminTokenView {
  id @0 :Text;
  name @1 :Text;
  createdBy @2 :Text;
  createdAt @3 :Float64;
  revokedAt @4 :Float64;  # 0 while active
}

struct Setting {
  key @0 :Text;
  valueJson @1 :Text;   # "null": unset
  version @2 :UInt32;
  updatedAt @3 :Float64;
  actor @4 :Text;
}

struct JoinTokenView {
  id @0 :Text;
  role @1 :Text;
  name @2 :Text;
  createdAt @3 :Float64;
  createdBy @4 :Text;
  expiresAt @5 :Float64;
  state @6 :Text;       # pending, used, expired, revoked
  usedBy @7 :Text;      # the address it was redeemed from ("" until used)
  labels @8 :List(Text);           # nodes: "key=value" the node's agent.yaml gets
  disabledEngines @9 :List(Text);  # nodes: engines the node's agent.yaml disables
}

struct JoinGrant {
  # What a machine joining with a token gets back.
  role @0 :Text;
  name @1 :Text;
  certificate @2 :Data;    # PEM, over the public key of its request: its private key never left it
  ca @3 :Data;             # the cluster CA certificate, PEM
  caKey @4 :Data;          # control planes only: the CA's key, so any control plane can sign after a failover
  storeUrl @5 :Text;       # control planes only: the store every control plane shares
  leaderLease @6 :Float64; # control planes only: seconds
  controlPlanes @7 :List(Text);  # every control plane's RPC address
  labels @8 :List(Text);           # nodes: "key=value" to write into agent.yaml (ctl nodes add --labels)
  disabledEngines @9 :List(Text);  # nodes: engines to disable in agent.yaml (ctl nodes add --disable-engine)
}

interface JoinDesk {
  # The bootstrap of an RPC connection that presented no certificate: joining with a token, nothing else.
  caCertificate @0 () -> (pem :Data);
  # The cluster CA certificate: the joiner checks it against the pin in its token before sending the token.
  redeem @1 (token :Text, request :Data, sans :List(Text), role :Text) -> (grant :JoinGrant);
  # request: a PEM certificate signing request (the joiner's key); sans: addresses a control plane is reached by;
  # role: what the joiner will run ("control", "node"; "": any): a token for another role is refused unspent.
}
