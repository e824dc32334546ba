//! `pdnode certs init`: a cluster CA and per-node certificates for the node plane's mutual TLS
//! (see `pdnode_nodeapi::certs`, docs/configuration.md `[security]`).

use super::UsageError;
use pdnode_nodeapi::certs::{self, CertNode, CertsError, CertsInit, DEFAULT_DAYS};
use std::path::PathBuf;

#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// Write DIR/ca.pem, DIR/ca.key and DIR/NAME.pem, DIR/NAME.key per --node. A CA already in
    /// DIR signs the new nodes (to add nodes later); existing files are never replaced without
    /// --force.
    Init(InitArgs),
}

#[derive(Debug, clap::Args)]
pub struct InitArgs {
    /// Directory for the files (created if missing).
    #[arg(long, value_name = "DIR")]
    pub dir: PathBuf,
    /// The cluster (node.cluster) the certificates are for.
    #[arg(long, default_value = "default")]
    pub cluster: String,
    /// A node: NAME:ROLE[@HOST[,HOST...]]. NAME is its node.id, ROLE prefill, decode, router or
    /// all; HOSTs (IP addresses or DNS names) are added as SANs for tools that check host names.
    /// Repeatable. Example: --node router-a:router@10.0.0.1 --node prefill-b:prefill
    #[arg(
        long = "node",
        value_name = "NAME:ROLE[@HOST,...]",
        required_unless_present = "etcd"
    )]
    pub nodes: Vec<CertNode>,
    /// Also write DIR/etcd-server.pem and DIR/etcd-server.key: a server certificate for etcd's
    /// client port naming these hosts (the IP addresses or DNS names nodes dial, comma
    /// separated), signed by the cluster CA (the one in DIR, or the one --node makes). Start
    /// etcd with --cert-file, --key-file and --trusted-ca-file DIR/ca.pem (--client-cert-auth
    /// to require node certificates).
    #[arg(long, value_name = "HOST[,HOST...]", value_delimiter = ',')]
    pub etcd: Vec<String>,
    /// Replace existing files (a new CA too: certificates of the old one stop being accepted).
    #[arg(long)]
    pub force: bool,
    /// Validity of the new certificates, days.
    #[arg(long, default_value_t = DEFAULT_DAYS)]
    pub days: u32,
}

pub async fn run(args: Args) -> anyhow::Result<()> {
    match args.command {
        Command::Init(a) => init(a),
    }
}

fn init(a: InitArgs) -> anyhow::Result<()> {
    let usage = |e: CertsError| match e {
        CertsError::Invalid(_)
        | CertsError::Exists { .. }
        | CertsError::CaMismatch { .. }
        | CertsError::NoCa { .. }
        | CertsError::NoEtcdHost
        | CertsError::NodeBadHost { .. } => anyhow::Error::new(UsageError(e.to_string())),
        e => anyhow::Error::new(e),
    };
    let req = CertsInit {
        dir: a.dir,
        cluster: a.cluster,
        nodes: a.nodes,
        force: a.force,
        days: a.days,
    };
    if !req.nodes.is_empty() {
        let written = certs::init(&req).map_err(usage)?;
        if written.new_ca {
            println!("new cluster CA for cluster {:?}", req.cluster);
        } else {
            println!(
                "signed with the existing CA {}",
                req.dir.join("ca.pem").display()
            );
        }
        for f in &written.files {
            println!("wrote {}", f.display());
        }
        println!(
            "each node: [node] id = \"NAME\", cluster = {:?}, role = ROLE and [security] tls_ca = \"{}\", tls_cert = \"{}\", tls_key = \"{}\"; keep ca.key off the nodes",
            req.cluster,
            req.dir.join("ca.pem").display(),
            req.dir.join("NAME.pem").display(),
            req.dir.join("NAME.key").display()
        );
    }
    if !a.etcd.is_empty() {
        // With --force and --node the CA is new: the etcd certificate is replaced too.
        let files = certs::etcd_server(&req.dir, &req.cluster, &a.etcd, req.days, req.force)
            .map_err(usage)?;
        for f in &files {
            println!("wrote {}", f.display());
        }
        let ca = req.dir.join("ca.pem");
        println!(
            "etcd: --cert-file {} --key-file {} --trusted-ca-file {} --client-cert-auth; each node and router: [registry] endpoints = [\"https://{}:2379\"], etcd_tls_ca = \"{}\", etcd_tls_cert/etcd_tls_key = its node files, etcd_user and etcd_password_file if etcd auth is on",
            req.dir
                .join(format!("{}.pem", certs::ETCD_SERVER))
                .display(),
            req.dir
                .join(format!("{}.key", certs::ETCD_SERVER))
                .display(),
            ca.display(),
            a.etcd[0],
            ca.display()
        );
    }
    Ok(())
}
