//! The hand-off negotiation (docs/protocol.md): the KV target decode sends prefill, the
//! per-request secret, and the two synchronous state machines — [`Reservation`] on the decode
//! side and [`Push`] on the prefill side. They decide; the node runtime does the I/O.

mod guard;
mod push;
mod reservation;
mod secret;
mod target;

pub use guard::BlockGuard;
pub use push::{Push, PushRelease, PushState, PutPlan};
pub use reservation::{Reservation, ReservationEnd, ReservationState};
pub use secret::Secret;
pub use target::{DoneStatus, KvTarget, Placement};
