//! [`NodeClient`] over the `pdnode.v1.Node` gRPC API.

// Wire messages are built with `..Default::default()` even when every field is set today, so
// fields added to pdnode.v1 (additive within v1) do not break this code.
#![allow(clippy::needless_update)]

use crate::tls::{NodeIdentity, NodeTls};
use crate::{
    DecodeCall, DecodeChunk, DecodeStream, KvTarget, MigrateCall, MigrateOutcome, NodeClient,
    NodeError, NodeStats, PrefillCall, PrefillOutcome, ReserveKv,
};
use futures::StreamExt;
use futures::future::BoxFuture;
use pdnode_core::{ErrorKind, NodeId, RequestId, Role};
use pdnode_proto::convert::{error_from_wire, finish_reason_from_wire, kind_of_status};
use pdnode_proto::v1;
use pdnode_proto::v1::node_client::NodeClient as WireClient;
use std::time::Duration;
use tonic::transport::{Channel, Endpoint};

/// `msg` as a request that carries the current span's trace context (W3C `traceparent` in its
/// metadata; none while traces are off). Called inside the call's future, so the span is the
/// caller's step span the future runs in.
fn traced<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    pdnode_telemetry::inject_metadata(&tracing::Span::current(), r.metadata_mut());
    r
}

/// How long a connection attempt to a node may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

fn status_err(s: tonic::Status) -> NodeError {
    // A status the node never sent (the connection broke: h2/transport error underneath) means
    // the node is gone or unreachable, not that it has a bug.
    use std::error::Error as _;
    if matches!(s.code(), tonic::Code::Unknown | tonic::Code::Internal) && s.source().is_some() {
        return NodeError::new(
            ErrorKind::Unavailable,
            format!("lost the connection to the node: {}", s.message()),
        );
    }
    NodeError::new(kind_of_status(&s), s.message().to_string())
}

/// How the router's channels to nodes are set up: HTTP/2 keepalive (`router.node_keepalive_*`)
/// and, with `security.tls_*`, mutual TLS ([`crate::tls`]).
///
/// A PING goes out after `keepalive_interval` without a frame from the node (also with no call
/// open); no answer within `keepalive_timeout` closes the connection, and every call on it fails
/// as `Unavailable` at once. That is how a frozen node (stopped process, hung host: the kernel
/// still ACKs, so TCP alone never notices) is found out in about interval + timeout.
#[derive(Debug, Clone)]
pub struct ChannelOptions {
    pub keepalive_interval: Duration,
    pub keepalive_timeout: Duration,
    /// Present this certificate and check the node's against the cluster CA; `None`: plaintext.
    pub tls: Option<NodeTls>,
}

impl From<&pdnode_core::config::RouterConfig> for ChannelOptions {
    fn from(c: &pdnode_core::config::RouterConfig) -> Self {
        Self {
            keepalive_interval: Duration::from_millis(c.node_keepalive_interval_ms),
            keepalive_timeout: Duration::from_millis(c.node_keepalive_timeout_ms),
            tls: None,
        }
    }
}

impl ChannelOptions {
    /// These options over mutual TLS with `tls` (`None`: plaintext).
    pub fn with_tls(mut self, tls: Option<NodeTls>) -> Self {
        self.tls = tls;
        self
    }
}

impl Default for ChannelOptions {
    fn default() -> Self {
        Self::from(&pdnode_core::config::RouterConfig::default())
    }
}

/// A client of one node's `pdnode.v1.Node` service.
#[derive(Clone)]
pub struct GrpcNodeClient {
    id: NodeId,
    inner: WireClient<Channel>,
}

impl GrpcNodeClient {
    /// A plaintext client that connects on first use to `addr` (`host:port` or a full URI), with
    /// the default [`ChannelOptions`].
    pub fn connect_lazy(id: NodeId, addr: &str) -> Result<Self, NodeError> {
        Self::connect_lazy_with(id, Role::Router, addr, &ChannelOptions::default())
    }

    /// A client of node `id` (of role `role`, as its card says) at `addr`, set up with `opts`.
    /// With TLS the node must present a certificate that names `id` and `role` in this node's
    /// cluster (see [`NodeTls::client_tls`]); `addr` then gets the `https` scheme.
    pub fn connect_lazy_with(
        id: NodeId,
        role: Role,
        addr: &str,
        opts: &ChannelOptions,
    ) -> Result<Self, NodeError> {
        let bad_addr = |uri: &str, e: &dyn std::fmt::Display| {
            NodeError::new(
                ErrorKind::InvalidRequest,
                format!("node {id} address {uri:?}: {e}"),
            )
        };
        let scheme = if opts.tls.is_some() { "https" } else { "http" };
        let uri = match addr.split_once("://") {
            Some((_, rest)) => format!("{scheme}://{rest}"),
            None => format!("{scheme}://{addr}"),
        };
        let mut ep = Endpoint::from_shared(uri.clone())
            .map_err(|e| bad_addr(&uri, &e))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_keep_alive_interval(opts.keepalive_interval)
            .keep_alive_timeout(opts.keepalive_timeout)
            .keep_alive_while_idle(true);
        if let Some(tls) = &opts.tls {
            let expect = NodeIdentity::new(tls.identity().cluster.clone(), role, id.clone());
            let (cfg, verifier) = tls.client_tls(expect);
            ep = ep
                .tls_config_with_verifier(cfg, verifier)
                .map_err(|e| bad_addr(&uri, &e))?;
        }
        Ok(Self {
            id,
            inner: WireClient::new(ep.connect_lazy()),
        })
    }

    /// `pdnode drain`: asks the node to shut down gracefully (`migrate`: moving its decodes
    /// first). Returns whether it will move them.
    pub async fn drain(&self, migrate: bool) -> Result<bool, NodeError> {
        let mut c = self.inner.clone();
        let r = c
            .drain(v1::DrainRequest { migrate })
            .await
            .map_err(status_err)?;
        Ok(r.into_inner().migrate)
    }

    pub fn id(&self) -> &NodeId {
        &self.id
    }
}

impl NodeClient for GrpcNodeClient {
    fn reserve_kv(&self, req: ReserveKv) -> BoxFuture<'_, Result<KvTarget, NodeError>> {
        let mut c = self.inner.clone();
        Box::pin(async move {
            let wire = v1::ReserveKvRequest {
                request_id: req.request_id.0,
                prompt_len: req.prompt_token_ids.len() as u32,
                max_tokens: req.max_tokens,
                prompt_token_ids: req.prompt_token_ids,
                prefill_node_id: req.prefill_node.to_string(),
                ..Default::default()
            };
            let r = c
                .reserve_kv(traced(wire))
                .await
                .map_err(status_err)?
                .into_inner();
            let t = r.target.ok_or_else(|| {
                NodeError::new(ErrorKind::Internal, "ReserveKv answered without a target")
            })?;
            KvTarget::try_from(t).map_err(|e| {
                NodeError::new(
                    ErrorKind::Internal,
                    format!("ReserveKv answered a bad KV target: {e}"),
                )
            })
        })
    }

    fn prefill(&self, req: PrefillCall) -> BoxFuture<'_, Result<PrefillOutcome, NodeError>> {
        let mut c = self.inner.clone();
        Box::pin(async move {
            let kv_target = Some(v1::KvTarget::from(&req.target));
            let wire = v1::PrefillRequest {
                request_id: req.request_id.0,
                prompt_token_ids: req.prompt_token_ids,
                sampling: Some((&req.sampling).into()),
                kv_target,
                ..Default::default()
            };
            let r = c
                .prefill(traced(wire))
                .await
                .map_err(status_err)?
                .into_inner();
            let finish = finish_reason_from_wire(r.finish_reason)
                .map_err(|e| NodeError::new(ErrorKind::Internal, e.to_string()))?;
            let t = r.timings.unwrap_or_default();
            Ok(PrefillOutcome {
                first_token_id: r.first_token_id,
                first_logprob: r.first_logprob.map(Into::into),
                finish,
                cached_tokens: t.cached_tokens,
                transfer_bytes: t.transfer_bytes,
                transfer_us: t.transfer_us,
                sampler: r.sampler.map(Into::into),
            })
        })
    }

    fn decode(&self, req: DecodeCall) -> BoxFuture<'_, Result<DecodeStream, NodeError>> {
        let mut c = self.inner.clone();
        Box::pin(async move {
            let wire = v1::DecodeRequest {
                request_id: req.request_id.0,
                secret: req.secret,
                first_token_id: req.first_token_id,
                first_logprob: req.first_logprob.as_ref().map(Into::into),
                sampling: Some((&req.sampling).into()),
                prompt_token_ids: req.prompt_token_ids,
                sampler: req.sampler.map(Into::into),
                ..Default::default()
            };
            let stream = c
                .decode(traced(wire))
                .await
                .map_err(status_err)?
                .into_inner();
            let mapped = stream.map(|item| {
                let msg = item.map_err(status_err)?;
                let finish = finish_reason_from_wire(msg.finish_reason)
                    .map_err(|e| NodeError::new(ErrorKind::Internal, e.to_string()))?;
                Ok(DecodeChunk {
                    token_ids: msg.token_ids,
                    logprobs: msg.logprobs.into_iter().map(Into::into).collect(),
                    finish,
                    error: msg.error.as_ref().map(|e| {
                        let (kind, message) = error_from_wire(e);
                        NodeError::new(kind, message)
                    }),
                    migrate: msg.migrate,
                })
            });
            let s: DecodeStream = Box::pin(mapped);
            Ok(s)
        })
    }

    fn abort(
        &self,
        id: RequestId,
        capability: Vec<u8>,
        reason: String,
    ) -> BoxFuture<'_, Result<bool, NodeError>> {
        let mut c = self.inner.clone();
        Box::pin(async move {
            let r = c
                .abort(traced(v1::AbortRequest {
                    request_id: id.0,
                    reason,
                    capability,
                }))
                .await
                .map_err(status_err)?;
            Ok(r.into_inner().found)
        })
    }

    fn migrate(&self, req: MigrateCall) -> BoxFuture<'_, Result<MigrateOutcome, NodeError>> {
        let mut c = self.inner.clone();
        Box::pin(async move {
            let r = c
                .migrate(traced(v1::MigrateRequest {
                    request_id: req.request_id.0,
                    capability: req.capability,
                    target: req.target.as_ref().map(v1::KvTarget::from),
                }))
                .await
                .map_err(status_err)?
                .into_inner();
            Ok(MigrateOutcome {
                token_ids: r.token_ids,
                prompt_len: r.prompt_len,
                generated: r.generated,
                sampler: r.sampler.map(Into::into),
                transfer_bytes: r.transfer_bytes,
                transfer_us: r.transfer_us,
            })
        })
    }

    fn stats(&self) -> BoxFuture<'_, Result<NodeStats, NodeError>> {
        let mut c = self.inner.clone();
        Box::pin(async move {
            let r = c
                .stats(v1::StatsRequest {})
                .await
                .map_err(status_err)?
                .into_inner();
            Ok(NodeStats {
                running_requests: r.running_requests,
                queued_requests: r.queued_requests,
                max_running_requests: r.max_running_requests,
                kv_blocks_free: r.kv_blocks_free,
                kv_blocks_total: r.kv_blocks_total,
                kv_blocks_reserved: r.kv_blocks_reserved,
                accounting: r.accounting.map(Into::into),
            })
        })
    }
}
