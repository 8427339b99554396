//! `csd testbed`: emulated clusters from scenario files (check one, or run it and
//! write its report).

use std::path::PathBuf;

use clap::Subcommand;
use csd_client::Result;

#[derive(Subcommand)]
pub(crate) enum TestbedCmd {
    /// Run a scenario.
    Run {
        /// The scenario file.
        scenario: PathBuf,
        /// Report folder (default: `testbed-out/` and the scenario name).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Smaller data, shorter runs, two values per swept axis.
        #[arg(long)]
        quick: bool,
    },
    /// Check a scenario file and list the runs it would make.
    Check {
        /// The scenario file.
        scenario: PathBuf,
    },
}

pub(crate) async fn run(cmd: TestbedCmd) -> Result<()> {
    use csd_testbed::scenario::{Scenario, label};
    match cmd {
        TestbedCmd::Check { scenario } => {
            let s = Scenario::from_file(&scenario)?;
            let points = s.points();
            println!(
                "{}: {} policies × {} points = {} runs, each stopped after {} s",
                s.name,
                s.policies.len(),
                points.len(),
                s.policies.len() * points.len(),
                s.timeout_s
            );
            for p in &points {
                println!("  {}", label(p));
            }
            Ok(())
        }
        TestbedCmd::Run {
            scenario,
            out,
            quick,
        } => {
            let s = Scenario::from_file(&scenario)?;
            let out = out.unwrap_or_else(|| PathBuf::from("testbed-out").join(&s.name));
            let opts = csd_testbed::RunOptions {
                out: out.clone(),
                quick,
                progress: true,
            };
            let report = csd_testbed::run(s, &opts).await?;
            println!("\n{}", report.headline.join("\n"));
            println!("report: {}", out.join("report.md").display());
            Ok(())
        }
    }
}
