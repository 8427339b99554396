//! [`CsdCodec`]: how the plans' own nodes cross to a `datafusion-distributed` worker.
//!
//! Two nodes are ours: [`CsdScanExec`] (see [`crate::compute::scan::codec`]) and
//! [`KeyCollectExec`] (a hash join's build side feeding a scan's join-key filter). A
//! collector and the scans that wait on it are linked by the collector's id: they
//! find each other again when they are decoded in the same plan (one task of one
//! stage, decoded on one worker). When they were planned in different stages both
//! carry where the keys meet ([`RemoteKeys`]): the collector publishes there, the
//! scan fetches from there.

use std::sync::Arc;
use std::time::Duration;

use datafusion::common::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::physical_plan::{
    PhysicalExtensionCodec, PhysicalPlanDecodeContext, PhysicalProtoConverterExtension,
};
use datafusion_proto::protobuf;
use prost::Message;

use super::keys::FlightKeyBoard;
use super::scope::DecodeScope;
use crate::compute::key_collector::{KeyCollectExec, KeyCollector, RemoteKeys};
use crate::compute::scan::CsdScanExec;
use crate::compute::scan::codec::ScanMsg;

/// Encodes and decodes the plan nodes of this crate for distributed execution.
/// Register it on the coordinating session and on every worker (both done by
/// [`super::Workers`] and [`crate::worker_sessions`]).
#[derive(Debug, Default, Clone, Copy)]
pub struct CsdCodec;

/// One of our nodes on the wire.
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct PlanNodeMsg {
    /// A scan of the storage nodes.
    #[prost(message, optional, tag = "1")]
    pub(crate) scan: Option<ScanMsg>,
    /// A join's build side collecting keys.
    #[prost(message, optional, tag = "2")]
    pub(crate) key_collect: Option<KeyCollectMsg>,
}

/// A [`KeyCollectExec`] on the wire (its input is the node's child).
#[derive(Clone, PartialEq, prost::Message)]
pub(crate) struct KeyCollectMsg {
    /// The collector's id in the plan.
    #[prost(uint64, tag = "1")]
    pub(crate) id: u64,
    /// The build side's key expressions.
    #[prost(message, repeated, tag = "2")]
    pub(crate) exprs: Vec<protobuf::PhysicalExprNode>,
    /// How long a scan waits for the keys, in milliseconds.
    #[prost(uint64, tag = "3")]
    pub(crate) wait_ms: u64,
    /// Filter bits per key.
    #[prost(uint32, tag = "4")]
    pub(crate) bits_per_key: u32,
    /// Where its keys meet the scans of other stages, if any do.
    #[prost(message, optional, tag = "5")]
    pub(crate) remote: Option<RemoteKeys>,
}

fn decode_error(what: impl std::fmt::Display) -> DataFusionError {
    DataFusionError::Plan(format!("a csd plan node cannot be decoded: {what}"))
}

impl PhysicalExtensionCodec for CsdCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
        converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let msg = PlanNodeMsg::decode(buf).map_err(decode_error)?;
        let scope = ctx
            .session_config()
            .get_extension::<DecodeScope>()
            .ok_or_else(|| {
                DataFusionError::Plan(
                    "this process runs no csd scans: a plan with csd nodes runs on a `csd worker` \
                 (or a session made by csd_query_pushdown::worker_sessions)"
                        .into(),
                )
            })?;
        match (msg.scan, msg.key_collect) {
            (Some(scan), None) => {
                if !inputs.is_empty() {
                    return Err(decode_error("a CsdScanExec has no inputs"));
                }
                Ok(Arc::new(CsdScanExec::from_msg(scan, scope.as_ref())?))
            }
            (None, Some(k)) => {
                let [input] = inputs else {
                    return Err(decode_error("a KeyCollectExec has one input"));
                };
                let schema = input.schema();
                let dcx = PhysicalPlanDecodeContext::new(ctx, self);
                let exprs = k
                    .exprs
                    .iter()
                    .map(|e| converter.proto_to_physical_expr(e, &schema, &dcx))
                    .collect::<Result<Vec<_>>>()?;
                let collector = Arc::new(KeyCollector::with_id(
                    k.id,
                    exprs,
                    1,
                    Duration::from_millis(k.wait_ms),
                    k.bits_per_key as usize,
                ));
                if let Some(r) = k.remote {
                    collector.set_remote(r, Arc::new(FlightKeyBoard));
                }
                scope.collectors().insert(k.id, collector.clone());
                Ok(Arc::new(KeyCollectExec::new(input.clone(), collector)))
            }
            _ => Err(decode_error("neither a scan nor a key collector")),
        }
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        let msg = if let Some(scan) = node.downcast_ref::<CsdScanExec>() {
            PlanNodeMsg {
                scan: Some(scan.to_msg()?),
                key_collect: None,
            }
        } else if let Some(k) = node.downcast_ref::<KeyCollectExec>() {
            let c = k.collector();
            PlanNodeMsg {
                scan: None,
                key_collect: Some(KeyCollectMsg {
                    id: c.id(),
                    exprs: c
                        .exprs()
                        .iter()
                        .map(|e| converter.physical_expr_to_proto(e, self))
                        .collect::<Result<_>>()?,
                    wait_ms: c.wait_for().as_millis() as u64,
                    bits_per_key: c.bits_per_key() as u32,
                    remote: c.remote().cloned(),
                }),
            }
        } else {
            return Err(DataFusionError::NotImplemented(format!(
                "{} is not a csd plan node",
                node.name()
            )));
        };
        msg.encode(buf)
            .map_err(|e| DataFusionError::External(Box::new(e)))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use arrow::datatypes::{DataType, Field, Schema};
    use csd_protocol::node_client::Credentials;
    use csd_protocol::{Compression, ObjectDescription};
    use datafusion::physical_expr::expressions::Column;
    use datafusion::physical_plan::empty::EmptyExec;
    use datafusion::prelude::SessionConfig;
    use datafusion_proto::physical_plan::DefaultPhysicalProtoConverter;
    use proptest::prelude::*;

    use super::super::env::WorkerEnv;
    use crate::compute::endpoints::{Endpoint, TableEndpoints};
    use crate::compute::range_read::NodeRangeStore;
    use crate::wire::fragment::Mode;
    use crate::wire::shipped::ShippedFunction;

    fn task_ctx(env: &Arc<WorkerEnv>) -> TaskContext {
        let config = SessionConfig::new().with_extension(Arc::new(DecodeScope::new(env.clone())));
        TaskContext::default().with_session_config(config)
    }

    fn roundtrip(
        node: Arc<dyn ExecutionPlan>,
        inputs: &[Arc<dyn ExecutionPlan>],
        ctx: &TaskContext,
    ) -> Arc<dyn ExecutionPlan> {
        let conv = DefaultPhysicalProtoConverter {};
        let mut buf = Vec::new();
        CsdCodec.try_encode(node, &mut buf, &conv).unwrap();
        CsdCodec.try_decode(&buf, inputs, ctx, &conv).unwrap()
    }

    static RT: std::sync::LazyLock<tokio::runtime::Runtime> = std::sync::LazyLock::new(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    });

    prop_compose! {
        fn scans()(
            table in "[a-z_]{1,12}",
            cols in 1usize..5,
            eps in prop::collection::vec(
                (0usize..3, "[a-z0-9]{1,6}", any::<u32>(), any::<u32>(), 0usize..3),
                0..6,
            ),
            compression in 0i32..3,
            plan in prop::collection::vec(any::<u8>(), 0..200),
            aggregate in any::<bool>(),
            describe in ".{0,40}",
            fraction in prop::option::of(0.0f64..1.0),
            limit in prop::option::of(0usize..1_000_000),
            direct in any::<bool>(),
            pinned in any::<bool>(),
            functions in prop::collection::vec(
                ("[a-z]{1,8}", "[a-z_]{1,8}", any::<[u8; 32]>(), prop::option::of(prop::collection::vec(any::<u8>(), 0..64))),
                0..3,
            ),
            extra in 0usize..4,
        ) -> (CsdScanExec, Arc<WorkerEnv>) {
            // Lazy connections need a runtime to start in.
            let _rt = RT.enter();
            let env = WorkerEnv::new(Credentials::default(), Some(1)).unwrap();
            let fields: Vec<Field> = (0..cols)
                .map(|i| Field::new(format!("c{i}"), DataType::Int64, i % 2 == 0))
                .collect();
            let schema = Arc::new(Schema::new(fields));
            let endpoints: Vec<Endpoint> = eps
                .into_iter()
                .map(|(node, part, rows, bytes, objects)| {
                    let url = format!("grpc://10.0.0.{node}:5005{node}");
                    let (client, node) = env.node(&url).unwrap();
                    Endpoint {
                        client,
                        partition: part.clone(),
                        rows: rows as u64,
                        bytes: bytes as u64,
                        objects: (0..objects)
                            .map(|i| ObjectDescription {
                                name: format!("{table}/{part}/{i}.parquet"),
                                len: 1000 + i as u64,
                                rows: 10 * i as u64,
                                row_groups: i,
                                int_ranges: vec![Some([i as i64, 7]), None],
                                digest: None,
                            })
                            .collect(),
                        node,
                        merged: vec![],
                        distinct: vec![],
                        node_distinct: Default::default(),
                        replicas: vec![],
                    }
                })
                .collect();
            let n = endpoints.len();
            let at = TableEndpoints::new(
                table,
                schema.clone(),
                endpoints,
                Compression::try_from(compression).unwrap(),
                env.ranges().clone(),
                env.local().clone(),
            );
            let mode = if aggregate { Mode::PartialAggregate } else { Mode::Complete };
            let mut scan = CsdScanExec::new(Arc::new(at), schema, plan, mode, describe)
                .with_estimate(fraction, limit)
                .with_functions(
                    functions
                        .into_iter()
                        .map(|(name, export, digest, bytes)| {
                            Arc::new(ShippedFunction {
                                name,
                                export,
                                digest: csd_protocol::ModuleDigest(digest),
                                bytes: bytes.map(Arc::from),
                            })
                        })
                        .collect(),
                )
                .with_partitions(n + extra);
            if direct {
                scan = scan.direct();
            }
            if pinned {
                scan = scan.pinned();
            }
            (scan, env)
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Every field of a scan survives the codec, and its objects become readable
        /// through the decoding worker's byte-range store.
        #[test]
        fn a_scan_round_trips_through_the_codec((scan, env) in scans()) {
            let _rt = RT.enter();
            let ctx = task_ctx(&env);
            let want = scan.to_msg().unwrap();
            let back = roundtrip(Arc::new(scan), &[], &ctx);
            let back = back.downcast_ref::<CsdScanExec>().unwrap();
            prop_assert_eq!(back.to_msg().unwrap(), want.clone());
            for e in back.table().endpoints() {
                for o in &e.objects {
                    let (_, _, len) = env
                        .ranges()
                        .locate(&NodeRangeStore::path(e.node, &o.name))
                        .unwrap();
                    prop_assert_eq!(len, o.len);
                }
            }
        }
    }

    /// A scan's join-key filter is linked again to its collector when both are in
    /// the decoded plan, fetched from the key board when they were planned in
    /// different stages, and dropped otherwise.
    #[tokio::test]
    async fn key_filters_find_their_collector_in_the_same_plan_only() {
        let env = WorkerEnv::new(Credentials::default(), Some(1)).unwrap();
        let schema = Arc::new(Schema::new(vec![Field::new("k", DataType::Int64, false)]));
        let build: Arc<dyn ExecutionPlan> = Arc::new(EmptyExec::new(schema.clone()));
        let collector = Arc::new(KeyCollector::new(
            vec![Arc::new(Column::new("k", 0))],
            1,
            Duration::from_millis(1500),
            12,
        ));
        let collect: Arc<dyn ExecutionPlan> =
            Arc::new(KeyCollectExec::new(build.clone(), collector.clone()));
        let (client, node) = env.node("grpc://10.0.0.1:1").unwrap();
        let at = TableEndpoints::new(
            "t".into(),
            schema.clone(),
            vec![Endpoint {
                client,
                partition: "p".into(),
                rows: 1,
                bytes: 1,
                objects: vec![],
                node,
                merged: vec![],
                distinct: vec![],
                node_distinct: Default::default(),
                replicas: vec![],
            }],
            Compression::None,
            env.ranges().clone(),
            env.local().clone(),
        );
        let scan = CsdScanExec::new(Arc::new(at), schema, vec![], Mode::Complete, String::new())
            .with_key_filter(collector.clone(), vec![0]);
        let scan: Arc<dyn ExecutionPlan> = Arc::new(scan);

        let ctx = task_ctx(&env);
        let k = roundtrip(collect, std::slice::from_ref(&build), &ctx);
        let k = k.downcast_ref::<KeyCollectExec>().unwrap();
        assert_eq!(k.collector().id(), collector.id());
        assert_eq!(k.collector().wait_for(), Duration::from_millis(1500));
        assert_eq!(k.collector().exprs().len(), 1);
        let s = roundtrip(scan.clone(), &[], &ctx);
        let s = s.downcast_ref::<CsdScanExec>().unwrap();
        assert_eq!(s.key_filter_columns(), vec![vec![0]]);
        let scope = ctx.session_config().get_extension::<DecodeScope>().unwrap();
        assert!(Arc::ptr_eq(
            &scope.collector(collector.id()).unwrap(),
            k.collector()
        ));

        // Another plan (a fresh scope) without the collector: no filter.
        let s = roundtrip(scan.clone(), &[], &task_ctx(&env));
        assert!(!s.downcast_ref::<CsdScanExec>().unwrap().has_key_filter());

        // Planned in different stages: both carry where the keys meet, and the scan
        // decoded without its collector fetches from there.
        let remote = RemoteKeys {
            home: "http://10.0.0.2:7".into(),
            key: "q/1".into(),
            wait_ms: 1500,
        };
        collector.set_remote(remote.clone(), Arc::new(FlightKeyBoard));
        let ctx = task_ctx(&env);
        let s = roundtrip(scan, &[], &ctx);
        let s = s.downcast_ref::<CsdScanExec>().unwrap();
        assert_eq!(s.key_filter_columns(), vec![vec![0]]);
        let fetcher = s.key_collectors().next().unwrap();
        assert_eq!(fetcher.id(), collector.id());
        assert_eq!(fetcher.remote(), Some(&remote));
        let k = roundtrip(
            Arc::new(KeyCollectExec::new(build.clone(), collector.clone())),
            &[build],
            &ctx,
        );
        assert_eq!(
            k.downcast_ref::<KeyCollectExec>()
                .unwrap()
                .collector()
                .remote(),
            Some(&remote)
        );
    }

    /// A process that is not a worker says so instead of failing obscurely.
    #[test]
    fn decoding_outside_a_worker_says_what_is_missing() {
        let conv = DefaultPhysicalProtoConverter {};
        let mut buf = Vec::new();
        PlanNodeMsg {
            scan: Some(ScanMsg::default()),
            key_collect: None,
        }
        .encode(&mut buf)
        .unwrap();
        let e = CsdCodec
            .try_decode(&buf, &[], &TaskContext::default(), &conv)
            .unwrap_err()
            .to_string();
        assert!(e.contains("csd worker"), "{e}");
        let e = CsdCodec
            .try_decode(&[0xff, 0xff], &[], &TaskContext::default(), &conv)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot be decoded"), "{e}");
    }
}
