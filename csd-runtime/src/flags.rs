//! Settings structs are clap `Args` first: their defaults are written once, on the
//! flag, and read back from there.

use clap::{Args, FromArgMatches};

/// The defaults of `T`'s flags, as clap parses an empty command line without reading
/// the environment: the one place a setting's default is written is its flag.
pub(crate) fn clap_defaults<T: Args + FromArgMatches>() -> T {
    let cmd = T::augment_args(clap::Command::new("defaults")).mut_args(|a| a.env(None::<&str>));
    cmd.try_get_matches_from(["defaults"])
        .and_then(|m| T::from_arg_matches(&m))
        .unwrap_or_else(|e| unreachable!("settings' own defaults do not parse: {e}"))
}
