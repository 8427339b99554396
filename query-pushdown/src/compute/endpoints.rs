//! Where a table's partitions live and how fragments over it travel: what a
//! [`CsdScanExec`](crate::compute::scan::CsdScanExec) needs of its table.

use std::sync::Arc;

use arrow::datatypes::SchemaRef;
use csd_protocol::Compression;
use csd_protocol::ObjectDescription;
use csd_protocol::node_client::NodeClient;

use crate::compute::gate::LocalGate;
use crate::compute::range_read::{NodeRangeStore, RangeReadTable};

/// One partition of a table on one node.
#[derive(Clone)]
pub struct Endpoint {
    /// The node.
    pub client: NodeClient,
    /// Partition name.
    pub partition: String,
    /// Rows.
    pub rows: u64,
    /// Stored bytes.
    pub bytes: u64,
    /// Its Parquet objects.
    pub objects: Vec<ObjectDescription>,
    /// The node's index in the cluster (its paths in [`NodeRangeStore`]).
    pub node: usize,
    /// When this endpoint stands for several of the node's partitions read as one
    /// (see [`TableEndpoints::per_node`]), their names (`partition` is then their
    /// names joined for display); empty for one partition.
    pub merged: Vec<String>,
    /// Per table column, the estimated distinct non-NULL values in this endpoint's
    /// rows, from the node's sketches (empty or `None` where unknown).
    pub distinct: Vec<Option<u64>>,
    /// The same over every partition of the table at this endpoint's node.
    pub node_distinct: Arc<Vec<Option<u64>>>,
    /// The same partition on other nodes, byte for byte (see
    /// [`crate::compute::replicas`]): where its fragment goes when this node is
    /// lost or busy. Empty for a partition kept once; for an endpoint standing for
    /// several partitions, the other nodes holding a copy of each of them.
    pub replicas: Vec<Endpoint>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.client.url(), self.partition)
    }
}

/// One endpoint for `many` partitions at one node, read as one (see
/// [`TableEndpoints::per_node`]); without replicas.
fn merged_at(many: &[&Endpoint]) -> Endpoint {
    let names: Vec<String> = many.iter().map(|e| e.partition.clone()).collect();
    Endpoint {
        client: many[0].client.clone(),
        partition: names.join("+"),
        rows: many.iter().map(|e| e.rows).sum(),
        bytes: many.iter().map(|e| e.bytes).sum(),
        objects: many.iter().flat_map(|e| e.objects.clone()).collect(),
        node: many[0].node,
        merged: names,
        // Every partition of the table at the node (the listing's union of them
        // all).
        distinct: many[0].node_distinct.as_ref().clone(),
        node_distinct: many[0].node_distinct.clone(),
        replicas: vec![],
    }
}

/// A table's endpoints, with what its scans share: answer compression, byte-range
/// reads of the nodes' objects (for fragments handed back), and the gate those run
/// under here.
#[derive(Debug)]
pub struct TableEndpoints {
    name: String,
    schema: SchemaRef,
    endpoints: Vec<Endpoint>,
    compression: Compression,
    ranges: Arc<NodeRangeStore>,
    local: Arc<LocalGate>,
}

impl TableEndpoints {
    /// A table called `name` with `schema`, held as `endpoints`; results travel with
    /// `compression`; `ranges` reads the nodes' objects by byte range; fragments
    /// handed back run here under `local` (see [`LocalGate`]).
    pub fn new(
        name: String,
        schema: SchemaRef,
        endpoints: Vec<Endpoint>,
        compression: Compression,
        ranges: Arc<NodeRangeStore>,
        local: Arc<LocalGate>,
    ) -> Self {
        TableEndpoints {
            name,
            schema,
            endpoints,
            compression,
            ranges,
            local,
        }
    }

    /// Where the table's objects are read by byte range.
    pub(crate) fn ranges(&self) -> &NodeRangeStore {
        &self.ranges
    }

    /// The same table with `endpoints` only.
    pub(crate) fn with_endpoints(&self, endpoints: Vec<Endpoint>) -> Self {
        TableEndpoints {
            name: self.name.clone(),
            schema: self.schema.clone(),
            endpoints,
            compression: self.compression,
            ranges: self.ranges.clone(),
            local: self.local.clone(),
        }
    }

    /// The same table with each node's partitions as one endpoint: a partial
    /// aggregate at a node then merges its partitions' states there and answers one
    /// state per group, instead of one per group and partition (and one request and
    /// answer per node instead of per partition).
    pub(crate) fn per_node(&self) -> Self {
        // Nodes in the order their first partition comes.
        let mut nodes: Vec<usize> = Vec::new();
        for e in &self.endpoints {
            if !nodes.contains(&e.node) {
                nodes.push(e.node);
            }
        }
        let mut out = Vec::new();
        for n in nodes {
            let group: Vec<&Endpoint> = self.endpoints.iter().filter(|e| e.node == n).collect();
            match group.as_slice() {
                [one] => out.push((*one).clone()),
                many => {
                    let mut at_node = merged_at(many);
                    // Another node holding a copy of each of these partitions can
                    // run the same fragment when this one is busy or lost.
                    let others = many[0].replicas.iter().map(|r| r.node);
                    at_node.replicas = others
                        .filter_map(|m| {
                            let copies: Option<Vec<&Endpoint>> = many
                                .iter()
                                .map(|e| e.replicas.iter().find(|r| r.node == m))
                                .collect();
                            Some(merged_at(&copies?))
                        })
                        .collect();
                    out.push(at_node);
                }
            }
        }
        self.with_endpoints(out)
    }

    /// Table name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Table schema.
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Where it lives.
    pub fn endpoints(&self) -> &[Endpoint] {
        &self.endpoints
    }

    /// Rows in all its partitions.
    pub fn rows(&self) -> u64 {
        self.endpoints.iter().map(|e| e.rows).sum()
    }

    /// Answer compression.
    pub fn compression(&self) -> Compression {
        self.compression
    }

    /// Where fragments the nodes hand back wait for a core here.
    pub(crate) fn local_gate(&self) -> &Arc<LocalGate> {
        &self.local
    }

    /// Whether `e`'s partition (or, for an endpoint standing for several, any of
    /// their objects) is kept on another node too.
    pub(crate) fn has_copies(&self, e: &Endpoint) -> bool {
        !e.replicas.is_empty()
            || e.objects.iter().any(|o| {
                self.ranges
                    .has_copies(&NodeRangeStore::path(e.node, &o.name))
            })
    }

    /// The objects of `endpoints` read by byte range, as a table here.
    pub(crate) fn range_table(&self, endpoints: &[Endpoint]) -> RangeReadTable {
        let files = endpoints
            .iter()
            .flat_map(|e| {
                e.objects.iter().map(|o| {
                    (
                        NodeRangeStore::path(e.node, &o.name).to_string(),
                        o.len,
                        o.rows,
                    )
                })
            })
            .collect();
        RangeReadTable::new(self.schema.clone(), files, self.ranges.clone())
    }
}
