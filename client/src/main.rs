//! `csd`: run a storage node, load data into it, query it, and run the demo. One
//! module per command under `commands/` (its arguments and its `run`); this file
//! only parses the command line and dispatches.

mod commands;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use csd_client::{Error, Result};

#[derive(Parser)]
#[command(
    name = "csd",
    version,
    about = "csd: computational-storage pushdown engine"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a storage node.
    Serve(commands::serve::ServeArgs),
    /// Store a Parquet or CSV file as a table partition, or (with --images or --text) a
    /// dataset (`id, label, data`) spread over --partitions partitions.
    Put(commands::put::PutArgs),
    /// Stream DNN features of a dataset, with the first layers run at the storage nodes
    /// (or print the split plan with --explain).
    Features(commands::features::FeaturesArgs),
    /// List tables (and with --objects, stored objects).
    Ls(commands::ls::LsArgs),
    /// Delete a table or one partition (`table/partition`).
    Rm(commands::rm::RmArgs),
    /// Stream kept results (references printed by `csd sql --keep`) and print them.
    Get(commands::get::GetArgs),
    /// List this tenant's kept results at a node, one JSON object a line.
    Refs(commands::refs::RefsArgs),
    /// Free kept results now.
    Release(commands::release::ReleaseArgs),
    /// Let another tenant read kept results (or with --revoke, no longer); prints
    /// each reference as that tenant resolves it (`csd get` it with its token).
    Grant(commands::grant::GrantArgs),
    /// Extend kept results to --ttl from now.
    Renew(commands::renew::RenewArgs),
    /// Lease CPU slots of a node for a while, to invoke shipped functions on without
    /// queueing; prints the lease as JSON (its `id` is what `csd invoke` takes).
    Lease(commands::lease::LeaseArgs),
    /// Call a function of a WebAssembly module (the guest SDK's SQL-function ABI) on a
    /// lease, over the rows of an Arrow IPC file; prints the result column.
    Invoke(commands::invoke::InvokeArgs),
    /// Print node, device and object-store figures as JSON.
    Stats(commands::stats::StatsArgs),
    /// Read every object a node stores from its device and check its checksums;
    /// prints what was damaged as JSON (exit code 4 when anything was).
    Scrub(commands::scrub::ScrubArgs),
    /// Give every partition back the copies it was put with (`put --replicas`):
    /// verifies each copy (a scrub on its node), deletes damaged ones and copies a
    /// good one byte for byte to the nodes that should hold it; reports what it did.
    Repair(commands::repair::RepairArgs),
    /// Tokens and certificates for nodes with tenants (`csd serve --auth`, TLS).
    #[command(subcommand)]
    Auth(commands::auth::AuthCmd),
    /// Run SQL over the nodes' tables, with the data-reducing part pushed to the nodes.
    ///
    /// Prints the result on stdout, and rows, time and bytes moved on stderr. With no
    /// query and no -f, reads statements from stdin (an interactive prompt on a
    /// terminal), each ended by `;`.
    Sql(commands::sql::SqlArgs),
    /// Run a compute-tier worker (datafusion-distributed) for `csd sql --workers`: it
    /// runs the stages of pushdown plans, with its own connections to the storage
    /// nodes (made with its own token and TLS settings).
    Worker(commands::worker::WorkerArgs),
    /// Serve Arrow Flight SQL in front of the nodes, for ADBC (Python, pandas,
    /// polars), JDBC and BI tools: queries plan as with `csd sql`, pushdown
    /// included; each caller asks the nodes with its own token.
    Gateway(commands::gateway::GatewayArgs),
    /// Run a WebAssembly module (a guest built with csd-guest, or any module speaking
    /// its ABI) over a table at the nodes that hold it; print the union of its outputs
    /// (or its merged aggregate) on stdout.
    Run(commands::run::RunArgs),
    /// Start an embedded node, load TPC-H, run queries with and without pushdown.
    Demo(commands::demo::DemoArgs),
    /// Emulated clusters from scenario files (`testbed/scenarios/*.toml`): start
    /// nodes on 127.0.0.1 behind throttled links, run the workload under each policy,
    /// write report.md, report.json and SVG plots.
    #[command(subcommand)]
    Testbed(commands::testbed::TestbedCmd),
}

async fn run(cli: Cli, matches: &clap::ArgMatches) -> Result<()> {
    match cli.command {
        Command::Serve(args) => {
            let serve_matches = matches
                .subcommand_matches("serve")
                .ok_or_else(|| Error::InvalidInput("serve: no arguments parsed".into()))?;
            commands::serve::run(args, serve_matches).await
        }
        Command::Put(args) => commands::put::run(args).await,
        Command::Features(args) => commands::features::run(args).await,
        Command::Ls(args) => commands::ls::run(args).await,
        Command::Rm(args) => commands::rm::run(args).await,
        Command::Get(args) => commands::get::run(args).await,
        Command::Refs(args) => commands::refs::run(args).await,
        Command::Release(args) => commands::release::run(args).await,
        Command::Grant(args) => commands::grant::run(args).await,
        Command::Renew(args) => commands::renew::run(args).await,
        Command::Lease(args) => commands::lease::run(args).await,
        Command::Invoke(args) => commands::invoke::run(args).await,
        Command::Stats(args) => commands::stats::run(args).await,
        Command::Scrub(args) => commands::scrub::run(args).await,
        Command::Repair(args) => commands::repair::run(args).await,
        Command::Auth(cmd) => commands::auth::run(cmd),
        Command::Sql(args) => commands::sql::run(args).await,
        Command::Worker(args) => commands::worker::run(args).await,
        Command::Gateway(args) => commands::gateway::run(args).await,
        Command::Run(args) => commands::run::run(args).await,
        Command::Demo(args) => commands::demo::run(args).await,
        Command::Testbed(args) => commands::testbed::run(args).await,
    }
}

fn main() -> std::process::ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let client_only = !matches!(
        cli.command,
        Command::Serve(_)
            | Command::Demo(_)
            | Command::Testbed(_)
            | Command::Gateway(_)
            | Command::Worker(_)
    );
    if client_only {
        // Pure client commands behave like other Unix tools under `csd ls | head`: end
        // quietly on a closed pipe instead of panicking in println!. Not where a server
        // runs (a node, a gateway, a worker): a peer closing its socket would then kill
        // it.
        // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let level = if matches!(cli.command, Command::Serve(_)) {
        "info"
    } else {
        "warn"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| level.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if client_only {
        // The runtime's threads do the network I/O: a node killed mid-answer must
        // fail a write there with EPIPE (and the query fail over to another copy),
        // not kill the process with SIGPIPE (hyper writes with `writev`, which has no
        // MSG_NOSIGNAL). SIGPIPE stays deliverable to the main thread, which prints.
        rt.on_thread_start(block_sigpipe);
    }
    let rt = match rt.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("csd: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(cli, &matches)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("csd: {}", csd_protocol::error::chain(&e));
            std::process::ExitCode::from(e.exit_code())
        }
    }
}

/// Blocks SIGPIPE for the calling thread: a write to a closed socket returns EPIPE.
fn block_sigpipe() {
    // SAFETY: a zeroed sigset_t is valid storage for sigemptyset, which initialises
    // it; pthread_sigmask changes only this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGPIPE);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

#[cfg(test)]
mod tests {
    /// Clap checks a command's arguments only when that (sub)command is built: each
    /// one is checked here (a flag clashing with another, as `--lease` once did with
    /// `invoke`'s lease argument, would otherwise panic when a user runs it).
    #[test]
    fn every_command_line_is_well_formed() {
        use clap::CommandFactory;
        fn check(c: &clap::Command) {
            c.clone().debug_assert();
            for s in c.get_subcommands() {
                check(s);
            }
        }
        check(&super::Cli::command());
    }
}
