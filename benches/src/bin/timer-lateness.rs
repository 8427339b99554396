//! How late `csd_runtime::timer::sleep_until` wakes a task, for a range of sleeps.
//! `cargo run --release -p csd-benches --bin timer-lateness`
use std::time::{Duration, Instant};

#[tokio::main]
async fn main() {
    println!(
        "{:>10} {:>12} {:>12} {:>12}",
        "sleep us", "median late", "p90 late", "max late"
    );
    for us in [20u64, 100, 165, 500, 2000] {
        let mut late: Vec<Duration> = Vec::new();
        for _ in 0..500 {
            let at = Instant::now() + Duration::from_micros(us);
            csd_runtime::timer::sleep_until(at).await;
            late.push(Instant::now().saturating_duration_since(at));
        }
        late.sort();
        println!(
            "{:>10} {:>10.1}us {:>10.1}us {:>10.1}us",
            us,
            late[250].as_secs_f64() * 1e6,
            late[450].as_secs_f64() * 1e6,
            late[499].as_secs_f64() * 1e6
        );
    }
}
