//! What travels between the compute tier and the nodes, and what both sides must
//! agree on: the fragment message and its limits ([`fragment`]), the join-key filter
//! as it travels ([`keyfilter`]), the functions a node evaluates ([`functions`]), and the shape a plan is sent in
//! ([`connectives`]).

pub mod connectives;
pub mod fragment;
pub mod functions;
pub mod keyfilter;
pub mod wasm;
