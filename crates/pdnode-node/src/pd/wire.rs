//! The `pdnode.v1.Node` data-path methods over a [`NodeClient`] (a [`super::PdNode`]): what the
//! node gRPC server answers for ReserveKv, Prefill, Decode and Abort. Conversions between wire
//! messages and router/core types happen here, at the edge.

use futures::StreamExt;
use pdnode_core::error::ErrorKind;
use pdnode_core::{NodeId, RequestId};
use pdnode_nodeapi::{
    DecodeCall, KvTarget, MigrateCall, NodeClient, NodeError, PrefillCall, ReserveKv,
};
use pdnode_proto::convert::{error_message, finish_reason_to_wire, grpc_code};
use pdnode_proto::v1;
use tonic::Status;

fn status(e: &NodeError) -> Status {
    Status::new(grpc_code(e.kind), e.message.clone())
}

fn bad(msg: impl Into<String>) -> Status {
    Status::invalid_argument(msg.into())
}

pub async fn reserve_kv(
    node: &dyn NodeClient,
    r: v1::ReserveKvRequest,
) -> Result<v1::ReserveKvResponse, Status> {
    if r.prompt_token_ids.is_empty() {
        return Err(bad("ReserveKv needs prompt_token_ids"));
    }
    if r.prompt_len != 0 && r.prompt_len as usize != r.prompt_token_ids.len() {
        return Err(bad(format!(
            "prompt_len {} does not match {} prompt_token_ids",
            r.prompt_len,
            r.prompt_token_ids.len()
        )));
    }
    let t = node
        .reserve_kv(ReserveKv {
            request_id: RequestId(r.request_id),
            prompt_token_ids: r.prompt_token_ids,
            max_tokens: r.max_tokens,
            prefill_node: NodeId::new(r.prefill_node_id),
        })
        .await
        .map_err(|e| status(&e))?;
    Ok(v1::ReserveKvResponse {
        target: Some(v1::KvTarget::from(&t)),
    })
}

pub async fn prefill(
    node: &dyn NodeClient,
    r: v1::PrefillRequest,
) -> Result<v1::PrefillResponse, Status> {
    let sampling: pdnode_core::SamplingParams = r.sampling.map(Into::into).unwrap_or_default();
    sampling.validate().map_err(|e| bad(e.to_string()))?;
    let target = r
        .kv_target
        .ok_or_else(|| bad("Prefill needs a kv_target (from the decode node's ReserveKv)"))?;
    // Every value of the target is checked here, at the edge (`pdnode_proto::convert`).
    let target = KvTarget::try_from(target).map_err(|e| bad(format!("kv_target: {e}")))?;
    let id = RequestId(r.request_id);
    let out = node
        .prefill(PrefillCall {
            request_id: id,
            prompt_token_ids: r.prompt_token_ids,
            sampling,
            target,
        })
        .await
        .map_err(|e| status(&e))?;
    Ok(v1::PrefillResponse {
        request_id: id.0,
        first_token_id: out.first_token_id,
        first_logprob: out.first_logprob.as_ref().map(Into::into),
        timings: Some(v1::PrefillTimings {
            transfer_us: out.transfer_us,
            transfer_bytes: out.transfer_bytes,
            cached_tokens: out.cached_tokens,
            ..Default::default()
        }),
        finish_reason: finish_reason_to_wire(out.finish),
        sampler: out.sampler.map(Into::into),
    })
}

pub type WireDecodeStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<v1::DecodeResponse, Status>> + Send>>;

pub async fn decode(
    node: &dyn NodeClient,
    r: v1::DecodeRequest,
) -> Result<WireDecodeStream, Status> {
    let sampling: pdnode_core::SamplingParams = r.sampling.map(Into::into).unwrap_or_default();
    sampling.validate().map_err(|e| bad(e.to_string()))?;
    let stream = node
        .decode(DecodeCall {
            request_id: RequestId(r.request_id),
            secret: r.secret,
            first_token_id: r.first_token_id,
            first_logprob: r.first_logprob.map(Into::into),
            sampling,
            prompt_token_ids: r.prompt_token_ids,
            sampler: r.sampler.map(Into::into),
        })
        .await
        .map_err(|e| status(&e))?;
    let mapped = stream.map(|item| match item {
        Ok(c) => Ok(v1::DecodeResponse {
            token_ids: c.token_ids,
            logprobs: c.logprobs.iter().map(Into::into).collect(),
            finish_reason: finish_reason_to_wire(c.finish),
            error: c.error.map(|e| error_message(e.kind, e.message)),
            migrate: c.migrate,
            ..Default::default()
        }),
        Err(e) => Ok(v1::DecodeResponse {
            finish_reason: finish_reason_to_wire(Some(pdnode_core::FinishReason::Error)),
            error: Some(error_message(e.kind, e.message)),
            ..Default::default()
        }),
    });
    Ok(Box::pin(mapped))
}

pub async fn abort(
    node: &dyn NodeClient,
    r: v1::AbortRequest,
) -> Result<v1::AbortResponse, Status> {
    let found = node
        .abort(RequestId(r.request_id), r.capability, r.reason)
        .await
        .map_err(|e| status(&e))?;
    Ok(v1::AbortResponse { found })
}

pub async fn migrate(
    node: &dyn NodeClient,
    r: v1::MigrateRequest,
) -> Result<v1::MigrateResponse, Status> {
    // Every value of the target is checked here, at the edge (`pdnode_proto::convert`).
    let target = r
        .target
        .map(KvTarget::try_from)
        .transpose()
        .map_err(|e| bad(format!("target: {e}")))?;
    let out = node
        .migrate(MigrateCall {
            request_id: RequestId(r.request_id),
            capability: r.capability,
            target,
        })
        .await
        .map_err(|e| status(&e))?;
    Ok(v1::MigrateResponse {
        token_ids: out.token_ids,
        prompt_len: out.prompt_len,
        generated: out.generated,
        sampler: out.sampler.map(Into::into),
        transfer_bytes: out.transfer_bytes,
        transfer_us: out.transfer_us,
    })
}

/// KvDone is not part of protocol v1's flow: the prefill node answers `Prefill` only after its
/// KV is flushed at the decode node, so the router's `Decode` call is the completion signal.
pub fn kv_done_unused() -> Status {
    Status::failed_precondition(
        "KvDone is unused in pdnode.v1: Prefill answers after the KV is flushed, and Decode claims it",
    )
}

/// The error kind a gRPC status carries, for logs.
pub fn kind_of(s: &Status) -> ErrorKind {
    pdnode_proto::convert::kind_of_status(s)
}
