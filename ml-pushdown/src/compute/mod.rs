//! The compute side: a whole feature job ([`job`]), its stream ([`stream`]), the
//! split planner ([`planner`]) and the head trained on the features ([`train`]).

pub mod job;
pub mod planner;
pub mod stream;
pub mod train;
