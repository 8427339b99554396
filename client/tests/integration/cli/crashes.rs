//! A `csd serve` process over a misbehaving drive (`faulty:` in front of a file),
//! killed with SIGKILL at random moments — between steps, during a put, a delete
//! or a query — and restarted on the same file, per seed, while `csd put`, `csd rm`
//! and `csd sql` (pushed down and by byte range) run as a user runs them. The
//! oracle, after every step: a partition whose put was acknowledged answers exactly
//! or the query fails with data loss naming it; a deleted partition never comes
//! back; an unacknowledged put or delete left the partition whole or absent; both
//! query paths agree. The same over two nodes with every partition put twice
//! (`--replicas 2`): a query answers whenever one copy is good, and `csd repair`
//! gives a partition back its copies. `CSD_FAULT_SEEDS=N` runs more seeds,
//! `CSD_FAULT_SEED=S` replays one.

use std::collections::BTreeMap;
use std::time::Duration;

use super::*;

/// Rows of partition `p` are the ids `p * SPAN ..`: a query groups by `id / SPAN`.
const SPAN: i64 = 1_000_000;

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        splitmix(&mut self.0) % n
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// What partition `p` may hold, as far as the answers seen so far tell.
#[derive(Clone, Copy, Debug, PartialEq)]
enum State {
    /// The put was acknowledged: exact, or lost with a data-loss error.
    Acked,
    /// The put or the delete was cut short: whole or absent.
    Maybe,
    /// The delete was acknowledged (or the partition was lost and removed).
    Gone,
}

/// Partition `p`'s rows as CSV, and its (rows, sum of v).
fn partition_csv(p: i64, rows: i64) -> (String, (i64, i64)) {
    let mut csv = String::from("id,k,s,v\n");
    let mut sum = 0;
    for i in 0..rows {
        let id = p * SPAN + i;
        let v = (id * 7919) % 10_007;
        sum += v;
        writeln!(csv, "{id},{},name-{},{v}", id % 97, id % 1013).unwrap();
    }
    (csv, (rows, sum))
}

#[derive(Default, Debug)]
struct Report {
    steps: u64,
    kills: u64,
    puts_acked: u64,
    deletes_acked: u64,
    answers: u64,
    lost: u64,
    repairs: u64,
    /// Node starts that stopped on a failed flush and were started again.
    restarts_after_flush: u64,
    /// Copies `csd repair` made (of a damaged copy, or one a cut put left alone).
    copied: u64,
}

struct Sim {
    seed: u64,
    /// The test's name, for the replay line.
    test: &'static str,
    rng: Rng,
    dir: tempfile::TempDir,
    /// Each node's drive file.
    devices: Vec<String>,
    /// Each node's starts so far: a drive's faults differ from one start to the next.
    starts: Vec<u64>,
    /// Each node's process (killed and reaped when dropped) and URL.
    nodes: Vec<Option<(Kill, String)>>,
    /// Copies of each partition (`csd put --replicas`).
    replicas: usize,
    parts: BTreeMap<i64, (State, (i64, i64))>,
    next: i64,
    report: Report,
}

impl Sim {
    fn new(seed: u64, nodes: usize, test: &'static str) -> Sim {
        let dir = tempfile::tempdir().unwrap();
        let devices = (0..nodes)
            .map(|i| dir.path().join(format!("dev{i}.img")).display().to_string())
            .collect();
        Sim {
            seed,
            test,
            rng: Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D)),
            dir,
            devices,
            starts: vec![0; nodes],
            nodes: (0..nodes).map(|_| None).collect(),
            replicas: nodes,
            parts: BTreeMap::new(),
            next: 0,
            report: Report::default(),
        }
    }

    /// Starts node `i` on its drive, again as a supervisor would when a flush failed
    /// as it opened its store (it stops rather than trust it); what it logged when it
    /// does not come up.
    fn start(&mut self, i: usize) -> Result<(), String> {
        let mut tries = 0;
        loop {
            match self.start_once(i) {
                Err(e) if e.contains("flush") && tries < 3 => {
                    tries += 1;
                    self.report.restarts_after_flush += 1;
                }
                done => return done,
            }
        }
    }

    fn start_once(&mut self, i: usize) -> Result<(), String> {
        let log = self.dir.path().join(format!("node{i}.log"));
        self.starts[i] += 1;
        // 64 MiB: catalog slots of 64 blocks, the store's metadata ends at block 129.
        let device = format!(
            "faulty:{},rot=0.0003,lse=0.0001,corrupt=0.002,write_eio=0.002,flush_fail=0.002,\
             safe_below=129:uring:{}",
            (self.seed * 16 + i as u64) * 4096 + self.starts[i],
            self.devices[i]
        );
        let mut child = Command::new(env!("CARGO_BIN_EXE_csd"))
            .args([
                "serve",
                "--device",
                &device,
                "--capacity",
                "64MiB",
                "--read-cache",
                "0",
                "--listen",
                "127.0.0.1:0",
            ])
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        use std::io::BufRead;
        let mut line = String::new();
        let _ = std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line);
        let Some(url) = line.split_whitespace().find(|w| w.starts_with("grpc://")) else {
            drop(Kill(child));
            let logged = std::fs::read_to_string(&log).unwrap_or_default();
            return Err(self.fail(format!("node {i} did not start: {line}{logged}")));
        };
        self.nodes[i] = Some((Kill(child), url.to_string()));
        Ok(())
    }

    /// `csd a…` over every node.
    fn on_all(&self, a: &[&str]) -> Vec<String> {
        let mut v: Vec<String> = a.iter().map(|s| s.to_string()).collect();
        for (_, url) in self.nodes.iter().flatten() {
            v.extend(["--node".to_string(), url.clone()]);
        }
        v
    }

    /// SIGKILL of a node chosen at random, reaped, and a new process on the same
    /// drive file.
    fn kill_and_restart(&mut self) -> Result<(), String> {
        let i = self.rng.below(self.nodes.len() as u64) as usize;
        self.restart(i)
    }

    fn restart(&mut self, i: usize) -> Result<(), String> {
        // SIGKILL, reaped.
        drop(self.nodes[i].take());
        self.report.kills += 1;
        self.start(i)
    }

    fn fail(&self, what: String) -> String {
        format!(
            "seed {}: {what}\n  replay: CSD_FAULT_SEED={} cargo test --workspace {}",
            self.seed, self.seed, self.test
        )
    }

    /// Runs `csd a…` while, with `kill` set, the node is killed after a random delay;
    /// the output, and whether the node was killed before the command ended.
    async fn run(&mut self, a: Vec<String>, kill: bool) -> Result<(Output, bool), String> {
        let child = Command::new(env!("CARGO_BIN_EXE_csd"))
            .args(&a[..])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let waiting = tokio::task::spawn_blocking(move || child.wait_with_output().unwrap());
        let mut killed = false;
        if kill {
            let delay = self.rng.below(400);
            tokio::time::sleep(Duration::from_millis(delay)).await;
            killed = !waiting.is_finished();
            if let Err(e) = self.kill_and_restart() {
                let _ = waiting.await;
                return Err(e);
            }
        }
        let out = waiting.await.unwrap();
        if std::env::var_os("CSD_FAULT_TRACE").is_some() {
            let (o, e) = text(&out);
            println!(
                "{:?} killed={killed} -> {:?}\n{o}{e}",
                &a[..2],
                out.status.code()
            );
        }
        Ok((out, killed))
    }

    async fn put(&mut self) -> Result<(), String> {
        let p = self.next;
        self.next += 1;
        // Mostly small partitions; some past the store's 64 KiB chunks many times.
        let rows = if self.rng.chance(30) { 40_000 } else { 300 };
        let (csv, expect) = partition_csv(p, rows);
        let file = self.dir.path().join(format!("p{p}.csv"));
        std::fs::write(&file, csv).unwrap();
        let kill = self.rng.chance(25);
        let (partition, copies) = (format!("p{p}"), self.replicas.to_string());
        let mut a = vec![
            "put",
            file.to_str().unwrap(),
            "--table",
            "t",
            "--partition",
            &partition,
        ];
        if self.replicas > 1 {
            a.extend(["--replicas", &copies]);
        }
        let a = self.on_all(&a);
        let (out, _) = self.run(a, kill).await?;
        let state = if out.status.success() {
            self.report.puts_acked += 1;
            State::Acked
        } else {
            State::Maybe
        };
        self.parts.insert(p, (state, expect));
        Ok(())
    }

    async fn delete(&mut self) -> Result<(), String> {
        let present: Vec<i64> = self
            .parts
            .iter()
            .filter(|(_, (s, _))| *s != State::Gone)
            .map(|(p, _)| *p)
            .collect();
        if present.is_empty() {
            return Ok(());
        }
        let p = present[self.rng.below(present.len() as u64) as usize];
        let kill = self.rng.chance(25);
        let (out, killed) = self
            .run(self.on_all(&["rm", &format!("t/p{p}")]), kill)
            .await?;
        let entry = self.parts.get_mut(&p).unwrap();
        if out.status.success() {
            self.report.deletes_acked += 1;
            entry.0 = State::Gone;
        } else if (text(&out).1.contains("not found") || text(&out).1.contains("on none of"))
            && !killed
        {
            // Never stored (a put cut short before its commit).
            if entry.0 == State::Acked {
                return Err(self.fail(format!("acknowledged p{p} not found: {:?}", text(&out))));
            }
            entry.0 = State::Gone;
        } else {
            entry.0 = State::Maybe;
        }
        Ok(())
    }

    /// One query, pushed down or not, checked against what each partition may hold.
    async fn query(&mut self, pushdown: bool) -> Result<(), String> {
        if self.parts.values().all(|(s, _)| *s == State::Gone) {
            return Ok(());
        }
        let q = format!(
            "SELECT id / {SPAN} AS p, count(*) AS n, sum(v) AS s FROM t GROUP BY id / {SPAN} ORDER BY p"
        );
        let mut a = vec!["sql", "--format", "csv", q.as_str()];
        if !pushdown {
            a.push("--no-pushdown");
        }
        let kill = self.rng.chance(15);
        let (out, killed) = self.run(self.on_all(&a), kill).await?;
        let (stdout, stderr) = text(&out);
        if !out.status.success() {
            if killed {
                return Ok(());
            }
            if stderr.contains("table 'datafusion.public.t' not found") {
                if let Some(p) = self.parts.iter().find(|(_, (s, _))| *s == State::Acked) {
                    return Err(
                        self.fail(format!("no table t with p{} acknowledged: {stderr}", p.0))
                    );
                }
                return Ok(());
            }
            // Data loss must name the object: that partition is lost (with copies:
            // every copy is, which repair confirms), and removed.
            if out.status.code() == Some(4)
                && let Some(p) = lost_partition(&stderr)
                && self.parts.contains_key(&p)
            {
                if std::env::var_os("CSD_FAULT_TRACE").is_some() {
                    for (_, u) in self.nodes.iter().flatten() {
                        let o = csd(args(&["scrub"], u)).await;
                        println!("TRACE scrub {u}: {:?}", text(&o));
                    }
                    for i in 0..self.nodes.len() {
                        let log = self.dir.path().join(format!("node{i}.log"));
                        let l = std::fs::read_to_string(log).unwrap_or_default();
                        println!("TRACE log {i}:\n{l}");
                    }
                    let o =
                        csd(self.on_all(&["sql", "--format", "csv", "--no-pushdown", &q])).await;
                    println!("TRACE again: {:?}", text(&o));
                }
                if self.replicas > 1 && !self.repair().await?.contains(&p) {
                    return Err(self.fail(format!(
                        "p{p} failed with data loss while a good copy was left \
                         (pushdown {pushdown}): {stderr}"
                    )));
                }
                self.remove_lost(p).await?;
                return Ok(());
            }
            return Err(self.fail(format!(
                "query (pushdown {pushdown}) failed without a kill or a data loss: {stderr}"
            )));
        }
        let mut seen = BTreeMap::new();
        for line in stdout.lines().skip(1).filter(|l| !l.is_empty()) {
            let f: Vec<i64> = line.split(',').map(|x| x.parse().unwrap()).collect();
            seen.insert(f[0], (f[1], f[2]));
        }
        for (p, got) in &seen {
            match self.parts.get(p) {
                None => return Err(self.fail(format!("p{p} answered, never put: {got:?}"))),
                Some((State::Gone, _)) => {
                    return Err(self.fail(format!("p{p} was deleted and came back: {got:?}")));
                }
                Some((_, want)) if want != got => {
                    return Err(self.fail(format!(
                        "p{p} answered {got:?} (rows, sum), stored {want:?} (pushdown {pushdown})"
                    )));
                }
                Some(_) => {}
            }
        }
        for (p, (s, _)) in &self.parts {
            if *s == State::Acked && !seen.contains_key(p) {
                return Err(self.fail(format!(
                    "acknowledged p{p} missing from the answer (pushdown {pushdown}): {stdout}"
                )));
            }
        }
        self.report.answers += 1;
        Ok(())
    }

    /// `p`, lost, deleted everywhere.
    async fn remove_lost(&mut self, p: i64) -> Result<(), String> {
        self.report.lost += 1;
        let rm_lost = self.on_all(&["rm", &format!("t/p{p}")]);
        let mut rm = csd(rm_lost.clone()).await;
        if flush_failed(&text(&rm).1) {
            // A flush failed earlier: the node says what to do, as a user does.
            for i in 0..self.nodes.len() {
                self.restart(i)?;
            }
            rm = csd(self.on_all(&["rm", &format!("t/p{p}")])).await;
        }
        let (_, err) = text(&rm);
        if !rm.status.success() && !err.contains("not found") && !err.contains("on none of") {
            return Err(self.fail(format!("removing lost p{p}: {err}")));
        }
        self.parts.get_mut(&p).unwrap().0 = State::Gone;
        Ok(())
    }

    /// `csd repair` over every node: the partitions it found with no good copy
    /// left. Anything else it could not do fails the seed.
    async fn repair(&mut self) -> Result<Vec<i64>, String> {
        self.report.repairs += 1;
        let mut out = csd(self.on_all(&["repair"])).await;
        if flush_failed(&text(&out).0) || flush_failed(&text(&out).1) {
            for i in 0..self.nodes.len() {
                self.restart(i)?;
            }
            out = csd(self.on_all(&["repair"])).await;
        }
        let (stdout, stderr) = text(&out);
        self.report.copied += stdout.matches(": copied from").count() as u64;
        let mut hopeless: Vec<i64> = stdout
            .lines()
            .filter(|l| l.contains("no good copy is left"))
            .filter_map(lost_partition)
            .collect();
        hopeless.dedup();
        // Short of copies is an answer (no good copy left, or a copy whose write the
        // drive failed); copies that differ, or any other failure, are not.
        let short = stderr.contains("still short of good copies");
        if stdout.contains("differ") || (!out.status.success() && !short) {
            return Err(self.fail(format!("repair failed:\n{stdout}{stderr}")));
        }
        Ok(hopeless)
    }

    async fn run_seed(&mut self, steps: u64) -> Result<(), String> {
        for _ in 0..steps {
            self.report.steps += 1;
            match self.rng.below(11) {
                0..=3 => self.put().await?,
                4 => self.delete().await?,
                5..=7 => self.query(true).await?,
                8 => self.query(false).await?,
                9 => self.kill_and_restart()?,
                _ if self.replicas > 1 => {
                    for p in self.repair().await? {
                        self.remove_lost(p).await?;
                    }
                }
                _ => {}
            }
        }
        // The end: one more kill, then both paths once more.
        self.kill_and_restart()?;
        self.query(true).await?;
        self.query(false).await
    }
}

/// Whether a node said its drive failed a flush (now, or earlier: it is read-only
/// until it restarts, and the user restarts it).
fn flush_failed(said: &str) -> bool {
    said.contains("read-only until the node restarts") || said.contains("flush: ")
}

/// `p` of the first `t/pN` the error names.
fn lost_partition(stderr: &str) -> Option<i64> {
    let at = stderr.find("t/p")? + 3;
    let digits: String = stderr[at..]
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_over_a_faulty_drive_loses_no_acknowledged_answer() {
    simulate(1, "a_node_killed_over_a_faulty_drive").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_copies_over_faulty_drives_answer_while_one_is_good() {
    simulate(2, "two_copies_over_faulty_drives").await;
}

/// The loop over `nodes` nodes, each partition put on all of them.
async fn simulate(nodes: usize, test: &'static str) {
    let seeds: Vec<u64> = match std::env::var("CSD_FAULT_SEED") {
        Ok(s) => vec![s.parse().expect("CSD_FAULT_SEED is a number")],
        Err(_) => {
            let n = std::env::var("CSD_FAULT_SEEDS")
                .ok()
                .and_then(|n| n.parse().ok())
                .unwrap_or(4);
            (1..=n).collect()
        }
    };
    let mut total = Report::default();
    let mut failed = Vec::new();
    for seed in &seeds {
        let mut sim = Sim::new(*seed, nodes, test);
        let ran = match (0..nodes).try_for_each(|i| sim.start(i)) {
            Ok(()) => sim.run_seed(24).await,
            Err(e) => Err(e),
        };
        if let Err(e) = ran {
            failed.push(e);
        }
        let r = &sim.report;
        total.steps += r.steps;
        total.kills += r.kills;
        total.puts_acked += r.puts_acked;
        total.deletes_acked += r.deletes_acked;
        total.answers += r.answers;
        total.lost += r.lost;
        total.repairs += r.repairs;
        total.copied += r.copied;
        total.restarts_after_flush += r.restarts_after_flush;
    }
    println!(
        "node crash loop, {nodes} node(s), {nodes} cop(ies) per partition: {} seeds, {} steps, \
         {} SIGKILLs, {} puts and {} deletes acknowledged, {} answers checked, {} partitions \
         lost to detected damage, {} repairs making {} copies, {} starts stopped by a failed \
         flush and started again, {} seeds failed",
        seeds.len(),
        total.steps,
        total.kills,
        total.puts_acked,
        total.deletes_acked,
        total.answers,
        total.lost,
        total.repairs,
        total.copied,
        total.restarts_after_flush,
        failed.len()
    );
    assert!(failed.is_empty(), "{}", failed.join("\n"));
    assert!(total.kills > 0 && total.answers > 0 && total.puts_acked > 0);
}
