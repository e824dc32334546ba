//! What the router answers from a worker's answer: bodies read within a size and a deadline,
//! a worker's JSON error passed on (anything else a 502), the router's own errors, and the
//! prefill worker's input logprobs merged in front of the decode worker's.

use super::MAX_ANSWER;
use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use futures::StreamExt;
use serde_json::{Value, json};
use std::time::Instant;

/// Why a worker's answer body could not be read.
#[derive(Debug, thiserror::Error)]
pub(super) enum BodyError {
    #[error("reading the answer: {0}")]
    Read(#[from] reqwest::Error),
    #[error("answer larger than {limit} bytes")]
    TooLarge { limit: usize },
}

pub(super) async fn read_body(resp: reqwest::Response) -> Result<Bytes, BodyError> {
    let mut out = Vec::new();
    let mut s = resp.bytes_stream();
    while let Some(c) = s.next().await {
        let c = c?;
        if out.len() + c.len() > MAX_ANSWER {
            return Err(BodyError::TooLarge { limit: MAX_ANSWER });
        }
        out.extend_from_slice(&c);
    }
    Ok(Bytes::from(out))
}

pub(super) async fn read_limited(resp: reqwest::Response, deadline: Instant) -> Option<Bytes> {
    tokio::time::timeout_at(deadline.into(), read_body(resp))
        .await
        .ok()
        .and_then(Result::ok)
}

/// A worker's own 4xx answer, passed on when it is JSON; otherwise a 502 that says so.
pub(super) fn pass_through(status: StatusCode, bytes: Bytes) -> Response {
    if serde_json::from_slice::<Value>(&bytes).is_ok() {
        let mut r = Response::new(Body::from(bytes));
        *r.status_mut() = status;
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        return r;
    }
    error_response(
        StatusCode::BAD_GATEWAY,
        "upstream_error",
        &format!(
            "a worker answered HTTP {status} with a body that is not JSON: {}",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        ),
    )
}

pub(crate) fn error_response(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

pub(super) fn unavailable(role: &str, last: Option<&str>) -> Response {
    let mut msg = format!("no usable {role} worker (none healthy, or every breaker open)");
    if let Some(l) = last {
        msg.push_str("; last failure: ");
        msg.push_str(l);
    }
    error_response(StatusCode::SERVICE_UNAVAILABLE, "unavailable", &msg)
}

/// Puts the prefill worker's `meta_info.input_token_logprobs` in front of the decode
/// worker's (one object, or element-wise for a batch's arrays).
pub fn merge_input_logprobs(decode: &mut Value, prefill: &Value) {
    fn merge_one(d: &mut Value, p: &Value) {
        let Some(pl) = p
            .pointer("/meta_info/input_token_logprobs")
            .and_then(Value::as_array)
        else {
            return;
        };
        let Some(meta) = d.get_mut("meta_info").and_then(Value::as_object_mut) else {
            return;
        };
        let mut merged = pl.clone();
        if let Some(Value::Array(dl)) = meta.get("input_token_logprobs") {
            merged.extend(dl.iter().cloned());
        }
        meta.insert("input_token_logprobs".into(), Value::Array(merged));
    }
    match (decode, prefill) {
        (Value::Array(ds), Value::Array(ps)) => {
            for (d, p) in ds.iter_mut().zip(ps) {
                merge_one(d, p);
            }
        }
        (d, p) => merge_one(d, p),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_logprobs_merge_prefill_first() {
        let mut d = json!({"text": "x", "meta_info": {"input_token_logprobs": [[-0.5, 3, null]]}});
        let p = json!({"text": "", "meta_info": {"input_token_logprobs": [[null, 1, null], [-1.0, 2, null]]}});
        merge_input_logprobs(&mut d, &p);
        assert_eq!(
            d["meta_info"]["input_token_logprobs"],
            json!([[null, 1, null], [-1.0, 2, null], [-0.5, 3, null]])
        );
        let mut batch = json!([{"meta_info": {}}, {"meta_info": {}}]);
        let pb = json!([{"meta_info": {"input_token_logprobs": [[1]]}}, {"meta_info": {"input_token_logprobs": [[2]]}}]);
        merge_input_logprobs(&mut batch, &pb);
        assert_eq!(batch[1]["meta_info"]["input_token_logprobs"], json!([[2]]));
    }

    #[test]
    fn non_json_worker_errors_become_502() {
        let r = pass_through(StatusCode::BAD_REQUEST, Bytes::from_static(b"<html>"));
        assert_eq!(r.status(), StatusCode::BAD_GATEWAY);
        let r = pass_through(
            StatusCode::BAD_REQUEST,
            Bytes::from_static(b"{\"error\":\"x\"}"),
        );
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    }
}
