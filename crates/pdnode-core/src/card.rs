//! The node card: what a node publishes in the registry, under its lease.

use crate::ids::NodeId;
use crate::layout::KvLayout;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The role a node process plays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Prefill,
    Decode,
    Router,
    /// Router + one prefill group + one decode group in one process.
    All,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Router => "router",
            Role::All => "all",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "prefill" => Ok(Role::Prefill),
            "decode" => Ok(Role::Decode),
            "router" => Ok(Role::Router),
            "all" => Ok(Role::All),
            _ => Err(format!(
                "unknown role {s:?}: expected one of prefill, decode, router, all"
            )),
        }
    }
}

/// Network addresses a node serves.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeAddresses {
    /// Node-to-node gRPC (`host:port`).
    pub grpc: String,
    /// HTTP (health, metrics; OpenAI API on routers), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<String>,
    /// UCX worker address of the KV transport, hex-encoded, if the node moves KV over UCX.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ucx_worker: Option<String>,
}

/// Capacity and current load, refreshed periodically.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct NodeCapacity {
    pub kv_blocks_total: u64,
    pub kv_blocks_free: u64,
    pub max_running_requests: u32,
    pub running_requests: u32,
    pub queued_requests: u32,
}

/// What a node publishes: the value under `pdnode/v1/{cluster}/nodes/{role}/{node_id}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeCard {
    pub id: NodeId,
    pub role: Role,
    pub cluster: String,
    /// Served model name (what clients pass as `model`).
    pub model_id: String,
    /// Hash of architecture + weights metadata; KV moves only between equal fingerprints.
    pub model_fingerprint: String,
    /// KV layout of the node's pool; `None` for routers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_layout: Option<KvLayout>,
    pub tp_size: u32,
    pub addresses: NodeAddresses,
    pub capacity: NodeCapacity,
    /// pdnode version of the process.
    pub version: String,
    /// Unix time (ms) the process started; tells a restart apart from the same id.
    pub started_at_ms: u64,
    /// The node runs both phases of a request itself and its node API (`pdnode.v1.Node`) serves
    /// ReserveKv, Prefill and Decode for it, so a router pairs it with itself (P == D). Set by a
    /// role-`all` node with `engine.colocated`. A role-`all` node without it keeps its prefill
    /// and decode engines in process: other routers must not use it. Cards without the field
    /// (older nodes) read as `false`.
    #[serde(default)]
    pub colocated: bool,
    /// Set on the card of an SGLang HTTP worker (registered by `pdnode sglang-register`), which
    /// only a router in SGLang mode with `router.sglang.discovery = "registry"` uses; pdnode's
    /// own routers skip such cards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sglang: Option<SglangWorker>,
    /// The node drains by migration: still registered (its routers keep its streams while
    /// they move) but taking no new request and no moved stream. Routers leave it out of
    /// placement. Cards without the field read as `false`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub draining: bool,
}

/// Where an SGLang worker serves, as its card carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SglangWorker {
    /// `http://host:port` of the worker's HTTP server.
    pub url: String,
    /// Prefill workers: the port of its KV bootstrap server (sent to decode workers), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bootstrap_port: Option<u16>,
}

impl NodeCard {
    /// A card of `cluster`, `role` and `id` with placeholder contents (model `m`, fingerprint
    /// `f`, gRPC at `127.0.0.1:1`, started at 1 ms, no layout, TP 1): for tests and examples
    /// that need a well-formed card, not a node behind it.
    pub fn placeholder(cluster: &str, role: Role, id: &str) -> Self {
        NodeCard {
            id: NodeId::new(id),
            role,
            cluster: cluster.into(),
            model_id: "m".into(),
            model_fingerprint: "f".into(),
            kv_layout: None,
            tp_size: 1,
            addresses: NodeAddresses {
                grpc: "127.0.0.1:1".into(),
                ..Default::default()
            },
            capacity: NodeCapacity::default(),
            version: "0".into(),
            started_at_ms: 1,
            colocated: false,
            sglang: None,
            draining: false,
        }
    }

    /// The registry key of this card.
    pub fn key(&self) -> String {
        node_key(&self.cluster, self.role, &self.id)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("NodeCard serializes")
    }

    pub fn from_json(s: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(s)
    }
}

/// Root of all pdnode keys of one cluster.
pub fn cluster_prefix(cluster: &str) -> String {
    format!("pdnode/v1/{cluster}/nodes/")
}

/// Key of one node: `pdnode/v1/{cluster}/nodes/{role}/{node_id}`.
pub fn node_key(cluster: &str, role: Role, id: &NodeId) -> String {
    format!("pdnode/v1/{cluster}/nodes/{role}/{id}")
}

/// Parses a node key back into (cluster, role, id).
pub fn parse_node_key(key: &str) -> Option<(String, Role, NodeId)> {
    let rest = key.strip_prefix("pdnode/v1/")?;
    let mut it = rest.split('/');
    let cluster = it.next()?;
    if it.next()? != "nodes" {
        return None;
    }
    let role = it.next()?.parse().ok()?;
    let id = it.next()?;
    if it.next().is_some() || id.is_empty() || cluster.is_empty() {
        return None;
    }
    Some((cluster.to_string(), role, NodeId::new(id)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_round_trip() {
        let k = node_key("prod", Role::Decode, &NodeId::new("d-1"));
        assert_eq!(k, "pdnode/v1/prod/nodes/decode/d-1");
        assert!(k.starts_with(&cluster_prefix("prod")));
        let (c, r, id) = parse_node_key(&k).unwrap();
        assert_eq!((c.as_str(), r, id.as_str()), ("prod", Role::Decode, "d-1"));
        assert!(parse_node_key("pdnode/v1/prod/nodes/bogus/x").is_none());
        assert!(parse_node_key("pdnode/v1/prod/nodes/decode/x/y").is_none());
    }

    #[test]
    fn card_json_round_trip() {
        let card = NodeCard {
            id: NodeId::new("p0"),
            role: Role::Prefill,
            cluster: "c".into(),
            model_id: "m".into(),
            model_fingerprint: "f".into(),
            kv_layout: None,
            tp_size: 4,
            addresses: NodeAddresses {
                grpc: "127.0.0.1:1".into(),
                ..Default::default()
            },
            capacity: NodeCapacity::default(),
            version: "0.1.0".into(),
            started_at_ms: 1,
            colocated: false,
            sglang: None,
            draining: false,
        };
        let back = NodeCard::from_json(card.to_json().as_bytes()).unwrap();
        assert_eq!(back, card);
        assert!(NodeCard::from_json(b"{not json").is_err());

        // `colocated` round-trips, and a card written before the field existed reads as false.
        let colo = NodeCard {
            role: Role::All,
            colocated: true,
            sglang: None,
            draining: false,
            ..card.clone()
        };
        let back = NodeCard::from_json(colo.to_json().as_bytes()).unwrap();
        assert!(back.colocated);
        let mut old: serde_json::Value = serde_json::from_str(&colo.to_json()).unwrap();
        old.as_object_mut().unwrap().remove("colocated");
        let back = NodeCard::from_json(old.to_string().as_bytes()).unwrap();
        assert_eq!(back.role, Role::All);
        assert!(!back.colocated);
    }
}
