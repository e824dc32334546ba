//! The harness's etcd starts, stops and restarts on the same port.

use pdnode_testkit::{EtcdServer, skip_etcd_tests};
use std::net::TcpStream;

#[test]
fn etcd_starts_stops_and_restarts_on_the_same_port() {
    if skip_etcd_tests() {
        return;
    }
    let mut etcd = EtcdServer::start().expect("etcd starts");
    let port = etcd.client_port();
    assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
    etcd.stop();
    assert!(!etcd.is_running());
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
    etcd.restart().expect("etcd restarts");
    assert_eq!(etcd.client_port(), port);
    assert!(TcpStream::connect(("127.0.0.1", port)).is_ok());
}
