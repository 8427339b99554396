//! `csd demo`: the README's main job (an embedded node, TPC-H, queries with and
//! without pushdown).

use csd_client::{Result, demo};

#[derive(clap::Args)]
pub(crate) struct DemoArgs {
    /// TPC-H scale factor.
    #[arg(long, default_value_t = 0.1)]
    scale: f64,
    /// Device spec (default: an io_uring file in the temp directory).
    #[arg(long)]
    device: Option<String>,
    /// Keep the device file (with --device it is kept anyway; this prints how to serve it).
    #[arg(long)]
    keep: bool,
}

pub(crate) async fn run(args: DemoArgs) -> Result<()> {
    let DemoArgs {
        scale,
        device,
        keep,
    } = args;
    demo::run(demo::DemoOptions {
        scale,
        device,
        keep,
        ..Default::default()
    })
    .await
}
