//! Scenario files parsed, checked, swept.

use super::*;

const BASE: &str = r#"
name = "t"
policies = ["none", "adaptive"]
[nodes]
count = 2
[data]
kind = "tpch"
scale = 0.01
[workload]
kind = "sql"
queries = [1, 6]
"#;

fn err(text: &str) -> String {
    Scenario::parse(text)
        .expect_err("should be refused")
        .to_string()
}

#[test]
fn pinning_gives_nodes_their_own_cores_and_compute_the_rest() {
    let mut s = Scenario::parse(BASE).expect("valid");
    assert_eq!(
        s.core_plan(&[0, 1, 2]).unwrap(),
        None,
        "pin is off by default"
    );
    s.nodes.pin = true;
    s.nodes.settings.cpus = 1;
    let plan = s.core_plan(&[0, 1, 2, 3, 5]).unwrap().unwrap();
    assert_eq!(plan.nodes, vec![vec![0], vec![1]]);
    assert_eq!(plan.compute, vec![2, 3, 5]);
    s.nodes.settings.cpus = 2;
    let e = s.core_plan(&[0, 1, 2, 3]).unwrap_err().to_string();
    assert!(e.contains("nodes.pin") && e.contains("need 4 cores"), "{e}");
}

#[test]
fn parses_defaults_and_points() {
    let mut s = Scenario::parse(BASE).expect("valid");
    assert_eq!(s.nodes.settings.cpus, 2, "the node's own default");
    assert_eq!(s.partitions(), 4);
    assert_eq!(s.baseline(), PolicyName::None);
    assert_eq!(s.points(), vec![Vec::<(String, f64)>::new()]);
    s.sweep = vec![
        SweepAxis {
            parameter: "link.bandwidth_mbit".into(),
            values: vec![100.0, 1000.0],
        },
        SweepAxis {
            parameter: "nodes.count".into(),
            values: vec![1.0, 2.0, 4.0],
        },
    ];
    s.validate().expect("valid sweep");
    let pts = s.points();
    assert_eq!(pts.len(), 6);
    let at = s.at(&pts[5]).expect("point");
    assert_eq!(at.nodes.count, 4);
    assert_eq!(at.link.bandwidth_mbit, 1000.0);
}

#[test]
fn errors_name_the_field() {
    let e = err(&BASE.replace("count = 2", "count = 0"));
    assert!(
        e.contains("nodes.count") && e.contains("expected 1 to 16"),
        "{e}"
    );
    let e = err(&BASE.replace("count = 2", "count = 2\ncpu = 3"));
    assert!(
        e.contains("unknown field `cpu`") && e.contains("cpus"),
        "{e}"
    );
    let e = err(&BASE.replace("count = 2", "count = \"two\""));
    assert!(
        e.contains("nodes.count") && e.contains("expected usize"),
        "{e}"
    );
    let e = err(&BASE.replace("[1, 6]", "[1, 23]"));
    assert!(e.contains("workload.queries") && e.contains("23"), "{e}");
    let e = err(&BASE.replace("\"adaptive\"", "\"auto\""));
    assert!(e.contains("policies") && e.contains("auto"), "{e}");
    let e = err(&BASE.replace("\"adaptive\"", "\"sometimes\""));
    assert!(
        e.contains("unknown policy") && e.contains("sometimes"),
        "{e}"
    );
    let e = err(&format!(
        "{BASE}[[sweep]]\nparameter = \"nodes.colour\"\nvalues = [1]\n"
    ));
    assert!(
        e.contains("sweep[0].parameter") && e.contains("link.bandwidth_mbit"),
        "{e}"
    );
    let e = err(&format!(
        "{BASE}[[sweep]]\nparameter = \"nodes.count\"\nvalues = [1, 2.5]\n"
    ));
    assert!(
        e.contains("sweep[0].values") && e.contains("whole number"),
        "{e}"
    );
    let e = err(&BASE.replace("queries = [1, 6]", "queries = [1]\nload = 2"));
    assert!(e.contains("workload.duration_s"), "{e}");
    let e = err(&BASE.replace("scale = 0.01", "scale = 0.01\nkind2 = 1"));
    assert!(e.contains("kind2"), "{e}");
    let e = err(&BASE.replace("\"sql\"", "\"features\""));
    assert!(e.contains("workload"), "{e}");
    let e = err(&BASE.replace("[nodes]", "[nodes]\nmemory = \"lots\""));
    assert!(
        e.contains("nodes:") && e.contains("`memory`") && e.contains("lots"),
        "{e}"
    );
}

#[test]
fn shrink_keeps_it_valid() {
    let mut s = Scenario::parse(&format!(
        "{BASE}[[sweep]]\nparameter = \"link.bandwidth_mbit\"\nvalues = [100, 300, 1000, 10000]\n"
    ))
    .expect("valid");
    s.shrink();
    s.validate().expect("still valid");
    assert_eq!(s.sweep[0].values, vec![100.0, 10000.0]);
}

#[test]
fn nodes_take_a_nodes_own_settings_and_refuse_the_testbeds() {
    let s = Scenario::parse(&BASE.replace(
        "count = 2",
        "count = 2\nread_cache = \"64MiB\"\nqueue_target_ms = 20",
    ))
    .expect("valid");
    assert_eq!(
        s.nodes.settings.read_cache,
        Some(csd_runtime::config::ByteSize::mib(64))
    );
    assert_eq!(s.nodes.settings.queue_target_ms, 20.0);
    let e = err(&BASE.replace("count = 2", "count = 2\npolicy = \"never\""));
    assert!(
        e.contains("nodes.policy") && e.contains("testbed sets it"),
        "{e}"
    );
    let e = err(&BASE.replace("count = 2", "count = 2\nqueue_target_ms = -1"));
    assert!(e.contains("nodes") && e.contains("queue"), "{e}");
}

#[test]
fn a_scenario_reads_back_from_its_report_json() {
    let text = BASE.replace(
        "count = 2",
        "count = 2\nmemory = \"512MiB\"\nqueue_target_ms = 20.0",
    );
    let s = Scenario::parse(&text).expect("valid");
    let json = serde_json::to_value(&s).expect("serializes");
    let nodes = json["nodes"].to_string();
    assert!(
        !nodes.contains("null"),
        "unset settings are left out: {nodes}"
    );
    assert!(nodes.contains("latency_us"), "the emulated device: {nodes}");
    let json = json.to_string();
    let back: Scenario = serde_json::from_str(&json).expect("reads back");
    assert_eq!(back.nodes.count, 2);
    assert_eq!(back.nodes.settings.memory, s.nodes.settings.memory);
    assert_eq!(back.nodes.settings.queue_target_ms, 20.0);
    assert_eq!(
        toml::Table::try_from(&back.nodes.settings).unwrap(),
        toml::Table::try_from(&s.nodes.settings).unwrap()
    );
}
