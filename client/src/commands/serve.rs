//! `csd serve`: run a storage node (its settings: [`NodeConfig`]).

use std::path::PathBuf;
use std::sync::Arc;

use csd_client::{Error, Result};
use csd_runtime::config::NodeConfig;
use csd_runtime::node;

use super::announce;

#[derive(clap::Args)]
pub(crate) struct ServeArgs {
    /// TOML file with the same keys as the flags (`CSD_*` variables and flags win).
    #[arg(long, env = "CSD_CONFIG")]
    config: Option<PathBuf>,
    #[command(flatten)]
    node: NodeConfig,
}

pub(crate) async fn run(args: ServeArgs, matches: &clap::ArgMatches) -> Result<()> {
    let config = NodeConfig::load(matches, args.config.as_ref())?;
    let operators = csd_query_pushdown::registry_with(&config)?
        .with(Arc::new(csd_ml_pushdown::MlOperator::from_config(&config)?));
    let node = node::start_with(&config, operators).await?;
    announce(format_args!(
        "csd storage node listening on {} (device {})",
        node.url, config.device
    ));
    if let Some(m) = node.metrics_addr {
        announce(format_args!("metrics at http://{m}/metrics"));
    }
    let mut node = node;
    tokio::select! {
        r = tokio::signal::ctrl_c() => {
            r.map_err(|e| Error::io("waiting for Ctrl-C", e))?;
            announce(format_args!("shutting down"));
            node.shutdown().await?;
        }
        // The server ending on its own is an error worth reporting, not a hang.
        r = node.wait() => r?,
    }
    Ok(())
}
