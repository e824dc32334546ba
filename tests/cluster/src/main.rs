//! `cluster-driver`: the system tests of `tests/cluster/` (run through `tests/cluster/run.sh`).
//!
//! Builds the hosts as network namespaces (`net`), joins the client namespace, then per case
//! starts etcd, a router, two prefill and two decode nodes from `configs/multi-host/`
//! (`cluster`), drives streaming load at concurrency 64 (`load`), injects one fault and checks
//! that no request hung and no surviving node holds KV or staging (`cases`). Prints one table
//! row per case; exits 0 only when every case passed.

mod cases;
mod cluster;
mod drive;
mod greedy;
mod lifecycle;
mod load;
mod metrics;
mod net;
mod pairing;
mod soak;

use anyhow::{Context, Result, anyhow, bail};
use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: cluster-driver --prefix NAME --bin PATH/TO/pdnode [--repo DIR] \
                     [--quick|--full] [--model PATH] [--case NAME] [--list] [--keep-logs] \
                     [--soak SECONDS] \
                     [--router-set KEY=VALUE ...] [--pairing SECONDS]";

struct Args {
    prefix: String,
    bin: PathBuf,
    repo: PathBuf,
    full: bool,
    /// `--full`'s model: a GGUF file or an HF directory (default: the demo model).
    model: Option<PathBuf>,
    case: Option<String>,
    list: bool,
    keep_logs: bool,
    /// Run the soak for this long instead of the cases.
    soak: Option<u64>,
    /// `--set`s for the soak's router (e.g. a small `router.cache_aware.max_tree_size`).
    router_sets: Vec<String>,
    /// Run the pairing benchmark with this measured window per policy instead of the cases.
    pairing: Option<u64>,
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        prefix: String::new(),
        bin: PathBuf::new(),
        repo: std::env::current_dir()?,
        full: false,
        model: None,
        case: None,
        list: false,
        keep_logs: false,
        soak: None,
        router_sets: Vec::new(),
        pairing: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| anyhow!("{name} needs a value"));
        match arg.as_str() {
            "--prefix" => a.prefix = value("--prefix")?,
            "--bin" => a.bin = PathBuf::from(value("--bin")?),
            "--repo" => a.repo = PathBuf::from(value("--repo")?),
            "--case" => a.case = Some(value("--case")?),
            "--quick" => a.full = false,
            "--full" => a.full = true,
            "--model" => a.model = Some(PathBuf::from(value("--model")?)),
            "--list" => a.list = true,
            "--keep-logs" => a.keep_logs = true,
            "--soak" => {
                let v = value("--soak")?;
                a.soak = Some(
                    v.parse()
                        .with_context(|| format!("--soak {v:?}: seconds"))?,
                );
            }
            "--router-set" => a.router_sets.push(value("--router-set")?),
            "--pairing" => {
                let v = value("--pairing")?;
                a.pairing = Some(
                    v.parse()
                        .with_context(|| format!("--pairing {v:?}: seconds"))?,
                );
            }
            "-h" | "--help" => bail!("{USAGE}"),
            other => bail!("unknown argument {other:?}\n{USAGE}"),
        }
    }
    if !a.list && (a.prefix.is_empty() || a.bin.as_os_str().is_empty()) {
        bail!("--prefix and --bin are required\n{USAGE}");
    }
    Ok(a)
}

fn main() -> ExitCode {
    match real_main() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("cluster-driver: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn real_main() -> Result<bool> {
    let args = parse_args()?;
    let chosen = args
        .model
        .clone()
        .unwrap_or_else(|| PathBuf::from(cases::DEMO_MODEL));
    if args.model.is_some() && !args.full {
        bail!("--model is for --full (the --quick cases run the simulated engine)");
    }
    let model =
        std::fs::canonicalize(args.repo.join(&chosen)).unwrap_or_else(|_| args.repo.join(&chosen));
    if args.full && !args.list && !model.exists() {
        bail!(
            "--full serves {}: not found (the demo model: run scripts/setup.sh first)",
            model.display()
        );
    }
    let matrix = || {
        if args.full {
            cases::full(&model)
        } else {
            cases::quick()
        }
    };
    let mut cases = matrix();
    if args.list {
        for c in &cases {
            println!("{:<16} {}", c.name, c.what);
        }
        if !args.full {
            for c in cases::beyond_quick() {
                println!("{:<16} {} (--full, or --case)", c.name, c.what);
            }
        }
        for c in cases::known_failing() {
            println!(
                "{:<16} {} (known to fail; only with --case)",
                c.name, c.what
            );
        }
        return Ok(true);
    }
    if let Some(name) = &args.case {
        if !args.full {
            cases.extend(cases::beyond_quick());
        }
        cases.extend(cases::known_failing());
        cases.retain(|c| c.name == name);
        if cases.is_empty() {
            let names: Vec<_> = matrix()
                .iter()
                .chain(&cases::beyond_quick())
                .chain(&cases::known_failing())
                .map(|c| c.name)
                .collect();
            bail!("no case {name:?}; cases: {}", names.join(", "));
        }
    }
    let bin = std::fs::canonicalize(&args.bin)
        .with_context(|| format!("pdnode binary {}", args.bin.display()))?;
    let repo = std::fs::canonicalize(&args.repo)?;
    if !repo.join("configs/multi-host/router.toml").is_file() {
        bail!("{} is not the repository root", repo.display());
    }
    let dir = tempfile::Builder::new()
        .prefix("pdnode-cluster-")
        .tempdir()?;

    // Namespaces first, then this thread joins the client one, then the runtime starts: every
    // thread of the driver lives in the client namespace and reaches 10.213.0.0/24 only.
    let net = net::Net::create(&args.prefix)?;
    net.enter(net::CLIENT.name)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    if !args.router_sets.is_empty() && args.soak.is_none() {
        bail!("--router-set applies to the soak (--soak SECONDS) only");
    }
    if let Some(secs) = args.pairing {
        let window = std::time::Duration::from_secs(secs);
        let pairing_dir = dir.path().join("pairing");
        let res = rt.block_on(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            let run = pairing::run(&net, &bin, &repo, &pairing_dir, window);
            tokio::select! {
                r = run => r,
                _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted (SIGINT)")),
                _ = term.recv() => Err(anyhow!("terminated (SIGTERM)")),
            }
        });
        drop(rt);
        let rows = res?;
        println!("{}", pairing::table(&rows, window));
        if args.keep_logs {
            eprintln!("cluster: logs kept in {}", dir.keep().display());
        }
        drop(net);
        return Ok(true);
    }
    if let Some(secs) = args.soak {
        let soak_dir = dir.path().join("soak");
        let res = rt.block_on(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            let run = soak::run(
                &net,
                &bin,
                &repo,
                &soak_dir,
                std::time::Duration::from_secs(secs),
                &args.router_sets,
            );
            tokio::select! {
                r = run => r,
                _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted (SIGINT)")),
                _ = term.recv() => Err(anyhow!("terminated (SIGTERM)")),
            }
        });
        drop(rt);
        let (row, resources) = res?;
        let ok = row.passed();
        println!("{}\n{resources}", drive::table(std::slice::from_ref(&row)));
        if ok && !args.keep_logs {
            drop(dir);
        } else {
            eprintln!("cluster: logs kept in {}", dir.keep().display());
        }
        drop(net);
        return Ok(ok);
    }
    let res = rt.block_on(async {
        let run = async {
            let mut rows = Vec::new();
            for (i, c) in cases.iter().enumerate() {
                eprintln!("cluster: case {} ({})", c.name, c.what);
                let case_dir = dir.path().join(format!("{i:02}-{}", c.name));
                let row = drive::run_row(c, &net, &bin, &repo, &case_dir).await;
                eprintln!(
                    "cluster: {} {} in {:.0} s{}",
                    c.name,
                    if row.passed() { "passed" } else { "FAILED" },
                    row.wall.as_secs_f64(),
                    if row.errors.is_empty() {
                        String::new()
                    } else {
                        format!("; client errors: {:?}", row.errors)
                    }
                );
                rows.push(row);
            }
            rows
        };
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            rows = run => Ok(rows),
            _ = tokio::signal::ctrl_c() => Err(anyhow!("interrupted (SIGINT)")),
            _ = term.recv() => Err(anyhow!("terminated (SIGTERM)")),
        }
    });
    // The cases' processes are stopped (their guards dropped with the future) before the
    // namespaces go.
    drop(rt);
    let mut rows = res?;
    if args.full {
        greedy::compare(&mut rows);
    }
    println!("{}", drive::table(&rows));
    let ok = rows.iter().all(drive::Row::passed);
    if ok && !args.keep_logs {
        drop(dir);
    } else {
        let kept = dir.keep();
        eprintln!("cluster: logs kept in {}", kept.display());
    }
    drop(net);
    Ok(ok)
}
