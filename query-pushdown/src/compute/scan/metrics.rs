//! The counters one partition of a [`CsdScanExec`](super::CsdScanExec) keeps, as
//! DataFusion metrics (`EXPLAIN ANALYZE` shows them).

use datafusion::physical_plan::metrics::{Count, ExecutionPlanMetricsSet, MetricBuilder};

/// A scan's counters by name, the one place their names are written: what
/// `EXPLAIN ANALYZE` shows and what a query's totals are summed from (on workers
/// too, where only the names travel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScanCounter {
    /// Bytes received from the node.
    BytesReceived,
    /// Bytes read here by byte range.
    RangeBytes,
    /// Bytes the node read from its device.
    NodeBytesRead,
    /// Rows the node's Parquet scans decoded.
    NodeRowsScanned,
    /// Fragments handed back.
    PushedBack,
}

impl ScanCounter {
    /// Its name among DataFusion's metrics.
    pub(crate) const fn name(self) -> &'static str {
        match self {
            ScanCounter::BytesReceived => "bytes_received",
            ScanCounter::RangeBytes => "range_bytes",
            ScanCounter::NodeBytesRead => "node_bytes_read",
            ScanCounter::NodeRowsScanned => "node_rows_scanned",
            ScanCounter::PushedBack => "pushed_back",
        }
    }
}

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
        let counter = |c: ScanCounter| MetricBuilder::new(metrics).counter(c.name(), partition);
        ScanMetrics {
            output_rows: MetricBuilder::new(metrics).output_rows(partition),
            bytes_received: counter(ScanCounter::BytesReceived),
            range_bytes: counter(ScanCounter::RangeBytes),
            node_bytes_read: counter(ScanCounter::NodeBytesRead),
            node_rows_scanned: counter(ScanCounter::NodeRowsScanned),
            pushed_back: counter(ScanCounter::PushedBack),
        }
    }
}
