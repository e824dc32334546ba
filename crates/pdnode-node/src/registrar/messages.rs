//! Messages of the Registrar. Callers use [`super::RegistrarHandle`].

use pdnode_registry::RegistrationStatus;
use ractor::RpcReplyPort;

pub enum RegistrarMsg {
    /// Publish the current load if it changed.
    Tick,
    /// `None` once deregistered.
    Status(RpcReplyPort<Option<RegistrationStatus>>),
    /// Revoke the lease now (shutdown step one).
    Deregister(RpcReplyPort<Result<(), pdnode_registry::RegistryError>>),
}
