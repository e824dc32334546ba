//! Sockets pdnode accepts: every accepted connection gets `TCP_NODELAY`.
//!
//! Without it, Nagle's algorithm holds back a small write (one streamed token, a gRPC header)
//! until the peer ACKs the previous one, and the peer's delayed ACK waits ~40 ms: one such
//! stall per streamed hop. Servers take their listeners through [`grpc_incoming`] (tonic) or
//! [`http_listener`] (axum); outgoing gRPC channels set `Endpoint::tcp_nodelay(true)`
//! ([`crate::grpc_client`]).

use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::TcpIncoming;

/// The connections `listener` accepts, each with `TCP_NODELAY`, for
/// `tonic::transport::Server::serve_with_incoming*`.
pub fn grpc_incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// `listener` for `axum::serve`, setting `TCP_NODELAY` on every accepted connection.
pub fn http_listener(listener: TcpListener) -> axum::serve::TapIo<TcpListener, fn(&mut TcpStream)> {
    use axum::serve::ListenerExt as _;
    listener.tap_io(set_nodelay as fn(&mut TcpStream))
}

fn set_nodelay(s: &mut TcpStream) {
    if let Err(e) = s.set_nodelay(true) {
        // The connection still works, only slower; nothing to refuse it for.
        tracing::debug!(error = %e, "could not set TCP_NODELAY on an accepted connection");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    async fn bound() -> (TcpListener, std::net::SocketAddr) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        (l, a)
    }

    #[tokio::test]
    async fn grpc_incoming_accepts_with_nodelay() {
        let (l, addr) = bound().await;
        let mut incoming = grpc_incoming(l);
        let _client = TcpStream::connect(addr).await.unwrap();
        let accepted = tokio::time::timeout(std::time::Duration::from_secs(5), incoming.next())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(accepted.nodelay().unwrap());
    }

    #[tokio::test]
    async fn http_listener_accepts_with_nodelay() {
        use axum::serve::Listener as _;
        let (l, addr) = bound().await;
        // A plain accept leaves Nagle on: the check below can fail.
        let _c = TcpStream::connect(addr).await.unwrap();
        let (plain, _) = l.accept().await.unwrap();
        assert!(!plain.nodelay().unwrap());
        let mut l = http_listener(l);
        let _client = TcpStream::connect(addr).await.unwrap();
        let (accepted, _) = tokio::time::timeout(std::time::Duration::from_secs(5), l.accept())
            .await
            .unwrap();
        assert!(accepted.nodelay().unwrap());
    }
}
