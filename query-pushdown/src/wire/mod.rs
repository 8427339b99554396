//! What travels between the compute tier and the nodes, and what both sides must
//! agree on: the fragment message and its limits ([`fragment`]), the join-key filter
//! as it travels ([`keyfilter`]), the functions a node evaluates ([`functions`]),
//! the shape a plan is sent in ([`connectives`]), the Wasm SQL functions a fragment
//! ships ([`shipped`]), a shipped module's own request ([`wasm`]), and what a node
//! reports of what it ran ([`details`]).

pub mod connectives;
pub mod details;
pub mod fragment;
pub mod functions;
pub mod keyfilter;
pub mod shipped;
pub mod wasm;
