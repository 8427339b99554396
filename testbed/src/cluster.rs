//! An emulated cluster on this machine: real `csd-runtime` nodes on 127.0.0.1, each
//! on an emulated NVMe device (or each in a QEMU guest on an emulated NVMe
//! controller: [`crate::guest`]), each reached through its own [`ThrottledLink`].
//!
//! Nodes and data outlive a run: runs that need the same nodes (same shape, same
//! admission policy, same data) reuse them, with fresh links so that every run's
//! byte counters start at zero. Data is loaded directly, not through the links.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use csd_runtime::admission::Policy;
use csd_runtime::config::NodeConfig;
use csd_runtime::node::{self, RunningNode};
use csd_runtime::node_client::{Credentials, NodeClient};

use crate::guest::{Guest, GuestSpec};
use crate::link::{LinkSpec, ThrottledLink};
use crate::report::CpuSample;
use crate::scenario::{DataSpec, NodeSystem, Scenario};
use crate::{Error, Result};

/// The table an images scenario's samples are stored as.
pub(crate) const DATASET: &str = "tb_images";

/// What makes two runs' nodes interchangeable.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeKey {
    count: usize,
    cpus: usize,
    /// The nodes' settings (as TOML: the key compares every one of them).
    settings: String,
    device: String,
    policy: Policy,
    data: String,
    partitions: usize,
    pin: bool,
    secure: bool,
}

impl NodeKey {
    /// The nodes `s` needs, under node admission `policy`.
    pub fn of(s: &Scenario, policy: Policy) -> Result<Self> {
        Ok(NodeKey {
            count: s.nodes.count,
            cpus: s.nodes.settings.cpus,
            settings: toml::to_string(&s.nodes.settings).unwrap_or_default(),
            device: s.device_spec()?,
            policy,
            data: format!("{:?}", s.data),
            partitions: s.partitions(),
            pin: s.nodes.pin,
            secure: s.nodes.secure,
        })
    }
}

/// Running nodes holding the scenario's data.
pub struct Cluster {
    /// How they were made.
    pub key: NodeKey,
    nodes: Vec<Node>,
    /// Direct (unthrottled) clients, one per node.
    pub direct: Vec<NodeClient>,
    /// Samples (images) or rows (lineitem) loaded.
    pub loaded: u64,
    /// Seconds spent loading.
    pub(crate) load_s: f64,
    /// Seconds the slowest QEMU guest took from start to a serving node.
    pub(crate) boot_s: Option<f64>,
    /// Image data: the model and its weights (stored at every node with the data).
    pub model: Option<(csd_ml_pushdown::Arch, Vec<u8>)>,
    /// With `nodes.pin`: the compute tier's threads, on the cores the nodes do not use.
    pub(crate) compute_pool: Option<Arc<rayon::ThreadPool>>,
    /// What clients present (a token and the CA, with `nodes.secure`).
    credentials: Credentials,
    /// Certificates and the tenants file of secure nodes; guests' disks and logs.
    _security: Option<tempfile::TempDir>,
    _guests: Option<tempfile::TempDir>,
}

/// A node of the cluster: in this process, or a QEMU guest.
enum Node {
    Local(RunningNode),
    Guest(Box<Guest>),
}

impl Node {
    fn addr(&self) -> std::net::SocketAddr {
        match self {
            Node::Local(n) => n.addr,
            Node::Guest(g) => g.addr(),
        }
    }
}

/// Where a node's admission figures come from.
enum Figures {
    Read(Arc<csd_runtime::admission::Admission>),
    Asked(Box<NodeClient>),
}

/// Boots `s.nodes.count` guests at once, each on a backing file of its own in `dir`.
async fn boot_guests(
    s: &Scenario,
    key: &NodeKey,
    dir: &std::path::Path,
    progress: &mut impl FnMut(String),
) -> Result<Vec<Guest>> {
    let q = &s.nodes.qemu;
    let binary = crate::guest::default_binary_for(q.arch)?;
    let args = s.nodes.guest_args(key.policy)?;
    progress(format!("booting {} QEMU guests", s.nodes.count));
    let boots = (0..s.nodes.count).map(|i| {
        let mut spec = GuestSpec::new(
            binary.clone(),
            dir.join(format!("node{i}.img")),
            dir.to_path_buf(),
        );
        spec.arch = q.arch;
        spec.disk_bytes = q.disk_mib << 20;
        spec.lba_bytes = q.lba_bytes;
        spec.memory_mib = q.memory_mib;
        spec.cpus = s.nodes.settings.cpus;
        spec.device = q.device.spec().into();
        spec.node_args = args.clone();
        Guest::boot(spec)
    });
    futures::future::try_join_all(boots).await
}

/// The token of the testbed's tenant on secure nodes.
const TOKEN: &str = "testbed-token";

/// A private CA, the nodes' certificate for 127.0.0.1, and a tenants file with one
/// tenant that may do everything, in a new temporary folder.
fn security() -> Result<(tempfile::TempDir, Credentials)> {
    let io = |e| Error::Cluster {
        context: "making the nodes' certificates".into(),
        source: csd_runtime::Error::io("writing them", e),
    };
    let dir = tempfile::tempdir().map_err(io)?;
    let certs = csd_runtime::tls::make_certificates(&["127.0.0.1".into()], "testbed").map_err(
        |source| Error::Cluster {
            context: "making the nodes' certificates".into(),
            source,
        },
    )?;
    certs.write(dir.path()).map_err(|source| Error::Cluster {
        context: "writing the nodes' certificates".into(),
        source,
    })?;
    std::fs::write(
        dir.path().join("tenants.toml"),
        format!(
            "[[tenant]]\nname = \"testbed\"\ntoken_sha256 = \"{}\"\ntables = [\"*\"]\ncan = [\"read\", \"write\", \"delete\", \"admin\"]\n",
            csd_runtime::auth::token_digest(TOKEN)
        ),
    )
    .map_err(io)?;
    let credentials = Credentials {
        token: Some(TOKEN.into()),
        tls_ca: Some(certs.ca_pem.into_bytes()),
        ..Default::default()
    };
    Ok((dir, credentials))
}

impl Cluster {
    /// Starts the nodes and loads the data. `progress` gets a line now and then.
    pub async fn start(
        s: &Scenario,
        key: NodeKey,
        mut progress: impl FnMut(String),
    ) -> Result<Self> {
        let plan = s.core_plan(&csd_runtime::pool::available_cores())?;
        let compute_pool = match &plan {
            Some(p) => Some(Arc::new(csd_ml_pushdown::thread_pool(
                "compute",
                p.compute.len(),
                Some(&p.compute),
            )?)),
            None => None,
        };
        let (security, credentials) = match s.nodes.secure {
            true => {
                let (d, c) = security()?;
                (Some(d), c)
            }
            false => (None, Credentials::default()),
        };
        let file = |f: &str| security.as_ref().map(|d| d.path().join(f));
        let mut nodes = Vec::new();
        let mut direct = Vec::new();
        let mut guests_dir = None;
        let mut boot_s = None;
        if s.nodes.system == NodeSystem::Qemu {
            let dir = tempfile::tempdir()
                .map_err(|e| Error::Guest(format!("a folder for the guests: {e}")))?;
            for g in boot_guests(s, &key, dir.path(), &mut progress).await? {
                boot_s = Some(g.boot_s.max(boot_s.unwrap_or(0.0)));
                direct.push(NodeClient::connect_with(&g.url, &credentials).await?);
                nodes.push(Node::Guest(Box::new(g)));
            }
            guests_dir = Some(dir);
        }
        let in_process = match s.nodes.system {
            NodeSystem::Process => s.nodes.count,
            NodeSystem::Qemu => 0,
        };
        for i in 0..in_process {
            let config = NodeConfig {
                device: key.device.clone(),
                listen: "127.0.0.1:0".into(),
                cpu_set: plan.as_ref().map(|p| {
                    let cores: Vec<String> = p.nodes[i].iter().map(usize::to_string).collect();
                    cores.join(",")
                }),
                format: true,
                policy: key.policy,
                auth: file("tenants.toml"),
                tls_cert: file("node.pem"),
                tls_key: file("node.key"),
                ..s.nodes.settings.clone()
            };
            let settings = |source| Error::Cluster {
                context: format!("the settings of node {i}"),
                source,
            };
            let operators = csd_query_pushdown::registry_with(&config)
                .map_err(settings)?
                .with(Arc::new(
                    csd_ml_pushdown::MlOperator::from_config(&config).map_err(settings)?,
                ));
            let n = node::start_with(&config, operators)
                .await
                .map_err(|source| Error::Cluster {
                    context: format!("starting node {i}"),
                    source,
                })?;
            direct.push(NodeClient::connect_with(&n.url, &credentials).await?);
            nodes.push(Node::Local(n));
        }
        let t = Instant::now();
        let parts = s.partitions();
        let mut model = None;
        let loaded = match &s.data {
            DataSpec::Tpch { scale, .. } => {
                let mut rows = 0;
                crate::tpch::load_parts(&direct, *scale, parts, |table, r| {
                    if table == "lineitem" {
                        rows += r;
                    }
                    progress(format!("loading TPC-H SF {scale}: {table}"));
                })
                .await?;
                rows
            }
            DataSpec::Images {
                dir,
                labels,
                repeat,
                ..
            } => {
                let dir = dir
                    .as_deref()
                    .map(crate::scenario::expand)
                    .unwrap_or_else(|| csd_ml_pushdown::assets_dir().join("textures/train"));
                if !dir.is_dir() {
                    return Err(Error::Scenario(format!(
                        "data.dir: {} is not a folder (run scripts/setup-ml.sh for the default textures)",
                        dir.display()
                    )));
                }
                let mut n = 0u64;
                let (count, _) = csd_ml_pushdown::job::put_images(
                    &direct,
                    DATASET,
                    &dir,
                    labels.as_deref(),
                    (parts, 1),
                    *repeat,
                    |k| {
                        n += k;
                        progress(format!("storing images: {n}"));
                    },
                )
                .await?;
                let (arch, weights) = s.image_model()?;
                for c in &direct {
                    csd_ml_pushdown::weights::ensure(c, &weights).await?;
                }
                model = Some((arch, weights));
                count as u64
            }
        };
        Ok(Cluster {
            key,
            nodes,
            direct,
            loaded,
            load_s: t.elapsed().as_secs_f64(),
            boot_s,
            model,
            compute_pool,
            credentials,
            _security: security,
            _guests: guests_dir,
        })
    }

    /// Fresh throttled links to every node, as `s` sets them.
    pub async fn links(&self, s: &Scenario) -> Result<Links> {
        let mut links = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let l = s.link_of(i);
            let spec = LinkSpec {
                bandwidth_bps: l.bandwidth_mbit * 1e6,
                latency: Duration::from_secs_f64(l.latency_us / 1e6),
            };
            links.push(
                ThrottledLink::start(spec, n.addr())
                    .await
                    .map_err(|e| Error::Cluster {
                        context: format!("link to node {i}"),
                        source: csd_runtime::Error::io("starting the link", e),
                    })?,
            );
        }
        let mut workers = Vec::new();
        for i in 0..s.compute.workers {
            let context = || format!("compute worker {i}");
            let env = csd_query_pushdown::WorkerEnv::new(self.credentials.clone(), None).map_err(
                |e| Error::Cluster {
                    context: context(),
                    source: csd_runtime::Error::Internal(e.to_string()),
                },
            )?;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .and_then(|l| Ok((l.local_addr()?, l)))
                .map_err(|e| Error::Cluster {
                    context: context(),
                    source: csd_runtime::Error::io("binding the worker", e),
                })?;
            let (addr, listener) = listener;
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            tokio::spawn(csd_query_pushdown::serve_worker_on(env, listener, async {
                let _ = stopped.await;
            }));
            workers.push((format!("grpc://{addr}"), stop));
        }
        Ok(Links {
            links,
            credentials: self.credentials.clone(),
            workers,
        })
    }

    /// Samples every node's busy CPU workers every `every` until the sampler is
    /// stopped.
    pub(crate) fn sample_cpu(&self, every: Duration) -> CpuSampler {
        // A guest's node is asked for its figures; a local one's are read.
        let admissions: Vec<_> = self
            .nodes
            .iter()
            .zip(&self.direct)
            .map(|(n, c)| match n {
                Node::Local(n) => Figures::Read(n.state.admission.clone()),
                Node::Guest(_) => Figures::Asked(Box::new(c.clone())),
            })
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let task = tokio::spawn(async move {
            let t0 = Instant::now();
            let mut out = Vec::new();
            while !s.load(Ordering::Relaxed) {
                let mut busy = Vec::with_capacity(admissions.len());
                for a in &admissions {
                    let a = match a {
                        Figures::Read(local) => Some(local.stats()),
                        Figures::Asked(remote) => remote.stats().await.ok().map(|s| s.admission),
                    };
                    busy.push(a.map_or(0.0, |a| a.running as f64 / a.slots.max(1) as f64));
                }
                out.push(CpuSample {
                    t_s: t0.elapsed().as_secs_f64(),
                    busy,
                });
                tokio::time::sleep(every).await;
            }
            out
        });
        CpuSampler { stop, task }
    }

    /// Stops the nodes.
    pub async fn shutdown(self) {
        for n in self.nodes {
            match n {
                Node::Local(n) => {
                    if let Err(e) = n.shutdown().await {
                        tracing::warn!("node shutdown: {e}");
                    }
                }
                Node::Guest(mut g) => g.kill(),
            }
        }
    }
}

/// The links of one run.
pub struct Links {
    links: Vec<ThrottledLink>,
    credentials: Credentials,
    /// Compute-tier workers (`compute.workers`): URL and what stops it.
    workers: Vec<(String, tokio::sync::oneshot::Sender<()>)>,
}

impl Links {
    /// URLs of the links' entries (node order): `grpc+tls://` to secure nodes.
    pub fn urls(&self) -> Vec<String> {
        let tls = self.credentials.tls_ca.is_some();
        self.links
            .iter()
            .map(|l| match tls {
                true => l.url().replace("grpc://", "grpc+tls://"),
                false => l.url(),
            })
            .collect()
    }

    /// The compute-tier workers of this run (`grpc://…`; empty: none).
    pub fn worker_urls(&self) -> Vec<String> {
        self.workers.iter().map(|(u, _)| u.clone()).collect()
    }

    /// What clients present to the nodes.
    pub fn credentials(&self) -> &Credentials {
        &self.credentials
    }

    /// Clients through the links.
    pub async fn clients(&self) -> Result<Vec<NodeClient>> {
        let mut out = Vec::new();
        for u in self.urls() {
            out.push(NodeClient::connect_with(&u, &self.credentials).await?);
        }
        Ok(out)
    }

    /// (to the nodes, from the nodes) bytes carried so far, all links.
    pub fn bytes(&self) -> (u64, u64) {
        self.links.iter().fold((0, 0), |(u, d), l| {
            let c = l.counters();
            (
                u + c.up_bytes.load(Ordering::Relaxed),
                d + c.down_bytes.load(Ordering::Relaxed),
            )
        })
    }

    /// Closes them.
    pub async fn shutdown(self) {
        for (_, stop) in self.workers {
            let _ = stop.send(());
        }
        for l in self.links {
            l.shutdown().await;
        }
    }
}

/// A running CPU sampler.
pub(crate) struct CpuSampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Vec<CpuSample>>,
}

impl CpuSampler {
    /// Stops and returns the samples.
    pub(crate) async fn finish(self) -> Vec<CpuSample> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap_or_default()
    }
}
