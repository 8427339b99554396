//! The counters one partition of a [`CsdScanExec`](super::CsdScanExec) keeps, as
//! DataFusion metrics (`EXPLAIN ANALYZE` shows them).

use datafusion::physical_plan::metrics::{Count, ExecutionPlanMetricsSet, MetricBuilder};

/// Counters of one scan partition (one endpoint).
#[derive(Debug, Clone)]
pub(crate) struct ScanMetrics {
    /// Rows this partition produced.
    pub(crate) output_rows: Count,
    /// Bytes received from the node (Arrow IPC after compression).
    pub bytes_received: Count,
    /// Bytes read here from the nodes by byte range (direct scans, fragments handed
    /// back).
    pub(crate) range_bytes: Count,
    /// Bytes the node read from its device.
    pub(crate) node_bytes_read: Count,
    /// Rows the node's Parquet scans decoded.
    pub(crate) node_rows_scanned: Count,
    /// 1 when the node handed the fragment back and it ran here.
    pub pushed_back: Count,
}

impl ScanMetrics {
    /// The counters of `partition` in `metrics`.
    pub(super) fn new(metrics: &ExecutionPlanMetricsSet, partition: usize) -> Self {
        let b = || MetricBuilder::new(metrics);
        ScanMetrics {
            output_rows: b().output_rows(partition),
            bytes_received: b().counter("bytes_received", partition),
            range_bytes: b().counter("range_bytes", partition),
            node_bytes_read: b().counter("node_bytes_read", partition),
            node_rows_scanned: b().counter("node_rows_scanned", partition),
            pushed_back: b().counter("pushed_back", partition),
        }
    }
}
