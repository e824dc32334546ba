//! One bench-transfer role (server or client) from its JSON options: the process the
//! multi-process tests (and `run_local`) start. `pdnode bench-transfer` is the user-facing
//! command; this binary exists so the bench crate's tests (and scripts, when the full
//! binary is not built) need no other crate.
//!
//! usage: pdnode-transfer-peer '<options JSON>'          one role
//!        pdnode-transfer-peer local '<options JSON>'    both roles as child processes

use pdnode_transfer_bench::{Options, run_local, run_role};

fn parse(json: &str) -> Options {
    match serde_json::from_str(json) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: bad options: {e}");
            std::process::exit(2);
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.as_slice() {
        [json] => run_role(&parse(json)).map(|_| 0),
        [mode, json] if mode == "local" => std::env::current_exe()
            .map_err(|e| pdnode_transfer::TransferError::Control {
                reason: format!("locate this binary: {e}"),
            })
            .and_then(|exe| run_local(&parse(json), &exe, &[])),
        _ => {
            eprintln!("usage: pdnode-transfer-peer [local] '<bench options JSON>'");
            std::process::exit(2);
        }
    };
    match result {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            println!("ERROR {e}");
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}
