//! Sockets pdnode accepts: every accepted connection gets `TCP_NODELAY`.
//!
//! Without it, Nagle's algorithm holds back a small write (one streamed token, a gRPC header)
//! until the peer ACKs the previous one, and the peer's delayed ACK waits ~40 ms: one such
//! stall per streamed hop. Servers take their listeners through [`grpc_incoming`] (tonic) or
//! [`serve_http`] (axum apps, on [`http_listener`]); outgoing gRPC channels set
//! `Endpoint::tcp_nodelay(true)` ([`crate::grpc_client`]).

use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::TcpIncoming;

/// The connections `listener` accepts, each with `TCP_NODELAY`, for
/// `tonic::transport::Server::serve_with_incoming*`.
pub fn grpc_incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// Calls one client connection may have open at once on a client-facing gRPC server (tonic
/// would otherwise lift hyper's default of 200 to no limit).
pub const CLIENT_MAX_STREAMS: u32 = 200;
/// A client-facing gRPC connection without a frame this long is pinged ...
pub const CLIENT_KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
/// ... and closed when the ping is not answered this long after: a client whose host died or
/// whose network dropped the connection holds no socket past interval + timeout.
pub const CLIENT_KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// The builder of a client-facing gRPC server (the router's and the SGLang router's
/// `pdnode.v1.Inference`): at most [`CLIENT_MAX_STREAMS`] calls a connection, HTTP/2
/// keepalive ([`CLIENT_KEEPALIVE_INTERVAL`], [`CLIENT_KEEPALIVE_TIMEOUT`]). Serve it with
/// [`grpc_incoming`].
pub fn client_grpc_server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_concurrent_streams(CLIENT_MAX_STREAMS)
        .http2_keepalive_interval(Some(CLIENT_KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(CLIENT_KEEPALIVE_TIMEOUT))
}

/// `listener` for `axum::serve`, setting `TCP_NODELAY` on every accepted connection.
pub fn http_listener(listener: TcpListener) -> axum::serve::TapIo<TcpListener, fn(&mut TcpStream)> {
    use axum::serve::ListenerExt as _;
    listener.tap_io(set_nodelay as fn(&mut TcpStream))
}

/// The header deadline of the listeners that only answer scrapes and probes (a node's
/// `/health` and `/metrics`): hyper's own default.
pub const SCRAPE_HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Serves `app` over HTTP/1.1 and HTTP/2 on `listener` (every accepted socket with
/// `TCP_NODELAY`) until `shutdown`, then lets every open connection finish what it serves
/// (graceful shutdown) and returns once all have closed. What `axum::serve` does, plus a
/// deadline on each request's headers: an HTTP/1 client that does not send a whole header
/// block within `header_timeout` (a slow sender, or a kept-alive connection with no next
/// request) has its connection closed, so no idle or trickling client holds a socket forever.
pub async fn serve_http(
    listener: TcpListener,
    app: axum::Router,
    header_timeout: std::time::Duration,
    shutdown: tokio_util::sync::CancellationToken,
) -> std::io::Result<()> {
    use axum::serve::Listener as _;
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::service::TowerToHyperService;
    let mut listener = http_listener(listener);
    // The loop holds `stop_rx` and drops it at shutdown: each connection, holding a `stop_tx`,
    // sees `closed()`. Each connection holds a `done_rx`: `done_tx.closed()` waits for them all.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(());
    let (done_tx, done_rx) = tokio::sync::watch::channel(());
    loop {
        let (io, _remote) = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = shutdown.cancelled() => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let stop_tx = stop_tx.clone();
        let done_rx = done_rx.clone();
        tokio::spawn(async move {
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(io), service);
            let mut conn = std::pin::pin!(conn);
            let mut stopping = std::pin::pin!(stop_tx.closed());
            let mut stopped = false;
            loop {
                tokio::select! {
                    served = conn.as_mut() => {
                        if let Err(e) = served {
                            tracing::trace!(error = %e, "an HTTP connection ended with an error");
                        }
                        break;
                    }
                    _ = &mut stopping, if !stopped => {
                        stopped = true;
                        conn.as_mut().graceful_shutdown();
                    }
                }
            }
            drop(done_rx);
        });
    }
    drop(stop_rx);
    drop(done_rx);
    done_tx.closed().await;
    Ok(())
}

fn set_nodelay(s: &mut TcpStream) {
    if let Err(e) = s.set_nodelay(true) {
        // The connection still works, only slower; nothing to refuse it for.
        tracing::debug!(error = %e, "could not set TCP_NODELAY on an accepted connection");
    }
}

/// A client-facing gRPC service (`add_service` takes it as it takes `S`) whose request messages
/// must arrive within `limit` (`router.client_send_timeout_s`, as the HTTP frontends' bodies):
/// a caller that sends part of a message and stalls gets `DEADLINE_EXCEEDED` and holds no
/// buffer past it. The clock runs from the call's headers; a body that ended is not timed.
#[derive(Clone)]
pub struct BodyDeadline<S> {
    inner: S,
    limit: std::time::Duration,
}

impl<S> BodyDeadline<S> {
    pub fn new(inner: S, limit: std::time::Duration) -> Self {
        Self { inner, limit }
    }
}

impl<S: tonic::server::NamedService> tonic::server::NamedService for BodyDeadline<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>>
    for BodyDeadline<S>
where
    S: tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
        let limit = self.limit;
        self.inner.call(req.map(|inner| {
            tonic::body::Body::new(DeadlineBody {
                inner,
                sleep: Box::pin(tokio::time::sleep(limit)),
                limit,
            })
        }))
    }
}

/// A request body that fails once `limit` passes before its end.
struct DeadlineBody {
    inner: tonic::body::Body,
    sleep: std::pin::Pin<Box<tokio::time::Sleep>>,
    limit: std::time::Duration,
}

impl http_body::Body for DeadlineBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        use std::future::Future as _;
        use std::task::Poll;
        let this = &mut *self;
        match std::pin::Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Pending if this.sleep.as_mut().poll(cx).is_ready() => {
                Poll::Ready(Some(Err(tonic::Status::deadline_exceeded(format!(
                    "the request message did not arrive within {} s (router.client_send_timeout_s)",
                    this.limit.as_secs()
                )))))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
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

    /// A trivial app on [`serve_http`] with a 1 s header deadline; `/slow` answers after 300 ms.
    async fn served() -> (
        std::net::SocketAddr,
        tokio_util::sync::CancellationToken,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ) {
        let (l, addr) = bound().await;
        let app = axum::Router::new()
            .route("/", axum::routing::get(|| async { "ok" }))
            .route(
                "/slow",
                axum::routing::get(|| async {
                    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                    "slow"
                }),
            );
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(serve_http(
            l,
            app,
            std::time::Duration::from_secs(1),
            stop.clone(),
        ));
        (addr, stop, task)
    }

    async fn get(c: &mut TcpStream, path: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let req = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
        c.write_all(req.as_bytes()).await.unwrap();
        let mut out = Vec::new();
        c.read_to_end(&mut out).await.unwrap();
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn serve_http_closes_a_connection_whose_headers_stall() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (addr, stop, task) = served().await;
        let mut ok = TcpStream::connect(addr).await.unwrap();
        assert!(get(&mut ok, "/").await.ends_with("ok"));
        // Half a request line, then nothing: closed at the 1 s deadline.
        let mut slow = TcpStream::connect(addr).await.unwrap();
        slow.write_all(b"GET / HTTP/1.1\r\nhost:").await.unwrap();
        let t0 = std::time::Instant::now();
        let mut out = Vec::new();
        let read = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            slow.read_to_end(&mut out),
        )
        .await
        .expect("a stalled header block kept its connection");
        let took = t0.elapsed();
        // Closed (an end of file or a reset), never answered as a request.
        let _ = read;
        assert!(!String::from_utf8_lossy(&out).contains("200"), "{out:?}");
        assert!(
            took >= std::time::Duration::from_millis(900)
                && took < std::time::Duration::from_secs(5),
            "{took:?}"
        );
        // The server still serves.
        let mut again = TcpStream::connect(addr).await.unwrap();
        assert!(get(&mut again, "/").await.ends_with("ok"));
        stop.cancel();
        task.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn serve_http_finishes_what_it_serves_at_shutdown() {
        let (addr, stop, task) = served().await;
        let mut c = TcpStream::connect(addr).await.unwrap();
        let answer = tokio::spawn(async move { get(&mut c, "/slow").await });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        stop.cancel();
        let answer = answer.await.unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("slow"), "{answer}");
        tokio::time::timeout(std::time::Duration::from_secs(5), task)
            .await
            .expect("serve_http returned once the connection closed")
            .unwrap()
            .unwrap();
        // No new connection is served after it returned.
        assert!(
            TcpStream::connect(addr).await.is_err()
                || get(&mut TcpStream::connect(addr).await.unwrap(), "/")
                    .await
                    .is_empty()
        );
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

    /// One data frame, then nothing more and no end (a client that stalls mid-message).
    struct Stalls(bool);

    impl http_body::Body for Stalls {
        type Data = bytes::Bytes;
        type Error = tonic::Status;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
            if std::mem::replace(&mut self.0, true) {
                std::task::Poll::Pending
            } else {
                let part = bytes::Bytes::from_static(&[0, 0, 0, 0, 16, 1, 2]);
                std::task::Poll::Ready(Some(Ok(http_body::Frame::data(part))))
            }
        }
    }

    /// Reads a request's body to its end: the bytes, or the body's error.
    #[derive(Clone)]
    struct ReadAll;

    impl tonic::codegen::Service<tonic::codegen::http::Request<tonic::body::Body>> for ReadAll {
        type Response = Result<usize, tonic::Status>;
        type Error = std::convert::Infallible;
        type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;
        fn poll_ready(
            &mut self,
            _cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<Result<(), Self::Error>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn call(&mut self, req: tonic::codegen::http::Request<tonic::body::Body>) -> Self::Future {
            use http_body::Body as _;
            let mut body = req.into_body();
            Box::pin(async move {
                let mut n = 0;
                loop {
                    let frame =
                        std::future::poll_fn(|cx| std::pin::Pin::new(&mut body).poll_frame(cx))
                            .await;
                    match frame {
                        None => return Ok(Ok(n)),
                        Some(Ok(f)) => n += f.into_data().map_or(0, |d| d.len()),
                        Some(Err(e)) => return Ok(Err(e)),
                    }
                }
            })
        }
    }

    #[tokio::test]
    async fn a_grpc_message_that_stalls_is_cut_at_the_body_deadline() {
        use tonic::codegen::Service as _;
        let limit = std::time::Duration::from_millis(100);
        let mut svc = BodyDeadline::new(ReadAll, limit);
        let stalled = tonic::codegen::http::Request::new(tonic::body::Body::new(Stalls(false)));
        let got = tokio::time::timeout(std::time::Duration::from_secs(5), svc.call(stalled))
            .await
            .expect("the body read ended")
            .unwrap();
        let e = got.unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e}");
        assert!(e.message().contains("client_send_timeout_s"), "{e}");
        // a whole message is read as it is
        let whole = tonic::codegen::http::Request::new(tonic::body::Body::new(http_body_full(&[
            0, 0, 0, 0, 2, 8, 1,
        ])));
        assert_eq!(svc.call(whole).await.unwrap().unwrap(), 7);
    }

    /// A body of `bytes` in one frame, then its end.
    fn http_body_full(
        bytes: &'static [u8],
    ) -> impl http_body::Body<Data = bytes::Bytes, Error = tonic::Status> + Send + 'static {
        struct Full(Option<bytes::Bytes>);
        impl http_body::Body for Full {
            type Data = bytes::Bytes;
            type Error = tonic::Status;
            fn poll_frame(
                mut self: std::pin::Pin<&mut Self>,
                _cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>>
            {
                std::task::Poll::Ready(self.0.take().map(|b| Ok(http_body::Frame::data(b))))
            }
        }
        Full(Some(bytes::Bytes::from_static(bytes)))
    }
}
