//! Keeping a query's answer at the nodes (results by reference, see
//! [`csd_runtime::refs`]): each partition's fragment runs at its node, which keeps
//! the rows and answers a reference instead of streaming them. The compute tier
//! moves no rows at all; whoever needs them resolves the references later, from
//! anywhere, with a plain Flight `DoGet`. All parts of one kept query form one table
//! (`csd_ref_GROUP`) across the nodes, which the next query reads like any other
//! (from a session made after the keep), so a pipeline of steps at the nodes moves
//! only its last answer.

use std::time::Duration;

use csd_protocol::ModuleDigest;
use csd_protocol::node_client::{Copies, Declined, Error as ClientError, Kept, Next, Tried};
use datafusion::common::{DataFusionError, Result};
use datafusion::physical_plan::ExecutionPlan;

use crate::compute::scan::only_scan;
use crate::compute::scan::opener::EndpointOpener;
use crate::compute::session::CsdSession;
use crate::error::to_datafusion;
use crate::wire::fragment::OPERATOR_NAME;

impl CsdSession {
    /// Runs `sql` at the nodes and keeps its answer there for `ttl`: one reference
    /// per partition (see the module docs). The query must push whole — filters,
    /// projections and functions a node evaluates over one table; a query with
    /// steps that run at the compute tier (joins, final aggregates, ORDER BY) is
    /// refused, since no node holds its answer.
    pub async fn keep(&self, sql: &str, ttl: Duration) -> Result<Vec<Kept>> {
        let df = self.ctx.sql(sql).await?;
        let plan = df.create_physical_plan().await?;
        let scan = only_scan(&plan).map_err(|left| {
            DataFusionError::Plan(format!(
                "the query does not push whole to the nodes (a {left} runs at the compute tier), \
                 so no node holds its answer to keep: keep a query of filters and projections over \
                 one table (see EXPLAIN), or run it without --keep"
            ))
        })?;
        let (ours, theirs) = (plan.schema(), scan.schema());
        let same = ours.fields().len() == theirs.fields().len()
            && ours
                .fields()
                .iter()
                .zip(theirs.fields())
                .all(|(a, b)| a.name() == b.name() && a.data_type() == b.data_type());
        if !same {
            return Err(DataFusionError::Plan(
                "the query's last projection runs at the compute tier, so no node holds its answer to keep: \
                 select the columns as the table has them (see EXPLAIN)"
                    .into(),
            ));
        }
        let task = self.ctx.task_ctx();
        // The answer never crosses the link: compressing it would only cost the node.
        let compression = csd_protocol::Compression::None;
        let group = csd_protocol::refs::new_group();
        let runs = scan.table().endpoints().iter().map(|endpoint| {
            let opener = scan.opener(endpoint.clone(), task.clone());
            let group = group.as_str();
            async move {
                // Kept at one copy's node: the next copy's when a node is busy or
                // lost (see `Copies`); never here, where nothing can be kept.
                let mut copies = Copies::new(endpoint.replicas.iter().cloned());
                let mut at = opener.clone();
                loop {
                    let why = match keep_at(&at, compression, ttl, group).await? {
                        Ok(kept) => return Ok(kept),
                        Err(why) => why,
                    };
                    let Next::Ask(next) = copies.declined(at.endpoint.clone(), at.label(), why)
                    else {
                        return Err(DataFusionError::External(
                            format!(
                                "no node holding partition {} kept its answer ({}): a kept result must \
                                 be made at a node; retry later, or run the query without --keep",
                                endpoint.partition,
                                Tried::list(copies.tried())
                            )
                            .into(),
                        ));
                    };
                    at = opener.at_copy(&next);
                }
            }
        });
        futures::future::try_join_all(runs).await
    }
}

/// Asks `at`'s node to run its fragment and keep the answer (sending a Wasm
/// function's module once if the node lacks it): the reference, or why the node
/// declined.
async fn keep_at(
    at: &EndpointOpener,
    compression: csd_protocol::Compression,
    ttl: Duration,
    group: &str,
) -> Result<std::result::Result<Kept, Declined>> {
    let args = at.fragment.to_bytes();
    let client = &at.endpoint.client;
    let mut sent: Vec<ModuleDigest> = Vec::new();
    loop {
        match client
            .keep(OPERATOR_NAME, args.clone(), compression, ttl, Some(group))
            .await
        {
            // A node without a Wasm function's module: send it once.
            Err(ClientError::ModuleMissing(d)) => {
                let bytes = (at.functions.iter())
                    .find(|f| f.digest == d && !sent.contains(&d))
                    .and_then(|f| f.bytes.clone());
                let Some(bytes) = bytes else {
                    return Err(to_datafusion(ClientError::ModuleMissing(d)));
                };
                client.put_module(&bytes).await.map_err(to_datafusion)?;
                sent.push(d);
            }
            Ok(kept) => return Ok(Ok(kept)),
            Err(e) => {
                return match Declined::of(&e) {
                    Some(why) => Ok(Err(why)),
                    None => Err(to_datafusion(e)),
                };
            }
        }
    }
}
