//! Conversions between `pdnode.v1` messages and pdnode-core types.
//!
//! Core -> wire is infallible (`From`). Wire -> core is `TryFrom` wherever the message holds an
//! enum or a value the core type constrains: an unknown or unspecified enum value from the wire is
//! a [`ConvertError`], never a panic.

use crate::v1;
use pdnode_core::card::{NodeAddresses, NodeCapacity};
use pdnode_core::error::Classify;
use pdnode_core::request::{SamplerState, TokenLogprob};
use pdnode_core::{
    DType, ErrorKind, FinishReason, KvKind, KvLayout, NodeCard, NodeId, Role, SamplingParams,
};

/// A wire message that does not map onto the core type.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    /// An enum field holds a number this version does not know.
    #[error("field `{field}`: unknown enum value {value}")]
    UnknownEnumValue { field: &'static str, value: i32 },
    /// An enum field is `*_UNSPECIFIED` where a value is required.
    #[error("field `{field}` is unspecified")]
    Unspecified { field: &'static str },
    /// A required message field is not set.
    #[error("field `{field}` is missing")]
    Missing { field: &'static str },
    /// A value out of the range the core type accepts.
    #[error("field `{field}`: {reason}")]
    Invalid { field: &'static str, reason: String },
}

impl Classify for ConvertError {
    fn kind(&self) -> ErrorKind {
        ErrorKind::InvalidRequest
    }
}

/// Reads a prost enum from its wire `i32`, naming `field` in the error.
fn wire_enum<E: TryFrom<i32>>(field: &'static str, value: i32) -> Result<E, ConvertError> {
    E::try_from(value).map_err(|_| ConvertError::UnknownEnumValue { field, value })
}

// ---------------------------------------------------------------- Role

impl From<Role> for v1::Role {
    fn from(r: Role) -> Self {
        match r {
            Role::Prefill => v1::Role::Prefill,
            Role::Decode => v1::Role::Decode,
            Role::Router => v1::Role::Router,
            Role::All => v1::Role::All,
        }
    }
}

impl TryFrom<v1::Role> for Role {
    type Error = ConvertError;
    fn try_from(r: v1::Role) -> Result<Self, ConvertError> {
        match r {
            v1::Role::Unspecified => Err(ConvertError::Unspecified { field: "role" }),
            v1::Role::Prefill => Ok(Role::Prefill),
            v1::Role::Decode => Ok(Role::Decode),
            v1::Role::Router => Ok(Role::Router),
            v1::Role::All => Ok(Role::All),
        }
    }
}

/// A role field from the wire; `ROLE_UNSPECIFIED` is an error.
pub fn role_from_wire(field: &'static str, value: i32) -> Result<Role, ConvertError> {
    match wire_enum::<v1::Role>(field, value)? {
        v1::Role::Unspecified => Err(ConvertError::Unspecified { field }),
        r => Role::try_from(r),
    }
}

/// A role filter from the wire (e.g. `ListNodesRequest.role`): `ROLE_UNSPECIFIED` means any.
pub fn role_filter_from_wire(
    field: &'static str,
    value: i32,
) -> Result<Option<Role>, ConvertError> {
    match wire_enum::<v1::Role>(field, value)? {
        v1::Role::Unspecified => Ok(None),
        r => Role::try_from(r).map(Some),
    }
}

// ---------------------------------------------------------------- FinishReason

impl From<FinishReason> for v1::FinishReason {
    fn from(f: FinishReason) -> Self {
        match f {
            FinishReason::Stop => v1::FinishReason::Stop,
            FinishReason::Length => v1::FinishReason::Length,
            FinishReason::Abort => v1::FinishReason::Abort,
            FinishReason::Error => v1::FinishReason::Error,
        }
    }
}

impl TryFrom<v1::FinishReason> for FinishReason {
    type Error = ConvertError;
    fn try_from(f: v1::FinishReason) -> Result<Self, ConvertError> {
        match f {
            v1::FinishReason::Unspecified => Err(ConvertError::Unspecified {
                field: "finish_reason",
            }),
            v1::FinishReason::Stop => Ok(FinishReason::Stop),
            v1::FinishReason::Length => Ok(FinishReason::Length),
            v1::FinishReason::Abort => Ok(FinishReason::Abort),
            v1::FinishReason::Error => Ok(FinishReason::Error),
        }
    }
}

/// A finish reason from a stream message: `FINISH_REASON_UNSPECIFIED` means "not finished".
pub fn finish_reason_from_wire(value: i32) -> Result<Option<FinishReason>, ConvertError> {
    match wire_enum::<v1::FinishReason>("finish_reason", value)? {
        v1::FinishReason::Unspecified => Ok(None),
        f => FinishReason::try_from(f).map(Some),
    }
}

/// The wire value of an optional finish reason (`None`: not finished).
pub fn finish_reason_to_wire(f: Option<FinishReason>) -> i32 {
    f.map_or(v1::FinishReason::Unspecified, v1::FinishReason::from) as i32
}

// ---------------------------------------------------------------- ErrorKind

impl From<ErrorKind> for v1::ErrorKind {
    fn from(k: ErrorKind) -> Self {
        match k {
            ErrorKind::InvalidRequest => v1::ErrorKind::InvalidRequest,
            ErrorKind::ContextLengthExceeded => v1::ErrorKind::ContextLengthExceeded,
            ErrorKind::Unauthenticated => v1::ErrorKind::Unauthenticated,
            ErrorKind::PermissionDenied => v1::ErrorKind::PermissionDenied,
            ErrorKind::Overloaded => v1::ErrorKind::Overloaded,
            ErrorKind::Unavailable => v1::ErrorKind::Unavailable,
            ErrorKind::Retryable => v1::ErrorKind::Retryable,
            ErrorKind::Timeout => v1::ErrorKind::Timeout,
            ErrorKind::Cancelled => v1::ErrorKind::Cancelled,
            ErrorKind::Internal => v1::ErrorKind::Internal,
        }
    }
}

impl TryFrom<v1::ErrorKind> for ErrorKind {
    type Error = ConvertError;
    fn try_from(k: v1::ErrorKind) -> Result<Self, ConvertError> {
        Ok(match k {
            v1::ErrorKind::Unspecified => {
                return Err(ConvertError::Unspecified {
                    field: "error.kind",
                });
            }
            v1::ErrorKind::InvalidRequest => ErrorKind::InvalidRequest,
            v1::ErrorKind::ContextLengthExceeded => ErrorKind::ContextLengthExceeded,
            v1::ErrorKind::Unauthenticated => ErrorKind::Unauthenticated,
            v1::ErrorKind::PermissionDenied => ErrorKind::PermissionDenied,
            v1::ErrorKind::Overloaded => ErrorKind::Overloaded,
            v1::ErrorKind::Unavailable => ErrorKind::Unavailable,
            v1::ErrorKind::Retryable => ErrorKind::Retryable,
            v1::ErrorKind::Timeout => ErrorKind::Timeout,
            v1::ErrorKind::Cancelled => ErrorKind::Cancelled,
            v1::ErrorKind::Internal => ErrorKind::Internal,
        })
    }
}

/// An [`v1::Error`] message from a kind and a message.
pub fn error_message(kind: ErrorKind, message: impl Into<String>) -> v1::Error {
    v1::Error {
        kind: v1::ErrorKind::from(kind) as i32,
        message: message.into(),
    }
}

/// Reads an [`v1::Error`] message; an unknown or unspecified kind reads as `Internal` (the peer
/// did fail; only its classification is lost).
pub fn error_from_wire(e: &v1::Error) -> (ErrorKind, String) {
    let kind = v1::ErrorKind::try_from(e.kind)
        .ok()
        .and_then(|k| ErrorKind::try_from(k).ok())
        .unwrap_or(ErrorKind::Internal);
    (kind, e.message.clone())
}

/// The gRPC status code of an error kind: the one place this mapping lives.
pub fn grpc_code(kind: ErrorKind) -> tonic::Code {
    match kind {
        ErrorKind::InvalidRequest | ErrorKind::ContextLengthExceeded => {
            tonic::Code::InvalidArgument
        }
        ErrorKind::Unauthenticated => tonic::Code::Unauthenticated,
        ErrorKind::PermissionDenied => tonic::Code::PermissionDenied,
        ErrorKind::Overloaded => tonic::Code::ResourceExhausted,
        ErrorKind::Unavailable | ErrorKind::Retryable => tonic::Code::Unavailable,
        ErrorKind::Timeout => tonic::Code::DeadlineExceeded,
        ErrorKind::Cancelled => tonic::Code::Cancelled,
        ErrorKind::Internal => tonic::Code::Internal,
    }
}

/// A `tonic::Status` for any classified error.
pub fn status_of<E: Classify + std::fmt::Display>(e: &E) -> tonic::Status {
    tonic::Status::new(grpc_code(e.kind()), e.to_string())
}

/// The error kind a caller should assume for a gRPC status it received.
pub fn kind_of_status(s: &tonic::Status) -> ErrorKind {
    use tonic::Code;
    match s.code() {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
            ErrorKind::InvalidRequest
        }
        Code::Unauthenticated => ErrorKind::Unauthenticated,
        Code::PermissionDenied => ErrorKind::PermissionDenied,
        Code::ResourceExhausted => ErrorKind::Overloaded,
        Code::Unavailable => ErrorKind::Unavailable,
        Code::Aborted => ErrorKind::Retryable,
        Code::DeadlineExceeded => ErrorKind::Timeout,
        Code::Cancelled => ErrorKind::Cancelled,
        _ => ErrorKind::Internal,
    }
}

// ---------------------------------------------------------------- DType, KvLayout

impl From<DType> for v1::Dtype {
    fn from(d: DType) -> Self {
        match d {
            DType::F32 => v1::Dtype::F32,
            DType::F16 => v1::Dtype::F16,
            DType::Bf16 => v1::Dtype::Bf16,
        }
    }
}

impl TryFrom<v1::Dtype> for DType {
    type Error = ConvertError;
    fn try_from(d: v1::Dtype) -> Result<Self, ConvertError> {
        match d {
            v1::Dtype::Unspecified => Err(ConvertError::Unspecified { field: "dtype" }),
            v1::Dtype::F32 => Ok(DType::F32),
            v1::Dtype::F16 => Ok(DType::F16),
            v1::Dtype::Bf16 => Ok(DType::Bf16),
        }
    }
}

impl From<&KvLayout> for v1::KvLayout {
    fn from(l: &KvLayout) -> Self {
        v1::KvLayout {
            dtype: v1::Dtype::from(l.dtype) as i32,
            num_layers: l.num_layers,
            block_size: l.block_size,
            kv_heads_per_rank: l.kv_heads_per_rank,
            head_dim: l.head_dim,
            tp_size: l.tp_size,
            model_fingerprint: l.model_fingerprint.clone(),
            kind: match l.kind {
                KvKind::KeyValue => v1::KvKind::KeyValue,
                KvKind::Latent => v1::KvKind::Latent,
            } as i32,
        }
    }
}

impl From<KvLayout> for v1::KvLayout {
    fn from(l: KvLayout) -> Self {
        v1::KvLayout::from(&l)
    }
}

impl TryFrom<&v1::KvLayout> for KvLayout {
    type Error = ConvertError;
    fn try_from(l: &v1::KvLayout) -> Result<Self, ConvertError> {
        let dtype = DType::try_from(wire_enum::<v1::Dtype>("kv_layout.dtype", l.dtype)?)?;
        for (field, v) in [
            ("kv_layout.num_layers", l.num_layers),
            ("kv_layout.block_size", l.block_size),
            ("kv_layout.kv_heads_per_rank", l.kv_heads_per_rank),
            ("kv_layout.head_dim", l.head_dim),
            ("kv_layout.tp_size", l.tp_size),
        ] {
            if v == 0 {
                return Err(ConvertError::Invalid {
                    field,
                    reason: "must be at least 1".into(),
                });
            }
        }
        Ok(KvLayout {
            dtype,
            num_layers: l.num_layers,
            block_size: l.block_size,
            kv_heads_per_rank: l.kv_heads_per_rank,
            head_dim: l.head_dim,
            tp_size: l.tp_size,
            model_fingerprint: l.model_fingerprint.clone(),
            kind: match wire_enum::<v1::KvKind>("kv_layout.kind", l.kind)? {
                v1::KvKind::KeyValue => KvKind::KeyValue,
                v1::KvKind::Latent => KvKind::Latent,
            },
        })
    }
}

impl TryFrom<v1::KvLayout> for KvLayout {
    type Error = ConvertError;
    fn try_from(l: v1::KvLayout) -> Result<Self, ConvertError> {
        KvLayout::try_from(&l)
    }
}

// ---------------------------------------------------------------- SamplingParams, logprobs

impl From<&SamplingParams> for v1::SamplingParams {
    fn from(p: &SamplingParams) -> Self {
        v1::SamplingParams {
            temperature: Some(p.temperature),
            top_p: Some(p.top_p),
            top_k: p.top_k,
            min_p: p.min_p,
            repetition_penalty: Some(p.repetition_penalty),
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            seed: p.seed,
            max_tokens: Some(p.max_tokens),
            stop: p.stop.clone(),
            stop_token_ids: p.stop_token_ids.clone(),
            ignore_eos: p.ignore_eos,
            logprobs: p.logprobs,
        }
    }
}

impl From<SamplingParams> for v1::SamplingParams {
    fn from(p: SamplingParams) -> Self {
        v1::SamplingParams::from(&p)
    }
}

/// Unset optional fields take the core defaults. No range checks here: the serving edge calls
/// [`SamplingParams::validate`], which names the bad parameter.
impl From<v1::SamplingParams> for SamplingParams {
    fn from(p: v1::SamplingParams) -> Self {
        let d = SamplingParams::default();
        SamplingParams {
            temperature: p.temperature.unwrap_or(d.temperature),
            top_p: p.top_p.unwrap_or(d.top_p),
            top_k: p.top_k,
            min_p: p.min_p,
            repetition_penalty: p.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: p.presence_penalty,
            frequency_penalty: p.frequency_penalty,
            seed: p.seed,
            max_tokens: p.max_tokens.unwrap_or(d.max_tokens),
            stop: p.stop,
            stop_token_ids: p.stop_token_ids,
            ignore_eos: p.ignore_eos,
            logprobs: p.logprobs,
        }
    }
}

impl From<SamplerState> for v1::SamplerState {
    fn from(s: SamplerState) -> Self {
        Self {
            seed: s.seed,
            word_pos_lo: s.word_pos as u64,
            word_pos_hi: (s.word_pos >> 64) as u64,
        }
    }
}

impl From<v1::SamplerState> for SamplerState {
    fn from(s: v1::SamplerState) -> Self {
        Self {
            seed: s.seed,
            word_pos: (u128::from(s.word_pos_hi) << 64) | u128::from(s.word_pos_lo),
        }
    }
}

impl From<&TokenLogprob> for v1::TokenLogprob {
    fn from(t: &TokenLogprob) -> Self {
        v1::TokenLogprob {
            token_id: t.token_id,
            logprob: t.logprob,
            top: t
                .top
                .iter()
                .map(|&(token_id, logprob)| v1::TopLogprob { token_id, logprob })
                .collect(),
        }
    }
}

impl From<v1::TokenLogprob> for TokenLogprob {
    fn from(t: v1::TokenLogprob) -> Self {
        TokenLogprob {
            token_id: t.token_id,
            logprob: t.logprob,
            top: t.top.into_iter().map(|x| (x.token_id, x.logprob)).collect(),
        }
    }
}

// ---------------------------------------------------------------- NodeCard

impl From<&NodeAddresses> for v1::NodeAddresses {
    fn from(a: &NodeAddresses) -> Self {
        v1::NodeAddresses {
            grpc: a.grpc.clone(),
            http: a.http.clone(),
            ucx_worker: a.ucx_worker.clone(),
        }
    }
}

impl From<v1::NodeAddresses> for NodeAddresses {
    fn from(a: v1::NodeAddresses) -> Self {
        NodeAddresses {
            grpc: a.grpc,
            http: a.http,
            ucx_worker: a.ucx_worker,
        }
    }
}

impl From<&NodeCapacity> for v1::NodeCapacity {
    fn from(c: &NodeCapacity) -> Self {
        v1::NodeCapacity {
            kv_blocks_total: c.kv_blocks_total,
            kv_blocks_free: c.kv_blocks_free,
            max_running_requests: c.max_running_requests,
            running_requests: c.running_requests,
            queued_requests: c.queued_requests,
        }
    }
}

impl From<v1::NodeCapacity> for NodeCapacity {
    fn from(c: v1::NodeCapacity) -> Self {
        NodeCapacity {
            kv_blocks_total: c.kv_blocks_total,
            kv_blocks_free: c.kv_blocks_free,
            max_running_requests: c.max_running_requests,
            running_requests: c.running_requests,
            queued_requests: c.queued_requests,
        }
    }
}

impl From<&NodeCard> for v1::NodeCard {
    fn from(c: &NodeCard) -> Self {
        v1::NodeCard {
            id: c.id.as_str().to_string(),
            role: v1::Role::from(c.role) as i32,
            cluster: c.cluster.clone(),
            model_id: c.model_id.clone(),
            model_fingerprint: c.model_fingerprint.clone(),
            kv_layout: c.kv_layout.as_ref().map(v1::KvLayout::from),
            tp_size: c.tp_size,
            addresses: Some(v1::NodeAddresses::from(&c.addresses)),
            capacity: Some(v1::NodeCapacity::from(&c.capacity)),
            version: c.version.clone(),
            started_at_ms: c.started_at_ms,
            colocated: c.colocated,
        }
    }
}

impl From<NodeCard> for v1::NodeCard {
    fn from(c: NodeCard) -> Self {
        v1::NodeCard::from(&c)
    }
}

impl TryFrom<v1::NodeCard> for NodeCard {
    type Error = ConvertError;
    fn try_from(c: v1::NodeCard) -> Result<Self, ConvertError> {
        let id = NodeId::new(c.id);
        if !id.is_valid() {
            return Err(ConvertError::Invalid {
                field: "node_card.id",
                reason: format!("{:?}: expected 1-128 of [A-Za-z0-9._-]", id.as_str()),
            });
        }
        Ok(NodeCard {
            id,
            role: role_from_wire("node_card.role", c.role)?,
            cluster: c.cluster,
            model_id: c.model_id,
            model_fingerprint: c.model_fingerprint,
            kv_layout: c.kv_layout.map(KvLayout::try_from).transpose()?,
            tp_size: c.tp_size,
            addresses: c
                .addresses
                .map(NodeAddresses::from)
                .ok_or(ConvertError::Missing {
                    field: "node_card.addresses",
                })?,
            capacity: c.capacity.map(NodeCapacity::from).unwrap_or_default(),
            version: c.version,
            started_at_ms: c.started_at_ms,
            colocated: c.colocated,
            // SGLang workers' cards stay in the registry; they never travel over the node API.
            sglang: None,
            draining: false,
        })
    }
}

mod kv_target;

#[cfg(test)]
mod tests;

impl From<&pdnode_core::Accounting> for v1::Accounting {
    fn from(a: &pdnode_core::Accounting) -> Self {
        v1::Accounting {
            kv_blocks_owned_request: a.kv_blocks_owned_request,
            kv_blocks_owned_transfer: a.kv_blocks_owned_transfer,
            kv_blocks_cached: a.kv_blocks_cached,
            kv_blocks_free: a.kv_blocks_free,
            staging_spans_owned: a.staging_spans_owned,
            staging_spans_quarantined: a.staging_spans_quarantined,
            staging_arena_free_bytes: a.staging_arena_free_bytes,
            staging_arena_bytes: a.staging_arena_bytes,
            staging_host_bytes: a.staging_host_bytes,
            fence_quarantines_total: a.fence_quarantines_total,
            fence_released_by_record_total: a.fence_released_by_record_total,
            fence_released_at_deadline_total: a.fence_released_at_deadline_total,
            fence_checksum_failures_total: a.fence_checksum_failures_total,
            fence_record_failures_total: a.fence_record_failures_total,
            fence_sources_leaked_total: a.fence_sources_leaked_total,
            engine_preemptions_total: a.engine_preemptions_total,
            engine_step_prefill: Some(step_times(&a.engine_step_prefill)),
            engine_step_decode: Some(step_times(&a.engine_step_decode)),
        }
    }
}

fn step_times(t: &pdnode_core::StepTimes) -> v1::StepTimes {
    v1::StepTimes {
        le: t.le.to_vec(),
        count: t.count,
        sum_us: t.sum_us,
    }
}

/// A malformed histogram from the wire reads as none (`StepTimes::from_parts`).
fn step_times_in(t: Option<v1::StepTimes>) -> pdnode_core::StepTimes {
    t.and_then(|t| pdnode_core::StepTimes::from_parts(&t.le, t.count, t.sum_us))
        .unwrap_or_default()
}

impl From<v1::Accounting> for pdnode_core::Accounting {
    fn from(a: v1::Accounting) -> Self {
        pdnode_core::Accounting {
            kv_blocks_owned_request: a.kv_blocks_owned_request,
            kv_blocks_owned_transfer: a.kv_blocks_owned_transfer,
            kv_blocks_cached: a.kv_blocks_cached,
            kv_blocks_free: a.kv_blocks_free,
            staging_spans_owned: a.staging_spans_owned,
            staging_spans_quarantined: a.staging_spans_quarantined,
            staging_arena_free_bytes: a.staging_arena_free_bytes,
            staging_arena_bytes: a.staging_arena_bytes,
            staging_host_bytes: a.staging_host_bytes,
            fence_quarantines_total: a.fence_quarantines_total,
            fence_released_by_record_total: a.fence_released_by_record_total,
            fence_released_at_deadline_total: a.fence_released_at_deadline_total,
            fence_checksum_failures_total: a.fence_checksum_failures_total,
            fence_record_failures_total: a.fence_record_failures_total,
            fence_sources_leaked_total: a.fence_sources_leaked_total,
            engine_preemptions_total: a.engine_preemptions_total,
            engine_step_prefill: step_times_in(a.engine_step_prefill),
            engine_step_decode: step_times_in(a.engine_step_decode),
        }
    }
}
