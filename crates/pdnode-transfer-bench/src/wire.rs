//! The bench's control channel: length-prefixed JSON frames over TCP on loopback. (The node
//! runtime uses `pdnode.v1.Node` gRPC for the same messages.) The KV target is the serving
//! one, `pdnode_core::KvTarget`, checked by its receiver before use.

use pdnode_core::{KvLayout, KvTarget, NodeId, RequestId};
use pdnode_transfer::TransferError;
use serde::{Deserialize, Serialize};
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;

/// Largest accepted frame (a target with thousands of blocks stays far below).
const MAX_FRAME: usize = 16 << 20;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum Msg {
    /// Client -> server: set up one sweep point.
    Hello {
        layout: KvLayout,
        pool_blocks: u32,
        max_request_blocks: u32,
        pool_placement: bool,
        prefill_node: NodeId,
    },
    /// Server -> client: its regions are registered.
    Welcome {
        worker_address: Vec<u8>,
    },
    Reserve {
        request: RequestId,
        blocks: u32,
        lease_ms: u64,
        prefill_layout: Option<KvLayout>,
    },
    Target {
        target: Box<KvTarget>,
    },
    Done {
        request: RequestId,
        secret: Vec<u8>,
        status: DoneStatus,
        bytes: u64,
        prefill_node: NodeId,
    },
    DoneAck {
        request: RequestId,
        scatter_us: u64,
        verify_us: u64,
    },
    Refused {
        request: Option<RequestId>,
        error: String,
    },
    Bye,
}

/// How a push ended, as the bench's sender reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DoneStatus {
    /// Every byte written and flushed (and the fence records behind them, when asked).
    Ok,
    /// The push failed; its puts are over. The receiver frees the blocks at once.
    Failed(String),
}

pub fn send(stream: &mut TcpStream, msg: &Msg) -> Result<(), TransferError> {
    let body = serde_json::to_vec(msg).map_err(|e| TransferError::Control {
        reason: format!("encode: {e}"),
    })?;
    let mut frame = (body.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&body);
    stream
        .write_all(&frame)
        .map_err(|e| TransferError::Control {
            reason: format!("send: {e}"),
        })
}

/// Reads one frame. `Ok(None)`: the read timeout passed with no frame started.
pub fn recv(stream: &mut TcpStream) -> Result<Option<Msg>, TransferError> {
    let mut len = [0u8; 4];
    match stream.read(&mut len[..1]) {
        Ok(0) => {
            return Err(TransferError::Control {
                reason: "peer closed the connection".into(),
            });
        }
        Ok(_) => {}
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
            return Ok(None);
        }
        Err(e) => {
            return Err(TransferError::Control {
                reason: format!("receive: {e}"),
            });
        }
    }
    let io = |e: std::io::Error| TransferError::Control {
        reason: format!("receive: {e}"),
    };
    stream.read_exact(&mut len[1..]).map_err(io)?;
    let n = u32::from_le_bytes(len) as usize;
    if n > MAX_FRAME {
        return Err(TransferError::Control {
            reason: format!("frame of {n} bytes exceeds {MAX_FRAME}"),
        });
    }
    let mut body = vec![0u8; n];
    stream.read_exact(&mut body).map_err(io)?;
    serde_json::from_slice(&body)
        .map(Some)
        .map_err(|e| TransferError::Control {
            reason: format!("decode: {e}"),
        })
}

/// Reads one frame, waiting at most until `deadline`.
pub fn recv_until(
    stream: &mut TcpStream,
    deadline: std::time::Instant,
) -> Result<Msg, TransferError> {
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(TransferError::Timeout {
                what: "control message".into(),
            });
        }
        stream
            .set_read_timeout(Some(left.min(std::time::Duration::from_millis(200))))
            .map_err(|e| TransferError::Control {
                reason: e.to_string(),
            })?;
        if let Some(m) = recv(stream)? {
            return Ok(m);
        }
    }
}
