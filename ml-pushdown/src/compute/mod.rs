//! The compute side: a whole feature job ([`job`]), its stream ([`stream`]) and a
//! partition's from its copies (`copies`), the split planner ([`planner`]) and the
//! head trained on the features ([`train`]).

mod boundary;
mod copies;
pub mod job;
pub mod planner;
pub mod stream;
pub mod train;
