//! One bench-transfer role (server or client) from its JSON options: the process the
//! multi-process tests (and `bench::run_local`) start. `pdnode bench-transfer` is the user-facing
//! command; this binary exists so the transfer crate's tests need no other crate.

use pdnode_transfer::bench::{Options, run_role};

fn main() {
    let Some(json) = std::env::args().nth(1) else {
        eprintln!("usage: pdnode-transfer-peer '<bench options JSON>'");
        std::process::exit(2);
    };
    let opts: Options = match serde_json::from_str(&json) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: bad options: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run_role(&opts) {
        println!("ERROR {e}");
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
