//! The configuration tree, one for every role.
//!
//! Layers, later wins: built-in defaults -> TOML file -> `PDNODE_<SECTION>__<KEY>` environment
//! variables -> `--set key=value` arguments. Every struct denies unknown fields; [`Config::validate`]
//! checks what types cannot. Errors name the key and the layer (file path, env var, `--set`) that
//! set it. `docs/configuration.md` describes every key.

mod load;
mod pem;
mod schema;
mod schema_router;
mod sglang;
mod validate;

pub use load::{
    ConfigError, ConfigSource, Loaded, MAX_CONFIG_BYTES, MAX_KEY_ERRORS, load, load_from_str,
    load_from_str_with_env,
};
pub use pem::{
    FileError, MAX_PEM_BYTES, pem_certs, pem_key, read_pem_certs, read_pem_file, read_pem_key,
    read_secret_file,
};
pub use schema::*;
pub use schema_router::*;
pub use sglang::{SglangConfig, SglangDecodeWorker, SglangPrefillWorker, worker_url_host};
