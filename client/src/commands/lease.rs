//! `csd lease`: lease a node's CPU slots for a while (or hold one, or end one).

use csd_client::{Error, Result};

use super::ClientCreds;

#[derive(clap::Args)]
pub(crate) struct LeaseArgs {
    /// Node URL.
    #[arg(long, default_value = "grpc://127.0.0.1:50051")]
    node: String,
    /// Slots.
    #[arg(long, default_value_t = 1)]
    slots: usize,
    /// How long, in seconds.
    #[arg(long, default_value_t = 60.0)]
    seconds: f64,
    /// End the lease LEASE now instead.
    #[arg(long, value_name = "LEASE", conflicts_with_all = ["slots", "seconds", "hold"])]
    release: Option<String>,
    /// Hold the lease while this command runs (until Ctrl-C): the node ends it
    /// once this process has been silent for --idle-s, so a holder that dies
    /// gives the slots back.
    #[arg(long)]
    hold: bool,
    /// With --hold: the idle limit, in seconds.
    #[arg(long, default_value_t = 10.0, requires = "hold")]
    idle_s: f64,
    /// Memory held for the pushed work run on the lease (`csd sql --lease`,
    /// `csd run --lease`), e.g. 512MiB; without it, that work draws on the
    /// node's free memory.
    #[arg(long)]
    memory: Option<csd_protocol::ByteSize>,
    #[command(flatten)]
    creds: ClientCreds,
}

pub(crate) async fn run(args: LeaseArgs) -> Result<()> {
    let LeaseArgs {
        node,
        slots,
        seconds,
        release,
        hold,
        idle_s,
        memory,
        creds,
    } = args;
    let c = creds.connect(&node).await?;
    if release.is_none() && (!seconds.is_finite() || seconds <= 0.0) {
        return Err(Error::InvalidInput(format!(
            "--seconds {seconds}: a lease lasts a positive number of seconds"
        )));
    }
    let ask = csd_protocol::LeaseRequest {
        slots,
        seconds,
        idle_seconds: None,
        memory,
    };
    if hold {
        if !idle_s.is_finite() || idle_s <= 0.0 {
            return Err(Error::InvalidInput(
                "--idle-s must be a positive number of seconds".into(),
            ));
        }
        let held = c
            .hold_lease_with(&csd_protocol::LeaseRequest {
                idle_seconds: Some(idle_s),
                ..ask
            })
            .await?;
        println!("{}", serde_json::to_string(&held.info).unwrap_or_default());
        eprintln!("holding lease {} (Ctrl-C ends it)", held.info.id);
        let _ = tokio::signal::ctrl_c().await;
        let id = held.info.id.clone();
        drop(held);
        c.release_lease(&id).await?;
        return Ok(());
    }
    let info = match release {
        Some(id) => c.release_lease(&id).await?,
        None => c.lease_with(&ask).await?,
    };
    println!("{}", serde_json::to_string(&info).unwrap_or_default());
    Ok(())
}
